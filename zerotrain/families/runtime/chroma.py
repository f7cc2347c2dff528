"""Chroma's torch side (zerotrain.families.chroma declares the family): T5 with its attention mask, the forward
arguments with a bool joint mask cut to the batch's used tokens, per-block checkpointing, Black Forest Labs keys
and the tiny model."""

from __future__ import annotations

import functools
from typing import Any

import torch
from diffusers import ChromaPipeline
from transformers import T5EncoderModel

from zerotrain import recompute
from zerotrain.errors import ZerotrainError
from zerotrain.families.base import check_tokens
from zerotrain.families.chroma import (
    _RMS_NORM,
    Chroma,
    chroma_top_module,
)
from zerotrain.families.parts.flux1 import (
    FLUX_PATCH,
    FLUX_SCHEDULER,
    MAX_T5_TOKENS,
    bfl_module,
)
from zerotrain.families.runtime.base import example_timestep, meta_or_random
from zerotrain.families.runtime.parts import tiny
from zerotrain.families.runtime.parts.flux1 import (
    Flux1TransformerRuntime,
    bfl_lora,
    latent_image_ids,
    pack_latents,
)
from zerotrain.protocols import FlowObjective, ModelSpec


def text_and_mask(batch: dict[str, torch.Tensor], b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's prompt_embeds (b, T, D) and prompt_attention_mask as bool (b, T), shapes checked."""
    text, mask = batch["prompt_embeds"], batch["prompt_attention_mask"]
    if text.ndim != 3 or text.shape[0] != b:
        raise ValueError(f"prompt_embeds must be ({b}, T, D), got {tuple(text.shape)}")
    if mask.shape != text.shape[:2]:
        raise ValueError(f"prompt_attention_mask must be {tuple(text.shape[:2])}, got {tuple(mask.shape)}")
    return text, mask > 0.5


def used_text_tokens(keep: torch.Tensor) -> int:
    """Text tokens a batch needs, keep (B, T) bool: up to the last one any caption keeps (the longest
    caption's pad token). Every later token is masked for every query, and with all text ids zero no
    position depends on it, so leaving it out is exact (measured: 3.6e-7, float summation order) and
    saves attention over up to 512 text tokens."""
    if keep.ndim != 2 or not keep.any(dim=1).all():
        empty = [] if keep.ndim != 2 else (~keep.any(dim=1)).nonzero().flatten().tolist()
        raise ValueError(f"prompt_attention_mask must be (B, T) and keep a token of every caption, got shape "
                         f"{tuple(keep.shape)} with no kept token in rows {empty}")
    positions = torch.arange(1, keep.shape[1] + 1, device=keep.device)
    return int((keep * positions).amax())


def joint_attention_mask(keep: torch.Tensor, image_tokens: int) -> torch.Tensor:
    """The transformer's mask (B, T + image_tokens) bool over text then image tokens, as
    ChromaPipeline._prepare_attention_mask lays it out: every image token attends and is attended."""
    if keep.dtype != torch.bool:
        raise ValueError(f"joint_attention_mask: keep must be bool, got {keep.dtype}")
    return ChromaPipeline._prepare_attention_mask(None, keep.shape[0], image_tokens, torch.bool, keep)


def checkpointed(forward: Any, *args: Any, checkpoint_fn: Any = None, **kwargs: Any) -> Any:
    """forward(*args, **kwargs) under checkpoint_fn(function, *args) (default: non-reentrant
    activation checkpointing) while autograd records."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    # The keyword arguments go in as positional ones, so that checkpoint_fn sees every tensor.
    names, count = list(kwargs), len(args)

    def call(*values: Any) -> Any:
        return forward(*values[:count], **dict(zip(names, values[count:])))

    return (checkpoint_fn or recompute.default_checkpoint)(call, *args, *kwargs.values())


class ChromaRuntime(Chroma, Flux1TransformerRuntime):
    """Chroma's torch side."""

    def enable_checkpointing(self, model: Any, blocks: list[str] | None = None, checkpoint_fn: Any = None) -> None:
        """Each block's own forward runs under non-reentrant torch.utils.checkpoint, its arguments
        passed through. Not diffusers' enable_gradient_checkpointing: ChromaTransformer2DModel.forward
        (diffusers 0.42, transformer_chroma.py:588) then calls the single-stream blocks without their
        attention_mask, so training would attend to padding that inference masks."""
        units = recompute.checkpoint_units(model)
        for name in units if blocks is None else blocks:
            units[name].forward = functools.partial(checkpointed, units[name].forward, checkpoint_fn=checkpoint_fn)

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, T, d_T5): T5's sequence of max_sequence_length = text_tokens tokens, run with
        the tokenizer's mask; prompt_attention_mask (B, T): 1 on the tokens the transformer attends to
        (the caption, its </s> and one pad token), 0 after. The text ids are zeros and not kept."""
        check_tokens(text_tokens, 1, MAX_T5_TOKENS, "T5 tokens for Chroma")
        embeds, _, mask, *_ = pipeline.encode_prompt(captions, device=device, do_classifier_free_guidance=False,
                                                     max_sequence_length=text_tokens)
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """As ChromaPipeline feeds the transformer, with a bool mask and the text cut to the batch's
        used tokens (used_text_tokens)."""
        b, _, h, w = x_t.shape
        text, keep = text_and_mask(batch, b)
        used = used_text_tokens(keep)
        hidden = pack_latents(x_t)
        dtype = objective.model_dtype
        # ChromaPipeline passes timestep / 1000 = sigma; the transformer scales it by 1000.
        kwargs = {
            "hidden_states": hidden.to(dtype),
            "encoder_hidden_states": text[:, :used].to(dtype),
            "timestep": sigma,
            "img_ids": latent_image_ids(h, w, x_t.device),
            "txt_ids": torch.zeros(used, 3, device=x_t.device),
            "attention_mask": joint_attention_mask(keep[:, :used], hidden.shape[1]),
        }
        return kwargs, self.target_layout(target)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        """Every text token attended: a batch whose longest caption fills text_tokens."""
        config = spec.config
        tensor = meta_or_random(device, dtype)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        tokens = (lat_h // FLUX_PATCH) * (lat_w // FLUX_PATCH)
        return {
            "hidden_states": tensor(batch, tokens, int(config.get("in_channels", self.default_in_channels))),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config.get("joint_attention_dim", 4096))),
            "timestep": example_timestep(tensor, batch, device),
            "img_ids": tensor(tokens, 3),
            "txt_ids": tensor(text_tokens, 3),
            "attention_mask": torch.ones(batch, text_tokens + tokens, dtype=torch.bool, device=device),
        }

    def validation_kwargs(self, embeds: dict[str, Any], negative: dict[str, Any] | None,
                          guidance_scale: float) -> dict[str, Any]:
        """The masks as bool, so the pipeline's mask stays bool (see the module docstring)."""
        kwargs = super().validation_kwargs(embeds, negative, guidance_scale)
        for key in ("prompt_attention_mask", "negative_prompt_attention_mask"):
            if key in kwargs:
                kwargs[key] = kwargs[key] > 0.5
        return kwargs

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """FLUX.1's kohya names (ComfyUI's Chroma is a Flux model and maps LoRAs as Flux's), the
        approximator's under its Black Forest Labs names (lora_unet_distilled_guidance_layer_...)."""
        return bfl_lora(model, pairs, alpha, chroma_top_module, self.title)

    def comfyui_model(self, weights: dict[str, Any]) -> dict[str, Any]:
        """Black Forest Labs' keys, the inverse of diffusers' convert_chroma_transformer_checkpoint_to_diffusers
        (from_single_file reads them back): ComfyUI recognises a Chroma file only by them
        (distilled_guidance_layer.norms.0.scale); its converter for diffusers keys knows FLUX.1's modules
        only, would drop the approximator and load the rest as FLUX.1. Diffusers' q, k, v (and a single
        block's MLP input) are concatenated into BFL's fused layers, in that order."""
        out: dict[str, torch.Tensor] = {}
        fused: dict[str, tuple[str, ...]] = {}  # BFL parameter -> its parts' diffusers parameters
        for name, tensor in weights.items():
            module, _, parameter = name.rpartition(".")
            found = bfl_module(module, chroma_top_module)
            if found is None:
                raise ZerotrainError(f"Chroma weight {name} has no ComfyUI (Black Forest Labs) name")
            target, parts = found
            if _RMS_NORM.search(target):
                parameter = "scale"
            if len(parts) == 1:
                out[f"{target}.{parameter}"] = tensor
            else:
                fused[f"{target}.{parameter}"] = tuple(f"{part}.{parameter}" for part in parts)
        for key, names in fused.items():
            out[key] = torch.cat([weights[name] for name in names], dim=0)
        return out

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """T5 alone, joint_attention_dim wide (no CLIP), and FLUX.1's published scheduler config: Chroma's
        diffusers folders were assembled from FLUX.1's components, and ai-toolkit trains Chroma with it."""
        t5 = tiny.t5_tokenizer()
        return tiny.diffusers_class("ChromaPipeline"), {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(FLUX_SCHEDULER),
            "text_encoder": tiny.seeded("text_encoder", T5EncoderModel, tiny.t5_config(t5, denoiser["joint_attention_dim"])),
            "tokenizer": t5,
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config,
                                       denoiser),
        }
