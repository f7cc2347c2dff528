"""Chroma (lodestones/Chroma1-HD, Chroma1-Base, Chroma1-Flash): ChromaTransformer2DModel, FLUX.1's
AutoencoderKL and T5's sequence with its attention mask, as ChromaPipeline uses them.

Chroma is FLUX.1-schnell with the per-block modulation Linears replaced by one small network
(distilled_guidance_layer) that computes every block's modulation from the timestep alone, no CLIP,
no guidance input, and a text attention mask. So the family is built on FLUX.1's transformer part
(parts.flux1.Flux1Transformer): the same VAE and latents, 2x2 packing, position ids, timestep = sigma,
dynamic shift, flow target, 512 T5 tokens, LoRA targets and Black Forest Labs names. What differs:

- Text: ChromaPipeline.encode_prompt runs T5 with the tokenizer's attention mask and gives the
  transformer a mask over the caption's tokens, its </s> and one pad token. The cache keeps that
  mask beside the embeddings (0/1, exact in bf16), and training passes it as a bool mask: the
  pipeline's own float mask reaches scaled_dot_product_attention as an additive bias that masks
  nothing (diffusers#12116, open in 0.42), while lodestone-rock/flow (Chroma's own trainer), ComfyUI
  and SimpleTuner use a bool mask. Validation passes bool masks too, which the pipeline keeps bool.
- Guidance: real classifier-free guidance (two predictions per step), guidance_scale 5.0, the
  negative prompt encoded like any other (the empty prompt by default).
- Gradient checkpointing: per block, not through diffusers' enable_gradient_checkpointing, whose
  single-stream blocks run without the attention mask (enable_checkpointing).
- Full fine-tunes train every parameter, distilled_guidance_layer included, as zerotrain's full mode
  does for every family (and diffusers' train_dreambooth_flux.py for FLUX.1's guidance and time
  embedders). Chroma's own trainer and OneTrainer keep it frozen instead; it is 278M of 8.9B
  parameters. The default LoRA targets (FLUX.1's block Linears) leave it out.
- ComfyUI: a full fine-tune is written with Black Forest Labs keys (comfyui_model), since ComfyUI
  recognises Chroma only by them.
"""

from __future__ import annotations

import re

from zerotrain.families.parts.flux1 import (
    MAX_T5_TOKENS,
    Flux1Transformer,
    flux_top_module,
)

# The approximator (distilled_guidance_layer): Black Forest Labs' names are diffusers' except its
# layers' two Linears (diffusers' convert_chroma_transformer_checkpoint_to_diffusers maps
# in_layer / out_layer to linear_1 / linear_2).
_APPROXIMATOR = re.compile(r"^distilled_guidance_layer\.(in_proj|out_proj|norms\.\d+|layers\.\d+\.linear_[12])$")
_APPROXIMATOR_LINEARS = {"linear_1": "in_layer", "linear_2": "out_layer"}
# Black Forest Labs' RMSNorm calls its weight "scale": the blocks' q/k norms and the approximator's norms.
_RMS_NORM = re.compile(r"(query_norm|key_norm|distilled_guidance_layer\.norms\.\d+)$")


def chroma_top_module(module: str) -> str | None:
    """Chroma's Black Forest Labs name of a module outside the blocks: the approximator's, or FLUX.1's
    embedders and output layer."""
    if _APPROXIMATOR.match(module):
        head, _, last = module.rpartition(".")
        return f"{head}.{_APPROXIMATOR_LINEARS[last]}" if last in _APPROXIMATOR_LINEARS else module
    return flux_top_module(module)


class Chroma(Flux1Transformer):
    runtime_class = "zerotrain.families.runtime.chroma:ChromaRuntime"
    name = "chroma"
    title = "Chroma"
    denoiser_classes = ("ChromaTransformer2DModel",)
    pipeline = "ChromaPipeline"
    text_components = (("tokenizer", "text_encoder"),)
    text_outputs = ("prompt_embeds", "prompt_attention_mask")
    # ChromaPipeline's max_sequence_length=512 T5 tokens.
    default_text_tokens = MAX_T5_TOKENS
    # ChromaPipeline.__call__'s guidance_scale (classifier-free, two predictions per step).
    default_guidance = 5.0
    classifier_free_guidance = True


FAMILY = Chroma()
