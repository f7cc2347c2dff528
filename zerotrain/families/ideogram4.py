"""Ideogram 4: Ideogram4Transformer2DModel, FLUX.2's VAE (AutoencoderKLFlux2) and thirteen hidden states of
Qwen3-VL-8B per token, as Ideogram4Pipeline and diffusers' train_dreambooth_lora_ideogram4.py use them.

What sets it apart:
- Two transformers of one class. `transformer` sees the text; `unconditional_transformer` sees only the
  image, with zeroed text, and every denoising step blends them as g * cond + (1 - g) * uncond
  (asymmetric guidance; there is no negative prompt). Training adapts `transformer` alone, as the
  training script does, and never loads the other one: the planner counts one 9.3B transformer. A LoRA
  therefore moves the conditional prediction only, and guidance scales its effect. Validation renders
  with both: the unconditional one is loaded frozen from the model folder for the render and freed
  after, streamed block by block from the host (diffusers' group offloading) on a GPU, so that it
  holds about one block of GPU memory.
- One sequence for text and image. The transformer takes a single packed sequence with per-token
  role (indicator), segment (attention only within a segment) and 3-axis position ids, and returns an
  output for every row. The pipeline lays it out [left padding | text | image]; training lays it out
  [image | text | padding] with the same ids, so that the prediction's first rows are the image's
  (Family.joint_output). Every token's result is the same in both layouts: positions are explicit,
  padding is its own segment, nothing else depends on the order (tests/unit/test_family_ideogram4.py).
- The text is the concatenation of decoder layers 0, 3, ..., 33, 35 of Qwen3-VL (53,248 features a
  token, 106 kB in bf16), whose positions start at 0 whatever the padding: the cache keeps each
  caption's own rows with a prefix mask, and training trims a batch to its longest caption. The
  pipeline does not truncate (it refuses a caption above max_sequence_length), and neither does
  zerotrain: a caption longer than data.text_tokens is an error that names it.
- Latents are the VAE's 32 channels folded 2x2 into 128 in (row, column, channel) order, channel
  fastest (Ideogram4Pipeline's decode; FLUX.2 folds channel-first), normalized by the VAE's batch-norm
  statistics. The timestep is t = 1 - sigma (1 is clean) and the output is x0 - noise, the negated
  velocity. The pipeline sets its own sigmas: logit-normal with std 1.5 around a mean that grows with
  the pixel count (mu = 0.5 ln(H W / 512^2)); training draws sigma so (the training script's
  logit_normal, std 1.5, resolution-aware mean), which is the shift e^mu = sqrt(H W) / 512.

ComfyUI: diffusers' Ideogram 4 LoRA loader reads the community layout (ai-toolkit's:
"diffusion_model.layers.N.attention.qkv" fused, kohya down/up/alpha), which the ComfyUI LoRA export
writes for the block modules. No single-file layout of the full model is public (diffusers has no
converter), so a full fine-tune exports in diffusers' layout only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.families.base import BaseFamily
from zerotrain.families.parts.latents import Flux2Codec

if TYPE_CHECKING:
    from pathlib import Path

    from zerotrain.protocols import ModelSpec

# The published scheduler: the pipeline passes its own sigmas and no mu, so no shift of the scheduler's may
# apply on top (use_dynamic_shifting off, shift 1).
IDEOGRAM4_SCHEDULER = {"num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False}
# Ideogram4Pipeline.__call__'s max_sequence_length: the most text tokens it takes.
MAX_TEXT_TOKENS = 2048
# The training script's and the pipeline's logit-normal std.
LOGIT_STD = 1.5
# AutoencoderKLFlux2's 2x2 cells, folded into channels.
VAE_PATCH = 2
# The unconditional transformer's folder and pipeline component.
UNCONDITIONAL = "unconditional_transformer"
# diffusers' Ideogram 4 LoRA converter (lora_conversion_utils._convert_non_diffusers_ideogram4_lora_to_diffusers):
# the community names of a block's adapted modules; q, k and v are one fused qkv there.
_COMMUNITY = {"attention.to_out.0": "attention.o", "feed_forward.w1": "feed_forward.w1",
              "feed_forward.w2": "feed_forward.w2", "feed_forward.w3": "feed_forward.w3",
              "adaln_modulation": "adaln_modulation"}
_QKV = ("attention.to_q", "attention.to_k", "attention.to_v")
# The full model's attention weights that ComfyUI's layout fuses (to_q takes to_k and to_v along) or renames.
_FULL_RENAMES = ("to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight")


def comfyui_model_to_diffusers(weights: dict[str, Any]) -> dict[str, Any]:
    """The inverse of Ideogram4.comfyui_model: attention.qkv split in three, attention.o named to_out.0."""
    out: dict[str, Any] = {}
    for key, tensor in weights.items():
        if key.endswith(".attention.qkv.weight"):
            block = key[: -len(".qkv.weight")]
            for name, part in zip(("to_q", "to_k", "to_v"), tensor.chunk(3, dim=0), strict=True):
                out[f"{block}.{name}.weight"] = part
        elif key.endswith(".attention.o.weight"):
            out[key.replace(".attention.o.weight", ".attention.to_out.0.weight")] = tensor
        else:
            out[key] = tensor
    return out


class Ideogram4Codec(Flux2Codec):
    """FLUX.2's VAE and batch norm, each 2x2 cell folded in Ideogram's order (not Flux2Pipeline's)."""
    runtime_class = "zerotrain.families.runtime.ideogram4:Ideogram4CodecRuntime"


IDEOGRAM4_VAE = Ideogram4Codec()


class Ideogram4(BaseFamily):
    runtime_class = "zerotrain.families.runtime.ideogram4:Ideogram4Runtime"
    name = "ideogram4"
    title = "Ideogram 4"
    denoiser_classes = ("Ideogram4Transformer2DModel",)
    codec = IDEOGRAM4_VAE
    pipeline = "Ideogram4Pipeline"
    text_components = (("tokenizer", "text_encoder"),)
    text_outputs = ("prompt_embeds", "prompt_embeds_mask")
    # A pipeline zerotrain builds for the text (or around the trained model) has no unconditional transformer
    # until validation_pipeline loads it.
    pipeline_extras: ClassVar[dict[str, Any]] = {UNCONDITIONAL: None}
    # The pipeline takes up to 2048; Ideogram's structured JSON captions run to a few hundred tokens.
    default_text_tokens = 512
    # train_dreambooth_lora_ideogram4.py's defaults: each block's attention projections and feed-forward.
    lora_targets = ("to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3")
    # Ideogram4Pipeline's default guidance_schedule is 7.0 for all but its last 3 of 48 steps (3.0 there);
    # validation renders with one constant guidance_scale at any step count.
    default_guidance = 7.0
    classifier_free_guidance = False
    default_in_channels = 128
    timestep_logit_std = LOGIT_STD
    joint_output = True

    # --- validation images -------------------------------------------------------------------------

    def classifier_free(self, guidance_scale: float) -> bool:
        """No negative prompt: the unconditional transformer runs at every guidance."""
        return False

    def takes_negative(self, spec: ModelSpec, folder: Path) -> bool:
        return False

    def validation_params(self, trained_base_params: int) -> int:
        """The unconditional transformer: the trained one's class and config (the pipeline requires the
        same in_channels and llm_features_dim, and the published pair is one architecture)."""
        return trained_base_params


FAMILY = Ideogram4()
