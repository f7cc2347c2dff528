"""Krea 2's torch side (zerotrain.families.krea2 declares the family): Krea2Pipeline's text, position ids and
forward arguments, ComfyUI's native names and the tiny model."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import Krea2Pipeline
from transformers import Qwen3VLModel

from zerotrain.families.base import check_tokens
from zerotrain.families.krea2 import (
    _TINY_TAPS,
    _TINY_TEXT_LAYERS,
    KREA2_SCHEDULER,
    SUFFIX_TOKENS,
    Krea2,
    native_name,
)
from zerotrain.families.parts.latents import QWEN_PATCH
from zerotrain.families.runtime.base import (
    BaseRuntime,
    compact_rows,
    example_timestep,
    meta_or_random,
    trim_rows,
)
from zerotrain.families.runtime.parts import tiny
from zerotrain.families.runtime.parts.latents import qwen_pack_latents
from zerotrain.protocols import FlowObjective, ModelSpec


def position_ids(text_tokens: int, height: int, width: int, device: Any) -> torch.Tensor:
    """Krea2Pipeline.prepare_position_ids for (height, width) latents: (text_tokens + tokens, 3), text at 0."""
    return Krea2Pipeline.prepare_position_ids(text_tokens, height // QWEN_PATCH, width // QWEN_PATCH, device)


class Krea2Runtime(Krea2, BaseRuntime):
    """Krea2's torch side."""

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, text_tokens, taps, d): the tapped Qwen3-VL states of each caption's prompt
        tokens (at most text_tokens - 5, as the pipeline truncates) and its 5 suffix tokens, zero-padded
        at the end; prompt_embeds_mask (B, text_tokens), 1 on those rows."""
        check_tokens(text_tokens, SUFFIX_TOKENS + 1, 4096, "Qwen3-VL tokens for Krea 2 (the prompt and its 5-token suffix)")
        embeds, mask = pipeline.encode_prompt(list(captions), device=device, max_sequence_length=text_tokens)
        return compact_rows(embeds, mask, text_tokens)

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        b, _, h, w = x_t.shape
        text, mask = batch["prompt_embeds"], batch["prompt_embeds_mask"]
        if text.shape[0] != b:
            raise ValueError(f"prompt_embeds must be ({b}, T, L, D), got {tuple(text.shape)}")
        text, valid = trim_rows(text, mask)
        dtype = objective.model_dtype
        # Krea2Pipeline passes t / 1000 = sigma in the latents' dtype; no mask where no caption is padded
        # (the same result, and SDPA's unmasked kernels).
        return {
            "hidden_states": qwen_pack_latents(x_t).to(dtype),
            "encoder_hidden_states": text.to(dtype),
            "timestep": sigma.to(dtype),
            "position_ids": position_ids(text.shape[1], h, w, x_t.device),
            "encoder_attention_mask": None if bool(valid.all()) else valid,
        }, self.target_layout(target)

    def target_layout(self, latents: Any) -> Any:
        return qwen_pack_latents(latents)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        """Every caption text_tokens long (no mask): the longest text a batch can carry."""
        config = spec.config
        tensor = meta_or_random(device, dtype)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        tokens = (lat_h // QWEN_PATCH) * (lat_w // QWEN_PATCH)
        return {
            "hidden_states": tensor(batch, tokens, int(config.get("in_channels", self.default_in_channels))),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config.get("num_text_layers", 12)),
                                            int(config.get("text_hidden_dim", 2560))),
            "timestep": example_timestep(tensor, batch, device),
            "position_ids": position_ids(text_tokens, lat_h, lat_w, device),
        }

    def validation_kwargs(self, embeds: dict[str, Any], negative: dict[str, Any] | None, guidance_scale: float) -> dict[str, Any]:
        """Each prompt's own rows with their mask, the prompt and the negative padded to one length
        (Krea2Pipeline builds one set of position ids from the prompt's and uses it for both; padded
        keys are masked, so the transformer sees what the pipeline's own layout gives it)."""
        texts = [trim_rows(embeds["prompt_embeds"], embeds["prompt_embeds_mask"])]
        if negative is not None:
            texts.append(trim_rows(negative["prompt_embeds"], negative["prompt_embeds_mask"]))
        length = max(text.shape[1] for text, _ in texts)
        texts = [(torch.nn.functional.pad(text, (0, 0, 0, 0, 0, length - text.shape[1])),
                  torch.nn.functional.pad(mask, (0, length - mask.shape[1]))) for text, mask in texts]
        kwargs: dict[str, Any] = {"prompt_embeds": texts[0][0], "prompt_embeds_mask": texts[0][1],
                                  "guidance_scale": guidance_scale}
        if negative is not None:
            kwargs.update({"negative_prompt_embeds": texts[1][0], "negative_prompt_embeds_mask": texts[1][1]})
        return kwargs

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """"diffusion_model." + the original module name (blocks.N.attn.wq ...), lora_A / lora_B with
        alpha / rank folded into lora_B: the layout of Krea's reference trainer and ComfyUI, which
        diffusers' Krea2 LoRA converter reads (it takes no alpha keys)."""
        out: dict[str, Any] = {}
        for module, (down, up) in pairs.items():
            name = "diffusion_model." + native_name(module + ".")[:-1]
            out[f"{name}.lora_A.weight"] = down.contiguous()
            out[f"{name}.lora_B.weight"] = (up * (float(alpha) / down.shape[0])).contiguous()
        return out

    def comfyui_model(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The original Krea 2 layout (blocks.N.attn.wq ..., the block modulation tables flat), which
        diffusers' from_single_file converts back to the same tensors."""
        out: dict[str, Any] = {}
        for name, tensor in weights.items():
            if name.startswith("transformer_blocks.") and name.endswith(".scale_shift_table"):
                tensor = tensor.reshape(-1)
            out[native_name(name)] = tensor
        return out

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """Qwen3-VL as wide as text_hidden_dim (its vision tower too, unused for text), three layers with
        two tapped, a Qwen tokenizer that splits the pipeline's prefix into exactly 34 tokens and its
        suffix into 5, and the published scheduler."""
        pipeline_class = tiny.diffusers_class("Krea2Pipeline")
        probe = pipeline_class(None, None, None, None, None)
        tokenizer = tiny.qwen2_tokenizer(probe.prompt_template_encode_prefix + "{}" + probe.prompt_template_encode_suffix)
        tiny.check_room(int(denoiser["num_text_layers"]) == len(_TINY_TAPS), "tiny-krea2", denoiser)
        return pipeline_class, {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(KREA2_SCHEDULER),
            "text_encoder": tiny.seeded("text_encoder", Qwen3VLModel, tiny.qwen3_vl_config(tokenizer, int(denoiser["text_hidden_dim"]), _TINY_TEXT_LAYERS)),
            "tokenizer": tokenizer,
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config, denoiser),
            "text_encoder_select_layers": _TINY_TAPS,
            "is_distilled": False,
        }
