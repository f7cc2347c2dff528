"""The checks every family shares, run over one table of families (FAMILIES, one row each; pytest's ids are
the family names, or the catalog names for the per-model check): the catalog's parameter counts and a
published config against the class defaults; planning the published model with the shipped facts and a
bare config.json; the cached text against the pipeline's encode_prompt and the cached latents against its
VAE; the shift and one scheduler step on the target; the planner's inputs through the model; backprop into
every parameter (but those a row names idle); validation against the pipeline's own render; the ComfyUI LoRA
and model exports.

What is special to a family stays in tests/unit/test_family_<name>.py. Adding a family to these checks is a
row; a field left None leaves that family out of the check that needs it (a comment in the row says why
where the check cannot apply, or where its own file checks it otherwise). Each tiny model is built once per
session (tiny_family.tiny_root) and loaded once per row."""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from peft import LoraConfig, get_peft_model_state_dict

from tests.unit.test_sampling import check_image, make_validator
from tests.unit.tiny_family import (
    bare_config,
    gen,
    plan_json,
    spec_of,
    tiny_encoders,
    tiny_pipeline,
    tiny_root,
)
from zerotrain.config import RunConfig
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.export import comfyui_lora_state_dict
from zerotrain.families import example_inputs, of
from zerotrain.models.conditioning import encode_latent_moments, encode_prompts
from zerotrain.objectives import flow_interpolate, flow_target, make_objective
from zerotrain.planner.measure import measure_model

CAPTIONS = ("a red chair", "An oil painting of Mountains at sunset, warm light on the lake!")


@dataclass(frozen=True)
class Family:
    """One family's row: what the shared checks need to know of it."""

    name: str  # the family (spec.family), the tests' id
    denoiser: str  # its denoiser's diffusers class (spec.class_name)
    parameters: dict[str, int]  # catalog name: sum(p.numel()) built on meta (diffusers 0.42.1)
    spec: dict[str, dict[str, Any]]  # catalog name: ModelSpec fields (and the family's pixel_factor) it resolves to
    defaults: tuple[str, ...] = ()  # catalog names whose published config is the class's defaults
    omitted: bool = False  # the published config leaves some class fields out (at their defaults)
    differ: frozenset[str] = frozenset()  # published fields that are not the class default
    # `zerotrain plan` of the published model at 1024 px: name, gpus, mode; the shipped facts' tokens; a check of them.
    plan: tuple[str, str, str] | None = None
    plan_tokens: tuple[int, int | None] = (4096, 512)
    plan_check: Callable[[Any], None] | None = None
    # A bare config.json of a catalog model's config: name, resolution, LoRA (rank 4) or not; the Linears the
    # family's default targets adapt, the image tokens, and LoRA's trainable count where written out.
    bare: tuple[str, int, bool] | None = None
    bare_lora_modules: int | None = None
    bare_image_tokens: int | None = None
    bare_trainable: int | None = None
    bare_check: Callable[[Any], None] | None = None
    # The tiny model: its catalog name, pipeline class, a side in px and the captions' text tokens.
    tiny: str | None = None
    pipeline: str | None = None
    side: int = 64
    captions: tuple[str, ...] = CAPTIONS
    text_tokens: int = 40
    latent_std: float = 0.0  # the cached batch's latent_std
    # The cache: each caption's rows as the pipeline encodes them, without its padding (None: not checked here),
    # their shape after the batch and text dimensions, and assert_close's tolerances for them (None: exactly equal).
    text_rows: Callable[[Any, list[str], int], list[torch.Tensor]] | None = None
    # Or, for a family whose cache is the pipeline's padded tensors (with a pooled vector or a mask): what its
    # encode_prompt gives for the captions, under the cache's keys.
    text_encoded: Callable[[Any, list[str], int], dict[str, torch.Tensor]] | None = None
    text_shape: tuple[int, ...] = ()
    text_tolerance: dict[str, float] | None = None
    # The cached latents' mean and std as the pipeline's VAE gives them for pixels (std None: not checked).
    latents: Callable[[Any, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]] | None = None
    # The objective: the shift at token counts (exactly, or approximately); the pipeline's scheduler set to a few
    # steps, the sign it steps with (output = sign * (noise - x0)), the layout of latents as the model's output,
    # and the model time of a scheduler timestep under its key (exactly or within float tolerance).
    shifts: dict[int, float] = field(default_factory=dict)
    shift_exact: bool = False
    scheduler: Callable[[], Any] | None = None
    sign: int = 1
    layout: Callable[[torch.Tensor], torch.Tensor] | None = None
    time: tuple[str, Callable[[torch.Tensor], torch.Tensor]] | None = None
    time_exact: bool = False
    planner_out: tuple[int, ...] | None = None  # the model's output shape for example_inputs(spec, 2, side, side, 12)
    backprop: bool = False  # prepare() backpropagates into every parameter (else its own file checks what does)
    idle: tuple[str, ...] = ()  # but exactly those whose names hold one of these, which the forward leaves unused
    # Validation: guidance, classifier-free or not, the PNG's text, the pipeline's extra call arguments, the
    # negative embeddings' keys, and the largest pixel difference from the pipeline's own render.
    guidance: float | None = None
    cfg: bool = False
    png_text: dict[str, str] = field(default_factory=dict)
    pipeline_call: dict[str, Any] = field(default_factory=dict)
    negative_keys: frozenset[str] | None = None
    render_tolerance: int = 1
    # The ComfyUI LoRA (checked when lora): targets beyond the family's, names it must hold, a check of the file,
    # and whether a fresh pipeline loads it (a loader: folder -> pipeline).
    lora: bool = False
    lora_extra: tuple[str, ...] = ()
    lora_keys: frozenset[str] | None = None
    lora_check: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None] | None = None
    lora_loader: Callable[[Path], Any] | None = None
    # A file in kohya's names (this prefix, the diffusers path with "_"), which diffusers' lora_state_dict does
    # not give back in peft's layout: checked by those names and their products instead.
    lora_kohya: str | None = None
    lora_read: bool = True  # diffusers' lora_state_dict reads the file (False: lora_check checks it alone)
    # The ComfyUI model: names it must hold, a check, and diffusers' reading of it back
    # (comfy, weights, folder, tmp_path) -> state dict.
    model_keys: frozenset[str] | None = None
    model_check: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor]], None] | None = None
    read_back: Callable[[dict[str, torch.Tensor], dict[str, torch.Tensor], Path, Path], dict[str, torch.Tensor]] | None = None
    # zerotrain's own ComfyUI model (with its markers) reads back exactly as model.denoiser (models.fine_tune).
    single_file: bool = True


# --- the rows' hooks ------------------------------------------------------------------------------------


def _exp_mu(base_seq: int, max_seq: int, base_shift: float, max_shift: float, module: str) -> Callable[[int], float]:
    def shift(tokens: int) -> float:
        calculate_shift = __import__(module, fromlist=["calculate_shift"]).calculate_shift
        return math.exp(calculate_shift(tokens, base_seq, max_seq, base_shift, max_shift))
    return shift


def _flux2_mu(tokens: int) -> float:
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    from zerotrain.families.flux2 import PIPELINE_STEPS

    return compute_empirical_mu(tokens, PIPELINE_STEPS)  # the pipeline's mu at its default steps


def _krea2_scheduler():
    from zerotrain.families.krea2 import KREA2_SCHEDULER

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(KREA2_SCHEDULER)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4).tolist(), mu=0.8)
    return scheduler


def _ideogram4_scheduler():
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas

    from zerotrain.families.ideogram4 import IDEOGRAM4_SCHEDULER

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(IDEOGRAM4_SCHEDULER)
    scheduler.set_timesteps(sigmas=_logit_normal_sigmas(4, 0.3, std=1.5).tolist())
    return scheduler


def _qwen21_scheduler():
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    from zerotrain.families.qwen_image21 import QWEN21_SCHEDULER

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(QWEN21_SCHEDULER)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=calculate_shift(16, 256, 4096, 0.5, 1.15))
    return scheduler


def _z_image_scheduler():
    from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas

    from zerotrain.families.z_image import Z_IMAGE_SCHEDULER

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(Z_IMAGE_SCHEDULER)
    scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(6), mu=1.0)  # static shift: mu is ignored
    return scheduler


def _krea2_rows(pipeline, captions, text_tokens):
    embeds, mask = pipeline.encode_prompt(captions, max_sequence_length=text_tokens)
    # The pipeline's mask: the prompt, padding, then the 5 suffix tokens (a hole); the cache's a prefix.
    assert mask[0, -5:].all() and not mask[0, -6] and not mask.all()
    return [embeds[i][mask[i]] for i in range(len(captions))]


def _ideogram4_rows(pipeline, captions, text_tokens):
    features, _, _, indicator = pipeline.encode_prompt(captions, 1, 1, text_tokens, "cpu")
    text = indicator[:, :text_tokens] == 3  # the pipeline pads on the left
    assert not text[:, 0].any() and (text.sum(1) > 8).all()
    return [features[i, :text_tokens][text[i]] for i in range(len(captions))]


def _qwen21_rows(pipeline, captions, text_tokens):
    embeds, mask, image_pad = pipeline.encode_prompt(captions, device="cpu")
    assert not image_pad.any()
    return [embeds[i, :int(mask[i].sum())] for i in range(len(captions))]


def _z_image_rows(pipeline, captions, text_tokens):
    own, negative = pipeline.encode_prompt(list(captions), do_classifier_free_guidance=False,
                                           max_sequence_length=text_tokens)
    assert negative == [] and len({len(e) for e in own}) == len(captions), "the captions should differ in length"
    return own


def _qwen_image_rows(pipeline, captions, text_tokens):
    rows = []
    for caption in captions:  # each row is the caption encoded alone (mask None), then zeros
        with torch.no_grad():
            alone, no_mask = pipeline.encode_prompt([caption], device="cpu", max_sequence_length=text_tokens)
        assert no_mask is None
        rows.append(alone[0])
    return rows


def _flux_text(pipeline, captions, text_tokens):
    embeds, pooled, text_ids = pipeline.encode_prompt(captions, device="cpu", max_sequence_length=text_tokens)
    assert not text_ids.any()  # zeros: not cached
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def _chroma_text(pipeline, captions, text_tokens):
    embeds, _, mask, negative, _, _ = pipeline.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False,
                                                             max_sequence_length=text_tokens)
    # The transformer's mask: the tokenizer's tokens (with </s>) and one pad, a prefix; 0/1 is exact in bf16.
    lengths = torch.tensor(pipeline.tokenizer(captions, padding="max_length", max_length=text_tokens).attention_mask).sum(1) + 1
    assert negative is None and len(set(lengths.tolist())) == len(captions) and (lengths < text_tokens).all()
    assert torch.equal(mask, (torch.arange(text_tokens) < lengths[:, None]).float())
    return {"prompt_embeds": embeds, "prompt_attention_mask": mask}


def _flux2_text(pipeline, captions, text_tokens):
    embeds, text_ids = pipeline.encode_prompt(captions, device="cpu", max_sequence_length=text_tokens)
    assert text_ids.shape[:2] == embeds.shape[:2]  # positions, not cached
    return {"prompt_embeds": embeds}


def _sd3_text(pipeline, captions, text_tokens):
    embeds, _, pooled, _ = pipeline.encode_prompt(captions, None, None, device="cpu", do_classifier_free_guidance=False,
                                                  max_sequence_length=text_tokens - 77)
    # CLIP-L's 8 and CLIP-G's 16 wide, zero-padded to T5's 32 as SD3 pads 2048 to 4096.
    assert embeds.shape[-1] == 32 and not embeds[:, :77, 24:].any()
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def _sdxl_text(pipeline, captions, text_tokens):
    embeds, _, pooled, _ = pipeline.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False)
    return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}


def _qwen_image_scheduler():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    from zerotrain.families.qwen_image import QWEN_SCHEDULER

    # QwenImagePipeline's: the shifted grid then stretched so that its last sigma is shift_terminal.
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(QWEN_SCHEDULER)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=calculate_shift(16, 256, 8192, 0.5, 0.9))
    return scheduler


def _flux2_scheduler():
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    from zerotrain.families.flux2 import FLUX2_SCHEDULER

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(FLUX2_SCHEDULER)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=compute_empirical_mu(16 * 16, 4))
    return scheduler


def _flux3_scheduler():
    from zerotrain.families.runtime.flux3 import settings

    scheduler = settings()["scheduler"].create()  # the blocks' own (shift 6.93)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4))
    return scheduler


def _flux_scheduler():
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    from zerotrain.families.parts.flux1 import FLUX_SCHEDULER

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(FLUX_SCHEDULER)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 4, 4), mu=calculate_shift(16 * 16))
    return scheduler


def _sd3_scheduler():
    from zerotrain.families.sd3 import SD3_SCHEDULER

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(SD3_SCHEDULER)
    scheduler.set_timesteps(4)  # StableDiffusion3Pipeline's: the static shift 3 applied
    return scheduler


def _packed(latents: torch.Tensor, pipeline: str = "FluxPipeline") -> torch.Tensor:
    """Latents (B, C, h, w) as the pipeline's _pack_latents packs them: 2x2 patches as tokens."""
    b, c, h, w = latents.shape
    return getattr(diffusers, pipeline)._pack_latents(latents, b, c, h, w)


def _shift_scale_latents(pipeline, pixels):
    """shift_factor (None: 0) and scaling_factor: the pipeline decodes latents / scaling + shift."""
    with torch.no_grad():
        posterior = pipeline.vae.encode(pixels).latent_dist
    vae = pipeline.vae.config
    return (posterior.mode() - (vae.shift_factor or 0.0)) * vae.scaling_factor, posterior.std * vae.scaling_factor


def _flux2_latents(pipeline, pixels):
    """The patchified mode, normalized by the VAE's batch-norm statistics; std 0 (nothing drawn)."""
    mean = pipeline._encode_vae_image(pixels, generator=None)
    return mean, torch.zeros_like(mean)


def _qwen21_latents(pipeline, pixels):
    """The pipeline encodes an image as RGBA (opaque here) and keeps the posterior's mode, normalized."""
    rgba = torch.cat([pixels, torch.ones_like(pixels[:, :1])], dim=1)
    return pipeline._encode_vae_image(rgba.unsqueeze(2), None)[:, :, 0], None


def _qwen_vae_latents(pipeline, pixels):
    """Qwen-Image's video VAE on one frame: (z - latents_mean) / latents_std per channel (the training script's)."""
    posterior = pipeline.vae.encode(pixels.unsqueeze(2)).latent_dist
    config = pipeline.vae.config
    mean, std = (torch.tensor(values).view(1, -1, 1, 1) for values in (config.latents_mean, config.latents_std))
    return (posterior.mean[:, :, 0] - mean) / std, posterior.std[:, :, 0] / std


def _chroma_plan(facts):
    with torch.device("meta"):
        model = diffusers.ChromaTransformer2DModel.from_config(spec_of("chroma").config)
    approximator = sum(p.numel() for p in model.distilled_guidance_layer.parameters())
    assert facts.family == "chroma" and facts.block_params["distilled_guidance_layer"] == approximator == 278_285_312


def _qwen_image_plan(facts):
    # LoRA on the 4 image-attention projections (3072 -> 3072) of each of the 60 blocks.
    assert facts.trainable_params == 60 * 4 * facts.lora_rank * (3072 + 3072)


def _ideogram4_plan(facts):
    # One transformer and its adapters: the unconditional one is not loaded for training.
    assert facts.total_params < 1.1 * 9_279_288_448


def _flux3_plan(facts):
    # The per-mode blocks are checkpoint units; the reference blocks, idle without references, free nothing.
    assert [(unit.names[0], len(unit.names)) for unit in facts.checkpoint_units] == [
        ("txt_mode_blocks.0", 5), ("mode_blocks.image.0", 5), ("single_transformer_blocks.0", 28)]


def _qwen21_bare(facts):
    """The transformer builds its token layout from img_mask with nonzero and tolist: the planner's meta trace
    keeps img_mask on the host (trace.HostMetadataMode) and traces forward and backward at full size."""
    assert facts.no_checkpointing.saved_bytes > 8 * facts.checkpointing.saved_bytes > 0


def _krea2_lora(comfy, layers):
    assert not [k for k in comfy if "alpha" in k or "transformer_blocks" in k]


def _bfl_update(comfy, name):
    """A kohya file's update of the BFL layer `name` as ComfyUI applies it: up @ down * alpha / rank."""
    down, up = comfy[f"lora_unet_{name}.lora_down.weight"], comfy[f"lora_unet_{name}.lora_up.weight"]
    return up @ down * (comfy[f"lora_unet_{name}.alpha"] / down.shape[0])


def _peft_update(layers, module):
    return layers[f"{module}.lora_B.weight"] @ layers[f"{module}.lora_A.weight"] * (8.0 / 4)


def _flux_lora(comfy, layers):
    """Black Forest Labs' names in kohya's file, fused layers stacking their parts' updates (zero where a part
    is not adapted) as ComfyUI applies them. (diffusers' reader of these files assumes FLUX.1's 3072 width, so
    it cannot read the tiny model's.)"""
    double, single = "transformer_blocks.0", "single_transformer_blocks.0"
    torch.testing.assert_close(_bfl_update(comfy, "double_blocks_0_img_attn_qkv"),
                               torch.cat([_peft_update(layers, f"{double}.attn.to_{p}") for p in "qkv"]))
    torch.testing.assert_close(_bfl_update(comfy, "double_blocks_0_txt_attn_qkv"),
                               torch.cat([_peft_update(layers, f"{double}.attn.add_{p}_proj") for p in "qkv"]))
    torch.testing.assert_close(_bfl_update(comfy, "double_blocks_0_txt_mlp_2"), _peft_update(layers, f"{double}.ff_context.net.2"))
    linear1 = _bfl_update(comfy, "single_blocks_0_linear1")  # q, k, v, then proj_mlp (no target: zero)
    qkv = torch.cat([_peft_update(layers, f"{single}.attn.to_{p}") for p in "qkv"])
    torch.testing.assert_close(linear1[:len(qkv)], qkv)
    assert not linear1[len(qkv):].any() and linear1.shape[0] > len(qkv)


def _chroma_lora(comfy, layers):
    """FLUX.1's names for the blocks; the approximator's Linears under BFL's in_layer."""
    _flux_lora(comfy, layers)
    for i in range(2):
        torch.testing.assert_close(_bfl_update(comfy, f"distilled_guidance_layer_layers_{i}_in_layer"),
                                   _peft_update(layers, f"distilled_guidance_layer.layers.{i}.linear_1"))


def _flux2_lora(comfy, layers):
    assert not any(key.endswith(".alpha") for key in comfy)  # alpha baked into B
    assert comfy["diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight"].shape == (12, 32)
    assert comfy["diffusion_model.double_blocks.0.txt_attn.qkv.lora_B.weight"].shape == (96, 8)


def _ideogram4_lora(comfy, layers):
    assert comfy["diffusion_model.layers.0.attention.qkv.lora_down.weight"].shape[0] == 3 * 4


def _z_image_lora(comfy, layers):
    modules = {k.removesuffix(".lora_A.weight") for k in layers if k.endswith(".lora_A.weight")}
    assert {"noise_refiner.0.attention.to_q", "context_refiner.0.attention.to_out.0", "layers.1.attention.to_v"} <= modules
    assert set(comfy) == {f"diffusion_model.{m}.{s}" for m in modules for s in ("lora_down.weight", "lora_up.weight", "alpha")}
    assert all(comfy[f"diffusion_model.{m}.alpha"].item() == 8.0 for m in modules)


def _flux3_loader(folder):
    pipeline = diffusers.Flux3ModularPipeline.from_pretrained(folder)
    pipeline.load_components(names=["transformer"], pretrained_model_name_or_path=str(folder))
    return pipeline


def _diffusers_names(comfy, weights, folder, tmp_path):
    """ComfyUI reads this family's diffusers names as they are: the class loads the file strictly."""
    model = transformer(folder)
    model.load_state_dict(comfy, strict=True)
    return model.state_dict()


def _flux2_back(comfy, weights, folder, tmp_path):
    from diffusers.loaders.single_file_utils import convert_flux2_transformer_checkpoint_to_diffusers

    assert sum(t.numel() for t in comfy.values()) == sum(t.numel() for t in weights.values())
    return convert_flux2_transformer_checkpoint_to_diffusers(dict(comfy))


def _qwen21_loader(folder):
    from zerotrain.families.runtime.qwen_image21 import load_processor

    return diffusers.QwenImage21Pipeline.from_pretrained(folder, processor=load_processor(folder))


def _krea2_back(comfy, weights, folder, tmp_path):
    from diffusers.loaders.single_file_utils import convert_krea2_transformer_checkpoint_to_diffusers

    assert comfy["blocks.0.mod.lin"].ndim == 1  # the original stores the six modulation vectors flat
    back = convert_krea2_transformer_checkpoint_to_diffusers(dict(comfy))
    return {k: v.reshape(weights[k].shape) if k in weights else v for k, v in back.items()}


def _z_image_back(comfy, weights, folder, tmp_path):
    from diffusers.loaders.single_file_utils import convert_z_image_transformer_checkpoint_to_diffusers

    dim = weights["layers.0.attention.to_q.weight"].shape[1]
    for key in ("layers.0.attention.qkv.weight", "noise_refiner.0.attention.qkv.weight",
                "context_refiner.0.attention.qkv.weight"):
        assert comfy[key].shape == (3 * dim, dim)
    assert not [k for k in comfy if any(part in k for part in ("to_q", "to_out", "norm_k", "all_x_embedder"))]
    return convert_z_image_transformer_checkpoint_to_diffusers(dict(comfy))


def _single_file_back(cls: str):
    def back(comfy, weights, folder, tmp_path):
        from safetensors.torch import save_file

        assert len(comfy) <= len(weights)
        save_file({k: v.contiguous() for k, v in comfy.items()}, tmp_path / "comfy.safetensors")
        loaded = getattr(diffusers, cls).from_single_file(str(tmp_path / "comfy.safetensors"), config=str(folder),
                                                          subfolder="transformer", torch_dtype=torch.float32)
        return loaded.state_dict()
    return back


def _flux3_model(comfy, weights):
    assert len(comfy) == len(weights)
    inner = weights["norm_out.linear.weight"].shape[0] // 2
    assert math.isclose(float(comfy["final_layer.image.adaLN_modulation.1.weight"][0, 0]),
                        float(weights["norm_out.linear.weight"][inner, 0]))  # (shift, scale) in BFL's


def _qwen21_model(comfy, weights):
    assert not any("gate_layer" in key or "img_mlp.proj" in key for key in comfy)


def _tokens(grid: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, h, w) as tokens (B, h * w, C), rows first: QwenImage21Pipeline._pack_latents."""
    return grid.flatten(2).transpose(1, 2)


def _target_layout(family: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def layout(latents: torch.Tensor) -> torch.Tensor:
        return of(spec_of(f"tiny-{family.replace('_', '-')}")).target_layout(latents)
    return layout


# --- the table ----------------------------------------------------------------------------------------------

FLUX1_VAE = {"vae_scale_factor": 8, "latent_channels": 16, "vae_scaling_factor": 0.3611, "vae_shift_factor": 0.1159}

FAMILIES = [
    Family(
        "chroma", "ChromaTransformer2DModel",
        # chroma is the class's defaults, as Chroma1-HD publishes them.
        parameters={"chroma": 8_899_983_424, "tiny-chroma": 45_808},
        spec={"chroma": FLUX1_VAE, "tiny-chroma": {}},
        defaults=("chroma",),
        plan=("chroma", "8xH100-80GB", "full"), plan_check=_chroma_plan,
        bare=("tiny-chroma", 64, True), bare_lora_modules=12 + 3,  # every Linear of the double block; q, k, v of the single
        bare_image_tokens=(64 // 16) ** 2,  # no vae/config.json: FLUX.1's 8x VAE, 2x2 packing
        tiny="tiny-chroma", pipeline="ChromaPipeline", latents=_shift_scale_latents,
        text_encoded=_chroma_text,  # T5's padded sequence and its mask, no pooled vector
        shifts={n: _exp_mu(256, 4096, 0.5, 1.15, "diffusers.pipelines.chroma.pipeline_chroma")(n) for n in (16, 256, 4096)},
        # FLUX.1's scheduler, packing and timestep = t / 1000; the output stepped as it is.
        scheduler=_flux_scheduler, layout=_packed, time=("timestep", lambda t: t / 1000),
        planner_out=(2, 16 * 16, 16), backprop=True,  # the approximator (distilled_guidance_layer) included
        # No guidance: validation masks the text with bools, the pipeline's float mask hides nothing
        # (diffusers#12116), so their renders differ; test_family_chroma.py checks validation's.
        lora=True, lora_extra=("linear_1",), lora_read=False, lora_check=_chroma_lora,
        # No read_back: diffusers' converter assumes the published 3072 width; test_family_chroma.py reads back
        # the full-size layout. So the tiny file cannot be read as model.denoiser either (from_single_file).
        single_file=False,
    ),
    Family(
        "flux", "FluxTransformer2DModel",
        # flux-dev and schnell match the published 11.9B; schnell is dev without the guidance embedder
        # (256 * 3072 + 3072 + 3072 * 3072 + 3072); Kontext [dev] is dev's architecture.
        parameters={"flux-dev": 11_901_408_320, "flux-schnell": 11_891_178_560, "flux-kontext-dev": 11_901_408_320,
                    "tiny-flux": 78_544, "tiny-flux-kontext": 78_544},
        spec={"flux-dev": FLUX1_VAE, "flux-schnell": FLUX1_VAE, "flux-kontext-dev": FLUX1_VAE,
              "tiny-flux": {"vae_scale_factor": 2, "latent_channels": 4, "pixel_factor": 4}},
        defaults=("flux-schnell",), omitted=True,
        plan=("flux-dev", "8xH100-80GB", "full"),  # (1024 / 16)^2 tokens, FluxPipeline's 512 T5 tokens
        # Every Linear of the double block; q, k, v of the single (its attention has no to_out).
        bare=("tiny-flux", 64, True), bare_lora_modules=12 + 3,
        bare_image_tokens=(64 // 16) ** 2,  # no vae/config.json: FLUX.1's 8x VAE, 2x2 packing
        tiny="tiny-flux", pipeline="FluxPipeline", text_tokens=24, text_encoded=_flux_text,
        latents=_shift_scale_latents,
        shifts={n: _exp_mu(256, 4096, 0.5, 1.15, "diffusers.pipelines.flux.pipeline_flux")(n) for n in (16, 256, 4096)},
        # FluxPipeline steps with the output as it is and passes timestep = t / 1000 (the transformer scales it back).
        scheduler=_flux_scheduler, layout=_packed, time=("timestep", lambda t: t / 1000),
        planner_out=(2, 16 * 16, 16), backprop=True,
        # Distilled guidance 3.5: one prediction a step, no negative prompt.
        guidance=3.5, cfg=False, png_text={"guidance_scale": "3.5"}, negative_keys=frozenset(),
        lora=True, lora_read=False, lora_check=_flux_lora,
        model_keys=frozenset({"x_embedder.weight", "transformer_blocks.0.attn.to_q.weight",
                              "single_transformer_blocks.0.proj_mlp.weight"}),
        read_back=_diffusers_names,
    ),
    Family(
        "flux2", "Flux2Transformer2DModel",
        parameters={"flux2-dev": 32_223_281_152, "flux2-klein-4b": 3_875_544_576, "flux2-klein-9b": 9_078_581_248,
                    "tiny-flux2": 104_128, "tiny-flux2-klein": 102_080},
        # 8x (2x tiny) VAE times the 2x2 patchify.
        spec={**{name: {"vae_scale_factor": 16, "vae_scaling_factor": None, "vae_shift_factor": None, "pixel_factor": 16}
                 for name in ("flux2-dev", "flux2-klein-4b", "flux2-klein-9b")},
              **{name: {"vae_scale_factor": 4, "vae_scaling_factor": None, "vae_shift_factor": None, "pixel_factor": 4}
                 for name in ("tiny-flux2", "tiny-flux2-klein")}},
        defaults=("flux2-dev",), omitted=True,
        plan=("flux2-dev", "8xH100-80GB", "full"), plan_tokens=(64 * 64, None),  # 1024 px / 16 px per token
        bare=("tiny-flux2-klein", 256, False),
        # [dev]'s tiny model (test_family_flux2.py checks [klein]'s): Mistral's template takes ~40 tokens.
        tiny="tiny-flux2", pipeline="Flux2Pipeline", text_tokens=64, text_encoded=_flux2_text, latents=_flux2_latents,
        shifts={n: math.exp(_flux2_mu(n)) for n in (256, 1024, 4096, 16384)},
        # Flux2Pipeline passes timestep = t / 1000 and steps with the output as it is, in its token order.
        scheduler=_flux2_scheduler, layout=lambda latents: diffusers.Flux2Pipeline._pack_latents(latents),
        time=("timestep", lambda t: t / 1000),
        planner_out=(2, 16 * 16, 16), backprop=True,
        # Embedded guidance 4: one prediction a step, no negative prompt.
        guidance=4.0, cfg=False, png_text={"guidance_scale": "4.0"}, negative_keys=frozenset(),
        # The double blocks' text q and v (k left out: zero rows in the fused qkv), feed-forwards and embedders.
        lora=True, lora_extra=("add_q_proj", "add_v_proj", "ff.linear_in", "ff_context.linear_out", "x_embedder",
                               "double_stream_modulation_img.linear"),
        lora_keys=frozenset({"diffusion_model.single_blocks.1.linear1.lora_A.weight",
                             "diffusion_model.single_blocks.1.linear2.lora_B.weight", "diffusion_model.img_in.lora_A.weight",
                             "diffusion_model.double_stream_modulation_img.lin.lora_B.weight"}),
        lora_check=_flux2_lora, lora_loader=diffusers.Flux2Pipeline.from_pretrained,
        # What ComfyUI detects FLUX.2 by (double_stream_modulation_img), BFL's fused layers.
        model_keys=frozenset({"double_stream_modulation_img.lin.weight", "guidance_in.in_layer.weight",
                              "double_blocks.1.img_attn.qkv.weight", "double_blocks.0.txt_attn.norm.key_norm.scale",
                              "single_blocks.1.linear1.weight", "single_blocks.0.norm.query_norm.scale",
                              "final_layer.adaLN_modulation.1.weight", "img_in.weight", "txt_in.weight"}),
        read_back=_flux2_back,
    ),
    Family(
        "flux3", "Flux3Transformer2DModel",
        # [klein] is Base distilled into a flow map, which adds the target timestep's embedder (256 -> 3072 -> 3072).
        parameters={"flux3-klein-base": 5_538_458_368, "flux3-klein": 5_548_681_984, "tiny-flux3": 94_880},
        # 8x VAE and 2x2 patches; the tiny VAE is 2x.
        spec={"flux3-klein-base": {"vae_scale_factor": 16, "vae_scaling_factor": None, "pixel_factor": 16},
              "tiny-flux3": {"vae_scale_factor": 4, "vae_scaling_factor": None, "pixel_factor": 4}},
        defaults=("flux3-klein-base",),
        plan=("flux3-klein-base", "1xRTX4090-24GB", "lora"), plan_check=_flux3_plan,
        bare=("flux3-klein-base", 1024, True), bare_image_tokens=4096,
        # Per block q, k, v, out (3072 -> 3072), linear_in (3072 -> 18432), linear_out (9216 -> 3072); 5 blocks for
        # each of image, references and text, 28 joint blocks.
        bare_lora_modules=(3 * 5 + 28) * 6,
        bare_trainable=(3 * 5 + 28) * (4 * 4 * (3072 + 3072) + 4 * (3072 + 18432) + 4 * (9216 + 3072)),
        # The cache and validation are test_family_flux3.py's: each caption's rows keep one of the step's padded
        # rows (multiples of 80), the latents come with the references' steps, and the blocks render without
        # their prompt upsampler.
        tiny="tiny-flux3", pipeline="Flux3ModularPipeline", planner_out=(2, 16 * 16, 16),
        shifts={16 * 16: 6.93, 64 * 64: 6.93}, shift_exact=True,  # static, whatever the resolution
        # The blocks pass timestep = t / 1000 and step with the output as it is.
        scheduler=_flux3_scheduler, layout=_target_layout("flux3"), time=("timestep", lambda t: t / 1000),
        # Text to image leaves the reference pathway idle (an edit trains it: test_family_flux3.py).
        backprop=True, idle=(".image_cond",),
        lora=True, lora_keys=frozenset({"diffusion_model.content_mode_blocks.image.0.q_proj.lora_A.weight",
                             "diffusion_model.txt_mode_blocks.0.mlp_in.lora_B.weight",
                             "diffusion_model.single_blocks.1.attn_out.lora_A.weight"}),
        lora_loader=_flux3_loader,
        model_keys=frozenset({"emb_in.image.weight", "txt_in.weight", "time_in.in_layer.weight",
                              "content_mode_blocks.image_cond.0.q_proj.weight", "txt_mode_blocks.0.norm.query_norm.scale",
                              "single_blocks.1.mlp_out.weight", "early_stream_modulations.txt.lin.weight",
                              "final_layer.image.linear.weight", "final_layer.image.adaLN_modulation.1.weight"}),
        model_check=_flux3_model, read_back=_single_file_back("Flux3Transformer2DModel"),
    ),
    Family(
        "ideogram4", "Ideogram4Transformer2DModel",
        parameters={"ideogram-4": 9_279_288_448, "tiny-ideogram4": 36_368},  # one transformer
        # 8x VAE and 2x2 fold; the tiny VAE is 2x.
        spec={"ideogram-4": {"vae_scale_factor": 16, "vae_scaling_factor": None, "pixel_factor": 16},
              "tiny-ideogram4": {"vae_scale_factor": 4, "vae_scaling_factor": None, "pixel_factor": 4}},
        defaults=("ideogram-4",),
        plan=("ideogram-4", "1xRTX4090-24GB", "lora"), plan_check=_ideogram4_plan,
        bare=("ideogram-4", 1024, True), bare_image_tokens=4096,
        # Per block q, k, v, out (4608 -> 4608), w1 and w3 (4608 -> 12288), w2 (12288 -> 4608); 34 blocks.
        bare_lora_modules=34 * 7, bare_trainable=34 * (4 * 4 * (4608 + 4608) + 3 * 4 * (4608 + 12288)),
        # No latents or read_back here: the pipeline has no encoder path (test_family_ideogram4.py inverts its
        # decode) and diffusers no reader of the ComfyUI model (that file reads it back with the family's inverse).
        tiny="tiny-ideogram4", pipeline="Ideogram4Pipeline",
        text_rows=_ideogram4_rows, text_shape=(208,),
        # 0.5 ln(H W / 512^2): the tiny 4 px a token at 64 px, at 1024 px, and 256 px on the tiny model.
        shifts={16 * 16: math.exp(0.5 * math.log(64 * 64 / 512**2)), 64 * 64 * 16: math.exp(0.5 * math.log(1024**2 / 512**2)),
                64 * 64: 0.5},
        # Ideogram4Pipeline passes t = 1 - sigma and steps the scheduler with the negated output.
        scheduler=_ideogram4_scheduler, sign=-1, layout=_target_layout("ideogram4"),
        time=("timestep", lambda t: 1 - t / 1000),
        planner_out=(2, 16 * 16 + 12, 16), backprop=True,
        # Both transformers, guidance 7 at every step, from the cached rows (the pipeline pads to 2048 tokens).
        guidance=7.0, cfg=False, png_text={"guidance_scale": "7.0"}, pipeline_call={"guidance_schedule": None},
        lora=True, lora_extra=("layers.0.adaln_modulation", "layers.1.adaln_modulation"),
        lora_keys=frozenset({"diffusion_model.layers.0.attention.qkv.lora_down.weight",
                             "diffusion_model.layers.1.attention.o.alpha",
                             "diffusion_model.layers.1.feed_forward.w2.lora_up.weight",
                             "diffusion_model.layers.0.adaln_modulation.lora_down.weight"}),
        lora_check=_ideogram4_lora, lora_loader=diffusers.Ideogram4Pipeline.from_pretrained,
    ),
    Family(
        "krea2", "Krea2Transformer2DModel",
        parameters={"krea-2-raw": 12_820_073_036, "krea-2-turbo": 12_820_073_036, "tiny-krea2": 41_138},  # Turbo is Raw distilled
        spec={name: {"vae_scale_factor": 8, "latent_channels": 16, "vae_scaling_factor": None, "pixel_factor": 16}
              for name in ("krea-2-raw", "krea-2-turbo", "tiny-krea2")},
        defaults=("krea-2-raw", "krea-2-turbo"),
        plan=("krea-2-raw", "1xRTX4090-24GB", "lora"),  # (1024 / 16)^2; Krea2Pipeline's 512
        # Per block q, k, v, out, gate, up and down (7; not ff.gate), in the 2 image blocks and the text fusion's 2;
        # the fusion's projector, txt_in's two, img_in, final, time's two and time_mod_proj.
        bare=("tiny-krea2", 256, True), bare_lora_modules=2 * 7 + 2 * 7 + 1 + 2 + 1 + 1 + 2 + 1,
        tiny="tiny-krea2", pipeline="Krea2Pipeline", latent_std=0.5,
        text_rows=_krea2_rows, text_shape=(2, 16), latents=_qwen_vae_latents,
        shifts={n: _exp_mu(256, 6400, 0.5, 1.15, "diffusers.pipelines.krea2.pipeline_krea2")(n) for n in (16, 4096, 9216)},
        # Krea2Pipeline steps the scheduler with the output as it is (noise - x0), the timestep the scheduler's t / 1000.
        scheduler=_krea2_scheduler, layout=_target_layout("krea2"), time=("timestep", lambda t: t / 1000),
        planner_out=(2, 16, 64), backprop=True,
        # The default guidance 4.5 guides with the encoded "" as Krea2Pipeline does.
        guidance=4.5, cfg=True, png_text={"guidance_scale": "4.5", "negative_prompt": ""},
        lora=True, lora_keys=frozenset({"diffusion_model.blocks.0.attn.wq.lora_A.weight", "diffusion_model.blocks.1.mlp.down.lora_B.weight",
                             "diffusion_model.txtfusion.projector.lora_A.weight", "diffusion_model.first.lora_A.weight",
                             "diffusion_model.tproj.1.lora_B.weight", "diffusion_model.last.linear.lora_A.weight"}),
        lora_check=_krea2_lora, lora_loader=diffusers.Krea2Pipeline.from_pretrained,
        model_keys=frozenset({"blocks.0.attn.wq.weight", "blocks.0.mod.lin", "txtfusion.projector.weight", "first.weight",
                              "last.modulation.lin", "tmlp.0.weight"}),
        read_back=_krea2_back,
    ),
    Family(
        "qwen_image", "QwenImageTransformer2DModel",
        # The published config (the class defaults) has 60 blocks of 339,831,296 plus 40,523,328 outside them;
        # the tiny one 2 blocks of width 32.
        # The Qwen-Image-Edit models are its architecture (Edit-2511 adds zero_cond_t, no parameter).
        parameters={"qwen-image": 20_430_401_088, "tiny-qwen-image": 92_448, "qwen-image-edit": 20_430_401_088,
                    "qwen-image-edit-2509": 20_430_401_088, "qwen-image-edit-2511": 20_430_401_088,
                    "tiny-qwen-image-edit-2511": 92_448},
        spec={name: {"vae_scale_factor": 8, "latent_channels": 16, "vae_scaling_factor": None, "vae_shift_factor": None}
              for name in ("qwen-image", "tiny-qwen-image", "qwen-image-edit-2511")},
        defaults=("qwen-image", "qwen-image-edit", "qwen-image-edit-2509"), omitted=True,
        plan=("qwen-image", "8xH100-80GB", "lora"), plan_check=_qwen_image_plan,  # (1024 / 16)^2; the pipeline's 512
        bare=("tiny-qwen-image", 256, False),
        tiny="tiny-qwen-image", pipeline="QwenImagePipeline", text_tokens=32,
        captions=("a red chair", "an oil painting of mountains at sunset, warm light on the lake"),
        text_rows=_qwen_image_rows, text_shape=(32,), text_tolerance={"atol": 1e-5, "rtol": 1e-5},
        latents=_qwen_vae_latents,
        shifts={n: _exp_mu(256, 8192, 0.5, 0.9, "diffusers.pipelines.qwenimage.pipeline_qwenimage")(n)
                for n in (16, 1024, 4096, 6889)},  # tiny at 64 px; 512, 1024 and 1328 px
        # QwenImagePipeline packs as FLUX.1, passes timestep = t / 1000 and steps with the output as it is.
        scheduler=_qwen_image_scheduler, layout=lambda latents: _packed(latents, "QwenImagePipeline"),
        time=("timestep", lambda t: t / 1000),
        # The last block's text stream (its to_add_out and txt_mlp) feeds nothing: no gradient.
        planner_out=(2, 16, 64), backprop=True, idle=("transformer_blocks.1.attn.to_add_out.", "transformer_blocks.1.txt_mlp."),
        # True classifier-free guidance 4 (true_cfg_scale) with the encoded "" as negative prompt.
        guidance=4.0, cfg=True, png_text={"guidance_scale": "4.0", "negative_prompt": ""},
        pipeline_call={"true_cfg_scale": 4.0, "negative_prompt": ""},
        negative_keys=frozenset({"prompt_embeds", "prompt_embeds_mask"}),
        lora=True, lora_loader=diffusers.QwenImagePipeline.from_pretrained,
        # What ComfyUI's model detection recognises Qwen-Image by (txt_norm), under diffusers' names.
        model_keys=frozenset({"txt_norm.weight", "img_in.weight", "transformer_blocks.0.attn.to_q.weight"}),
        read_back=_diffusers_names,
    ),
    Family(
        "qwen_image21", "QwenImage21Transformer2DModel",
        parameters={"qwen-image-2.1": 7_115_124_736, "tiny-qwen-image21": 43_360},
        # 16 px a latent token, 32 px an image slot (2x2 tokens): the pipeline rounds sizes to 32.
        spec={name: {"vae_scale_factor": 16, "pixel_factor": 32, "image_tokens_1024": 4096}
              for name in ("qwen-image-2.1", "tiny-qwen-image21")},
        defaults=("qwen-image-2.1",),
        plan=("qwen-image-2.1", "1xRTX4090-24GB", "lora"),
        bare=("qwen-image-2.1", 1024, True), bare_image_tokens=4096, bare_check=_qwen21_bare,
        bare_lora_modules=32 * 4, bare_trainable=32 * 4 * 4 * (4096 + 4096),  # q, k, v, out per block
        tiny="tiny-qwen-image21", pipeline="QwenImage21Pipeline",
        captions=("a red chair", "An oil painting of mountains at sunset, warm light on the lake!"),
        text_rows=_qwen21_rows, text_shape=(32,), text_tolerance={}, latents=_qwen21_latents,
        shifts={n: _exp_mu(256, 4096, 0.5, 1.15, "diffusers.pipelines.qwenimage21.pipeline_qwenimage21")(n) for n in (16, 4096)},
        scheduler=_qwen21_scheduler, layout=_tokens,
        planner_out=(2, 12 + 4 * 4, 4), backprop=True,
        # No guidance here: the model renders RGBA; test_family_qwen_image21.py compares it with the pipeline's.
        # The ComfyUI LoRA of the attention (the fused MLP's is that file's).
        lora=True, lora_loader=_qwen21_loader,
        model_keys=frozenset({"transformer_blocks.0.img_mlp.gate_up.weight", "txt_in.text_norm.weight"}),
        model_check=_qwen21_model, read_back=_single_file_back("QwenImage21Transformer2DModel"),
    ),
    Family(
        "sd3", "SD3Transformer2DModel",
        # Without the fixed sin-cos pos_embed buffer the published "8.1B" / "2.5B" count:
        # 192 * 192 * 2432 = 89,653,248 (large) and 384 * 384 * 1536 = 226,492,416 (medium).
        parameters={"sd3.5-large": 8_056_627_520, "sd3.5-medium": 2_243_171_520, "tiny-sd3": 88_320},
        spec={name: {"vae_scale_factor": 8, "latent_channels": 16, "vae_scaling_factor": 1.5305,
                     "vae_shift_factor": 0.0609, "pixel_factor": 16} for name in ("sd3.5-large", "sd3.5-medium")},
        # No defaults: the class's are SD3 Medium's; SD 3.5 Large differs in 5 of its 12 fields.
        plan=("sd3.5-large", "8xH100-80GB", "lora"), plan_tokens=(64 * 64, 77 + 256),
        # The 8 targets of the first joint block; the last is context_pre_only (no to_add_out).
        bare=("tiny-sd3", 64, True), bare_lora_modules=8 + 7,
        tiny="tiny-sd3", pipeline="StableDiffusion3Pipeline", text_tokens=77 + 16, text_encoded=_sd3_text,
        latents=_shift_scale_latents,
        shifts={256: 3.0, 4096: 3.0}, shift_exact=True,
        # StableDiffusion3Pipeline passes the scheduler's timestep (sigma * 1000) and steps with the output as it is.
        scheduler=_sd3_scheduler, layout=lambda latents: latents, time=("timestep", lambda t: t),
        planner_out=(2, 16, 32, 32), backprop=True,
        guidance=7.0, cfg=True, png_text={"guidance_scale": "7.0", "negative_prompt": ""},
        negative_keys=frozenset({"prompt_embeds", "pooled_prompt_embeds"}),
        # OneTrainer's names, which ComfyUI maps (diffusers reads them not).
        lora=True, lora_kohya="lora_transformer_",
        model_keys=frozenset({"pos_embed.proj.weight", "context_embedder.weight", "transformer_blocks.0.attn.to_q.weight"}),
        read_back=_diffusers_names,
    ),
    Family(
        "unet", "UNet2DConditionModel",
        # sdxl-base and sd1.5 (plan only) match the published 2.57B and 859,520,964.
        parameters={"sdxl-base": 2_567_463_684, "sd1.5": 859_520_964, "tiny-sdxl": 1_012_324},
        # A UNet halves the latents once a down block after the first: 8x VAE times 2^2 (SDXL), 2^3 (SD1.5).
        spec={"sdxl-base": {"vae_scale_factor": 8, "latent_channels": 4, "vae_scaling_factor": 0.13025,
                            "vae_shift_factor": None, "pixel_factor": 32},
              "sd1.5": {"vae_scaling_factor": 0.18215, "pixel_factor": 64}},
        # No defaults: UNet2DConditionModel's are SD 1's. No shifts or scheduler step: SDXL is DDPM (epsilon).
        plan=("sdxl-base", "1xRTX4090-24GB", "lora"), plan_tokens=(128 * 128, 77),
        # q, k, v and out of self- and cross-attention in the tiny UNet's 4 transformer blocks.
        bare=("tiny-sdxl", 64, True), bare_lora_modules=4 * 2 * 4,
        tiny="tiny-sdxl", pipeline="StableDiffusionXLPipeline", text_tokens=77, text_encoded=_sdxl_text,
        latents=_shift_scale_latents,
        planner_out=(2, 4, 32, 32), backprop=True,
        # Classifier-free guidance 5 with zero negative embeddings (force_zeros_for_empty_prompt), as the pipeline.
        guidance=5.0, cfg=True, png_text={"guidance_scale": "5.0", "negative_prompt": ""},
        negative_keys=frozenset({"prompt_embeds", "pooled_prompt_embeds"}),
        lora=True, lora_kohya="lora_unet_", lora_loader=diffusers.StableDiffusionXLPipeline.from_pretrained,
        model_keys=frozenset({"conv_in.weight", "add_embedding.linear_1.weight",
                              "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.weight"}),
        read_back=_diffusers_names,
    ),
    Family(
        "z_image", "ZImageTransformer2DModel",
        # The published count is the class default's: axes_lens, the only published field that differs, sizes a
        # RoPE table, not parameters. Turbo is the same architecture.
        parameters={"z-image": 6_154_908_736, "z-image-turbo": 6_154_908_736, "tiny-z-image": 364_176},
        spec={"z-image": {**FLUX1_VAE, "pixel_factor": 16}, "z-image-turbo": {"latent_channels": 16},
              "tiny-z-image": {"latent_channels": 16}},
        defaults=("z-image", "z-image-turbo"), omitted=True, differ=frozenset({"axes_lens"}),
        plan=("z-image", "8xH100-80GB", "full"),  # (1024 / 16)^2; ZImagePipeline's 512
        bare=("tiny-z-image", 256, True), bare_lora_modules=4 * (2 + 1 + 1),  # layers, noise_refiner and context_refiner
        tiny="tiny-z-image", pipeline="ZImagePipeline", text_tokens=48, latent_std=0.5,
        captions=("a photo of a cat sitting on a red chair", "An oil painting of Mountains at sunset, unseen words!"),
        text_rows=_z_image_rows, text_shape=(16,), latents=_shift_scale_latents,
        shifts={256: 6.0, 4096: 6.0}, shift_exact=True,
        # The pipeline steps with -output, and passes timestep = (1000 - t) / 1000 for each scheduler timestep t.
        scheduler=_z_image_scheduler, sign=-1, layout=lambda latents: latents,
        time=("t", lambda t: (1000 - t) / 1000), time_exact=True,
        planner_out=(2, 16, 32, 32), backprop=True,  # x_pad_token at other sizes: test_family_z_image.py
        # The default guidance 5 runs classifier-free guidance with the encoded "" as ZImagePipeline does: pixel for pixel.
        guidance=5.0, cfg=True, png_text={"guidance_scale": "5.0", "negative_prompt": ""},
        negative_keys=frozenset({"prompt_embeds", "prompt_embeds_mask"}), render_tolerance=0,
        lora=True, lora_check=_z_image_lora,
        model_keys=frozenset({"x_embedder.weight", "final_layer.adaLN_modulation.1.weight", "layers.0.attention.out.weight",
                              "layers.0.attention.q_norm.weight", "cap_pad_token", "x_pad_token"}),
        read_back=_z_image_back,
    ),
]


def rows(*needed: str) -> list[Any]:
    """The rows that have every field in `needed`, as pytest params with the family's id."""
    return [pytest.param(row, id=row.name) for row in FAMILIES
            if all(getattr(row, name) not in (None, (), {}, False) for name in needed)]


# --- the tiny model of a row: built once per session, loaded once per row ------------------------------------


@pytest.fixture(scope="module")
def row(request) -> Family:
    return request.param


@pytest.fixture(scope="module")
def folder(row, tmp_path_factory) -> Path:
    from zerotrain.models.tiny import ensure_tiny_pipeline

    return ensure_tiny_pipeline(row.tiny, tiny_root(tmp_path_factory))


@pytest.fixture(scope="module")
def pipeline(row, folder):
    if row.name == "qwen_image21":  # its processor built without torchvision
        from zerotrain.families.runtime.qwen_image21 import load_processor

        return tiny_pipeline(folder, row.pipeline, processor=load_processor(folder))
    return tiny_pipeline(folder, row.pipeline)


@pytest.fixture(scope="module")
def encoders(folder):
    return tiny_encoders(folder)


def transformer(folder: Path) -> torch.nn.Module:
    """The tiny model's denoiser (a transformer, or SDXL's UNet), loaded anew."""
    spec = spec_of(folder)
    return spec.denoiser_class().from_pretrained(folder, subfolder=of(spec).denoiser_folder)


def objective_of(row: Family, folder: Path):
    return make_objective(spec_of(folder), of(spec_of(folder)).scheduler_config(folder), ObjectiveConfig(), row.side)


def cached_batch(row: Family, folder: Path, encoders) -> dict[str, torch.Tensor]:
    """The row's captions as CachedDataset's items collate, with random latents of the tiny model's grid."""
    spec = spec_of(folder)
    grid = row.side // spec.vae_scale_factor
    shape = (len(row.captions), spec.latent_channels, grid, grid)
    sizes = torch.tensor([[row.side, row.side]] * len(row.captions))  # (height, width): SDXL's time ids
    return {"latent_mean": torch.randn(shape, generator=gen(1)), "latent_std": torch.full(shape, row.latent_std),
            "original_size": sizes, "crop_top_left": torch.zeros_like(sizes), "target_size": sizes,
            **encode_prompts(encoders, list(row.captions), row.text_tokens)}


# --- catalog and planning -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("row", "name"), [pytest.param(row, name, id=name) for row in FAMILIES for name in row.parameters])
def test_catalog_entry_builds_on_meta_with_the_published_count(row, name):
    spec = spec_of(name)
    assert (spec.family, spec.class_name) == (row.name, row.denoiser)
    with torch.device("meta"):
        model = spec.denoiser_class().from_config(spec.config)
    assert sum(p.numel() for p in model.parameters()) == row.parameters[name]
    family = of(spec)
    methods = {"pixel_factor": family.pixel_factor, "image_tokens_1024": lambda s: family.image_tokens(s, 1024)}
    facts = row.spec.get(name, {})
    assert {key: methods[key](spec) if key in methods else getattr(spec, key) for key in facts} == facts


def test_every_catalog_model_and_family_has_a_row():
    from zerotrain.families import all_families
    from zerotrain.models.catalog import catalog_names

    counted = [name for row in FAMILIES for name in row.parameters]
    assert sorted(counted) == catalog_names(), "a catalog model without its count in a row, or in two rows"
    assert sorted(row.name for row in FAMILIES) == sorted(family.name for family in all_families())


@pytest.mark.parametrize("row", rows("defaults"))
def test_published_configs_are_the_class_defaults(row):
    cls = getattr(diffusers, row.denoiser)
    # The defaults as a config.json holds them (tuples become lists).
    defaults = {k: json.loads(json.dumps(p.default)) for k, p in inspect.signature(cls.__init__).parameters.items()
                if k not in ("self", "args", "kwargs")}
    for name in row.defaults:
        published = {k: v for k, v in spec_of(name).config.items() if not k.startswith("_")}
        assert published.keys() <= defaults.keys() and (row.omitted or published.keys() == defaults.keys())
        assert {k for k, v in published.items() if v != defaults[k]} == row.differ


@pytest.mark.parametrize("row", rows("plan"))
def test_plans_the_published_model_at_1024_with_the_shipped_facts(row, tmp_path, monkeypatch, capsys):
    name, gpus, mode = row.plan
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    plan = plan_json(capsys, name, "--resolution", "1024", "--gpus", gpus, "--mode", mode)
    assert plan["model"] == name and plan["chosen"]["fits"] is True
    run = RunConfig(model={"name_or_path": name}, training={"mode": mode}, data={"resolution": 1024})
    facts = measure_model(spec_of(name), run)
    assert facts.cached and facts.source == "shipped", "the plan's: shipped with zerotrain"
    image_tokens, text_tokens = row.plan_tokens
    assert facts.image_tokens == image_tokens and text_tokens in (None, facts.text_tokens)
    if mode == "full":
        assert facts.total_params == facts.trainable_params == row.parameters[name]
    else:  # the base and its adapters (for ideogram-4 one transformer: the unconditional one is not loaded to train)
        assert facts.total_params == row.parameters[name] + facts.trainable_params > row.parameters[name]
    if row.plan_check:
        row.plan_check(facts)


@pytest.mark.parametrize("row", rows("bare"))
def test_a_bare_config_json_plans_and_lora_counts_the_default_targets(row, tmp_path, monkeypatch, capsys):
    name, resolution, lora = row.bare
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = bare_config(tmp_path, spec_of(name).config)
    mode = ["--mode", "lora", "--lora-rank", "4"] if lora else []
    assert plan_json(capsys, path, "--resolution", str(resolution), "--gpus", "1xRTX4090-24GB", *mode)["chosen"]["fits"] is True
    if not lora:
        return
    spec = spec_of(path)
    run = RunConfig(model={"name_or_path": str(path)}, training={"mode": "lora", "lora": {"rank": 4}},
                    data={"resolution": resolution})
    facts = measure_model(spec, run)  # what the plan measured (not shipped facts), from the cache it wrote
    assert facts.source == "cached"
    with torch.device("meta"):
        model = spec.denoiser_class().from_config(spec.config)
    targets = of(spec).default_lora_targets(spec)
    adapted = [m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and any(n == t or n.endswith("." + t) for t in targets)]
    assert len(adapted) == row.bare_lora_modules
    assert facts.trainable_params == sum(4 * (m.in_features + m.out_features) for m in adapted)
    assert facts.total_params == row.parameters[name] + facts.trainable_params
    if row.bare_trainable is not None:
        assert facts.trainable_params == row.bare_trainable
    if row.bare_image_tokens is not None:
        assert facts.image_tokens == row.bare_image_tokens
    if row.bare_check:
        row.bare_check(facts)


# --- the cache -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", rows("text_rows"), indirect=True)
def test_cached_captions_are_the_pipelines_rows_without_the_padding(row, pipeline, encoders):
    captions, text_tokens = list(row.captions), row.text_tokens
    cached = encode_prompts(encoders, captions, text_tokens)
    assert list(cached) == ["prompt_embeds", "prompt_embeds_mask"]
    assert cached["prompt_embeds"].shape == (len(captions), text_tokens, *row.text_shape)
    assert cached["prompt_embeds_mask"].dtype == torch.int64
    with torch.no_grad():
        own = row.text_rows(pipeline, captions, text_tokens)
    for i, rows_i in enumerate(own):
        n = len(rows_i)
        assert 0 < n < text_tokens
        assert cached["prompt_embeds_mask"][i].tolist() == [1] * n + [0] * (text_tokens - n)
        if row.text_tolerance is None:
            assert torch.equal(cached["prompt_embeds"][i, :n], rows_i)
        else:
            torch.testing.assert_close(cached["prompt_embeds"][i, :n], rows_i, **row.text_tolerance)
        assert not cached["prompt_embeds"][i, n:].any()


@pytest.mark.parametrize("row", rows("text_encoded"), indirect=True)
def test_cached_captions_are_the_pipelines_encode_prompt(row, pipeline, encoders):
    captions = list(row.captions)
    cached = encode_prompts(encoders, captions, row.text_tokens)
    with torch.no_grad():
        own = row.text_encoded(pipeline, captions, row.text_tokens)
    assert list(cached) == list(own) and cached["prompt_embeds"].shape[:2] == (len(captions), row.text_tokens)
    for key, tensor in own.items():
        torch.testing.assert_close(cached[key], tensor, msg=key)
    assert not torch.equal(cached["prompt_embeds"][0], cached["prompt_embeds"][1])


@pytest.mark.parametrize("row", rows("latents"), indirect=True)
def test_cached_latents_are_the_vaes_normalized(row, pipeline, encoders):
    """A VAE with batch-norm statistics (FLUX.2's) gets ones that differ per channel for the check, restored
    after (both VAEs are shared)."""
    pixels = torch.rand(2, 3, row.side, row.side, generator=gen(4)) * 2 - 1
    vaes = [vae for vae in (encoders.vae, pipeline.vae) if hasattr(vae, "bn")]
    saved = [{k: v.clone() for k, v in vae.bn.state_dict().items()} for vae in vaes]
    try:
        with torch.no_grad():
            for vae in vaes:
                channels = vae.bn.running_mean.shape[0]
                vae.bn.running_mean.copy_(torch.linspace(-1, 1, channels))
                vae.bn.running_var.copy_(torch.linspace(0.5, 2, channels))
        moments = encode_latent_moments(encoders, pixels)
        with torch.no_grad():
            mean, std = row.latents(pipeline, pixels)
    finally:
        for vae, state in zip(vaes, saved, strict=True):
            vae.bn.load_state_dict(state)
    torch.testing.assert_close(moments.mean, mean)
    if std is not None:
        torch.testing.assert_close(moments.std, std)


# --- the objective --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", rows("shifts"), indirect=True)
def test_the_shift_is_the_pipelines(row, folder):
    objective = objective_of(row, folder)
    for tokens, shift in row.shifts.items():
        assert objective.shift(tokens) == (shift if row.shift_exact else pytest.approx(shift)), tokens


@pytest.mark.parametrize("row", rows("scheduler"), indirect=True)
def test_one_scheduler_step_on_the_target_lands_on_the_flow(row, folder, encoders):
    """With the output equal to flow_inputs' target (sign * (noise - x0) as the pipeline steps the scheduler with
    sign * output), each Euler step from x at sigma_i lands on x at sigma_(i+1): the target's sign, layout and the
    model time are the pipeline's."""
    objective = objective_of(row, folder)
    batch = cached_batch(row, folder, encoders)
    shape = batch["latent_mean"].shape
    x0, noise = torch.randn(shape, generator=gen(2)), torch.randn(shape, generator=gen(3))
    scheduler = row.scheduler()
    scheduler.set_begin_index(0)
    family = of(spec_of(folder))
    for i, timestep in enumerate(scheduler.timesteps):
        sigma = scheduler.sigmas[i].expand(shape[0])
        x_t = flow_interpolate(x0, noise, sigma)
        kwargs, target = family.flow_inputs(objective, x_t, flow_target(x0, noise), sigma, batch)
        if row.time:
            key, time = row.time
            if row.time_exact:
                assert torch.equal(kwargs[key], time(timestep.expand(shape[0])))
            else:
                torch.testing.assert_close(kwargs[key], time(timestep.expand(shape[0])))
        torch.testing.assert_close(target, row.layout(row.sign * (noise - x0)))
        stepped = scheduler.step(row.sign * target, timestep, row.layout(x_t), return_dict=False)[0]
        torch.testing.assert_close(stepped, row.layout(flow_interpolate(x0, noise, scheduler.sigmas[i + 1].expand(shape[0]))))


@pytest.mark.parametrize("row", rows("planner_out"), indirect=True)
def test_the_planners_inputs_run_the_model(row, folder):
    spec = spec_of(folder)
    with torch.no_grad():
        out = transformer(folder)(**example_inputs(spec, 2, row.side, row.side, 12, "cpu", torch.float32),
                                  return_dict=False)[0]
    assert of(spec).prediction(out).shape == row.planner_out  # (Z-Image's output is a list: stacked)


@pytest.mark.parametrize("row", rows("backprop"), indirect=True)
def test_prepare_backpropagates_into_every_parameter(row, folder, encoders):
    model = transformer(folder).train()
    objective = objective_of(row, folder)
    prepared = objective.prepare(cached_batch(row, folder, encoders), gen())
    loss = objective.loss(model(**prepared.model_kwargs, return_dict=False)[0], prepared)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    idle = {n for n, _ in model.named_parameters() if any(part in n for part in row.idle)}
    assert {n for n, p in model.named_parameters() if p.grad is None} == idle


# --- validation -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", rows("guidance"), indirect=True)
def test_validation_renders_what_the_pipeline_renders_from_the_prompt(row, folder, pipeline, tmp_path):
    prompt = row.captions[0]
    _, _, validator = make_validator(folder.parent, row.tiny, f"validation.prompts=['{prompt}']", "validation.seeds=[3]")
    assert validator.cfg is row.cfg and validator.guidance_scale == row.guidance
    if row.negative_keys is not None:
        assert set(validator.negative_embeds) == row.negative_keys
    path = validator.render(getattr(pipeline, of(spec_of(folder)).denoiser_folder), 0, tmp_path)[0]
    rendered = check_image(path, row.side, {"prompt": prompt, **row.png_text})
    direct = pipeline(prompt=prompt, height=row.side, width=row.side, num_inference_steps=2, guidance_scale=row.guidance,
                      generator=gen(3), **row.pipeline_call).images[0]
    assert np.abs(rendered - np.asarray(direct).astype(np.int16)).max() <= row.render_tolerance


# --- export ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("row", rows("lora"), indirect=True)
def test_comfyui_lora_is_the_same_adapter_diffusers_reads_back(row, folder):
    spec = spec_of(folder)
    rank, alpha = 4, 8.0
    model = transformer(folder)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=[*of(spec).default_lora_targets(spec), *row.lora_extra],
                                 init_lora_weights="gaussian"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            param.data.normal_(generator=gen(7))
    layers = get_peft_model_state_dict(model)
    comfy = comfyui_lora_state_dict(spec, model, layers, alpha)
    assert (row.lora_keys or frozenset()) <= comfy.keys()
    if row.lora_check:
        row.lora_check(comfy, layers)
    modules = {k.removesuffix(".lora_A.weight") for k in layers if k.endswith(".lora_A.weight")}
    expected = {m: layers[f"{m}.lora_B.weight"] @ layers[f"{m}.lora_A.weight"] * (alpha / rank) for m in modules}
    if row.lora_kohya:
        names = {m: row.lora_kohya + m.replace(".", "_") for m in modules}
        assert set(comfy) == {f"{names[m]}.{s}" for m in modules for s in ("lora_down.weight", "lora_up.weight", "alpha")}
        for module, name in names.items():
            got = comfy[f"{name}.lora_up.weight"] @ comfy[f"{name}.lora_down.weight"] * (comfy[f"{name}.alpha"] / rank)
            torch.testing.assert_close(got, expected[module], rtol=1e-5, atol=1e-6)
    elif row.lora_read:
        state = getattr(diffusers, row.pipeline).lora_state_dict(dict(comfy))  # diffusers' reader of the layout
        state = state[0] if isinstance(state, tuple) else state
        read = {k.removeprefix("transformer.").rsplit(".", 2)[0] for k in state}
        assert modules <= read  # and a part a fused layer's file holds, not adapted, reads back as no update
        for module in read:
            got = state[f"transformer.{module}.lora_B.weight"] @ state[f"transformer.{module}.lora_A.weight"]
            torch.testing.assert_close(got, expected.get(module, torch.zeros_like(got)), rtol=1e-5, atol=1e-6)
    if row.lora_loader:  # and the pipeline loads the file (a pipeline of its own: the adapter stays in its transformer)
        row.lora_loader(folder).load_lora_weights(dict(comfy))


@pytest.mark.parametrize("row", rows("tiny", "single_file"), indirect=True)
def test_the_comfyui_model_trains_again_as_model_denoiser_with_the_same_weights(row, folder, tmp_path):
    """The file `zerotrain export --comfyui` writes, given as model.denoiser over its base, becomes the folder
    training loads (models.fine_tune): every weight as exported, bit for bit, in its dtype; a file in diffusers'
    names and shapes is linked, not copied."""
    from safetensors.torch import load_file, save_file

    from zerotrain.models.fine_tune import WEIGHTS, write_single_file

    spec = spec_of(folder)
    weights = {k: (v + 0.01 * torch.randn(v.shape, generator=gen(3))).to(v.dtype)
               for k, v in transformer(folder).state_dict().items()}
    comfy = {**of(spec).comfyui_model(dict(weights)), **of(spec).comfyui_markers(spec)}
    file = tmp_path / "fine-tune.safetensors"
    save_file({k: v.contiguous() for k, v in comfy.items()}, file, metadata={"format": "pt"})
    denoiser = folder / of(spec).denoiser_folder
    how = write_single_file(spec, file, denoiser, tmp_path / "out", "model.denoiser")
    assert ((tmp_path / "out" / WEIGHTS).is_symlink()) == (how == "diffusers' names") == (comfy.keys() == weights.keys())
    back = load_file(tmp_path / "out" / WEIGHTS)
    assert back.keys() == weights.keys()
    assert [k for k in weights if back[k].dtype != weights[k].dtype or not torch.equal(back[k], weights[k])] == []
    loaded = spec.denoiser_class().from_pretrained(tmp_path / "out")
    assert all(torch.equal(loaded.state_dict()[k], weights[k]) for k in weights)


@pytest.mark.parametrize("row", rows("read_back"), indirect=True)
def test_comfyui_model_is_the_original_layout_and_converts_back_exactly(row, folder, tmp_path):
    weights = {k: v.clone() for k, v in transformer(folder).state_dict().items()}
    comfy = of(spec_of(folder)).comfyui_model(dict(weights))
    assert row.model_keys <= comfy.keys()
    if row.model_check:
        row.model_check(comfy, weights)
    back = row.read_back(comfy, weights, folder, tmp_path)
    assert back.keys() == weights.keys()
    assert not [k for k in weights if not torch.equal(back[k], weights[k])]
