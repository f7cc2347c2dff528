"""Krea 2 (Raw and Turbo): Krea2Transformer2DModel, the Qwen-Image VAE (AutoencoderKLQwenImage) and
twelve hidden states of Qwen3-VL-4B per token, as Krea2Pipeline and diffusers'
train_dreambooth_lora_krea2.py use them.

What sets it apart:
- The text is a stack: encode_prompt takes hidden states (2, 5, ..., 35) of Qwen3-VL for every token
  (text_encoder_select_layers, in model_index.json), so prompt_embeds is (B, T, 12, 2560) and the
  transformer fuses the twelve itself (text_fusion). The prompt sits between a 34-token system prefix,
  which is dropped, and a 5-token suffix that follows the padding, so the pipeline's mask has a hole:
  [prompt | pad | suffix]. Every text token has RoPE position 0 and padded keys are masked, so the
  transformer is blind to where the padding goes: the cache keeps each caption's own rows (prompt, then
  suffix) zero-padded at the end with a prefix mask, and training trims a batch to its longest caption
  (the pipeline's layout and this one agree to 2.4e-7 in float32; tests/unit/test_family_krea2.py).
- Latents are Qwen-Image's: 16 channels normalized per channel, 2x2 patches packed as
  QwenImagePipeline packs them, 64 channels a token. The timestep is sigma (the model scales it by
  1000); the output is the velocity noise - x0. Classifier-free guidance runs for any guidance above
  0 (cond + g (cond - uncond)).
- The scheduler shifts by the image tokens (exponential time shift, mu from 0.5 at 256 tokens to 1.15
  at 6400): the published config must say max_image_seq_len 6400, or FlowMatchEulerDiscreteScheduler's
  4096 applies. Turbo is the same model distilled (model_index.json's is_distilled), sampled in 8 steps
  without guidance at a fixed mu of 1.15.

Fine-tuning: train on Raw, as Krea's model card says ("the checkpoint you should use for fine-tuning,
post-training, and LoRA training"); a LoRA trained on Raw loads into Turbo, which renders it in 8 steps
(tests/distributed/test_train_table.py, row krea2). Turbo itself trains too, as any distilled checkpoint does, at
the cost of its few-step behaviour.

LoRA defaults to the training script's targets (the Krea 2 authors' recommendation): the block
attention with its output gate, the MLP's up and down projections, the text fusion's projector, and the
input, time and final layers. ComfyUI and Krea's reference trainer name the modules as the original
checkpoint does (blocks.N.attn.wq ...): the ComfyUI exports use those names, which diffusers' own
converters (single file and LoRA) read back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.families.base import BaseFamily, model_index, packed_channels
from zerotrain.families.parts.latents import QWEN_IMAGE_VAE, QWEN_PATCH

if TYPE_CHECKING:
    from pathlib import Path

    from zerotrain.protocols import ModelSpec

# Krea2Pipeline's suffix after the padding: "<|im_end|>\n<|im_start|>assistant\n".
SUFFIX_TOKENS = 5
# The published scheduler config (krea/Krea-2-Raw scheduler/scheduler_config.json as the pipeline's
# docstring gives it); the tiny model gets the same.
KREA2_SCHEDULER = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 6400,
    "time_shift_type": "exponential",
}
# The tiny Qwen3-VL: three layers, of which the tiny model_index taps the first two, so that no tap is the
# final-normed state, as none of the published taps is.
_TINY_TEXT_LAYERS, _TINY_TAPS = 3, (1, 2)

# diffusers module paths -> the original (Krea, ComfyUI) names, as diffusers' converters map them back
# (loaders/single_file_utils.py convert_krea2_transformer_checkpoint_to_diffusers and
# lora_conversion_utils.py _convert_non_diffusers_krea2_lora_to_diffusers). First match wins.
_NATIVE_PREFIXES = (
    ("img_in.", "first."), ("time_embed.linear_1.", "tmlp.0."), ("time_embed.linear_2.", "tmlp.2."),
    ("time_mod_proj.", "tproj.1."), ("txt_in.norm.weight", "txtmlp.0.scale"), ("txt_in.linear_1.", "txtmlp.1."),
    ("txt_in.linear_2.", "txtmlp.3."), ("text_fusion.", "txtfusion."), ("transformer_blocks.", "blocks."),
    ("final_layer.linear.", "last.linear."), ("final_layer.norm.weight", "last.norm.scale"),
    ("final_layer.scale_shift_table", "last.modulation.lin"),
)
_NATIVE_BLOCK = (
    (".attn.to_q.", ".attn.wq."), (".attn.to_k.", ".attn.wk."), (".attn.to_v.", ".attn.wv."),
    (".attn.to_out.0.", ".attn.wo."), (".attn.to_gate.", ".attn.gate."),
    (".attn.norm_q.weight", ".attn.qknorm.qnorm.scale"), (".attn.norm_k.weight", ".attn.qknorm.knorm.scale"),
    (".ff.", ".mlp."), (".norm1.weight", ".prenorm.scale"), (".norm2.weight", ".postnorm.scale"),
    (".scale_shift_table", ".mod.lin"),
)


def native_name(name: str) -> str:
    """A diffusers parameter (or module path + ".") of Krea2Transformer2DModel under its original name."""
    for old, new in _NATIVE_PREFIXES:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    if not name.startswith("last."):
        for old, new in _NATIVE_BLOCK:
            name = name.replace(old, new)
    return name


class Krea2(BaseFamily):
    runtime_class = "zerotrain.families.runtime.krea2:Krea2Runtime"
    name = "krea2"
    title = "Krea 2"
    denoiser_classes = ("Krea2Transformer2DModel",)
    codec = QWEN_IMAGE_VAE
    pipeline = "Krea2Pipeline"
    text_components = (("tokenizer", "text_encoder"),)
    text_outputs = ("prompt_embeds", "prompt_embeds_mask")
    # Krea2Pipeline.__call__'s max_sequence_length: the prompt and its 5-token suffix.
    default_text_tokens = 512
    # train_dreambooth_lora_krea2.py's defaults ("the Krea 2 authors' recommended default"); the
    # SwiGLU gate (ff.gate) is left out as there.
    lora_targets = ("img_in", "final_layer.linear", "to_q", "to_k", "to_v", "to_out.0", "to_gate", "ff.up",
                    "ff.down", "text_fusion.projector", "txt_in.linear_1", "txt_in.linear_2",
                    "time_embed.linear_1", "time_embed.linear_2", "time_mod_proj")
    # Krea2Pipeline.__call__'s guidance_scale for Raw (Turbo: 0, in 8 steps).
    default_guidance = 4.5
    classifier_free_guidance = True
    default_in_channels = 64
    shift_defaults: ClassVar[dict[str, float]] = {"base_image_seq_len": 256, "max_image_seq_len": 6400,
                                                  "base_shift": 0.5, "max_shift": 1.15}

    def latent_channels(self, config: dict[str, Any], where: Any) -> int:
        return packed_channels(int(config.get("in_channels") or self.default_in_channels), where, self.title, "input")

    def patch(self, spec: ModelSpec) -> int:
        return QWEN_PATCH

    def classifier_free(self, guidance_scale: float) -> bool:
        """Krea2Pipeline guides as cond + g * (cond - uncond) for any g above 0."""
        return guidance_scale > 0

    # --- validation images -------------------------------------------------------------------------

    def pipeline_kwargs(self, spec: ModelSpec, folder: Path) -> dict[str, Any]:
        """The model folder's own text_encoder_select_layers, is_distilled and patch_size (model_index.json),
        which Krea2Pipeline registers: Turbo samples at a fixed shift."""
        index = model_index(folder, self.title)
        return {key: index[key] for key in ("text_encoder_select_layers", "is_distilled", "patch_size") if key in index}


FAMILY = Krea2()
