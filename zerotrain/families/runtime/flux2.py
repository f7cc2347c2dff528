"""FLUX.2's torch side (zerotrain.families.flux2 declares the family): the Mistral or Qwen3 text of
Flux2Pipeline / Flux2KleinPipeline, position ids, the empirical shift, reference latents, Black Forest Labs keys
and the tiny models with their chat templates."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from diffusers import Flux2Pipeline
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import check_tokens, shift_from_mu
from zerotrain.families.flux2 import (
    _NORM_WEIGHT,
    _SWAPPED,
    DENOISER_DEFAULTS,
    FLUX2_SCHEDULER,
    PIPELINE_STEPS,
    Flux2,
    bfl_module,
    pipeline_for,
)
from zerotrain.families.runtime.base import BaseRuntime, example_timestep, meta_or_random
from zerotrain.families.runtime.parts import tiny
from zerotrain.families.runtime.parts.keymaps import fuse_lora, swap_halves
from zerotrain.families.runtime.parts.tiny import QWEN3_CHAT_TEMPLATE, QWEN3_PROMPT, QWEN3_THINK_TOKENS
from zerotrain.protocols import FlowObjective, ModelSpec

# What Flux2Pipeline's chat template makes of a caption (Mistral Small 3.1's format: system prompt
# first), and Flux2KleinPipeline's (Qwen3, one user turn, enable_thinking=False: an empty think block).
DEV_PROMPT = "<s>[SYSTEM_PROMPT]{system}[/SYSTEM_PROMPT][INST]{{}}[/INST]"
KLEIN_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
# Mistral Small 3.1's chat template, cut to what Flux2Pipeline sends (a system and a user turn whose
# content is a list of text parts) and rendered as the published one renders it.
MISTRAL_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- if messages[0]['content'] is string %}{%- set system = messages[0]['content'] %}"
    "{%- else %}{%- set system = messages[0]['content'][0]['text'] %}{%- endif %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- '[SYSTEM_PROMPT]' + system + '[/SYSTEM_PROMPT]' }}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST]' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- else %}{{- '[IMG]' }}{%- endif %}"
    "{%- endfor %}{%- endif %}{{- '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] + eos_token }}{%- endif %}"
    "{%- endfor %}"
)
# Mistral's specials the template uses, eos (which the tiny tokenizer also pads and unks with) first.
MISTRAL_SPECIALS = ("</s>", "<s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[IMG]")
# The tiny text encoders: grouped-query attention (2 heads, 1 key/value head) as the real 32 / 8.
_TINY_HEADS, _TINY_KV_HEADS = 2, 1


def latent_ids(batch: int, height: int, width: int, device: torch.device | str) -> torch.Tensor:
    """Image position ids (batch, height * width, 4) int64 of (height, width) latents, by
    Flux2Pipeline._prepare_latent_ids (which reads only the latents' shape, so a meta tensor stands in)."""
    return Flux2Pipeline._prepare_latent_ids(torch.empty(batch, 1, height, width, device="meta")).to(device)


def text_ids(text: torch.Tensor) -> torch.Tensor:
    """Text position ids (B, T, 4) int64 of prompt_embeds (B, T, D), by Flux2Pipeline._prepare_text_ids."""
    return Flux2Pipeline._prepare_text_ids(text).to(text.device)


def _prompt_embeds(batch: dict[str, torch.Tensor], b: int) -> torch.Tensor:
    text = batch["prompt_embeds"]
    if text.ndim != 3 or text.shape[0] != b:
        raise ValueError(f"prompt_embeds must be ({b}, T, D), got {tuple(text.shape)}")
    return text


def _bfl_target(module: str) -> tuple[str, tuple[str, ...]]:
    found = bfl_module(module)
    if found is None:
        raise ZerotrainError(f"FLUX.2 module {module} has no ComfyUI (Black Forest Labs) name")
    return found


def _tiny_text_config(tokenizer: Any, hidden: int, layers: int) -> dict[str, Any]:
    """The fields the tiny Mistral and Qwen3 text models share."""
    return {
        "vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": _TINY_HEADS, "num_key_value_heads": _TINY_KV_HEADS,
        "head_dim": hidden // _TINY_HEADS, "max_position_embeddings": 1024,
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
    }


def _tiny_mistral(hidden: int, layers: int) -> tuple[Any, Any]:
    tokenizer = tiny.qwen2_tokenizer(DEV_PROMPT.format(system=SYSTEM_MESSAGE), MISTRAL_SPECIALS, MISTRAL_CHAT_TEMPLATE)
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    text = {**_tiny_text_config(tokenizer, hidden, layers), "model_type": "mistral", "sliding_window": None,
            "bos_token_id": tokenizer.bos_token_id}
    # Pixtral's smallest tower: one layer, one 8-pixel patch per side of a 16-pixel image.
    vision = {"model_type": "pixtral", "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": 1,
              "num_attention_heads": _TINY_HEADS, "head_dim": hidden // _TINY_HEADS, "image_size": 16, "patch_size": 8}
    config = Mistral3Config(text_config=text, vision_config=vision,
                            image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"))
    return tokenizer, tiny.seeded("text_encoder", Mistral3ForConditionalGeneration, config)


def _tiny_qwen3(hidden: int, layers: int) -> tuple[Any, Any]:
    tokenizer = tiny.qwen2_tokenizer(KLEIN_PROMPT, (*tiny.QWEN_SPECIALS, *QWEN3_THINK_TOKENS), QWEN3_CHAT_TEMPLATE)
    config = Qwen3Config(**_tiny_text_config(tokenizer, hidden, layers), tie_word_embeddings=True)
    return tokenizer, tiny.seeded("text_encoder", Qwen3ForCausalLM, config)


class Flux2Runtime(Flux2, BaseRuntime):
    """Flux2's torch side."""

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, text_tokens, 3 x hidden): the text encoder's hidden states after the
        pipeline's three text_encoder_out_layers, per token, of the templated caption padded (or cut)
        to text_tokens. No mask: the transformer attends every position, padding included, so the
        whole padded sequence is the conditioning. The text ids depend only on its length (text_ids)."""
        limit = pipeline.text_encoder.config.get_text_config().max_position_embeddings
        check_tokens(text_tokens, 1, limit, f"the text encoder's positions for {self.title}")
        prompt_embeds, _ = pipeline.encode_prompt(captions, device=device, max_sequence_length=text_tokens)
        return {"prompt_embeds": prompt_embeds}

    def dynamic_shift(self, scheduler_config: dict[str, Any], image_seq_len: int) -> float:
        """The shift of Flux2Pipeline's (and Flux2KleinPipeline's) default render: mu from Black Forest
        Labs' compute_empirical_mu(image_seq_len, PIPELINE_STEPS), which replaces calculate_shift (the
        config's base/max shift go unused), through the scheduler's time_shift_type as
        set_timesteps(mu=...) applies it. diffusers' FLUX.2 training scripts draw sigma unshifted;
        objective.shift: 1 trains that way."""
        if image_seq_len < 1:
            raise ValueError(f"dynamic_shift: image_seq_len must be positive, got {image_seq_len}")
        return shift_from_mu(scheduler_config, compute_empirical_mu(image_seq_len, PIPELINE_STEPS))

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        b, _, h, w = x_t.shape
        text = _prompt_embeds(batch, b)
        dtype = objective.model_dtype
        # The pipelines pass timestep / 1000 = sigma; the transformer scales it (and guidance) by 1000.
        # _pack_latents returns a permuted view; quanto's int8 CPU matmul (a qint8 base) needs a
        # contiguous last dimension.
        kwargs = {
            "hidden_states": Flux2Pipeline._pack_latents(x_t).to(dtype).contiguous(),
            "encoder_hidden_states": text.to(dtype),
            "timestep": sigma,
            "img_ids": latent_ids(b, h, w, x_t.device),
            "txt_ids": text_ids(text),
        }
        if objective.spec.config.get("guidance_embeds", DENOISER_DEFAULTS["guidance_embeds"]):
            kwargs["guidance"] = torch.full((b,), objective.config.guidance, device=x_t.device)
        return kwargs, self.target_layout(target)

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[Any]) -> dict[str, Any]:
        """Flux2Pipeline's: each reference's latents packed (_pack_latents) after the noisy tokens, in
        order; their ids from _prepare_image_ids (T = 10, 20, ... per reference); one timestep."""
        hidden = kwargs["hidden_states"]
        b = hidden.shape[0]
        packed = [Flux2Pipeline._pack_latents(latents).to(hidden.dtype) for latents in references]
        # _prepare_image_ids reads only the shapes (its coordinates are built on the host).
        ids = Flux2Pipeline._prepare_image_ids([torch.empty(1, *r.shape[1:], device="meta") for r in references])
        ids = ids.repeat(b, 1, 1).to(kwargs["img_ids"].device)
        return {**kwargs, "hidden_states": torch.cat([hidden, *packed], dim=1).contiguous(),
                "img_ids": torch.cat([kwargs["img_ids"], ids], dim=1)}

    def reference_kwargs(self, spec: ModelSpec, images: list[Any], size: tuple[int, int],
                         area: int | None = None) -> dict[str, Any]:
        return {"image": list(images)}

    def target_layout(self, latents: Any) -> Any:
        return Flux2Pipeline._pack_latents(latents)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        config = {**DENOISER_DEFAULTS, **spec.config}
        tensor = meta_or_random(device, dtype)
        t = example_timestep(tensor, batch, device)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        text = tensor(batch, text_tokens, int(config["joint_attention_dim"]))
        inputs = {
            "hidden_states": tensor(batch, lat_h * lat_w, int(config["in_channels"])),
            "encoder_hidden_states": text,
            "timestep": t,
            "img_ids": latent_ids(batch, lat_h, lat_w, device),
            "txt_ids": text_ids(text),
        }
        if config["guidance_embeds"]:
            inputs["guidance"] = t
        return inputs

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """"diffusion_model." + the Black Forest Labs module path, with lora_A / lora_B weights and no
        alpha (ComfyUI then scales by 1, so B carries alpha / r): the layout diffusers' own
        Flux2LoraLoaderMixin also reads (it rejects alpha keys there). Diffusers' separate q/k/v are one
        fused qkv layer in BFL's model (fuse_lora)."""
        groups = dict(_bfl_target(module) for module in pairs)
        modules = dict(model.named_modules())
        out: dict[str, Any] = {}
        for target, parts in groups.items():
            down, up, rank = fuse_lora(modules, pairs, parts, f"{self.title} {target}")
            if target == _SWAPPED:
                up = swap_halves(up)
            out[f"diffusion_model.{target}.lora_A.weight"] = down.contiguous()
            out[f"diffusion_model.{target}.lora_B.weight"] = (up.float() * (alpha / rank)).to(up.dtype).contiguous()
        return out

    def comfyui_model(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The transformer in Black Forest Labs' layout (as BFL's flux2-dev.safetensors and
        flux-2-klein-*.safetensors, which ComfyUI's "Load Diffusion Model" reads): q/k/v concatenated into
        qkv, RMSNorm weights named scale, the final modulation's halves swapped. The exact inverse of
        diffusers' convert_flux2_transformer_checkpoint_to_diffusers."""
        out: dict[str, torch.Tensor] = {}
        fused: dict[str, tuple[str, ...]] = {}
        for key, tensor in weights.items():
            module, param = key.rsplit(".", 1)
            target, parts = _bfl_target(module)
            if len(parts) > 1:
                fused[target] = parts
                continue
            if target.endswith("_norm"):
                param = _NORM_WEIGHT
            out[f"{target}.{param}"] = swap_halves(tensor) if target == _SWAPPED else tensor
        for target, parts in fused.items():
            missing = [part for part in parts if f"{part}.weight" not in weights]
            if missing:
                raise ZerotrainError(f"FLUX.2 weights lack {missing[0]}.weight, needed for BFL's {target}")
            out[f"{target}.weight"] = torch.cat([weights[f"{part}.weight"] for part in parts], dim=0)
        return out

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """The pipeline the config calls for, its text encoder as deep as the pipeline's
        text_encoder_out_layers reach and a third of joint_attention_dim wide (three layers' states are
        stacked per token): [dev] Mistral3ForConditionalGeneration (a Mistral text model and the smallest
        Pixtral vision tower, which encode_prompt never runs) with a byte-level BPE tokenizer carrying
        Mistral's chat template; [klein] Qwen3ForCausalLM with Qwen3's."""
        pipeline_class = tiny.diffusers_class(pipeline_for(denoiser))
        out_layers = inspect.signature(pipeline_class.encode_prompt).parameters["text_encoder_out_layers"].default
        joint = denoiser["joint_attention_dim"]
        hidden = joint // len(out_layers)
        tiny.check_room(joint % len(out_layers) == 0 and hidden % (2 * _TINY_HEADS) == 0, "tiny-flux2", denoiser)
        if pipeline_class.__name__ == "Flux2Pipeline":
            tokenizer, text_encoder = _tiny_mistral(hidden, max(out_layers))
        else:
            tokenizer, text_encoder = _tiny_qwen3(hidden, max(out_layers))
        return pipeline_class, {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(FLUX2_SCHEDULER),
            "text_encoder": text_encoder,
            "tokenizer": tokenizer,
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config,
                                       denoiser),
        }
