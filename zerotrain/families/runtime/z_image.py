"""Z-Image's torch side (zerotrain.families.z_image declares the family): Qwen3's captions padded for the cache
and cut back to their lengths for the denoiser, its reversed time and negated output, ComfyUI keys and the tiny
model."""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen3Config, Qwen3Model

from zerotrain.errors import ZerotrainError
from zerotrain.families.runtime.base import BaseRuntime, example_timestep, kohya_lora, meta_or_random
from zerotrain.families.runtime.parts import tiny
from zerotrain.families.z_image import (
    _NATIVE_ATTENTION,
    _NATIVE_PREFIXES,
    _QKV,
    _TINY_QWEN3_HEADS,
    _TINY_QWEN3_KV_HEADS,
    _TINY_QWEN3_LAYERS,
    Z_IMAGE_SCHEDULER,
    ZImage,
    check_rope_room,
)
from zerotrain.protocols import FlowObjective, ModelSpec


def pad_captions(embeds: list[torch.Tensor], tokens: int) -> dict[str, torch.Tensor]:
    """ZImagePipeline.encode_prompt's captions, (L_i, D) each, as the cache stores them:
    prompt_embeds (B, tokens, D) with zeros after each caption's L_i rows, and prompt_embeds_mask
    (B, tokens) int64, 1 on those rows (the denoiser must never see the zeros: see caption_list)."""
    if not embeds or any(e.ndim != 2 or e.shape[1] != embeds[0].shape[1] for e in embeds):
        raise ValueError(f"pad_captions: expected (L_i, D) captions, got {[tuple(e.shape) for e in embeds]}")
    if any(not 0 < len(e) <= tokens for e in embeds):
        raise ValueError(f"pad_captions: caption lengths {[len(e) for e in embeds]} must be 1..{tokens}")
    padded = embeds[0].new_zeros(len(embeds), tokens, embeds[0].shape[1])
    mask = torch.zeros(len(embeds), tokens, dtype=torch.int64, device=embeds[0].device)
    for i, caption in enumerate(embeds):
        padded[i, : len(caption)] = caption
        mask[i, : len(caption)] = 1
    return {"prompt_embeds": padded, "prompt_embeds_mask": mask}


def caption_list(embeds: torch.Tensor, mask: torch.Tensor, batch: int) -> list[torch.Tensor]:
    """The captions (L_i, D) the denoiser takes, from prompt_embeds (batch, T, D) and its mask (batch, T)
    (any dtype: the cache stores it in bf16), which must mark a prefix of each row."""
    if embeds.ndim != 3 or embeds.shape[0] != batch:
        raise ValueError(f"prompt_embeds must be ({batch}, T, D), got {tuple(embeds.shape)}")
    if tuple(mask.shape) != tuple(embeds.shape[:2]):
        raise ValueError(f"prompt_embeds_mask must be {tuple(embeds.shape[:2])}, got {tuple(mask.shape)}")
    kept = mask != 0
    lengths = kept.sum(dim=1)
    prefix = torch.arange(embeds.shape[1], device=mask.device) < lengths.unsqueeze(1)
    if not torch.equal(kept, prefix) or not (lengths > 0).all():
        raise ValueError("prompt_embeds_mask must mark a non-empty prefix of every caption")
    return [embeds[i, :length] for i, length in enumerate(lengths.tolist())]


def model_time(sigma: torch.Tensor, num_train_timesteps: int) -> torch.Tensor:
    """The denoiser's t (B,) at noise level sigma (B,), as ZImagePipeline computes it from the scheduler's
    timestep sigma * n: (n - timestep) / n = 1 - sigma, 0 at pure noise and 1 at the clean image."""
    if sigma.ndim != 1:
        raise ValueError(f"sigma must have shape (batch,), got {tuple(sigma.shape)}")
    timestep = sigma * num_train_timesteps
    return (num_train_timesteps - timestep) / num_train_timesteps


def stack_prediction(output: list[torch.Tensor]) -> torch.Tensor:
    """The denoiser's list of (C, 1, h, w) outputs as one (B, C, h, w) tensor, as ZImagePipeline stacks
    and squeezes them."""
    if not output or any(o.ndim != 4 or o.shape[1] != 1 or o.shape != output[0].shape for o in output):
        raise ValueError(f"expected equal (C, 1, h, w) outputs, got {[tuple(o.shape) for o in output]}")
    return torch.stack(output, dim=0).squeeze(2)


class ZImageRuntime(ZImage, BaseRuntime):
    """ZImage's torch side."""

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """Qwen3's second-to-last hidden states of each templated caption's own tokens (at most text_tokens),
        zero-padded to text_tokens: prompt_embeds (B, text_tokens, d) and prompt_embeds_mask (B, text_tokens).
        The pipeline rewrites the list it is given, so it gets a copy."""
        embeds, _ = pipeline.encode_prompt(list(captions), device=device, do_classifier_free_guidance=False,
                                           max_sequence_length=text_tokens)
        return pad_captions(embeds, text_tokens)

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        b = x_t.shape[0]
        captions = caption_list(batch["prompt_embeds"], batch["prompt_embeds_mask"], b)
        dtype = objective.model_dtype
        kwargs = {
            "x": list(x_t.to(dtype).unsqueeze(2).unbind(0)),
            "t": model_time(sigma, objective.num_train_timesteps),
            "cap_feats": [caption.to(dtype) for caption in captions],
        }
        # ZImagePipeline steps the scheduler with the negated output: the output is x0 - noise.
        return kwargs, -target

    def prediction(self, output: Any) -> Any:
        return stack_prediction(output)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        """Every caption text_tokens long: the most a step can see."""
        check_rope_room(spec, text_tokens, height, width)
        config = spec.config
        tensor = meta_or_random(device, dtype)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        channels, text_width = int(config.get("in_channels", 16)), int(config.get("cap_feat_dim", 2560))
        return {
            "x": [tensor(channels, 1, lat_h, lat_w) for _ in range(batch)],
            "t": example_timestep(tensor, batch, device),
            "cap_feats": [tensor(text_tokens, text_width) for _ in range(batch)],
        }

    def validation_kwargs(self, embeds: dict[str, Any], negative: dict[str, Any] | None, guidance_scale: float) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"prompt_embeds": caption_list(embeds["prompt_embeds"], embeds["prompt_embeds_mask"], 1),
                                  "guidance_scale": guidance_scale}
        if negative is not None:
            kwargs["negative_prompt_embeds"] = caption_list(negative["prompt_embeds"], negative["prompt_embeds_mask"], 1)
        return kwargs

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """"diffusion_model." + the diffusers module path, with kohya's lora_down/lora_up/alpha: ComfyUI maps
        Z-Image's diffusers names onto its own layers (comfy/lora.py model_lora_keys_unet through
        comfy/utils.py z_image_to_diffusers), q, k and v onto their rows of the fused qkv, and scales by
        alpha / rank. diffusers' lora_state_dict reads the same file back."""
        out: dict[str, Any] = {}
        for module, (down, up) in pairs.items():
            out.update(kohya_lora(f"diffusion_model.{module}", down, up, alpha))
        return out

    def comfyui_model(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The original Z-Image layout that ComfyUI's "Load Diffusion Model" reads (as Comfy-Org's
        z_image_turbo_bf16.safetensors): q, k and v concatenated into attention.qkv, and ComfyUI's names
        for the rest. Exact: diffusers' from_single_file converts it back to the same tensors."""
        out: dict[str, Any] = {}
        for name, tensor in weights.items():
            block, _, rest = name.partition(".attention.")
            layer, _, end = rest.rpartition(".")
            if rest and layer in _QKV:
                if layer == _QKV[0]:
                    parts = [weights[f"{block}.attention.{part}.{end}"] for part in _QKV]
                    out[f"{block}.attention.qkv.{end}"] = torch.cat(parts, dim=0)
                continue
            if rest and layer in _NATIVE_ATTENTION:
                out[f"{block}.attention.{_NATIVE_ATTENTION[layer]}.{end}"] = tensor
                continue
            prefix = next((p for p in _NATIVE_PREFIXES if name.startswith(p)), None)
            if prefix is None and name.startswith(("all_x_embedder.", "all_final_layer.")):
                raise ZerotrainError(f"{name}: ComfyUI's Z-Image has one patch size (2x2, 1 frame), no name for this layer")
            out[_NATIVE_PREFIXES[prefix] + name[len(prefix):] if prefix else name] = tensor
        return out

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """Qwen3 as wide as cap_feat_dim (its hidden states are the captions), with a Qwen tokenizer whose
        merges cover the chat template, and the base model's scheduler."""
        hidden = denoiser["cap_feat_dim"]
        tiny.check_room(hidden % _TINY_QWEN3_HEADS == 0, "tiny-z-image", denoiser)
        tokenizer = tiny.qwen2_tokenizer(tiny.QWEN3_PROMPT, (*tiny.QWEN_SPECIALS, *tiny.QWEN3_THINK_TOKENS),
                                       tiny.QWEN3_CHAT_TEMPLATE)
        qwen3 = Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=_TINY_QWEN3_LAYERS, num_attention_heads=_TINY_QWEN3_HEADS,
            num_key_value_heads=_TINY_QWEN3_KV_HEADS, head_dim=hidden // _TINY_QWEN3_HEADS,
            tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )
        return tiny.diffusers_class("ZImagePipeline"), {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(Z_IMAGE_SCHEDULER),
            "text_encoder": tiny.seeded("text_encoder", Qwen3Model, qwen3),
            "tokenizer": tokenizer,
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config,
                                       denoiser),
        }
