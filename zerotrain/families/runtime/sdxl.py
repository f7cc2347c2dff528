"""SDXL's (and SD1.x/2.x's) torch side (zerotrain.families.sdxl declares the family): the two CLIPs through
StableDiffusionXLPipeline.encode_prompt, the UNet's added time ids, kohya LoRA names and the tiny model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import CLIPTextModel, CLIPTextModelWithProjection

from zerotrain.families.base import check_tokens
from zerotrain.families.runtime.base import BaseRuntime, example_timestep, kohya_prefixed, meta_or_random
from zerotrain.families.runtime.parts import tiny
from zerotrain.families.sdxl import (
    SDXL_SCHEDULER,
    SDXL_TIME_IDS,
    UNet,
    is_sdxl,
)
from zerotrain.protocols import ModelSpec


def sdxl_time_ids(
    original_size: tuple[int, int], crop_top_left: tuple[int, int], target_size: tuple[int, int]
) -> torch.Tensor:
    """SDXL's add_time_ids of one image, (6,) float32, as StableDiffusionXLPipeline._get_add_time_ids
    lays them out: original (height, width), crop (top, left), target (height, width). Training records
    the original size before resizing and the crop actually taken, as train_text_to_image_sdxl.py does."""
    parts = {"original_size": original_size, "crop_top_left": crop_top_left, "target_size": target_size}
    for name, value in parts.items():
        if len(value) != 2 or any(int(v) != v or v < 0 for v in value):
            raise ValueError(f"sdxl_time_ids: {name} must be two non-negative integers, got {value!r}")
    return torch.tensor([int(v) for value in parts.values() for v in value], dtype=torch.float32)


def _zeros_for_empty(folder: Path) -> bool:
    """StableDiffusionXLPipeline's force_zeros_for_empty_prompt (model_index.json; True by default)."""
    try:
        index = json.loads((folder / "model_index.json").read_text())
        return bool(index.get("force_zeros_for_empty_prompt", True))
    except (OSError, ValueError):
        return True


class UNetRuntime(UNet, BaseRuntime):
    """UNet's torch side."""

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """CLIP's 77 tokens. prompt_embeds (B, 77, d_L + d_G): both CLIPs' penultimate states;
        pooled_prompt_embeds (B, p_G), text_encoder_2's projection."""
        clip_tokens = pipeline.tokenizer.model_max_length
        check_tokens(text_tokens, clip_tokens, clip_tokens, "CLIP tokens for SDXL")
        prompt_embeds, _, pooled, _ = pipeline.encode_prompt(captions, device=device, do_classifier_free_guidance=False)
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def negative_embeds(self, folder: Path, negative_prompt: str, encoded: dict[str, Any]) -> dict[str, Any]:
        """StableDiffusionXLPipeline's default without a negative prompt (force_zeros_for_empty_prompt
        in model_index.json, True by default): zeros, not the encoded ""."""
        if negative_prompt or not _zeros_for_empty(folder):
            return encoded
        return {name: torch.zeros_like(value) for name, value in encoded.items()}

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        config = spec.config
        tensor = meta_or_random(device, dtype)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        inputs = {
            "sample": tensor(batch, int(config.get("in_channels", 4)), lat_h, lat_w),
            "timestep": example_timestep(tensor, batch, device),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config["cross_attention_dim"])),
        }
        if is_sdxl(config):
            time_dim = int(config["addition_time_embed_dim"]) * SDXL_TIME_IDS
            pooled_dim = int(config["projection_class_embeddings_input_dim"]) - time_dim
            inputs["added_cond_kwargs"] = {"text_embeds": tensor(batch, pooled_dim), "time_ids": tensor(batch, SDXL_TIME_IDS)}
        return inputs

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """"lora_unet_" + the diffusers module path with "." -> "_", as ComfyUI's comfy/lora.py
        model_lora_keys_unet maps SDXL and SD1.x UNets."""
        return kohya_prefixed("lora_unet_", pairs, alpha)

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """The two CLIPs' penultimate states concatenate to cross_attention_dim (published 768 + 1280 =
        2048); the second's projection is the pooled `text_embeds`, which the UNet's add_embedding takes
        with 6 time ids of addition_time_embed_dim each."""
        cross = denoiser["cross_attention_dim"]
        hidden_l = cross // 4
        hidden_g = cross - hidden_l
        time_ids = SDXL_TIME_IDS * denoiser["addition_time_embed_dim"]
        projection = denoiser["projection_class_embeddings_input_dim"] - time_ids
        tiny.check_room(hidden_l > 0 and projection > 0, "tiny-sdxl", denoiser)
        clip_l, clip_g = tiny.clip_tokenizer(tiny.CLIP_EOS), tiny.clip_tokenizer(tiny.OPENCLIP_PAD)
        return tiny.diffusers_class("StableDiffusionXLPipeline"), {
            "text_encoder": tiny.seeded("text_encoder", CLIPTextModel, tiny.clip_config(clip_l, hidden_l, hidden_l)),
            "text_encoder_2": tiny.seeded("text_encoder_2", CLIPTextModelWithProjection,
                                          tiny.clip_config(clip_g, hidden_g, projection)),
            "tokenizer": clip_l,
            "tokenizer_2": clip_g,
            "unet": tiny.seeded("unet", tiny.diffusers_class(denoiser["_class_name"]).from_config, denoiser),
            "scheduler": tiny.diffusers_class("EulerDiscreteScheduler").from_config(SDXL_SCHEDULER),
            **self.pipeline_extras,
        }
