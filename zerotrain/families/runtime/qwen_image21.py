"""Qwen-Image 2.1's torch side (zerotrain.families.qwen_image21 declares the family): its RGBA video VAE's
posterior and normalization, the Qwen3-VL text with its condition images' slots, the joint forward arguments and
references, validation through QwenImage21Pipeline, ComfyUI keys and the tiny model."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKLQwenImage21
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_dimensions
from transformers import Qwen3VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import caption_too_long, check_tokens
from zerotrain.families.qwen_image21 import (
    _MLP_PARTS,
    QWEN21_SCHEDULER,
    SLOT,
    VAE_SCALE,
    VISION_TOKENS,
    QwenImage21,
    QwenImage21Codec,
)
from zerotrain.families.runtime.base import (
    BaseRuntime,
    compact_rows,
    example_timestep,
    meta_or_random,
    trim_rows,
)
from zerotrain.families.runtime.parts import tiny
from zerotrain.families.runtime.parts.keymaps import fuse_lora
from zerotrain.families.runtime.parts.latents import channel_view, one_frame
from zerotrain.families.runtime.parts.qwen_vl import load_text_processor, text_processor, with_slots
from zerotrain.protocols import FlowObjective, ModelSpec


def tokens(grid: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, h, w) as the transformer's tokens (B, h * w, C): QwenImage21Pipeline._pack_latents."""
    return grid.flatten(2).transpose(1, 2)


def image_mask(text_rows: int, height: int, width: int, batch: int, device: Any = "cpu",
               slots: torch.Tensor | None = None) -> torch.Tensor:
    """img_mask (B, text_rows + h w / 4) bool: the text encoder's rows (True at the condition images' slots,
    `slots` (text_rows,); none for text-to-image), then one slot per 2x2 target latent tokens, as the pipeline
    appends them (append_target_slots)."""
    if height % SLOT or width % SLOT:
        raise ValueError(f"image_mask: latents {height}x{width} are not a multiple of {SLOT}")
    text = torch.zeros(text_rows, dtype=torch.bool) if slots is None else slots.to("cpu", torch.bool)
    if len(text) != text_rows:
        raise ValueError(f"image_mask: {len(text)} slot flags for {text_rows} text rows")
    row = torch.cat([text, torch.ones(height * width // (SLOT * SLOT), dtype=torch.bool)])
    return row.to(device).expand(batch, -1)


def joint_inputs(image: torch.Tensor, text: torch.Tensor, valid: torch.Tensor | None, height: int, width: int,
                 timestep: torch.Tensor, mask_device: Any, slots: torch.Tensor | None = None) -> dict[str, Any]:
    """The transformer's arguments for target tokens (B, h w, C) and the text encoder's rows (B, n, D) of which
    `valid` marks each caption's (None: every row) and `slots` (n,) the condition images' (None: no images):
    img_mask on `mask_device` (the host for the planner's trace)."""
    b = image.shape[0]
    return {"hidden_states": image, "encoder_hidden_states": text, "encoder_hidden_states_mask": valid,
            "timestep": timestep, "img_shapes": [[(1, height, width)]] * b,
            "img_mask": image_mask(text.shape[1], height, width, b, mask_device, slots)}


def condition_size(area: int, control: tuple[int, int]) -> tuple[int, int]:
    """(width, height) of a condition image of `control`'s size as QwenImage21Pipeline sizes it for
    output_resolution ** 2 = `area` pixels (calculate_dimensions: its aspect at that area, sides rounded to 32),
    applied again until the pipeline would keep the size it gives: at validation the pipeline sizes once more
    the image it is handed, and its text encoder must read the one the cached prompt was encoded with."""
    size = control
    for _ in range(16):
        width, height, _ = calculate_dimensions(area, size[0] / size[1])
        given, size = size, (max(VAE_SCALE * SLOT, int(width)), max(VAE_SCALE * SLOT, int(height)))
        if size == given:
            break
    return size


@functools.cache
def render_class() -> type:
    """QwenImage21Pipeline whose __call__ also takes image_pad_mask (and negative_image_pad_mask) with
    prompt_embeds encoded with condition images, and hands it to encode_prompt, which takes it: diffusers
    0.42.1's __call__ does not pass it on, so it refuses such embeddings (its encode_prompt asks for the mask).
    Everything else is the pipeline's own __call__. Validation renders edits through it from cached text."""
    class QwenImage21CachedTextPipeline(diffusers.QwenImage21Pipeline):
        def __call__(self, *args: Any, image_pad_mask: Any = None, negative_image_pad_mask: Any = None,
                     **kwargs: Any) -> Any:
            self._image_pad_masks = [image_pad_mask, negative_image_pad_mask]
            try:
                return super().__call__(*args, **kwargs)
            finally:
                self._image_pad_masks = []

        def encode_prompt(self, *args: Any, **kwargs: Any) -> Any:
            masks = getattr(self, "_image_pad_masks", [])
            if masks and kwargs.get("prompt_embeds") is not None and kwargs.get("image_pad_mask") is None:
                kwargs["image_pad_mask"] = masks.pop(0)
            return super().encode_prompt(*args, **kwargs)

    return QwenImage21CachedTextPipeline


def load_processor(folder: Path | str) -> Any:
    """The folder's processor/ (a Qwen3VLProcessor's files) as text_processor builds it, without torchvision."""
    return load_text_processor(folder)


def tiny_image_processor() -> Any:
    """Qwen3-VL's image processor settings (16 px patches merged 2x2: one vision token per 32x32 pixels, the
    pixels scaled to [-1, 1]), with a smallest image of 32x32 pixels instead of 256x256, for 64 px test images."""
    return Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                    image_std=[0.5] * 3, size={"shortest_edge": 32 * 32, "longest_edge": 4096 * 4096})


def _prompt_kwargs(embeds: dict[str, Any], prefix: str) -> dict[str, Any]:
    text, mask = trim_rows(embeds["prompt_embeds"], embeds["prompt_embeds_mask"])
    if "image_pad_mask" not in embeds:
        return {f"{prefix}prompt_embeds": text, f"{prefix}prompt_embeds_mask": mask}
    text, mask, slots = with_slots(text, mask, embeds["image_pad_mask"])
    return {f"{prefix}prompt_embeds": text, f"{prefix}prompt_embeds_mask": mask,
            f"{prefix}image_pad_mask": slots.to(text.device).expand(len(text), -1)}


class TinyPipeline:
    """QwenImage21Pipeline(**components) whose save_pretrained records the processor as the Qwen3VLProcessor it is
    (text_processor's class lives in zerotrain)."""

    def __init__(self, **components: Any) -> None:
        self.pipeline = diffusers.QwenImage21Pipeline(**components)

    def save_pretrained(self, folder: Any, **kwargs: Any) -> None:
        self.pipeline.save_pretrained(folder, **kwargs)
        path = Path(folder) / "model_index.json"
        index = json.loads(path.read_text(encoding="utf-8"))
        index["processor"] = ["transformers", "Qwen3VLProcessor"]
        path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


class QwenImage21CodecRuntime(QwenImage21Codec):
    """QwenImage21Codec's torch side."""

    def posterior(self, vae: Any, pixels: torch.Tensor) -> Any:
        """The posterior of opaque RGBA one-frame videos (B, 4, 1, H, W), the frame axis dropped."""
        pixels = pixels.to(device=vae.device, dtype=vae.dtype)
        rgba = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
        return one_frame(vae.encode(rgba.unsqueeze(2)).latent_dist.parameters, self.vae_class)

    def normalize_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """(z - latents_mean) / latents_std per channel, as the pipeline encodes condition images."""
        return (latents - channel_view(vae.config.latents_mean, latents)) / channel_view(vae.config.latents_std, latents)

    def normalize_std(self, vae: Any, std: torch.Tensor) -> torch.Tensor:
        return std / channel_view(vae.config.latents_std, std)


class QwenImage21Runtime(QwenImage21, BaseRuntime):
    """QwenImage21's torch side."""

    def encoder_pipeline(self, pipeline_class: Any, folder: Path, dtype: Any, skipped: dict[str, None]) -> Any:
        """The pipeline around the folder's VAE, Qwen3-VL and processor (load_processor), loaded one by one: the
        pipeline's own from_pretrained builds the processor only with torchvision."""
        return pipeline_class(scheduler=None, transformer=None, processor=load_processor(folder),
                              vae=AutoencoderKLQwenImage21.from_pretrained(folder, subfolder="vae", torch_dtype=dtype),
                              text_encoder=Qwen3VLForConditionalGeneration.from_pretrained(
                                  folder, subfolder="text_encoder", dtype=dtype))

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any,
                      images: list[list[Any]] | None = None) -> dict[str, Any]:
        """prompt_embeds (B, text_tokens, hidden): each caption's rows from the pipeline's encode_prompt,
        zero-padded at the end; prompt_embeds_mask (B, text_tokens), 1 on them. With `images` (each caption's
        condition images, PIL at reference_size), each caption is encoded with its images as the pipeline encodes
        one prompt, and image_pad_mask (B, text_tokens + S) flags where the S image slots sat among its rows;
        the slots' own rows are not kept (with_slots lays the caption back around them)."""
        check_tokens(text_tokens, 1, pipeline.text_encoder.config.get_text_config().max_position_embeddings,
                     f"Qwen3-VL's positions for {self.title}")
        if images is not None:
            encoded = [self._encode_with_images(pipeline, caption, pictures, text_tokens, device)
                       for caption, pictures in zip(captions, images, strict=True)]
            return {name: torch.cat([one[name] for one in encoded]) for name in encoded[0]}
        embeds, mask, _ = pipeline.encode_prompt(list(captions), device=device)
        if mask is None:
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        for caption, count in zip(captions, mask.sum(dim=1).tolist(), strict=True):
            if count > text_tokens:
                raise caption_too_long(caption, count, text_tokens, f"{self.title}'s template",
                                       " (the pipeline does not truncate)")
        if embeds.shape[1] < text_tokens:
            embeds = torch.nn.functional.pad(embeds, (0, 0, 0, text_tokens - embeds.shape[1]))
            mask = torch.nn.functional.pad(mask, (0, text_tokens - mask.shape[1]))
        return compact_rows(embeds[:, :text_tokens], mask[:, :text_tokens], text_tokens)

    def _encode_with_images(self, pipeline: Any, caption: str, pictures: list[Any], text_tokens: int,
                            device: Any) -> dict[str, Any]:
        """One caption read with its condition images by the pipeline's encode_prompt (its ti2i template: the
        images' vision tokens before the caption)."""
        embeds, _, pads = pipeline.encode_prompt([caption], image=list(pictures), device=device)
        slots = sum((picture.size[0] // (VAE_SCALE * SLOT)) * (picture.size[1] // (VAE_SCALE * SLOT))
                    for picture in pictures)
        if int(pads.sum()) != slots:
            sizes = ", ".join(f"{p.size[0]}x{p.size[1]}" for p in pictures)
            raise ZerotrainError(f"{self.title}'s processor reads the condition images ({sizes} px) as "
                                 f"{int(pads.sum())} image tokens, not the {slots} their latents fill (one per 32x32 "
                                 "px): its preprocessor_config.json's size (min and max pixels) leaves out that size; "
                                 "set data.control_resolution to a size it admits")
        count = int((~pads).sum())
        if count > text_tokens:
            raise caption_too_long(caption, count, text_tokens, f"{self.title}'s template",
                                   " (the pipeline does not truncate; the images' tokens do not count)")
        flags = torch.cat([pads[0], pads.new_zeros(text_tokens - count)])[None]
        return {**compact_rows(embeds, (~pads).long(), text_tokens), "image_pad_mask": flags}

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        b, _, h, w = x_t.shape
        text = batch["prompt_embeds"]
        if text.ndim != 3 or text.shape[0] != b:
            raise ValueError(f"prompt_embeds must be ({b}, T, D), got {tuple(text.shape)}")
        text, valid = trim_rows(text, batch["prompt_embeds_mask"])
        slots = None
        if "image_pad_mask" in batch:  # an edit: the caption was read with its condition images
            text, valid, slots = with_slots(text, valid, batch["image_pad_mask"])
        dtype = objective.model_dtype
        # The pipeline passes timestep / 1000 = sigma in the latents' dtype, and no mask when nothing is padded.
        kwargs = joint_inputs(tokens(x_t).to(dtype), text.to(dtype), None if bool(valid.all()) else valid, h, w,
                              sigma.to(dtype), x_t.device, slots)
        return kwargs, tokens(target)

    def target_layout(self, latents: Any) -> Any:
        return tokens(latents)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        """Every caption text_tokens long; img_mask on the device, or on the host for a meta trace
        (HostMetadataMode lets it read the mask there)."""
        config = spec.config
        tensor = meta_or_random(device, dtype)
        h, w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        return joint_inputs(tensor(batch, h * w, int(config.get("in_channels", self.default_in_channels))),
                            tensor(batch, text_tokens, int(config.get("context_in_dim", 4096))), None, h, w,
                            example_timestep(tensor, batch, device),
                            "cpu" if torch.device(device).type == "meta" else device)

    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        """As the pipeline sizes a condition image: its aspect at output_resolution ** 2 pixels, the sides rounded
        to 32 (condition_size). The pipeline's output_resolution is the target's side: the target's area here, or
        data.control_resolution ** 2."""
        return condition_size(area * area if area else target[0] * target[1], control)

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[Any]) -> dict[str, Any]:
        """The pipeline's layout: the condition images' latents, in order, before the target's in hidden_states,
        and their (1, h, w) before the target's in img_shapes; the text's slots flagged in img_mask (by the cached
        text's image_pad_mask, flow_inputs). The transformer modulates them at t = 0 (causal_condition). The
        planner's inputs hold the caption alone: their slots go before it, where the template puts the images."""
        hidden, text, mask = kwargs["hidden_states"], kwargs["encoder_hidden_states"], kwargs["img_mask"]
        valid = kwargs["encoder_hidden_states_mask"]
        needed = sum(r.shape[2] * r.shape[3] for r in references) // (SLOT * SLOT)
        have = int(mask[0, :text.shape[1]].sum())
        if not have:
            b = text.shape[0]
            text = torch.cat([text.new_zeros(b, needed, text.shape[2]), text], dim=1)
            mask = torch.cat([mask.new_ones(mask.shape[0], needed), mask], dim=1)
            valid = None if valid is None else torch.cat([valid.new_ones(b, needed), valid], dim=1)
        elif have != needed:
            raise ValueError(f"the text holds {have} image slots, but the references' latents fill {needed}")
        cond = [tokens(latents).to(hidden.dtype) for latents in references]
        shapes = [[*[(1, r.shape[2], r.shape[3]) for r in references], *sample] for sample in kwargs["img_shapes"]]
        return {**kwargs, "hidden_states": torch.cat([*cond, hidden], dim=1), "encoder_hidden_states": text,
                "encoder_hidden_states_mask": valid, "img_mask": mask, "img_shapes": shapes}

    def reference_kwargs(self, spec: ModelSpec, images: list[Any], size: tuple[int, int],
                         area: int | None = None) -> dict[str, Any]:
        """The images, and output_resolution at which the pipeline sizes them as they are (condition_size)."""
        return {"image": list(images), "output_resolution": area or math.isqrt(size[0] * size[1])}

    def validation_pipeline(self, spec: ModelSpec, folder: Path, components: dict[str, Any], device: Any) -> Any:
        """QwenImage21Pipeline (render_class: one that takes the image_pad_mask of cached edit prompts) with the
        folder's processor, which its constructor reads (the text encoder stays unloaded: validation passes
        cached text)."""
        return render_class()(**{**components, "processor": load_processor(folder)})

    def validation_kwargs(self, embeds: dict[str, Any], negative: dict[str, Any] | None, guidance_scale: float) -> dict[str, Any]:
        """Each prompt's own rows and its mask (laid around its condition images' slots for an edit, with their
        flags); guidance is true_cfg_scale."""
        kwargs = {"true_cfg_scale": guidance_scale, **_prompt_kwargs(embeds, "")}
        if negative is not None:
            kwargs.update(_prompt_kwargs(negative, "negative_"))
        return kwargs

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """"diffusion_model." + the module path with lora_A / lora_B / alpha (ComfyUI scales by alpha / rank);
        a block's gate_layer and proj as one img_mlp.gate_up adapter (gate rows first; with both adapted, twice the
        rank and twice the alpha: the same scale on each; with one, zero rows for the other)."""
        modules = dict(model.named_modules())
        out: dict[str, Any] = {}
        for module, (down, up) in pairs.items():
            block, sep, part = module.partition(".img_mlp.")
            if sep and f"img_mlp.{part}" in _MLP_PARTS:
                parts = tuple(f"{block}.{name}" for name in _MLP_PARTS)
                if module != next(name for name in parts if name in pairs):
                    continue  # fused with the block's first adapted part
                down, up, rank = fuse_lora(modules, pairs, parts, f"{self.title} {block}.img_mlp.gate_up")
                name, scale = f"diffusion_model.{block}.img_mlp.gate_up", down.shape[0] // rank
            else:
                name, scale = f"diffusion_model.{module}", 1
            out[f"{name}.lora_A.weight"] = down.contiguous()
            out[f"{name}.lora_B.weight"] = up.contiguous()
            out[f"{name}.alpha"] = torch.tensor(float(alpha) * scale, dtype=torch.float32)
        return out

    def comfyui_model(self, weights: dict[str, Any]) -> dict[str, Any]:
        """Diffusers' names with each block's gate_layer and proj concatenated into img_mlp.gate_up (gate rows
        first), the layout diffusers' single-file converter splits."""
        out: dict[str, Any] = {}
        for key, tensor in weights.items():
            if key.endswith(".img_mlp.proj.weight"):
                continue
            if key.endswith(".img_mlp.gate_layer.weight"):
                up = weights.get(key.replace("gate_layer", "proj"))
                if up is None:
                    raise ZerotrainError(f"{self.title} weights lack {key.replace('gate_layer', 'proj')}, needed for gate_up")
                out[key.replace("gate_layer", "gate_up")] = torch.cat([tensor, up], dim=0)
            else:
                out[key] = tensor
        return out

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """A Qwen3-VL (ForConditionalGeneration, as the pipeline loads it) as wide as context_in_dim, two layers,
        a Qwen tokenizer with Qwen3-VL's vision tokens and a chat template for the pipeline's system message,
        the processor without its video processor, and the scheduler the pipeline's fallbacks describe."""
        template = ("<|im_start|>system\nComprehend and analyze the provided prompt.<|im_end|>\n"
                    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
        tokenizer = tiny.qwen2_tokenizer(template, (*tiny.QWEN_SPECIALS, *VISION_TOKENS), tiny.QWEN3_VL_TEXT_TEMPLATE)
        width = int(denoiser["context_in_dim"])
        config = tiny.qwen3_vl_config(tokenizer, width, 2)
        # The vision tokens' ids in this tokenizer, which the model looks for to place the image's states.
        for name, token in zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                               VISION_TOKENS, strict=True):
            setattr(config, name, tokenizer.convert_tokens_to_ids(token))
        return TinyPipeline, {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(QWEN21_SCHEDULER),
            "text_encoder": tiny.seeded("text_encoder", Qwen3VLForConditionalGeneration, config),
            "processor": text_processor(tokenizer, tiny_image_processor()),
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config, denoiser),
        }
