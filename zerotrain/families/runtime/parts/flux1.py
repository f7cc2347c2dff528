"""The torch side of FLUX.1's transformer part (zerotrain.families.parts.flux1 declares it): FluxPipeline's 2x2
packing and position ids, kohya LoRAs in Black Forest Labs' names, and Flux1Runtime, FLUX.1's CLIP-L + T5
conditioning, forward arguments and tiny model for FLUX.1-shaped families."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from diffusers import FluxPipeline
from transformers import CLIPTextModel, T5EncoderModel

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import check_tokens
from zerotrain.families.parts.flux1 import (
    _SWAPPED,
    FLUX_PATCH,
    FLUX_SCHEDULER,
    MAX_T5_TOKENS,
    Flux1,
    Flux1Transformer,
    bfl_module,
    flux_top_module,
)
from zerotrain.families.runtime.base import (
    BaseRuntime,
    example_timestep,
    kohya_lora,
    meta_or_random,
    text_and_pooled,
)
from zerotrain.families.runtime.parts import tiny
from zerotrain.families.runtime.parts.keymaps import fuse_lora, swap_halves
from zerotrain.families.runtime.parts.latents import pack_2x2
from zerotrain.protocols import FlowObjective, ModelSpec


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """Flux's image tokens: FluxPipeline._pack_latents."""
    return pack_2x2(latents, "FluxPipeline")


@functools.lru_cache(maxsize=64)
def latent_image_ids(height: int, width: int, device: torch.device) -> torch.Tensor:
    """Flux's image position ids (h/2 * w/2, 3) float32 for (h, w) latents, by
    FluxPipeline._prepare_latent_image_ids on the packed grid. Kept per bucket shape: every batch
    asks for them (the transformer only reads them)."""
    return FluxPipeline._prepare_latent_image_ids(None, height // FLUX_PATCH, width // FLUX_PATCH, device, torch.float32)


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


class Flux1TransformerRuntime(Flux1Transformer, BaseRuntime):
    """Flux1Transformer's torch side."""

    def target_layout(self, latents: Any) -> Any:
        return pack_latents(latents)


class Flux1Runtime(Flux1, Flux1TransformerRuntime):
    """Flux1's torch side."""

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, T, d_T5): T5's sequence of max_sequence_length = text_tokens tokens;
        pooled_prompt_embeds (B, d_CLIP), CLIP-L's pooled output. The text ids are zeros and not kept."""
        check_tokens(text_tokens, 1, MAX_T5_TOKENS, "T5 tokens for Flux")
        prompt_embeds, pooled, _ = pipeline.encode_prompt(captions, device=device, max_sequence_length=text_tokens)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
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
