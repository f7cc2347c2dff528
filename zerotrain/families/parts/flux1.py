"""FLUX.1's transformer part, which Flux (and Kontext) and Chroma share: its 2x2 latent packing and position ids
(FluxPipeline's), its published scheduler and T5 limit, Black Forest Labs' module names (as ComfyUI and kohya name
them) and kohya LoRAs in them, and `Flux1Transformer`, the defaults of a FLUX.1-shaped denoiser; and `Flux1`, a
FluxTransformer2DModel as FluxPipeline runs it (CLIP-L's pooled output and T5's sequence), which a FLUX.1 family
subclasses with its own name, pipeline and defaults."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import (
    BaseFamily,
    check_tokens,
    example_timestep,
    kohya_lora,
    meta_or_random,
    packed_channels,
    text_and_pooled,
)
from zerotrain.families.parts.keymaps import fuse_lora, swap_halves
from zerotrain.families.parts.latents import PUBLISHED_VAE_SCALE_FACTOR, pack_2x2
from zerotrain.protocols import VaeFacts

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from zerotrain.protocols import FlowObjective, ModelSpec

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


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """Flux's image tokens: FluxPipeline._pack_latents."""
    return pack_2x2(latents, "FluxPipeline")


@functools.lru_cache(maxsize=64)
def latent_image_ids(height: int, width: int, device: torch.device) -> torch.Tensor:
    """Flux's image position ids (h/2 * w/2, 3) float32 for (h, w) latents, by
    FluxPipeline._prepare_latent_image_ids on the packed grid. Kept per bucket shape: every batch
    asks for them (the transformer only reads them)."""
    import torch
    from diffusers import FluxPipeline

    return FluxPipeline._prepare_latent_image_ids(None, height // FLUX_PATCH, width // FLUX_PATCH, device, torch.float32)


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


def bfl_lora(model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float, top: Callable[[str], str | None],
             title: str) -> dict[str, Any]:
    """"lora_unet_" + the Black Forest Labs module path with "." -> "_" (kohya sd-scripts' Flux names,
    e.g. lora_unet_double_blocks_0_img_attn_qkv), for a Flux-style transformer (`title`) whose modules
    outside the blocks `top` names. Diffusers' separate q/k/v (and a single block's proj_mlp) are one
    fused layer there: their A matrices are stacked (rank 3r or 4r) and their B matrices placed
    block-diagonally at their output rows, zero rows for parts without a LoRA; alpha grows with the
    rank so the scale stays alpha / r. Exact, as kohya's own converter."""
    plain: dict[str, str] = {}  # diffusers module -> BFL module
    fused: dict[str, tuple[str, ...]] = {}  # BFL module -> its parts' diffusers modules
    for module in pairs:
        found = bfl_module(module, top)
        if found is None:
            raise ZerotrainError(f"LoRA on {title} module {module} has no ComfyUI (Black Forest Labs) name")
        target, parts = found
        if len(parts) == 1:
            plain[module] = target
        else:
            fused.setdefault(target, parts)
    out: dict[str, torch.Tensor] = {}
    for module, target in plain.items():
        down, up = pairs[module]
        if target in _SWAPPED:
            up = swap_halves(up)
        out.update(kohya_lora("lora_unet_" + target.replace(".", "_"), down, up, alpha))
    modules = dict(model.named_modules())
    for target, parts in fused.items():
        down, up, rank = fuse_lora(modules, pairs, parts, f"{title} {target}")
        # Every part is scaled by alpha / r; the fused layer by its alpha / (sum of ranks).
        out.update(kohya_lora("lora_unet_" + target.replace(".", "_"), down, up, alpha * down.shape[0] / rank))
    return out


class Flux1Transformer(BaseFamily):
    """What Flux and Chroma share of a FLUX.1-shaped transformer (FluxTransformer2DModel, ChromaTransformer2DModel):
    FLUX.1's VAE, its 2x2 packing, its blocks, its default LoRA targets and its ComfyUI names. A family subclasses it
    and declares its own text conditioning, forward arguments, pipeline and tiny model."""

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

    def target_layout(self, latents: Any) -> Any:
        return pack_latents(latents)

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

    text_components = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
    # Distilled guidance: one prediction per step, the guidance an input of the transformer.
    classifier_free_guidance = False

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, T, d_T5): T5's sequence of max_sequence_length = text_tokens tokens;
        pooled_prompt_embeds (B, d_CLIP), CLIP-L's pooled output. The text ids are zeros and not kept."""
        check_tokens(text_tokens, 1, MAX_T5_TOKENS, "T5 tokens for Flux")
        prompt_embeds, pooled, _ = pipeline.encode_prompt(captions, device=device, max_sequence_length=text_tokens)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        import torch

        b, _, h, w = x_t.shape
        text, pooled = text_and_pooled(batch, b)
        dtype = objective.model_dtype
        # FluxPipeline passes timestep / 1000 = sigma; the transformer scales it (and guidance) by 1000.
        kwargs = {
            "hidden_states": pack_latents(x_t).to(dtype),
            "encoder_hidden_states": text.to(dtype),
            "pooled_projections": pooled.to(dtype),
            "timestep": sigma,
            "img_ids": latent_image_ids(h, w, x_t.device),
            "txt_ids": torch.zeros(text.shape[1], 3, device=x_t.device),
        }
        if objective.spec.config.get("guidance_embeds", False):
            kwargs["guidance"] = torch.full((b,), objective.config.guidance, device=x_t.device)
        return kwargs, self.target_layout(target)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        config = spec.config
        tensor = meta_or_random(device, dtype)
        t = example_timestep(tensor, batch, device)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        tokens = (lat_h // FLUX_PATCH) * (lat_w // FLUX_PATCH)
        inputs = {
            "hidden_states": tensor(batch, tokens, int(config.get("in_channels", self.default_in_channels))),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config.get("joint_attention_dim", 4096))),
            "pooled_projections": tensor(batch, int(config.get("pooled_projection_dim", 768))),
            "timestep": t,
            "img_ids": tensor(tokens, 3),
            "txt_ids": tensor(text_tokens, 3),
        }
        if config.get("guidance_embeds", False):
            inputs["guidance"] = t
        return inputs

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """Kohya's Black Forest Labs names (bfl_lora), FLUX.1's modules outside the blocks included."""
        return bfl_lora(model, pairs, alpha, flux_top_module, "Flux")

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """CLIP-L gives only its pooled output (pooled_projection_dim wide); T5 gives the sequence
        (joint_attention_dim wide)."""
        from transformers import CLIPTextModel, T5EncoderModel

        from zerotrain.families.parts import tiny

        clip, t5 = tiny.clip_tokenizer(tiny.CLIP_EOS), tiny.t5_tokenizer()
        width = denoiser["pooled_projection_dim"]
        return tiny.diffusers_class(self.pipeline), {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(FLUX_SCHEDULER),
            "text_encoder": tiny.seeded("text_encoder", CLIPTextModel, tiny.clip_config(clip, width, width)),
            "tokenizer": clip,
            "text_encoder_2": tiny.seeded("text_encoder_2", T5EncoderModel,
                                          tiny.t5_config(t5, denoiser["joint_attention_dim"])),
            "tokenizer_2": t5,
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config,
                                       denoiser),
        }
