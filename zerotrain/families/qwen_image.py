"""Qwen-Image: QwenImageTransformer2DModel, its AutoencoderKLQwenImage (the Wan-2.1 VAE) and Qwen2.5-VL's
last hidden states of the templated prompt, as QwenImagePipeline and diffusers'
train_dreambooth_lora_qwen_image.py use them.

What sets it apart from FLUX.1:
- The VAE is 3-D (video): pixels go in as (B, 3, 1, H, W) and latents come out as (B, 16, 1, h, w). The
  frame axis is dropped for the cache and training, and latents are normalized per channel,
  (z - latents_mean) / latents_std, as the training script does and the pipeline undoes before decoding.
- The text is variable-length: encode_prompt drops the template's 34-token system prefix and pads only
  to the longest caption of its batch, with a mask (None when nothing is padded). The cache keeps every
  caption zero-padded to text_tokens with its mask, so captions collate. Training trims each batch to
  its longest caption and passes the mask as encoder_hidden_states_mask. The transformer masks padded
  keys in attention and gives text RoPE positions over the padded width, so padding does not change
  the image stream (3.6e-7 against the same caption unpadded, in float32).
- The timestep is sigma (the pipeline passes t / 1000 and the model scales it by 1000). There is no
  guidance input: Qwen-Image uses true classifier-free guidance (true_cfg_scale with a negative prompt).
- The scheduler shifts by the image sequence length (use_dynamic_shifting, exponential time shift,
  mu from 0.5 at 256 tokens to 0.9 at 8192). Training draws sigma through the same time_shift. The
  published config also has shift_terminal 0.02. set_timesteps applies it to an n-step inference grid:
  an affine stretch of 1 - sigma, scaled by that grid's own last sigma, so that the last step lands on
  0.02. A continuous training draw has no last step to scale by, so training leaves shift_terminal out
  and covers every sigma in (0, 1), which includes every sigma the stretched grid visits. diffusers'
  script does not shift at all (its shift=3.0 is ignored under dynamic shifting); objective.shift=1
  gives that.

LoRA defaults to the training script's targets: the image stream's attention projections (to_q, to_k,
to_v, to_out.0). The text stream's (add_q_proj, add_k_proj, add_v_proj, to_add_out) and the MLPs are
left to training.lora.target_modules. ComfyUI names the transformer's modules as diffusers does, so the
ComfyUI LoRA is the diffusers module path under "diffusion_model.", and a full fine-tune's diffusers
keys load in ComfyUI unchanged (it detects Qwen-Image by txt_norm.weight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.families.base import (
    BaseFamily,
    check_tokens,
    example_timestep,
    meta_or_random,
    packed_channels,
    trim_rows,
)
from zerotrain.families.parts.latents import QWEN_IMAGE_VAE, QWEN_PATCH, qwen_pack_latents
from zerotrain.families.parts.qwen_image_edit import EDIT_PIPELINES, PLUS

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from zerotrain.protocols import FlowObjective, ModelSpec

# QwenImagePipeline.check_inputs refuses max_sequence_length above 1024 text tokens.
MAX_TEXT_TOKENS = 1024
# The published scheduler config (Qwen/Qwen-Image scheduler/scheduler_config.json).
QWEN_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "invert_sigmas": False,
    "max_image_seq_len": 8192,
    "max_shift": 0.9,
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "shift_terminal": 0.02,
    "stochastic_sampling": False,
    "time_shift_type": "exponential",
    "use_beta_sigmas": False,
    "use_dynamic_shifting": True,
    "use_exponential_sigmas": False,
    "use_karras_sigmas": False,
}
# Denoiser config flags of Qwen-Image-Layered (its extra timestep condition and 3-D RoPE), whose
# conditioning no pipeline zerotrain trains through produces. (Edit-2511's zero_cond_t is the Plus
# pipeline's: the transformer itself modulates the reference tokens at t = 0.)
_LAYERED_FLAGS = ("use_additional_t_cond", "use_layer3d_rope")
# Qwen2.5-VL's tokens around an image (the edit pipelines' templates and its processor).
_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The tiny text encoder's layers and heads: two layers, so the last hidden state differs from the embeddings.
_TINY_TEXT_LAYERS = 2
_TINY_TEXT_HEADS = 2


def image_shapes(batch: int, height: int, width: int) -> list[list[tuple[int, int, int]]]:
    """img_shapes for (height, width) latents as QwenImagePipeline passes them: one frame of
    h/2 x w/2 tokens per sample (the transformer's RoPE reads the first sample's, so a batch shares one size)."""
    return [[(1, height // QWEN_PATCH, width // QWEN_PATCH)]] * batch


class QwenImage(BaseFamily):
    name = "qwen_image"
    title = "Qwen-Image"
    denoiser_classes = ("QwenImageTransformer2DModel",)
    codec = QWEN_IMAGE_VAE
    pipeline = "QwenImagePipeline"
    text_components = (("tokenizer", "text_encoder"),)
    text_outputs = ("prompt_embeds", "prompt_embeds_mask")
    # QwenImagePipeline.__call__'s max_sequence_length (and the training script's).
    default_text_tokens = 512
    # As diffusers' train_dreambooth_lora_qwen_image.py chooses them.
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    # QwenImagePipeline.__call__'s true_cfg_scale: classifier-free, with a negative prompt.
    default_guidance = 4.0
    classifier_free_guidance = True
    default_in_channels = 64
    # The edit pipelines' text encoder reads the references with the caption, and keeps their rows.
    text_reads_references = True
    reference_text_outputs = ("image_pad_mask", "image_rows")
    # calculate_shift's defaults as QwenImagePipeline writes them.
    shift_defaults: ClassVar[dict[str, float]] = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}

    def latent_channels(self, config: dict[str, Any], where: Path | str) -> int:
        return packed_channels(int(config.get("in_channels") or self.default_in_channels), where, self.title, "input")

    def patch(self, spec: ModelSpec) -> int:
        return QWEN_PATCH

    def plan_only(self, spec: ModelSpec) -> str | None:
        if any(spec.config.get(flag) for flag in _LAYERED_FLAGS):
            return "image-conditioned Qwen-Image transformers (Layered)"
        return None

    def pipeline_name(self, spec: ModelSpec) -> str:
        """The edit pipeline a model was published with (its model_index.json or catalog entry); a bare
        config with zero_cond_t (Edit-2511's) is the Plus pipeline's; QwenImagePipeline otherwise."""
        if spec.pipeline_class in EDIT_PIPELINES:
            return spec.pipeline_class
        return PLUS if spec.config.get("zero_cond_t") else self.pipeline

    # --- references: Qwen-Image-Edit -------------------------------------------------------------

    def max_references(self, spec: ModelSpec) -> int:
        return EDIT_PIPELINES.get(self.pipeline_name(spec), 0)

    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        """As the edit pipelines size the image their VAE encodes: the control's aspect at 1024 x 1024
        pixels of area (or area x area), each side rounded to 32 (their calculate_dimensions)."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import (
            VAE_IMAGE_SIZE,
            calculate_dimensions,
        )

        if not self.max_references(spec):
            raise self._no_references(spec)
        # Applied again until the size stays: at validation the pipeline sizes once more the image it is
        # handed (this size), and its text encoder must read the image the cached caption was encoded with.
        size = control
        for _ in range(16):
            width, height = calculate_dimensions(area * area if area else VAE_IMAGE_SIZE, size[0] / size[1])
            given, size = size, (int(width), int(height))
            if size == given:
                break
        return size

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[Any]) -> dict[str, Any]:
        """The edit pipelines': each reference's latents packed (_pack_latents) after the noisy tokens,
        and img_shapes listing the target's grid then each reference's; one timestep, which Edit-2511's
        transformer (zero_cond_t) itself doubles, giving the reference tokens t = 0 (modulate_index)."""
        import torch

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

    def reference_text_rows(self, spec: ModelSpec, references: list[tuple[int, int]]) -> int:
        """The text encoder's rows of the references (width, height) beside the caption's: the images' tokens
        (qwen_image_edit.image_rows), which the cache keeps apart from data.text_tokens."""
        from zerotrain.families.parts.qwen_image_edit import image_rows

        return sum(image_rows(self.pipeline_name(spec), w, h) for w, h in references)

    def text_reference_identity(self, spec: ModelSpec) -> tuple[Any, ...]:
        """The image processor that reads an edit caption's references (qwen_image_edit.vl_backend)."""
        from zerotrain.families.parts.qwen_image_edit import vl_backend

        return (("vl_processor", vl_backend()),) if self.max_references(spec) else ()

    # --- loading: the edit pipelines' processor ----------------------------------------------------

    def text_parts(self, pipeline_name: str) -> tuple[tuple[str, str], ...]:
        """The edit pipelines read text through their processor (their tokenizer goes unused)."""
        return (("processor", "text_encoder"),) if pipeline_name in EDIT_PIPELINES else self.text_components

    def encoder_pipeline(self, pipeline_class: Any, folder: Path, dtype: Any, skipped: dict[str, None]) -> Any:
        if pipeline_class.__name__ in EDIT_PIPELINES:
            from zerotrain.families.parts import qwen_image_edit

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
        import torch

        return {"__index_timestep_zero__": torch.tensor([])} if spec.config.get("zero_cond_t") else {}

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any,
                      images: list[list[Any]] | None = None) -> dict[str, Any]:
        """prompt_embeds (B, text_tokens, d): Qwen2.5-VL's last hidden states of each templated caption
        without the template's system prefix, truncated to text_tokens as the pipeline truncates them
        and zero-padded to text_tokens; prompt_embeds_mask (B, text_tokens) int64, 1 for a token. With
        `images` (each caption's references, PIL at reference_size), an edit pipeline's encoding of each
        caption with them (qwen_image_edit.encode_with_images): the image rows apart."""
        import torch

        check_tokens(text_tokens, 1, MAX_TEXT_TOKENS, "Qwen2.5-VL tokens for Qwen-Image")
        if images is not None:
            from zerotrain.families.parts.qwen_image_edit import encode_with_images

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
            from zerotrain.families.parts.qwen_vl import with_slots

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
        from zerotrain.families.parts.qwen_image_edit import cached_rows

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
        import torch

        out: dict[str, torch.Tensor] = {}
        for module, (down, up) in pairs.items():
            name = f"diffusion_model.{module}"
            out[f"{name}.lora_A.weight"] = down.contiguous()
            out[f"{name}.lora_B.weight"] = up.contiguous()
            out[f"{name}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
        return out

    def comfyui_adapter_name(self, module: str) -> str:
        return f"diffusion_model.{module}"

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """Qwen2.5-VL as wide as joint_attention_dim (its vision tower too, unused for text), and a
        tokenizer that splits the pipeline's template as Qwen's does, so its 34-token prefix drops exactly."""
        from transformers import Qwen2_5_VLForConditionalGeneration

        from zerotrain.families.parts import tiny

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
            from transformers import Qwen2VLProcessor

            from zerotrain.families.parts.qwen_image_edit import published_image_processor
            from zerotrain.families.parts.qwen_vl import text_processor

            # The ids of the vision tokens in this tokenizer, where the model places an image's states.
            for name, token in zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                                   _VISION_TOKENS, strict=True):
                setattr(config, name, tokenizer.convert_tokens_to_ids(token))
            components["processor"] = text_processor(tokenizer, published_image_processor(), Qwen2VLProcessor)
        components["text_encoder"] = tiny.seeded("text_encoder", Qwen2_5_VLForConditionalGeneration, config)
        return pipeline_class, components


def _qwen25_vl_config(tokenizer: Any, denoiser: dict[str, Any]) -> Any:
    """A narrow Qwen2.5-VL: hidden size joint_attention_dim; its multimodal RoPE sections split the
    head's rotary half 1:1.5:1.5 as the published [16, 24, 24] of 64."""
    from transformers import Qwen2_5_VLConfig

    from zerotrain.families.parts import tiny

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


FAMILY = QwenImage()
