"""FLUX.2 ([dev] and [klein]): Flux2Transformer2DModel, AutoencoderKLFlux2 and the stacked hidden states of a
causal language model as text (Mistral Small 3.1 for [dev], Qwen3 for [klein]), as Flux2Pipeline,
Flux2KleinPipeline and diffusers' train_dreambooth_lora_flux2*.py use them.

One family, two pipelines (pipeline_name): [dev] embeds its guidance (guidance_embeds) and renders with
Flux2Pipeline; [klein] has no guidance embedder and renders with Flux2KleinPipeline, with classifier-free
guidance (the klein-base models) or step-distilled without any (model_index.json's is_distilled).

Latents live where the transformer sees them: the VAE's 32 channels folded 2x2 into 128
(Flux2Pipeline._patchify_latents) and normalized by the VAE's batch-norm running statistics, so one
latent cell is one image token (16 pixels a side) and the denoiser's own patch_size is 1. They are the
posterior's mode, not draws from it: Black Forest Labs' reference AutoEncoder.encode
(black-forest-labs/flux2 src/flux2/autoencoder.py) returns the normalized mean and drops the log-variance,
and diffusers' FLUX.2 scripts encode with latent_dist.mode(), so the model never saw sampled latents.
The cache stores the mode with a zero std (the generic layout), and every step's "draw" is the mode.

The real FLUX.2 [dev] repo keeps a PixtralProcessor in tokenizer/, which transformers builds only with
torchvision installed; zerotrain does not install it, so caching a real [dev] folder needs
`pip install torchvision` (Flux2Pipeline itself only calls the processor's apply_chat_template).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from zerotrain.families.base import BaseFamily, capped_size, model_index
from zerotrain.families.parts.flux1 import FLUX_SCHEDULER
from zerotrain.families.parts.latents import FLUX2_VAE

if TYPE_CHECKING:
    from pathlib import Path

    from zerotrain.protocols import ModelSpec

# convert_flux2_to_diffusers.py copies black-forest-labs/FLUX.1-dev's scheduler config into every FLUX.2
# repo: dynamic shifting, whose calculate_shift parameters the FLUX.2 pipelines ignore (dynamic_shift).
FLUX2_SCHEDULER = FLUX_SCHEDULER
# The number of denoising steps Flux2Pipeline and Flux2KleinPipeline sample with by default: their mu
# (compute_empirical_mu) depends on it, so training shifts as a default-settings render samples.
PIPELINE_STEPS = 50
# Flux2Pipeline scales a reference above this area (1024 x 1024 pixels) down to it, at its own aspect.
REFERENCE_AREA = 1024
# Black Forest Labs' FLUX.2 model card: up to 10 reference images (the pipelines set no limit).
MAX_REFERENCES = 10
# Flux2Transformer2DModel.__init__'s defaults (which are FLUX.2 [dev]'s config), for configs that omit them.
DENOISER_DEFAULTS = {"in_channels": 128, "joint_attention_dim": 15360, "num_single_layers": 48, "guidance_embeds": True}

# Flux2Transformer2DModel module -> Black Forest Labs' module (BFL's flux2 src/flux2/model.py, as diffusers'
# convert_flux2_transformer_checkpoint_to_diffusers and ComfyUI name them); fused BFL layers list their
# diffusers parts in output order. The q/k RMSNorms (no LoRA targets them) are there for full weights.
_DOUBLE = {
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "ff.linear_in": "img_mlp.0", "ff.linear_out": "img_mlp.2",
    "ff_context.linear_in": "txt_mlp.0", "ff_context.linear_out": "txt_mlp.2",
    "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
}
_DOUBLE_FUSED = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_SINGLE = {
    "attn.to_qkv_mlp_proj": "linear1", "attn.to_out": "linear2",
    "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm",
}
_TOP = {
    "x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
    "time_guidance_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_guidance_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_guidance_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_guidance_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "double_stream_modulation_img.linear": "double_stream_modulation_img.lin",
    "double_stream_modulation_txt.linear": "double_stream_modulation_txt.lin",
    "single_stream_modulation.linear": "single_stream_modulation.lin",
    "norm_out.linear": "final_layer.adaLN_modulation.1",  # (shift, scale) rows swapped to (scale, shift)
}
_SWAPPED = "final_layer.adaLN_modulation.1"
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")
# BFL's RMSNorm calls its weight "scale".
_NORM_WEIGHT = "scale"


def pipeline_for(config: dict[str, Any]) -> str:
    """The diffusers pipeline of a Flux2Transformer2DModel config: Flux2Pipeline passes an embedded
    guidance every step, so it serves the models with a guidance embedder ([dev]); Flux2KleinPipeline
    passes none ([klein])."""
    guided = config.get("guidance_embeds", DENOISER_DEFAULTS["guidance_embeds"])
    return "Flux2Pipeline" if guided else "Flux2KleinPipeline"


def bfl_module(module: str) -> tuple[str, tuple[str, ...]] | None:
    """The Black Forest Labs module that holds Flux2Transformer2DModel module `module`, and the diffusers
    modules fused into it in output order (`module` alone when it is not fused); None when BFL has none."""
    match = _BLOCK.match(module)
    if match is None:
        return (_TOP[module], (module,)) if module in _TOP else None
    kind, index, rest = match.groups()
    if kind == "single_transformer_blocks":
        return (f"single_blocks.{index}.{_SINGLE[rest]}", (module,)) if rest in _SINGLE else None
    if rest in _DOUBLE:
        return f"double_blocks.{index}.{_DOUBLE[rest]}", (module,)
    for target, parts in _DOUBLE_FUSED.items():
        if rest in parts:
            return f"double_blocks.{index}.{target}", tuple(f"{kind}.{index}.{part}" for part in parts)
    return None


class Flux2(BaseFamily):
    runtime_class = "zerotrain.families.runtime.flux2:Flux2Runtime"
    name = "flux2"
    title = "FLUX.2"
    diffusers_lokr = True
    denoiser_classes = ("Flux2Transformer2DModel",)
    codec = FLUX2_VAE
    pipeline = "Flux2Pipeline"
    text_components = (("tokenizer", "text_encoder"),)
    text_outputs = ("prompt_embeds",)
    # The pipelines' max_sequence_length=512: every caption padded to it (the transformer attends all of it).
    default_text_tokens = 512
    # As diffusers' train_dreambooth_lora_flux2*.py choose them: the double blocks' image attention and
    # the single blocks' fused input and output projections. A single block's attn.to_out is a Linear but
    # a double block's a ModuleList (a bare "to_out" fails there), so default_lora_targets names them by index.
    depth_keys = ("num_layers", "num_single_layers")
    lora_targets = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj")
    # Both pipelines' __call__ guidance_scale: embedded guidance for [dev], classifier-free for klein-base.
    default_guidance = 4.0
    classifier_free_guidance = True
    default_in_channels = DENOISER_DEFAULTS["in_channels"]

    # --- the model and its latents -----------------------------------------------------------------

    def pipeline_name(self, spec: ModelSpec) -> str:
        return pipeline_for(spec.config)

    def default_lora_targets(self, spec: ModelSpec) -> list[str]:
        single = int(spec.config.get("num_single_layers", DENOISER_DEFAULTS["num_single_layers"]))
        return [*self.lora_targets, *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(single))]

    # --- references ------------------------------------------------------------------------------

    def max_references(self, spec: ModelSpec) -> int:
        return MAX_REFERENCES

    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        """As Flux2Pipeline and Flux2KleinPipeline size each image: its own size, scaled down to 1024 x
        1024 pixels of area at its aspect when above that, each side floored to the VAE's 16 pixels;
        with `area`, scaled to that area instead."""
        return capped_size(control, area, self.pixel_factor(spec), REFERENCE_AREA)

    def comfyui_adapter_name(self, module: str) -> str:
        """"transformer." + the diffusers module path: ComfyUI's Flux2 model subclasses its Flux, whose
        table of diffusers names (comfy/utils.py flux_to_diffusers) holds FLUX.2's too (ff.linear_in,
        attn.to_qkv_mlp_proj, attn.to_out), q, k and v onto their rows of the fused qkv."""
        return f"transformer.{module}"

    # --- validation images -------------------------------------------------------------------------

    def takes_negative(self, spec: ModelSpec, folder: Path) -> bool:
        """Only klein-base guides with a negative prompt: [dev]'s guidance is embedded, a distilled
        [klein] (is_distilled) ignores guidance."""
        return pipeline_for(spec.config) == "Flux2KleinPipeline" and not self._distilled(folder)

    def pipeline_kwargs(self, spec: ModelSpec, folder: Path) -> dict[str, Any]:
        """Flux2KleinPipeline's is_distilled, as the model's folder registers it."""
        if pipeline_for(spec.config) != "Flux2KleinPipeline":
            return {}
        return {"is_distilled": self._distilled(folder)}

    def _distilled(self, folder: Path) -> bool:
        return bool(model_index(folder, "FLUX.2").get("is_distilled", False))


FAMILY = Flux2()
