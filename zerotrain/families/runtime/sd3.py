"""SD3's torch side (zerotrain.families.sd3 declares the family): StableDiffusion3Pipeline.encode_prompt (two
CLIPs and T5), the transformer's forward arguments, kohya LoRA names and the tiny model."""

from __future__ import annotations

from typing import Any

from transformers import CLIPTextModelWithProjection, T5EncoderModel

from zerotrain.families.base import check_tokens
from zerotrain.families.parts.flux1 import MAX_T5_TOKENS
from zerotrain.families.runtime.base import (
    BaseRuntime,
    example_timestep,
    kohya_prefixed,
    meta_or_random,
    text_and_pooled,
)
from zerotrain.families.runtime.parts import tiny
from zerotrain.families.sd3 import SD3, SD3_SCHEDULER
from zerotrain.protocols import FlowObjective, ModelSpec


class SD3Runtime(SD3, BaseRuntime):
    """SD3's torch side."""

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """CLIP's 77 tokens plus text_tokens - 77 T5 tokens. prompt_embeds (B, T, d_T5): the two CLIPs'
        penultimate states concatenated and zero-padded to d_T5, followed by T5's; pooled_prompt_embeds
        (B, p_L + p_G), the two CLIP projections."""
        clip_tokens = pipeline.tokenizer.model_max_length
        check_tokens(text_tokens, clip_tokens + 1, clip_tokens + MAX_T5_TOKENS, f"{clip_tokens} CLIP + T5 tokens for SD3")
        prompt_embeds, _, pooled, _ = pipeline.encode_prompt(
            captions, None, None, device=device, do_classifier_free_guidance=False,
            max_sequence_length=text_tokens - clip_tokens,
        )
        return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        text, pooled = text_and_pooled(batch, x_t.shape[0])
        dtype = objective.model_dtype
        # SD3's transformer takes sigma * num_train_timesteps, as its scheduler's timesteps.
        return {
            "hidden_states": x_t.to(dtype),
            "encoder_hidden_states": text.to(dtype),
            "pooled_projections": pooled.to(dtype),
            "timestep": sigma * objective.num_train_timesteps,
        }, target

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        config = spec.config
        tensor = meta_or_random(device, dtype)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        return {
            "hidden_states": tensor(batch, int(config.get("in_channels", 16)), lat_h, lat_w),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config.get("joint_attention_dim", 4096))),
            "pooled_projections": tensor(batch, int(config.get("pooled_projection_dim", 2048))),
            "timestep": example_timestep(tensor, batch, device),
        }

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """"lora_transformer_" + the diffusers module path with "." -> "_" (OneTrainer's naming, which
        ComfyUI's comfy/lora.py model_lora_keys_unet maps for SD3)."""
        return kohya_prefixed("lora_transformer_", pairs, alpha)

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """The two CLIPs' penultimate states are concatenated and zero-padded to T5's width
        (joint_attention_dim), so their widths must sum to at most it; their projections concatenate to
        pooled_projection_dim. Published: 768 + 1280 = 2048 padded to 4096; projections 768 + 1280."""
        joint, pooled = denoiser["joint_attention_dim"], denoiser["pooled_projection_dim"]
        # Three quarters of T5's width, split 1:2 (published 768:1280), so the zero padding runs as in SD3.
        hidden_l, hidden_g = joint // 4, joint // 2
        proj_l = pooled // 2
        proj_g = pooled - proj_l
        tiny.check_room(min(hidden_l, proj_l) > 0 and hidden_l + hidden_g <= joint, "tiny-sd3", denoiser)
        clip_l, clip_g, t5 = tiny.clip_tokenizer(tiny.CLIP_EOS), tiny.clip_tokenizer(tiny.OPENCLIP_PAD), tiny.t5_tokenizer()
        return tiny.diffusers_class("StableDiffusion3Pipeline"), {
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config,
                                       denoiser),
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(SD3_SCHEDULER),
            "text_encoder": tiny.seeded("text_encoder", CLIPTextModelWithProjection,
                                        tiny.clip_config(clip_l, hidden_l, proj_l)),
            "tokenizer": clip_l,
            "text_encoder_2": tiny.seeded("text_encoder_2", CLIPTextModelWithProjection,
                                          tiny.clip_config(clip_g, hidden_g, proj_g)),
            "tokenizer_2": clip_g,
            "text_encoder_3": tiny.seeded("text_encoder_3", T5EncoderModel, tiny.t5_config(t5, joint)),
            "tokenizer_3": t5,
        }
