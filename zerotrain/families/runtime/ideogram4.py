"""Ideogram 4's torch side (zerotrain.families.ideogram4 declares the family): Ideogram's fold of FLUX.2's VAE
cells, the Qwen3-VL features of Ideogram4Pipeline.encode_prompt, the joint forward arguments (text, image and
unconditional tokens), validation with cached text, ComfyUI keys and the tiny model."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from diffusers import Ideogram4Pipeline, Ideogram4Transformer2DModel
from diffusers.models.transformers.transformer_ideogram4 import (
    LLM_TOKEN_INDICATOR,
    SEQUENCE_PADDING_INDICATOR,
)
from diffusers.pipelines.ideogram4.pipeline_ideogram4 import QWEN3_VL_ACTIVATION_LAYERS, _resolution_aware_mu
from transformers import Qwen3VLModel

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import caption_too_long, check_tokens
from zerotrain.families.ideogram4 import (
    _COMMUNITY,
    _FULL_RENAMES,
    _QKV,
    IDEOGRAM4_SCHEDULER,
    MAX_TEXT_TOKENS,
    UNCONDITIONAL,
    VAE_PATCH,
    Ideogram4,
    Ideogram4Codec,
    comfyui_model_to_diffusers,
)
from zerotrain.families.runtime.base import (
    BaseRuntime,
    compact_rows,
    example_timestep,
    kohya_lora,
    meta_or_random,
    trim_rows,
)
from zerotrain.families.runtime.parts import tiny
from zerotrain.families.runtime.parts.keymaps import fuse_lora
from zerotrain.families.runtime.parts.latents import Flux2CodecRuntime
from zerotrain.protocols import FlowObjective, ModelSpec


def tokens(grid: torch.Tensor) -> torch.Tensor:
    """A folded grid (B, C, h, w) as tokens (B, h * w, C), rows first, as the pipeline packs latents."""
    return grid.flatten(2).transpose(1, 2)


def joint_ids(valid: torch.Tensor, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """position_ids (B, N + n, 3), segment_ids and indicator (B, N + n) of the layout [image | text | padding]
    for a (grid_h, grid_w) image and captions whose rows `valid` (B, n) marks (a prefix each): the image's
    ids as Ideogram4Pipeline._prepare_ids gives them, each caption's positions 0..n_i - 1 on all three
    axes, padding in a segment of its own with position 0 and indicator 0, as the pipeline's."""
    b, n = valid.shape
    device = valid.device
    image_pos, image_seg, image_ind = Ideogram4Pipeline._prepare_ids([0] * b, grid_h, grid_w, 0, device)
    text_pos = (torch.arange(n, device=device) * valid).unsqueeze(-1).expand(b, n, 3)
    text_seg = torch.where(valid, 1, SEQUENCE_PADDING_INDICATOR)
    text_ind = torch.where(valid, LLM_TOKEN_INDICATOR, 0)
    return (torch.cat([image_pos, text_pos], dim=1), torch.cat([image_seg, text_seg], dim=1),
            torch.cat([image_ind, text_ind], dim=1))


def joint_inputs(image: torch.Tensor, text: torch.Tensor, valid: torch.Tensor, grid_h: int, grid_w: int,
                 timestep: torch.Tensor) -> dict[str, Any]:
    """The transformer's forward arguments for image tokens (B, N, C) and text rows (B, n, D) of which
    `valid` (B, n) marks each caption's: the sequence [image | text | padding], zeros where a row carries
    no latent or no text, as the pipeline fills them."""
    b, n = valid.shape
    hidden = torch.cat([image, image.new_zeros(b, n, image.shape[2])], dim=1)
    features = torch.cat([text.new_zeros(b, image.shape[1], text.shape[2]), text * valid.unsqueeze(-1).to(text.dtype)],
                         dim=1)
    position_ids, segment_ids, indicator = joint_ids(valid, grid_h, grid_w)
    return {"hidden_states": hidden, "timestep": timestep, "encoder_hidden_states": features,
            "position_ids": position_ids, "segment_ids": segment_ids, "indicator": indicator}


def chat_tokens(tokenizer: Any, caption: str) -> int:
    """How many tokens Ideogram4Pipeline.encode_prompt gives a caption: its chat template's text, tokenized
    without special tokens."""
    messages = [{"role": "user", "content": [{"type": "text", "text": caption}]}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def cached_text_pipeline() -> type:
    """Ideogram4Pipeline fed cached text: __call__(prompt_embeds=(B, n, D), ...) renders with those features
    in place of encode_prompt's (the pipeline itself takes only prompts, which need the 8B text encoder)."""
    class CachedTextIdeogram4Pipeline(Ideogram4Pipeline):
        _features: Any = None

        def __call__(self, prompt_embeds: Any, **kwargs: Any) -> Any:
            self._features = prompt_embeds
            try:
                return super().__call__(prompt=[""] * prompt_embeds.shape[0],
                                        max_sequence_length=prompt_embeds.shape[1], **kwargs)
            finally:
                self._features = None

        def encode_prompt(self, prompt: Any, grid_h: int, grid_w: int, max_sequence_length: int, device: Any) -> Any:
            features = self._features.to(device=device, dtype=torch.float32)
            b, n = features.shape[:2]
            ids = self._prepare_ids([n] * b, grid_h, grid_w, n, device)
            return (torch.cat([features, features.new_zeros(b, grid_h * grid_w, features.shape[2])], dim=1), *ids)

    return CachedTextIdeogram4Pipeline


class Ideogram4CodecRuntime(Ideogram4Codec, Flux2CodecRuntime):
    """Ideogram4Codec's torch side."""

    def fold(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents (B, C, h, w) as the transformer's grid (B, 4C, h/2, w/2): each 2x2 cell's values in
        (row, column, channel) order, channel fastest, as Ideogram4Pipeline unfolds them before decoding."""
        b, c, h, w = latents.shape
        if h % VAE_PATCH or w % VAE_PATCH:
            raise ValueError(f"fold: latents {h}x{w} are not a multiple of {VAE_PATCH}")
        cells = latents.reshape(b, c, h // VAE_PATCH, VAE_PATCH, w // VAE_PATCH, VAE_PATCH)
        return cells.permute(0, 3, 5, 1, 2, 4).reshape(b, c * VAE_PATCH * VAE_PATCH, h // VAE_PATCH, w // VAE_PATCH)


class Ideogram4Runtime(Ideogram4, BaseRuntime):
    """Ideogram4's torch side."""

    def encode_prompt(self, pipeline: Any, captions: list[str], text_tokens: int, device: Any) -> dict[str, Any]:
        """prompt_embeds (B, text_tokens, 53248 for the published model): each caption's rows of the tapped
        Qwen3-VL states, zero-padded at the end; prompt_embeds_mask (B, text_tokens), 1 on those rows."""
        check_tokens(text_tokens, 1, MAX_TEXT_TOKENS, f"Ideogram4Pipeline's max_sequence_length for {self.title}")
        for caption in captions:
            count = chat_tokens(pipeline.tokenizer, caption)
            if count > text_tokens:
                raise caption_too_long(caption, count, text_tokens, f"{self.title}'s chat template",
                                       " (the pipeline does not truncate)", MAX_TEXT_TOKENS)
        features, _, _, indicator = pipeline.encode_prompt(list(captions), grid_h=1, grid_w=1,
                                                           max_sequence_length=text_tokens, device=device)
        return compact_rows(features[:, :text_tokens], indicator[:, :text_tokens] == LLM_TOKEN_INDICATOR, text_tokens)

    def sampling_shift(self, spec: ModelSpec, scheduler_config: dict[str, Any], image_seq_len: int) -> float:
        """e^mu of the pipeline's resolution-aware mean for the pixels of image_seq_len tokens: its sigmas are
        the logit-normal's at that mean, which is the logit-normal at 0 shifted by e^mu."""
        if image_seq_len < 1:
            raise ValueError(f"sampling_shift: image_seq_len must be positive, got {image_seq_len}")
        pixels = image_seq_len * self.pixel_factor(spec) ** 2
        return math.exp(_resolution_aware_mu(height=pixels, width=1, base_mu=0.0))  # it reads H * W only

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        b, _, h, w = x_t.shape
        text, mask = batch["prompt_embeds"], batch["prompt_embeds_mask"]
        if text.ndim != 3 or text.shape[0] != b:
            raise ValueError(f"prompt_embeds must be ({b}, T, D), got {tuple(text.shape)}")
        text, valid = trim_rows(text, mask)
        dtype = objective.model_dtype
        # The pipeline passes t = 1 - sigma in the transformer's dtype and steps on the negated output.
        kwargs = joint_inputs(tokens(x_t).to(dtype), text.to(dtype), valid, h, w, (1 - sigma).to(dtype))
        return kwargs, -tokens(target)

    def target_layout(self, latents: Any) -> Any:
        return tokens(latents)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        """Every caption text_tokens long: the longest sequence a batch can carry."""
        config = spec.config
        tensor = meta_or_random(device, dtype)
        grid_h, grid_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        image = tensor(batch, grid_h * grid_w, int(config.get("in_channels", self.default_in_channels)))
        text = tensor(batch, text_tokens, int(config.get("llm_features_dim", 53248)))
        valid = torch.ones(batch, text_tokens, dtype=torch.bool, device=device)
        # in the model's dtype, as flow_inputs gives it (an fp32 one fails the timestep embedding's bf16 matmul)
        return joint_inputs(image, text, valid, grid_h, grid_w, example_timestep(tensor, batch, device).to(dtype))

    def validation_pipeline(self, spec: ModelSpec, folder: Path, components: dict[str, Any], device: Any) -> Any:
        """Ideogram4Pipeline (fed cached text) with the folder's unconditional transformer, frozen in the
        trained model's dtype: on a GPU it stays on the host and diffusers' group offloading moves one block
        at a time to the device; elsewhere it is loaded where the trained model is."""
        model = components[self.denoiser_folder]
        unconditional = Ideogram4Transformer2DModel.from_pretrained(folder, subfolder=UNCONDITIONAL, torch_dtype=model.dtype)
        unconditional.requires_grad_(False).eval()
        device = torch.device(device)
        if device.type == "cuda":
            unconditional.enable_group_offload(onload_device=device, offload_device=torch.device("cpu"),
                                               offload_type="block_level", num_blocks_per_group=1)
        else:
            unconditional.to(device)
        return cached_text_pipeline()(**{**components, UNCONDITIONAL: unconditional})

    def validation_kwargs(self, embeds: dict[str, Any], negative: dict[str, Any] | None, guidance_scale: float) -> dict[str, Any]:
        """The prompt's own rows and one guidance for every step (the default 48-step schedule fits 48 steps only)."""
        text, _ = trim_rows(embeds["prompt_embeds"], embeds["prompt_embeds_mask"])
        return {"prompt_embeds": text, "guidance_scale": guidance_scale, "guidance_schedule": None}

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """The community layout diffusers' Ideogram 4 loader reads: "diffusion_model.layers.N." + the
        block's module (attention.qkv fused from q, k and v, attention.o, feed_forward.w1/w2/w3,
        adaln_modulation), kohya's lora_down / lora_up / alpha. A fused qkv has three times the rank, so
        its alpha is three times too: the same scale on each part."""
        modules = dict(model.named_modules())
        out: dict[str, Any] = {}
        fused: set[str] = set()
        for module, (down, up) in pairs.items():
            block, _, rest = module.partition(".")
            index, _, rest = rest.partition(".")
            if block != "layers" or not index.isdigit() or (rest not in _COMMUNITY and rest not in _QKV):
                raise ZerotrainError(f"{self.title} module {module} has no name in the community LoRA layout "
                                     "(blocks' attention, feed-forward and modulation only); export without --comfyui, "
                                     "or train only those modules (training.lora.target_modules)")
            if rest in _COMMUNITY:
                out.update(kohya_lora(f"diffusion_model.layers.{index}.{_COMMUNITY[rest]}", down, up, alpha))
            elif index not in fused:
                fused.add(index)
                parts = tuple(f"layers.{index}.{part}" for part in _QKV)
                down, up, rank = fuse_lora(modules, pairs, parts, f"{self.title} layers.{index}.attention.qkv")
                scale = down.shape[0] // rank
                out.update(kohya_lora(f"diffusion_model.layers.{index}.attention.qkv", down, up, alpha * scale))
        return out

    def comfyui_model(self, weights: dict[str, Any]) -> dict[str, Any]:
        """The original single-file layout ComfyUI detects (its Ideogram4 model): diffusers' names, each block's
        attention.to_q, to_k and to_v fused into attention.qkv (rows q, k, v) and to_out.0 named attention.o
        (comfyui_model_to_diffusers reads it back)."""
        out: dict[str, Any] = {}
        for key, tensor in weights.items():
            block, sep, rest = key.partition(".attention.")
            if not sep or rest not in _FULL_RENAMES:
                out[key] = tensor
            elif rest == "to_q.weight":
                parts = [weights.get(f"{block}.attention.{name}.weight") for name in ("to_q", "to_k", "to_v")]
                if any(part is None for part in parts):
                    raise ZerotrainError(f"{self.title} weights lack {block}'s to_k or to_v, needed for attention.qkv")
                out[f"{block}.attention.qkv.weight"] = torch.cat(parts, dim=0)
            elif rest == "to_out.0.weight":
                out[f"{block}.attention.o.weight"] = tensor
        return out

    def diffusers_weights(self, weights: dict[str, Any]) -> dict[str, Any]:
        """comfyui_model's layout read back (diffusers' names pass through unchanged): diffusers has no
        Ideogram 4 single-file loader."""
        return comfyui_model_to_diffusers(weights)

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """Both transformers from the tiny config (the unconditional one from its own seed), a Qwen3-VL as
        deep as the pipeline's taps reach (36 layers: it taps them by index) and llm_features_dim / 13 wide,
        a Qwen tokenizer with a chat template that renders the pipeline's list content, and the published
        scheduler."""
        taps = len(QWEN3_VL_ACTIVATION_LAYERS)
        width = int(denoiser["llm_features_dim"]) // taps
        tiny.check_room(width * taps == int(denoiser["llm_features_dim"]), "tiny-ideogram4", denoiser)
        tokenizer = tiny.qwen2_tokenizer(tiny.QWEN3_PROMPT, tiny.QWEN_SPECIALS, tiny.QWEN3_VL_TEXT_TEMPLATE)
        build = tiny.diffusers_class(denoiser["_class_name"]).from_config
        return tiny.diffusers_class(self.pipeline), {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(IDEOGRAM4_SCHEDULER),
            "text_encoder": tiny.seeded("text_encoder", Qwen3VLModel,
                                        tiny.qwen3_vl_config(tokenizer, width, max(QWEN3_VL_ACTIVATION_LAYERS) + 1)),
            "tokenizer": tokenizer,
            "transformer": tiny.seeded("transformer", build, denoiser),
            UNCONDITIONAL: tiny.seeded(UNCONDITIONAL, build, denoiser),
        }
