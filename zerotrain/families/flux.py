"""FLUX.1 (dev, schnell and fine-tunes): FluxTransformer2DModel, FLUX.1's AutoencoderKL, CLIP-L's pooled
output and T5's sequence, as FluxPipeline and diffusers' train_dreambooth_flux.py use them."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.errors import ZerotrainError
from zerotrain.families.base import (
    PUBLISHED_VAE_SCALE_FACTOR,
    BaseFamily,
    area_size,
    check_tokens,
    example_timestep,
    kohya_lora,
    meta_or_random,
    text_and_pooled,
)
from zerotrain.protocols import VaeFacts

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from zerotrain.protocols import FlowObjective, ModelSpec

# Flux packs each 2x2 patch of latents into one token (FluxPipeline._pack_latents), so in_channels is
# 4 x the VAE's latent channels (64 = 4 x 16 for FLUX.1).
FLUX_PATCH = 2
_PACKING = FLUX_PATCH * FLUX_PATCH
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
# FLUX.1 Kontext: FluxTransformer2DModel rendered by this pipeline, which appends one image's latents.
KONTEXT_PIPELINE = "FluxKontextPipeline"
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, h/2 * w/2, 4C) by FluxPipeline._pack_latents: Flux's image tokens."""
    from diffusers import FluxPipeline

    if latents.ndim != 4 or latents.shape[0] < 1:
        raise ValueError(f"latents must be (B, C, h, w), got {tuple(latents.shape)}")
    b, c, h, w = latents.shape
    if h % FLUX_PATCH or w % FLUX_PATCH:
        raise ValueError(f"pack_latents: latent height and width must be even, got {h}x{w}")
    return FluxPipeline._pack_latents(latents, b, c, h, w)


@functools.lru_cache(maxsize=64)
def latent_image_ids(height: int, width: int, device: torch.device) -> torch.Tensor:
    """Flux's image position ids (h/2 * w/2, 3) float32 for (h, w) latents, by
    FluxPipeline._prepare_latent_image_ids on the packed grid. Kept per bucket shape: every batch
    asks for them (the transformer only reads them)."""
    import torch
    from diffusers import FluxPipeline

    return FluxPipeline._prepare_latent_image_ids(None, height // FLUX_PATCH, width // FLUX_PATCH, device, torch.float32)


class Flux(BaseFamily):
    name = "flux"
    title = "FLUX.1"
    denoiser_classes = ("FluxTransformer2DModel",)
    pipeline = "FluxPipeline"
    text_components = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
    # FluxPipeline's max_sequence_length=512 T5 tokens.
    default_text_tokens = 512
    # As diffusers' train_dreambooth_lora_flux.py chooses them.
    depth_keys = ("num_layers", "num_single_layers")
    lora_targets = (
        "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
        "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
        "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
    )
    # FluxPipeline.__call__'s guidance_scale (distilled guidance, one prediction per step).
    default_guidance = 3.5
    classifier_free_guidance = False
    default_in_channels = 64
    # calculate_shift's defaults as FluxPipeline writes them.
    shift_defaults: ClassVar[dict[str, float]] = {"base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15}

    def latent_channels(self, config: dict[str, Any], where: Path | str) -> int:
        channels = super().latent_channels(config, where)
        if channels % _PACKING:
            raise ZerotrainError(
                f"model.name_or_path: {where} has {channels} output channels; Flux packs 2x2 latent patches, "
                "so it must be a multiple of 4"
            )
        return channels // _PACKING

    def published_vae(self, config: dict[str, Any]) -> VaeFacts:
        # FLUX.1 ae (black-forest-labs/FLUX.1-dev vae/config.json): 16 channels, scaling 0.3611, shift 0.1159.
        return VaeFacts(PUBLISHED_VAE_SCALE_FACTOR, self.latent_channels(config, "config"), 0.3611, 0.1159)

    def patch(self, spec: ModelSpec) -> int:
        return FLUX_PATCH

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

    def target_layout(self, latents: Any) -> Any:
        return pack_latents(latents)

    def example_inputs(self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
                       device: Any, dtype: Any) -> dict[str, Any]:
        config = spec.config
        tensor = meta_or_random(device, dtype)
        t = example_timestep(tensor, batch, device)
        lat_h, lat_w = height // spec.vae_scale_factor, width // spec.vae_scale_factor
        tokens = (lat_h // 2) * (lat_w // 2)
        inputs = {
            "hidden_states": tensor(batch, tokens, int(config.get("in_channels", 64))),
            "encoder_hidden_states": tensor(batch, text_tokens, int(config.get("joint_attention_dim", 4096))),
            "pooled_projections": tensor(batch, int(config.get("pooled_projection_dim", 768))),
            "timestep": t,
            "img_ids": tensor(tokens, 3),
            "txt_ids": tensor(text_tokens, 3),
        }
        if config.get("guidance_embeds", False):
            inputs["guidance"] = t
        return inputs

    # --- references: FLUX.1 Kontext --------------------------------------------------------------

    def pipeline_name(self, spec: ModelSpec) -> str:
        """FluxKontextPipeline for a Kontext model (its model_index.json or catalog entry says so: its
        transformer's config is FLUX.1 [dev]'s), the family's pipeline otherwise."""
        return KONTEXT_PIPELINE if spec.pipeline_class == KONTEXT_PIPELINE else self.pipeline

    def max_references(self, spec: ModelSpec) -> int:
        """FluxKontextPipeline takes one image."""
        return 1 if self.pipeline_name(spec) == KONTEXT_PIPELINE else 0

    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        """The target's size, as Kontext edits are trained and rendered (the pipeline's output takes its
        input image's size); with `area`, the control's own aspect at that area."""
        if not self.max_references(spec):
            raise self._no_references(spec)
        return target if area is None else area_size(control, area, self.pixel_factor(spec))

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[Any]) -> dict[str, Any]:
        """FluxKontextPipeline's: the image latents packed (_pack_latents) after the noisy tokens, their
        ids the target grid's ids (_prepare_latent_image_ids) with channel 0 set to 1; one timestep."""
        import torch

        hidden, ids = [kwargs["hidden_states"]], [kwargs["img_ids"]]
        for latents in references:
            _, _, h, w = latents.shape
            hidden.append(pack_latents(latents).to(kwargs["hidden_states"].dtype))
            image_ids = latent_image_ids(h, w, latents.device).clone()
            image_ids[..., 0] = 1
            ids.append(image_ids)
        return {**kwargs, "hidden_states": torch.cat(hidden, dim=1), "img_ids": torch.cat(ids, dim=0)}

    def reference_kwargs(self, spec: ModelSpec, images: list[Any], size: tuple[int, int],
                         area: int | None = None) -> dict[str, Any]:
        """The image as given: no snapping to Kontext's preferred resolutions (_auto_resize), since
        training encoded it at reference_size; max_area the size's, since FluxKontextPipeline scales
        its output to max_area (1024 x 1024 by default) whatever height and width say."""
        if not self.max_references(spec):
            raise self._no_references(spec)
        return {"image": images[0], "_auto_resize": False, "max_area": size[0] * size[1]}

    def comfyui_adapter_name(self, module: str) -> str:
        """"transformer." + the diffusers module path: ComfyUI maps Flux's diffusers names onto its own
        (comfy/utils.py flux_to_diffusers), q, k and v onto their rows of the fused qkv. Its Chroma and
        Flux2 models subclass its Flux (comfy/model_base.py), so Chroma's names map the same way."""
        return f"transformer.{module}"

    def comfyui_lora(self, model: Any, pairs: dict[str, tuple[Any, Any]], alpha: float) -> dict[str, Any]:
        """Kohya's Black Forest Labs names (bfl_lora), FLUX.1's modules outside the blocks included."""
        return bfl_lora(model, pairs, alpha, flux_top_module, "Flux")

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """CLIP-L gives only its pooled output (pooled_projection_dim wide); T5 gives the sequence
        (joint_attention_dim wide)."""
        from transformers import CLIPTextModel, T5EncoderModel

        from zerotrain.models import tiny_parts as tiny

        clip, t5 = tiny.clip_tokenizer(tiny.CLIP_EOS), tiny.t5_tokenizer()
        width = denoiser["pooled_projection_dim"]
        return tiny.diffusers_class("FluxPipeline"), {
            "scheduler": tiny.diffusers_class("FlowMatchEulerDiscreteScheduler").from_config(FLUX_SCHEDULER),
            "text_encoder": tiny.seeded("text_encoder", CLIPTextModel, tiny.clip_config(clip, width, width)),
            "tokenizer": clip,
            "text_encoder_2": tiny.seeded("text_encoder_2", T5EncoderModel,
                                          tiny.t5_config(t5, denoiser["joint_attention_dim"])),
            "tokenizer_2": t5,
            "transformer": tiny.seeded("transformer", tiny.diffusers_class(denoiser["_class_name"]).from_config,
                                       denoiser),
        }


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


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """(shift, scale) output rows as (scale, shift): diffusers' AdaLayerNormContinuous (norm_out) and
    Black Forest Labs' final adaLN_modulation order them oppositely (swap_scale_shift in diffusers'
    converters)."""
    import torch

    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def fuse_lora(
    modules: dict[str, Any], pairs: dict[str, tuple[Any, Any]], parts: tuple[str, ...], what: str
) -> tuple[Any, Any, int]:
    """One LoRA (A, B, the rank of each part) for a fused layer (`what`, for errors) made of the diffusers
    modules `parts` (in output order; `modules` maps names to modules), from those of them in `pairs`:
    their A matrices stacked (rank the sum of theirs) and their B matrices placed block-diagonally at
    their output rows, zero rows for parts without a LoRA. Exact: B @ A is the parts' B_i @ A_i stacked."""
    import torch

    present = [part for part in parts if part in pairs]
    ranks = [pairs[part][0].shape[0] for part in present]
    if any(r != ranks[0] for r in ranks):
        raise ZerotrainError(f"LoRA parts of {what} have different ranks {ranks}; cannot fuse them")
    rows = [_out_features(modules[part]) for part in parts]
    down = torch.cat([pairs[part][0] for part in present], dim=0)
    up = pairs[present[0]][1].new_zeros((sum(rows), sum(ranks)))
    row, column = 0, 0
    for part, height in zip(parts, rows, strict=True):
        if part in pairs:
            up[row:row + height, column:column + ranks[0]] = pairs[part][1]
            column += ranks[0]
        row += height
    return down, up, ranks[0]


def _out_features(module: Any) -> int:
    base = getattr(module, "base_layer", module)
    return int(base.weight.shape[0])


FAMILY = Flux()
