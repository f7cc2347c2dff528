"""FLUX.1's transformer part, which Flux (and Kontext) and Chroma share: its published scheduler, patch and T5 limit,
Black Forest Labs' module names (as ComfyUI and kohya name them), and `Flux1Transformer`, the defaults of a
FLUX.1-shaped denoiser; and `Flux1`, a FluxTransformer2DModel as FluxPipeline runs it (CLIP-L's pooled output and
T5's sequence), which a FLUX.1 family subclasses with its own name, pipeline and defaults. The torch side
(zerotrain.families.runtime.parts.flux1) packs latents, makes position ids and kohya LoRAs, and conditions,
runs and builds the tiny model."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.families.base import BaseFamily, packed_channels
from zerotrain.families.parts.latents import PUBLISHED_VAE_SCALE_FACTOR
from zerotrain.protocols import VaeFacts

if TYPE_CHECKING:
    from pathlib import Path

    from zerotrain.protocols import ModelSpec

# Flux packs each 2x2 patch of latents into one token (FluxPipeline._pack_latents), so in_channels is
# 4 x the VAE's latent channels (64 = 4 x 16 for FLUX.1).
FLUX_PATCH = 2
# FluxPipeline refuses max_sequence_length above 512 T5 tokens.
MAX_T5_TOKENS = 512
# The published scheduler config (black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json).
FLUX_SCHEDULER = {
    "base_image_seq_len": 256,
    "base_shift": 0.5,
    "max_image_seq_len": 4096,
    "max_shift": 1.15,
    "num_train_timesteps": 1000,
    "shift": 3.0,
    "use_dynamic_shifting": True,
}

# FluxTransformer2DModel module -> Black Forest Labs' module, as ComfyUI maps them
# (comfy/utils.py flux_to_diffusers) and kohya sd-scripts names Flux LoRAs. Fused BFL layers list
# their diffusers parts in output order (q, k, v[, mlp]). The q/k RMSNorms (no LoRA can target them)
# are listed for full state dicts, where BFL calls their weight "scale".
_DOUBLE = {
    "attn.to_out.0": "img_attn.proj", "attn.to_add_out": "txt_attn.proj",
    "norm1.linear": "img_mod.lin", "norm1_context.linear": "txt_mod.lin",
    "ff.net.0.proj": "img_mlp.0", "ff.net.2": "img_mlp.2",
    "ff_context.net.0.proj": "txt_mlp.0", "ff_context.net.2": "txt_mlp.2",
    "attn.norm_q": "img_attn.norm.query_norm", "attn.norm_k": "img_attn.norm.key_norm",
    "attn.norm_added_q": "txt_attn.norm.query_norm", "attn.norm_added_k": "txt_attn.norm.key_norm",
}
_DOUBLE_FUSED = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_SINGLE = {"norm.linear": "modulation.lin", "proj_out": "linear2",
           "attn.norm_q": "norm.query_norm", "attn.norm_k": "norm.key_norm"}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_TOP = {
    "x_embedder": "img_in", "context_embedder": "txt_in", "proj_out": "final_layer.linear",
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
    "norm_out.linear": "final_layer.adaLN_modulation.1",  # (shift, scale) rows swapped to (scale, shift)
}
_SWAPPED = {"final_layer.adaLN_modulation.1"}
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def flux_top_module(module: str) -> str | None:
    """FLUX.1's Black Forest Labs name of a module outside the blocks (embedders, output layer), if any."""
    return _TOP.get(module)


def bfl_module(module: str, top: Callable[[str], str | None]) -> tuple[str, tuple[str, ...]] | None:
    """The Black Forest Labs module that holds diffusers module `module` of a Flux-style transformer, and
    the diffusers modules fused into it in output order (`module` alone when it is not fused); None when
    it has no BFL name. `top` names the modules outside the blocks, which differ between models."""
    match = _BLOCK.match(module)
    if match is None:
        target = top(module)
        return None if target is None else (target, (module,))
    kind, index, rest = match.groups()
    double = kind == "transformer_blocks"
    block = f"{'double' if double else 'single'}_blocks.{index}"
    simple, groups = (_DOUBLE, _DOUBLE_FUSED) if double else (_SINGLE, _SINGLE_FUSED)
    if rest in simple:
        return f"{block}.{simple[rest]}", (module,)
    for target, parts in groups.items():
        if rest in parts:
            return f"{block}.{target}", tuple(f"{kind}.{index}.{part}" for part in parts)
    return None


class Flux1Transformer(BaseFamily):
    """What Flux and Chroma share of a FLUX.1-shaped transformer (FluxTransformer2DModel, ChromaTransformer2DModel):
    FLUX.1's VAE, its 2x2 packing, its blocks, its default LoRA targets and its ComfyUI names. A family subclasses it
    and declares its own text conditioning, forward arguments, pipeline and tiny model."""
    runtime_class = "zerotrain.families.runtime.parts.flux1:Flux1TransformerRuntime"

    # As diffusers' train_dreambooth_lora_flux.py chooses them.
    depth_keys = ("num_layers", "num_single_layers")
    lora_targets = (
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    )
    default_in_channels = 64
    # calculate_shift's defaults as FluxPipeline writes them.
    shift_defaults: ClassVar[dict[str, float]] = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}

    def latent_channels(self, config: dict[str, Any], where: Path | str) -> int:
        return packed_channels(super().latent_channels(config, where), where, "Flux", "output")

    def published_vae(self, config: dict[str, Any]) -> VaeFacts:
        # FLUX.1 ae (black-forest-labs/FLUX.1-dev vae/config.json): 16 channels, scaling 0.3611, shift 0.1159.
        return VaeFacts(PUBLISHED_VAE_SCALE_FACTOR, self.latent_channels(config, "config"), 0.3611, 0.1159)

    def patch(self, spec: ModelSpec) -> int:
        return FLUX_PATCH

    def comfyui_adapter_name(self, module: str) -> str:
        """"transformer." + the diffusers module path: ComfyUI maps Flux's diffusers names onto its own
        (comfy/utils.py flux_to_diffusers), q, k and v onto their rows of the fused qkv. Its Chroma and
        Flux2 models subclass its Flux (comfy/model_base.py), so Chroma's names map the same way."""
        return f"transformer.{module}"


class Flux1(Flux1Transformer):
    """FluxTransformer2DModel, FLUX.1's AutoencoderKL, CLIP-L's pooled output and T5's sequence, as FluxPipeline and
    diffusers' train_dreambooth_flux.py use them: the text conditioning, the forward arguments (distilled guidance
    where the config embeds it), kohya's LoRA names and the tiny model. A family subclasses it and declares its
    name, title, denoiser_classes, pipeline (FluxPipeline's, or one that calls encode_prompt and the transformer
    alike), default_text_tokens and default_guidance."""
    runtime_class = "zerotrain.families.runtime.parts.flux1:Flux1Runtime"

    text_components = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
    # Distilled guidance: one prediction per step, the guidance an input of the transformer.
    classifier_free_guidance = False


