"""Qwen-Image's torch side (zerotrain.families.qwen_image declares the family): QwenImagePipeline's text (and
the edit pipelines' text that reads the references), packed latents and image shapes, reference latents,
ComfyUI keys and the tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLProcessor

from zerotrain.families.base import check_tokens
from zerotrain.families.parts.latents import QWEN_PATCH
from zerotrain.families.parts.qwen_image_edit import EDIT_PIPELINES, PLUS
from zerotrain.families.qwen_image import (
    _TINY_TEXT_HEADS,
    _TINY_TEXT_LAYERS,
    _VISION_TOKENS,
    MAX_TEXT_TOKENS,
    QWEN_SCHEDULER,
    QwenImage,
)
from zerotrain.families.runtime.base import BaseRuntime, example_timestep, meta_or_random, trim_rows
from zerotrain.families.runtime.parts import qwen_image_edit, tiny
from zerotrain.families.runtime.parts.latents import qwen_pack_latents
from zerotrain.families.runtime.parts.qwen_image_edit import (
    cached_rows,
    encode_with_images,
    image_rows,
    published_image_processor,
    vl_backend,
)
from zerotrain.families.runtime.parts.qwen_vl import text_processor, with_slots
from zerotrain.protocols import FlowObjective, ModelSpec


def image_shapes(batch: int, height: int, width: int) -> list[list[tuple[int, int, int]]]:
    """img_shapes for (height, width) latents as QwenImagePipeline passes them: one frame of
    h/2 x w/2 tokens per sample (the transformer's RoPE reads the first sample's, so a batch shares one size)."""
    return [[(1, height // QWEN_PATCH, width // QWEN_PATCH)]] * batch


def _qwen25_vl_config(tokenizer: Any, denoiser: dict[str, Any]) -> Any:
    """A narrow Qwen2.5-VL: hidden size joint_attention_dim; its multimodal RoPE sections split the
    head's rotary half 1:1.5:1.5 as the published [16, 24, 24] of 64."""
    width = denoiser["joint_attention_dim"]
    rotary = width // _TINY_TEXT_HEADS // 2
    tiny.check_room(width % (4 * _TINY_TEXT_HEADS) == 0 and rotary >= 4, "tiny-qwen-image", denoiser)
    temporal = rotary // 4
    height = (rotary - temporal) // 2
    return Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_hidden_layers": _TINY_TEXT_LAYERS,
            "num_attention_heads": _TINY_TEXT_HEADS,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [temporal, height, rotary - temporal - height],
                                "rope_theta": 1000000.0},
            "bos_token_id": tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": width},
    )


class QwenImageRuntime(QwenImage, BaseRuntime):
    """QwenImage's torch side."""

    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        """As the edit pipelines size the image their VAE encodes: the control's aspect at 1024 x 1024
        pixels of area (or area x area), each side rounded to 32 (their calculate_dimensions). The pipeline
        module's VAE_IMAGE_SIZE is read at each call, as the pipeline reads it."""
        if not self.max_references(spec):
            raise self._no_references(spec)
        # Applied again until the size stays: at validation the pipeline sizes once more the image it is
        # handed (this size), and its text encoder must read the image the cached caption was encoded with.
        size = control
        for _ in range(16):
            width, height = edit_plus.calculate_dimensions(area * area if area else edit_plus.VAE_IMAGE_SIZE,
                                                           size[0] / size[1])
            given, size = size, (int(width), int(height))
            if size == given:
                break
        return size

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[Any]) -> dict[str, Any]:
        """The edit pipelines': each reference's latents packed (_pack_latents) after the noisy tokens,
        and img_shapes listing the target's grid then each reference's; one timestep, which Edit-2511's
        transformer (zero_cond_t) itself doubles, giving the reference tokens t = 0 (modulate_index)."""
        hidden = kwargs["hidden_states"]
        packed = [qwen_pack_latents(latents).to(hidden.dtype) for latents in references]
        shapes = [[*sample, *[(1, r.shape[2] // QWEN_PATCH, r.shape[3] // QWEN_PATCH) for r in references]]
                  for sample in kwargs["img_shapes"]]
        return {**kwargs, "hidden_states": torch.cat([hidden, *packed], dim=1), "img_shapes": shapes}

    def reference_kwargs(self, spec: ModelSpec, images: list[Any], size: tuple[int, int],
                         area: int | None = None) -> dict[str, Any]:
        if not self.max_references(spec):
            raise self._no_references(spec)
        return {"image": list(images) if self.pipeline_name(spec) == PLUS else images[0]}

    def image_text_rows(self, spec: ModelSpec, references: list[tuple[int, int]]) -> int:
        """The text encoder's rows of the references (width, height) beside the caption's: the images' tokens
        (qwen_image_edit.image_rows), which the cache keeps apart from data.text_tokens."""
        return sum(image_rows(self.pipeline_name(spec), w, h) for w, h in references)

    def text_reference_identity(self, spec: ModelSpec) -> tuple[Any, ...]:
        """The image processor that reads an edit caption's references (qwen_image_edit.vl_backend)."""
        return (("vl_processor", vl_backend()),) if self.max_references(spec) else ()

    def encoder_pipeline(self, pipeline_class: Any, folder: Path, dtype: Any, skipped: dict[str, None]) -> Any:
        if pipeline_class.__name__ in EDIT_PIPELINES:
            return qwen_image_edit.encoder_pipeline(pipeline_class, folder, dtype)
        return super().encoder_pipeline(pipeline_class, folder, dtype, skipped)

    def text_pipeline(self, pipeline_class: Any, components: dict[str, Any]) -> Any:
        if pipeline_class.__name__ in EDIT_PIPELINES:
            components = {"tokenizer": None, **components}
        return pipeline_class(**components)

    def validation_pipeline(self, spec: ModelSpec, folder: Path, components: dict[str, Any], device: Any) -> Any:
        """The model's pipeline; an edit pipeline with no tokenizer nor processor (it renders from cached text)."""
        if self.pipeline_name(spec) in EDIT_PIPELINES:
            components = {"tokenizer": None, "processor": None, **components}
        return super().validation_pipeline(spec, folder, components, device)

    def comfyui_markers(self, spec: ModelSpec) -> dict[str, Any]:
        """Edit-2511's: ComfyUI's model detection switches to its reference method (t = 0 for the reference
        tokens, "index_timestep_zero") when the file holds __index_timestep_zero__, the empty float32 buffer its
        QwenImageTransformer2DModel registers then."""
        return {"__index_timestep_zero__": torch.tensor([])} if spec.config.get("zero_cond_t") else {}

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any,
                      images: list[list[Any]] | None = None) -> dict[str, Any]:
        """prompt_embeds (B, text_tokens, d): Qwen2.5-VL's last hidden states of each templated caption
        without the template's system prefix, truncated to text_tokens as the pipeline truncates them
        and zero-padded to text_tokens; prompt_embeds_mask (B, text_tokens) int64, 1 for a token. With
        `images` (each caption's references, PIL at reference_size), an edit pipeline's encoding of each
        caption with them (qwen_image_edit.encode_with_images): the image rows apart."""
        check_tokens(text_tokens, 1, MAX_TEXT_TOKENS, "Qwen2.5-VL tokens for Qwen-Image")
        if images is not None:
            encoded = [encode_with_images(pipeline, caption, pictures, text_tokens, device, self.title)
                       for caption, pictures in zip(captions, images, strict=True)]
            return {name: torch.cat([one[name] for one in encoded]) for name in encoded[0]}
        embeds, mask = pipeline.encode_prompt(captions, device=device, max_sequence_length=text_tokens)
        b, length, _ = embeds.shape
        if mask is None:  # encode_prompt drops an all-ones mask
            mask = torch.ones(b, length, dtype=torch.long, device=embeds.device)
        pad = text_tokens - length
        return {
            "prompt_embeds": torch.nn.functional.pad(embeds, (0, 0, 0, pad)),
            "prompt_embeds_mask": torch.nn.functional.pad(mask, (0, pad)),
        }

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        b, _, h, w = x_t.shape
        text, mask = batch["prompt_embeds"], batch["prompt_embeds_mask"]
        if text.shape[0] != b:
            raise ValueError(f"prompt_embeds must be ({b}, T, D), got {tuple(text.shape)}")
        text, valid = trim_rows(text, mask)
        if "image_pad_mask" in batch:  # an edit: the caption's rows laid back around its images' rows
            text, valid, _ = with_slots(text, valid, batch["image_pad_mask"], batch["image_rows"])
        dtype = objective.model_dtype
        # QwenImagePipeline passes timestep / 1000 = sigma (the model scales it by 1000), no guidance, and
        # no mask when no caption is padded (as encode_prompt returns it), which lets SDPA use flash attention.
        return {
            "hidden_states": qwen_pack_latents(x_t).to(dtype),
            "encoder_hidden_states": text.to(dtype),
            "encoder_hidden_states_mask": None if bool(valid.all()) else valid,
            "timestep": sigma,
            "img_shapes": image_shapes(b, h, w),
        }, self.target_layout(target)

    def target_layout(self, latents: Any) -> Any:
        return qwen_pack_latents(latents)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        """Every caption text_tokens long (no padding, so no mask): the longest text a batch can carry."""
        config = spec.config
        tensor = meta_or_random(device, dtype)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        tokens = (lat_h // QWEN_PATCH) * (lat_w // QWEN_PATCH)
        return {
            "hidden_states": tensor(batch, tokens, int(config.get("in_channels", self.default_in_channels))),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config.get("joint_attention_dim", 3584))),
            "timestep": example_timestep(tensor, batch, device),
            "img_shapes": image_shapes(batch, lat_h, lat_w),
        }

    def validation_kwargs(self, embeds: dict[str, Any], negative: dict[str, Any] | None, guidance_scale: float) -> dict[str, Any]:
        """Each prompt cut to its own length, as the pipeline encodes a prompt alone (an edit's laid back
        around its images' rows); the all-ones mask given along is what the pipeline's encode_prompt turns
        into None itself. Guidance is true_cfg_scale; max_sequence_length admits every cached token of a
        text-to-image prompt (the pipeline's default is 512, and it cuts there); the edit pipelines cut
        nothing and refuse a max_sequence_length above 1024, so an edit gives none."""
        kwargs: dict[str, Any] = {"true_cfg_scale": guidance_scale}
        for prefix, given in (("", embeds), ("negative_", negative)):
            if given is not None:
                text, mask = cached_rows(given)
                kwargs.update({f"{prefix}prompt_embeds": text, f"{prefix}prompt_embeds_mask": mask})
        if "image_pad_mask" not in embeds:
            kwargs["max_sequence_length"] = int(embeds["prompt_embeds"].shape[1])
        return kwargs

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """"diffusion_model." + the diffusers module path, with lora_A / lora_B and alpha (ComfyUI's
        Qwen-Image modules have diffusers' names; it scales by alpha / rank, as peft does)."""
        out: dict[str, torch.Tensor] = {}
        for module, (down, up) in pairs.items():
            name = f"diffusion_model.{module}"
            out[f"{name}.lora_A.weight"] = down.contiguous()
            out[f"{name}.lora_B.weight"] = up.contiguous()
            out[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
        return out

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """Qwen2.5-VL as wide as joint_attention_dim (its vision tower too, unused for text), and a
        tokenizer that splits the pipeline's template as Qwen's does, so its 34-token prefix drops exactly."""
        edit = bool(denoiser.get("zero_cond_t"))  # Edit-2511's: the Plus pipeline, its template and processor
        pipeline_class = tiny.diffusers_class(PLUS if edit else "QwenImagePipeline")
        template = pipeline_class(*[None] * (6 if edit else 5)).prompt_template_encode
        tokenizer = tiny.qwen2_tokenizer(template, (*tiny.QWEN_SPECIALS, *_VISION_TOKENS) if edit else tiny.QWEN_SPECIALS)
        config = _qwen25_vl_config(tokenizer, denoiser)
        components = {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(QWEN_SCHEDULER),
            "tokenizer": tokenizer,
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config,
                                       denoiser),
        }
        if edit:
            # The ids of the vision tokens in this tokenizer, where the model places an image's states.
            for name, token in zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                                   _VISION_TOKENS, strict=True):
                setattr(config, name, tokenizer.convert_tokens_to_ids(token))
            components["processor"] = text_processor(tokenizer, published_image_processor(), Qwen2VLProcessor)
        components["text_encoder"] = tiny.seeded("text_encoder", Qwen2_5_VLForConditionalGeneration, config)
        return pipeline_class, components
