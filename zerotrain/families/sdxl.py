"""SDXL, and SD 1.x/2.x for planning: UNet2DConditionModel, AutoencoderKL and two CLIPs, as
StableDiffusionXLPipeline and diffusers' train_text_to_image_sdxl.py use them. The family is named
"unet" in caches and plan facts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.families.base import BaseFamily, share_blocks
from zerotrain.families.parts.latents import PUBLISHED_VAE_SCALE_FACTOR
from zerotrain.protocols import VaeFacts

if TYPE_CHECKING:
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


class UNet(BaseFamily):
    runtime_class = "zerotrain.families.runtime.sdxl:UNetRuntime"
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

    objective = "ddpm"

    def ddpm_time_ids(self, spec: ModelSpec) -> bool:
        return is_sdxl(spec.config)

    def comfyui_adapter_name(self, module: str) -> str:
        return "lora_unet_" + module.replace(".", "_")


FAMILY = UNet()
