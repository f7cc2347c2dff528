"""Qwen-Image 2.1: QwenImage21Transformer2DModel, its AutoencoderKLQwenImage21 and the last decoder layer of
Qwen3-VL, as QwenImage21Pipeline uses them.

What sets it apart:
- One sequence. The transformer takes the text (Qwen3-VL's states, the template's system prefix dropped) and
  the latents in a single block-causal sequence: causal over the text, bidirectional inside each image, the
  target image last (img_mask marks its slots, one per 2x2 latent tokens, so images are multiples of 32
  pixels). It returns a row for every position, and the loss scores the last ones, the target's
  (Family.joint_output with target_last), as the pipeline cuts noise_pred[:, -N:]. The text and any
  condition image are modulated at t = 0 (causal_condition), the target at its timestep.
- Text: the last decoder layer's output before Qwen3-VL's final norm (the pipeline hooks the norm out), of
  the caption in the pipeline's raw template; each caption keeps its own rows with a mask (the transformer
  masks padded keys; the pipeline pads a batch too, the same way). The pipeline does not truncate, and
  neither does zerotrain: a caption above data.text_tokens is an error that names it.
- Latents: the VAE reads RGBA one-frame videos (B, 4, 1, H, W), 16x down to 64 channels, normalized per
  channel by latents_mean / latents_std as the pipeline encodes and decodes; an RGB image gets an opaque
  alpha, as the pipeline's convert("RGBA") gives it. One latent cell is one token (no packing).
- The timestep is sigma and the target the velocity (noise - x0); the scheduler shifts by the target's token
  count (dynamic shifting through calculate_shift, 0.5 at 256 tokens to 1.15 at 4096).
- Sampling needs no guidance (true_cfg_scale 1 by default); the pipeline's sample_sigmas (model_index.json)
  set its steps when the model's authors fixed them.
- Edits (up to MAX_REFERENCES condition images): the text encoder reads each image with the caption (the
  template's vision tokens before it, one per 32x32 pixels), so the cache encodes an edit caption with its
  images (encode_prompt's images; text_reads_references) and keeps the caption's rows and image_pad_mask, the
  places of the images' slots, whose own rows the transformer overwrites with the images' latents. Training
  lays the rows back around the slots (with_slots) and puts the images' tokens before the target's
  (add_references), as the pipeline's call does. Validation renders through render_class, which passes the
  cached image_pad_mask on to encode_prompt.

The planner traces the transformer on the meta device with img_mask on the host: the transformer derives its
token layout from it with nonzero and tolist (trace.HostMetadataMode).

The processor (Qwen3VLProcessor) is built without its video processor (runtime.parts.qwen_vl.text_processor): transformers
builds that one only with torchvision, which zerotrain does not install.

ComfyUI: its Qwen-Image 2.1 layout is diffusers' names with each block's SwiGLU gate and up projections fused
into img_mlp.gate_up, gate rows first (diffusers' convert_qwen_image21_transformer_checkpoint_to_diffusers
splits it). The full model exports so, and a LoRA as "diffusion_model." + the module path (lora_A / lora_B /
alpha), gate and up fused into one gate_up adapter where both are trained.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.families.base import BaseFamily, model_index
from zerotrain.families.parts.declared import Declared
from zerotrain.protocols import LatentCodec, VaeFacts

if TYPE_CHECKING:
    from pathlib import Path

    from zerotrain.protocols import ModelSpec

# QwenImage21Pipeline's fallbacks for calculate_shift, and dynamic shifting, as its __call__ passes mu.
QWEN21_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": True,
                    "time_shift_type": "exponential", "base_image_seq_len": 256, "max_image_seq_len": 4096,
                    "base_shift": 0.5, "max_shift": 1.15}
# The most condition images zerotrain trains an edit with. The pipeline takes a list of any length; each image
# costs the text encoder one token per 32x32 pixels and the transformer one per 16x16, at the target's area.
MAX_REFERENCES = 3
# Every image slot of the text encoder's sequence stands for 2x2 latent tokens.
SLOT = 2
# The VAE's 16x: QwenImage21Pipeline.vae_scale_factor.
VAE_SCALE = 16
# Qwen3-VL's tokens around an image, which the processor and the pipeline's template use.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# AutoencoderKLQwenImage21's defaults (the published VAE), when a vae/config.json omits them.
_VAE_DEFAULTS = {"z_dim": 64, "dim_mult": [1, 2, 4, 8, 8]}
_MLP_PARTS = ("img_mlp.gate_layer", "img_mlp.proj")  # fused into ComfyUI's img_mlp.gate_up, gate rows first


class QwenImage21Codec(Declared):
    """AutoencoderKLQwenImage21: a video VAE of RGBA frames, 16x down, z_dim channels, normalized per channel by the
    config's latents_mean and latents_std."""
    runtime_class = "zerotrain.families.runtime.qwen_image21:QwenImage21CodecRuntime"
    runtime_protocol = LatentCodec

    vae_class = "AutoencoderKLQwenImage21"

    def vae_facts(self, vae_config: dict[str, Any]) -> VaeFacts:
        vae = {**_VAE_DEFAULTS, **vae_config}
        return VaeFacts(2 ** (len(vae["dim_mult"]) - 1), int(vae["z_dim"]), None, None)

    def published(self, latent_channels: int) -> VaeFacts:
        return VaeFacts(VAE_SCALE, latent_channels, None, None)

    def vae_downsampling(self, vae: Any) -> int:
        return 2 ** (len(vae.config.dim_mult) - 1)

    def vae_latent_channels(self, vae: Any) -> int:
        return int(vae.config.z_dim)


QWEN_IMAGE21_VAE = QwenImage21Codec()


class QwenImage21(BaseFamily):
    runtime_class = "zerotrain.families.runtime.qwen_image21:QwenImage21Runtime"
    name = "qwen_image21"
    title = "Qwen-Image 2.1"
    denoiser_classes = ("QwenImage21Transformer2DModel",)
    codec = QWEN_IMAGE21_VAE
    pipeline = "QwenImage21Pipeline"
    text_components = (("processor", "text_encoder"),)
    text_outputs = ("prompt_embeds", "prompt_embeds_mask")
    default_text_tokens = 512
    # Every block's attention projections (the community LoRAs' targets: the released checkpoints fuse the MLP's
    # gate and up projections, which a LoRA of diffusers' names misses there).
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0")
    # QwenImage21Pipeline.__call__'s true_cfg_scale: 1, no guidance (classifier-free, with a negative prompt, above 1).
    default_guidance = 1.0
    classifier_free_guidance = True
    default_in_channels = 64
    shift_defaults: ClassVar[dict[str, float]] = {key: QWEN21_SCHEDULER[key] for key in
                                                  ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")}
    joint_output = True
    target_last = True
    text_reads_references = True

    # --- the model and its latents -----------------------------------------------------------------

    def pixel_factor(self, spec: ModelSpec) -> int:
        """The VAE's 16 pixels a token times the 2x2 tokens of an image slot: 32, as the pipeline rounds sizes."""
        return spec.vae_scale_factor * SLOT

    def image_tokens(self, spec: ModelSpec, resolution: int) -> int:
        side = resolution // spec.vae_scale_factor
        return side * side

    # --- references --------------------------------------------------------------------------------

    def max_references(self, spec: ModelSpec) -> int:
        return MAX_REFERENCES

    # --- validation images -------------------------------------------------------------------------

    def pipeline_kwargs(self, spec: ModelSpec, folder: Path) -> dict[str, Any]:
        """The folder's sample_sigmas (model_index.json): the steps its authors fixed, if any."""
        return {"sample_sigmas": model_index(folder, self.title).get("sample_sigmas")}


FAMILY = QwenImage21()
