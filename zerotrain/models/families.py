"""What each model family needs, and nothing about ZeRO: the conditioning a denoiser's forward
takes (following diffusers' own pipelines), the pixel factor a resolution must be a multiple of,
and the default LoRA targets. The denoisers themselves are the diffusers classes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import ModelSpec

if TYPE_CHECKING:
    import torch

# Default LoRA targets, as diffusers' own training scripts choose them
# (train_dreambooth_lora_flux.py, train_dreambooth_lora_sd3.py, train_text_to_image_lora_sdxl.py).
LORA_TARGETS: dict[str, list[str]] = {
    "flux": [
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    ],
    "sd3": [
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
    ],
    "unet": ["to_k", "to_q", "to_v", "to_out.0"],
}

# The denoiser's subfolder in a diffusers model folder, and its component name in the pipelines.
DENOISER_FOLDER = {"flux": "transformer", "sd3": "transformer", "unet": "unet"}

# Text sequence length the pipelines feed the denoiser by default: FluxPipeline's
# max_sequence_length=512 T5 tokens; StableDiffusion3Pipeline's 77 CLIP + 256 T5 tokens;
# CLIP's 77 tokens for the UNets.
DEFAULT_TEXT_TOKENS = {"flux": 512, "sd3": 77 + 256, "unet": 77}

# SDXL's add_time_ids: original size (2), crop top-left (2), target size (2).
SDXL_TIME_IDS = 6


def pixel_factor(spec: ModelSpec) -> int:
    """Sides of a training image must be multiples of this: the VAE's downsampling times the
    denoiser's own patching (Flux packs 2x2 latents; SD3 patchifies; a UNet halves the latent
    once per down block after the first)."""
    config = spec.config
    if spec.family == "flux":
        return spec.vae_scale_factor * 2
    if spec.family == "sd3":
        return spec.vae_scale_factor * int(config.get("patch_size", 2))
    return spec.vae_scale_factor * 2 ** (len(config["down_block_types"]) - 1)


def check_resolution(spec: ModelSpec, resolution: int) -> None:
    factor = pixel_factor(spec)
    if resolution % factor:
        lower, upper = resolution // factor * factor, (resolution // factor + 1) * factor
        raise ZerotrainError(
            f"data.resolution={resolution} is not a multiple of {factor} for {spec.name} "
            f"(VAE x{spec.vae_scale_factor} times the denoiser's patching); use {lower or upper} or {upper}"
        )


def image_tokens(spec: ModelSpec, resolution: int) -> int:
    """Image tokens (DiTs) or latent pixels (UNets) of a square image at this resolution."""
    side = resolution // pixel_factor(spec) if spec.family != "unet" else resolution // spec.vae_scale_factor
    return side * side


def example_inputs(
    spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
    device: torch.device | str, dtype: torch.dtype,
) -> dict[str, Any]:
    """Keyword arguments for one training forward of the denoiser, shaped as the family's
    diffusers pipeline shapes them. Values are uninitialised on meta, random elsewhere."""
    import torch

    config = spec.config

    def tensor(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
        if torch.device(device).type == "meta":
            return torch.empty(*shape, device=device, dtype=kind)
        return torch.randn(*shape, device=device, dtype=kind)

    lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
    t = tensor(batch, kind=torch.float32).abs() if torch.device(device).type != "meta" else tensor(batch)
    if spec.family == "flux":
        tokens = (lat_h // 2) * (lat_w // 2)
        inputs = {
            "hidden_states": tensor(batch, tokens, int(config.get("in_channels", 64))),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config.get("joint_attention_dim", 4096))),
            "pooled_projections": tensor(batch, int(config.get("pooled_projection_dim", 768))),
            "timestep": t,
            "img_ids": tensor(tokens, 3),
            "txt_ids": tensor(text_tokens, 3),
        }
        if config.get("guidance_embeds", False):
            inputs["guidance"] = t
        return inputs
    if spec.family == "sd3":
        return {
            "hidden_states": tensor(batch, int(config.get("in_channels", 16)), lat_h, lat_w),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config.get("joint_attention_dim", 4096))),
            "pooled_projections": tensor(batch, int(config.get("pooled_projection_dim", 2048))),
            "timestep": t,
        }
    inputs = {
        "sample": tensor(batch, int(config.get("in_channels", 4)), lat_h, lat_w),
        "timestep": t,
        "encoder_hidden_states": tensor(batch, text_tokens, int(config["cross_attention_dim"])),
    }
    if config.get("addition_embed_type") == "text_time":
        time_dim = int(config["addition_time_embed_dim"]) * SDXL_TIME_IDS
        pooled_dim = int(config["projection_class_embeddings_input_dim"]) - time_dim
        inputs["added_cond_kwargs"] = {"text_embeds": tensor(batch, pooled_dim), "time_ids": tensor(batch, SDXL_TIME_IDS)}
    return inputs
