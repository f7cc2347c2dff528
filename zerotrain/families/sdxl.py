"""SDXL, and SD 1.x/2.x for planning: UNet2DConditionModel, AutoencoderKL and two CLIPs, as
StableDiffusionXLPipeline and diffusers' train_text_to_image_sdxl.py use them. The family is named
"unet" in caches and plan facts."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.families.base import (
    BaseFamily,
    check_tokens,
    example_timestep,
    kohya_prefixed,
    meta_or_random,
    share_blocks,
)
from zerotrain.families.parts.latents import PUBLISHED_VAE_SCALE_FACTOR
from zerotrain.protocols import VaeFacts

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from zerotrain.protocols import ModelSpec

# SDXL's add_time_ids: original size (2), crop top-left (2), target size (2).
SDXL_TIME_IDS = 6
# The published scheduler config (stabilityai/stable-diffusion-xl-base-1.0 scheduler/scheduler_config.json).
SDXL_SCHEDULER = {
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "beta_start": 0.00085,
    "interpolation_type": "linear",
    "num_train_timesteps": 1000,
    "prediction_type": "epsilon",
    "steps_offset": 1,
    "timestep_spacing": "leading",
    "use_karras_sigmas": False,
}
# Published VAE scaling: SDXL (stable-diffusion-xl-base-1.0 vae) 0.13025; SD1.x/2.x 0.18215. No shift.
_SDXL_VAE_SCALING = 0.13025
_SD1_VAE_SCALING = 0.18215


def is_sdxl(config: dict[str, Any]) -> bool:
    """Only SDXL-style UNets condition on (size, crop) time ids through text_time embeddings."""
    return config.get("addition_embed_type") == "text_time"


def sdxl_time_ids(
    original_size: tuple[int, int], crop_top_left: tuple[int, int], target_size: tuple[int, int]
) -> torch.Tensor:
    """SDXL's add_time_ids of one image, (6,) float32, as StableDiffusionXLPipeline._get_add_time_ids
    lays them out: original (height, width), crop (top, left), target (height, width). Training records
    the original size before resizing and the crop actually taken, as train_text_to_image_sdxl.py does."""
    import torch

    parts = {"original_size": original_size, "crop_top_left": crop_top_left, "target_size": target_size}
    for name, value in parts.items():
        if len(value) != 2 or any(int(v) != v or v < 0 for v in value):
            raise ValueError(f"sdxl_time_ids: {name} must be two non-negative integers, got {value!r}")
    return torch.tensor([int(v) for value in parts.values() for v in value], dtype=torch.float32)


class UNet(BaseFamily):
    name = "unet"
    title = "SDXL"
    denoiser_classes = ("UNet2DConditionModel",)
    denoiser_folder = "unet"
    pipeline = "StableDiffusionXLPipeline"
    text_components = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
    # CLIP's 77 tokens.
    default_text_tokens = 77
    # As diffusers' train_text_to_image_lora_sdxl.py chooses them.
    def with_blocks(self, config: dict[str, Any], blocks: int) -> dict[str, Any]:
        """Fewer transformer blocks per down block (transformer_layers_per_block, mirrored by the up
        blocks), at full width; the ResNets stay."""
        per_block = config.get("transformer_layers_per_block", 1)
        if isinstance(per_block, int):
            per_block = [per_block] * len(config["down_block_types"])
        depths = {str(i): int(d) for i, (d, kind) in enumerate(zip(per_block, config["down_block_types"]))
                  if "CrossAttn" in kind}
        shared = share_blocks(depths, max(blocks, len(depths)))
        return {**config, "transformer_layers_per_block": [shared.get(str(i), d) for i, d in enumerate(per_block)]}

    lora_targets = ("to_k", "to_q", "to_v", "to_out.0")
    # StableDiffusionXLPipeline.__call__'s guidance_scale (classifier-free).
    default_guidance = 5.0
    classifier_free_guidance = True
    # invisible-watermark is not a dependency; only decoded images are watermarked anyway.
    pipeline_extras: ClassVar[dict[str, Any]] = {"add_watermarker": False}
    default_in_channels = 4

    def published_vae(self, config: dict[str, Any]) -> VaeFacts:
        scaling = _SDXL_VAE_SCALING if is_sdxl(config) else _SD1_VAE_SCALING
        return VaeFacts(PUBLISHED_VAE_SCALE_FACTOR, self.latent_channels(config, "config"), scaling, None)

    def patch(self, spec: ModelSpec) -> int:
        """A UNet halves the latent once per down block after the first."""
        return 2 ** (len(spec.config["down_block_types"]) - 1)

    def image_tokens(self, spec: ModelSpec, resolution: int) -> int:
        """Latent pixels of a square image (a UNet has no tokens)."""
        side = resolution // spec.vae_scale_factor
        return side * side

    def plan_only(self, spec: ModelSpec) -> str | None:
        if is_sdxl(spec.config):
            return None
        return "SD 1.x/2.x UNets"

    def pipeline_name(self, spec: ModelSpec) -> str:
        return self.pipeline if is_sdxl(spec.config) else "StableDiffusionPipeline"

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """CLIP's 77 tokens. prompt_embeds (B, 77, d_L + d_G): both CLIPs' penultimate states;
        pooled_prompt_embeds (B, p_G), text_encoder_2's projection."""
        clip_tokens = pipeline.tokenizer.model_max_length
        check_tokens(text_tokens, clip_tokens, clip_tokens, "CLIP tokens for SDXL")
        prompt_embeds, _, pooled, _ = pipeline.encode_prompt(captions, device=device, do_classifier_free_guidance=False)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def negative_embeds(self, folder: Path, negative_prompt: str, encoded: dict[str, Any]) -> dict[str, Any]:
        """StableDiffusionXLPipeline's default without a negative prompt (force_zeros_for_empty_prompt
        in model_index.json, True by default): zeros, not the encoded ""."""
        import torch

        if negative_prompt or not _zeros_for_empty(folder):
            return encoded
        return {name: torch.zeros_like(value) for name, value in encoded.items()}

    objective = "ddpm"

    def ddpm_time_ids(self, spec: ModelSpec) -> bool:
        return is_sdxl(spec.config)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        config = spec.config
        tensor = meta_or_random(device, dtype)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        inputs = {
            "sample": tensor(batch, int(config.get("in_channels", 4)), lat_h, lat_w),
            "timestep": example_timestep(tensor, batch, device),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config["cross_attention_dim"])),
        }
        if is_sdxl(config):
            time_dim = int(config["addition_time_embed_dim"]) * SDXL_TIME_IDS
            pooled_dim = int(config["projection_class_embeddings_input_dim"]) - time_dim
            inputs["added_cond_kwargs"] = {"text_embeds": tensor(batch, pooled_dim), "time_ids": tensor(batch, SDXL_TIME_IDS)}
        return inputs

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """"lora_unet_" + the diffusers module path with "." -> "_", as ComfyUI's comfy/lora.py
        model_lora_keys_unet maps SDXL and SD1.x UNets."""
        return kohya_prefixed("lora_unet_", pairs, alpha)

    def comfyui_adapter_name(self, module: str) -> str:
        return "lora_unet_" + module.replace(".", "_")

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """The two CLIPs' penultimate states concatenate to cross_attention_dim (published 768 + 1280 =
        2048); the second's projection is the pooled `text_embeds`, which the UNet's add_embedding takes
        with 6 time ids of addition_time_embed_dim each."""
        from transformers import CLIPTextModel, CLIPTextModelWithProjection

        from zerotrain.families.parts import tiny

        cross = denoiser["cross_attention_dim"]
        hidden_l = cross // 4
        hidden_g = cross - hidden_l
        time_ids = SDXL_TIME_IDS * denoiser["addition_time_embed_dim"]
        projection = denoiser["projection_class_embeddings_input_dim"] - time_ids
        tiny.check_room(hidden_l > 0 and projection > 0, "tiny-sdxl", denoiser)
        clip_l, clip_g = tiny.clip_tokenizer(tiny.CLIP_EOS), tiny.clip_tokenizer(tiny.OPENCLIP_PAD)
        return tiny.diffusers_class("StableDiffusionXLPipeline"), {
            "text_encoder": tiny.seeded("text_encoder", CLIPTextModel, tiny.clip_config(clip_l, hidden_l, hidden_l)),
            "text_encoder_2": tiny.seeded("text_encoder_2", CLIPTextModelWithProjection,
                                          tiny.clip_config(clip_g, hidden_g, projection)),
            "tokenizer": clip_l,
            "tokenizer_2": clip_g,
            "unet": tiny.seeded("unet", tiny.diffusers_class(denoiser["_class_name"]).from_config, denoiser),
            "scheduler": tiny.diffusers_class("EulerDiscreteScheduler").from_config(SDXL_SCHEDULER),
            **self.pipeline_extras,
        }


def _zeros_for_empty(folder: Path) -> bool:
    """StableDiffusionXLPipeline's force_zeros_for_empty_prompt (model_index.json; True by default)."""
    try:
        index = json.loads((folder / "model_index.json").read_text())
        return bool(index.get("force_zeros_for_empty_prompt", True))
    except (OSError, ValueError):
        return True


FAMILY = UNet()
