"""Stable Diffusion 3 / 3.5: SD3Transformer2DModel, its AutoencoderKL, two CLIPs and T5, as
StableDiffusion3Pipeline and diffusers' train_dreambooth_sd3.py use them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.families.base import BaseFamily
from zerotrain.families.parts.latents import PUBLISHED_VAE_SCALE_FACTOR
from zerotrain.protocols import VaeFacts

if TYPE_CHECKING:
    from zerotrain.protocols import ModelSpec

# The published scheduler config (stabilityai/stable-diffusion-3.5-large scheduler/scheduler_config.json).
SD3_SCHEDULER = {"num_train_timesteps": 1000, "shift": 3.0}


class SD3(BaseFamily):
    runtime_class = "zerotrain.families.runtime.sd3:SD3Runtime"
    name = "sd3"
    title = "SD3"
    denoiser_classes = ("SD3Transformer2DModel",)
    pipeline = "StableDiffusion3Pipeline"
    text_components = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"),
                       ("tokenizer_3", "text_encoder_3"))
    # StableDiffusion3Pipeline's 77 CLIP + 256 T5 tokens.
    default_text_tokens = 77 + 256
    # As diffusers' train_dreambooth_lora_sd3.py chooses them.
    def with_blocks(self, config: dict[str, Any], blocks: int) -> dict[str, Any]:
        """Fewer blocks, and SD3.5-medium's dual-attention blocks among those kept."""
        out = super().with_blocks(config, blocks)
        if config.get("dual_attention_layers"):
            out["dual_attention_layers"] = [i for i in config["dual_attention_layers"] if i < out["num_layers"]]
        return out

    lora_targets = (
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v",
    )
    # StableDiffusion3Pipeline.__call__'s guidance_scale (classifier-free).
    default_guidance = 7.0
    classifier_free_guidance = True
    default_in_channels = 16
    # calculate_shift's defaults as StableDiffusion3Pipeline writes them (with use_dynamic_shifting).
    shift_defaults: ClassVar[dict[str, float]] = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.16}

    def published_vae(self, config: dict[str, Any]) -> VaeFacts:
        # SD3/3.5 (stabilityai/stable-diffusion-3.5-large vae/config.json): scaling 1.5305, shift 0.0609.
        return VaeFacts(PUBLISHED_VAE_SCALE_FACTOR, self.latent_channels(config, "config"), 1.5305, 0.0609)

    def patch(self, spec: ModelSpec) -> int:
        return int(spec.config.get("patch_size", 2))

    def comfyui_adapter_name(self, module: str) -> str:
        return "lora_transformer_" + module.replace(".", "_")


FAMILY = SD3()
