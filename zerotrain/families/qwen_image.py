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

from zerotrain.families.base import BaseFamily, packed_channels
from zerotrain.families.parts.latents import QWEN_IMAGE_VAE, QWEN_PATCH
from zerotrain.families.parts.qwen_image_edit import EDIT_PIPELINES, PLUS

if TYPE_CHECKING:
    from pathlib import Path

    from zerotrain.protocols import ModelSpec

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


class QwenImage(BaseFamily):
    runtime_class = "zerotrain.families.runtime.qwen_image:QwenImageRuntime"
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

    def min_references(self, spec: ModelSpec) -> int:
        """The edit pipelines take at least one image."""
        return min(1, self.max_references(spec))

    def reference_text_rows(self, spec: ModelSpec, references: list[tuple[int, int]]) -> int:
        """The references' rows beside the caption's, as the processor resizes them: the torch side counts them
        (image_text_rows, by transformers' smart_resize), so a plan with references imports it; none without."""
        return self.runtime().image_text_rows(spec, references) if references else 0

    # --- loading: the edit pipelines' processor ----------------------------------------------------

    def text_parts(self, pipeline_name: str) -> tuple[tuple[str, str], ...]:
        """The edit pipelines read text through their processor (their tokenizer goes unused)."""
        return (("processor", "text_encoder"),) if pipeline_name in EDIT_PIPELINES else self.text_components

    def comfyui_adapter_name(self, module: str) -> str:
        return f"diffusion_model.{module}"


FAMILY = QwenImage()
