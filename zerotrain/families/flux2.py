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

import inspect
import re
from typing import TYPE_CHECKING, Any

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import (
    BaseFamily,
    capped_size,
    check_tokens,
    example_timestep,
    meta_or_random,
    model_index,
    shift_from_mu,
)
from zerotrain.families.parts.flux1 import FLUX_SCHEDULER
from zerotrain.families.parts.keymaps import fuse_lora, swap_halves
from zerotrain.families.parts.latents import FLUX2_VAE
from zerotrain.families.parts.tiny import QWEN3_CHAT_TEMPLATE, QWEN3_PROMPT, QWEN3_THINK_TOKENS

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from zerotrain.protocols import FlowObjective, ModelSpec

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


def latent_ids(batch: int, height: int, width: int, device: torch.device | str) -> torch.Tensor:
    """Image position ids (batch, height * width, 4) int64 of (height, width) latents, by
    Flux2Pipeline._prepare_latent_ids (which reads only the latents' shape, so a meta tensor stands in)."""
    import torch
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._prepare_latent_ids(torch.empty(batch, 1, height, width, device="meta")).to(device)


def text_ids(text: torch.Tensor) -> torch.Tensor:
    """Text position ids (B, T, 4) int64 of prompt_embeds (B, T, D), by Flux2Pipeline._prepare_text_ids."""
    from diffusers import Flux2Pipeline

    return Flux2Pipeline._prepare_text_ids(text).to(text.device)


def _prompt_embeds(batch: dict[str, torch.Tensor], b: int) -> torch.Tensor:
    text = batch["prompt_embeds"]
    if text.ndim != 3 or text.shape[0] != b:
        raise ValueError(f"prompt_embeds must be ({b}, T, D), got {tuple(text.shape)}")
    return text


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


def _bfl_target(module: str) -> tuple[str, tuple[str, ...]]:
    found = bfl_module(module)
    if found is None:
        raise ZerotrainError(f"FLUX.2 module {module} has no ComfyUI (Black Forest Labs) name")
    return found


class Flux2(BaseFamily):
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

    # --- conditioning ------------------------------------------------------------------------------

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, text_tokens, 3 x hidden): the text encoder's hidden states after the
        pipeline's three text_encoder_out_layers, per token, of the templated caption padded (or cut)
        to text_tokens. No mask: the transformer attends every position, padding included, so the
        whole padded sequence is the conditioning. The text ids depend only on its length (text_ids)."""
        limit = pipeline.text_encoder.config.get_text_config().max_position_embeddings
        check_tokens(text_tokens, 1, limit, f"the text encoder's positions for {self.title}")
        prompt_embeds, _ = pipeline.encode_prompt(captions, device=device, max_sequence_length=text_tokens)
        return {"prompt_embeds": prompt_embeds}

    # --- training ----------------------------------------------------------------------------------

    def dynamic_shift(self, scheduler_config: dict[str, Any], image_seq_len: int) -> float:
        """The shift of Flux2Pipeline's (and Flux2KleinPipeline's) default render: mu from Black Forest
        Labs' compute_empirical_mu(image_seq_len, PIPELINE_STEPS), which replaces calculate_shift (the
        config's base/max shift go unused), through the scheduler's time_shift_type as
        set_timesteps(mu=...) applies it. diffusers' FLUX.2 training scripts draw sigma unshifted;
        objective.shift: 1 trains that way."""
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        if image_seq_len < 1:
            raise ValueError(f"dynamic_shift: image_seq_len must be positive, got {image_seq_len}")
        return shift_from_mu(scheduler_config, compute_empirical_mu(image_seq_len, PIPELINE_STEPS))

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        import torch
        from diffusers import Flux2Pipeline

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

    # --- references ------------------------------------------------------------------------------

    def max_references(self, spec: ModelSpec) -> int:
        return MAX_REFERENCES

    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        """As Flux2Pipeline and Flux2KleinPipeline size each image: its own size, scaled down to 1024 x
        1024 pixels of area at its aspect when above that, each side floored to the VAE's 16 pixels;
        with `area`, scaled to that area instead."""
        return capped_size(control, area, self.pixel_factor(spec), REFERENCE_AREA)

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[Any]) -> dict[str, Any]:
        """Flux2Pipeline's: each reference's latents packed (_pack_latents) after the noisy tokens, in
        order; their ids from _prepare_image_ids (T = 10, 20, ... per reference); one timestep."""
        import torch
        from diffusers import Flux2Pipeline

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

    def comfyui_adapter_name(self, module: str) -> str:
        """"transformer." + the diffusers module path: ComfyUI's Flux2 model subclasses its Flux, whose
        table of diffusers names (comfy/utils.py flux_to_diffusers) holds FLUX.2's too (ff.linear_in,
        attn.to_qkv_mlp_proj, attn.to_out), q, k and v onto their rows of the fused qkv."""
        return f"transformer.{module}"

    def target_layout(self, latents: Any) -> Any:
        from diffusers import Flux2Pipeline

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

    # --- export ------------------------------------------------------------------------------------

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
        import torch

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

    # --- the tiny model ----------------------------------------------------------------------------

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """The pipeline the config calls for, its text encoder as deep as the pipeline's
        text_encoder_out_layers reach and a third of joint_attention_dim wide (three layers' states are
        stacked per token): [dev] Mistral3ForConditionalGeneration (a Mistral text model and the smallest
        Pixtral vision tower, which encode_prompt never runs) with a byte-level BPE tokenizer carrying
        Mistral's chat template; [klein] Qwen3ForCausalLM with Qwen3's."""
        from zerotrain.families.parts import tiny

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


def _tiny_text_config(tokenizer: Any, hidden: int, layers: int) -> dict[str, Any]:
    """The fields the tiny Mistral and Qwen3 text models share."""
    return {
        "vocab_size": len(tokenizer), "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers, "num_attention_heads": _TINY_HEADS, "num_key_value_heads": _TINY_KV_HEADS,
        "head_dim": hidden // _TINY_HEADS, "max_position_embeddings": 1024,
        "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
    }


def _tiny_mistral(hidden: int, layers: int) -> tuple[Any, Any]:
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from zerotrain.families.parts import tiny

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
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from zerotrain.families.parts import tiny

    tokenizer = tiny.qwen2_tokenizer(KLEIN_PROMPT, (*tiny.QWEN_SPECIALS, *QWEN3_THINK_TOKENS), QWEN3_CHAT_TEMPLATE)
    config = Qwen3Config(**_tiny_text_config(tokenizer, hidden, layers), tie_word_embeddings=True)
    return tokenizer, tiny.seeded("text_encoder", Qwen3ForCausalLM, config)


FAMILY = Flux2()
