"""What is special to Qwen-Image (zerotrain/families/qwen_image.py) against diffusers' own classes: the VAE facts
of a bare config.json, the Edit variants, the tiny model folder, the cache's padding and truncation against
QwenImagePipeline.encode_prompt, the terminal stretch being inference's alone, the model inputs (the text
trimmed and masked, no mask for captions of one length, the planner's layout), padding that changes nothing,
validation without guidance, the diffusers-format LoRA, and the Edit-2511 mark in the ComfyUI model. The
checks every family shares are test_families.py's."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import diffusers
import huggingface_hub.constants
import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
from diffusers.utils.torch_utils import randn_tensor
from peft import LoraConfig, get_peft_model_state_dict

from tests.unit.tiny_family import tiny_fixtures
from zerotrain.config import ModelConfig
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.errors import ZerotrainError
from zerotrain.families import example_inputs, of
from zerotrain.families.qwen_image import FAMILY, QWEN_SCHEDULER
from zerotrain.families.runtime.parts.latents import qwen_pack_latents as pack_latents
from zerotrain.models.catalog import check_trainable, is_plan_only, resolve_model
from zerotrain.models.conditioning import encode_prompts
from zerotrain.models.tiny import build_tiny_pipeline
from zerotrain.objectives import dynamic_shift, make_objective, sample_flow_timesteps, shift_sigmas
from zerotrain.protocols import ModelSpec

TINY = "tiny-qwen-image"
# The catalog's parameter counts are test_families.py's (FAMILIES).
CAPTIONS = ["a red chair", "an oil painting of mountains at sunset, warm light on the lake"]
TEXT_TOKENS = 32
# The tiny VAE downsamples 8x as the published one: 64 px are 8x8 latents, 4x4 image tokens.
SIDE = 64


def spec_of(name: str, **config: object) -> ModelSpec:
    """A resolved model, with denoiser config fields replaced (ModelSpec is frozen)."""
    spec = resolve_model(ModelConfig(name_or_path=name))
    return dataclasses.replace(spec, config={**spec.config, **config}) if config else spec


def files_digest(folder: Path) -> dict[str, str]:
    return {path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


root, folder, pipeline, encoders = tiny_fixtures(TINY, "QwenImagePipeline")


# --- 1. catalog ------------------------------------------------------------------------------------

def test_published_config_vae_facts(tmp_path):
    published = spec_of("qwen-image")  # the class defaults: test_families.py's
    # A bare config.json gets the published VAE's facts; a vae/config.json beside it its own.
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps(published.config))
    bare = spec_of(str(tmp_path / "transformer" / "config.json"))
    assert (bare.vae_scale_factor, bare.latent_channels, bare.vae_scaling_factor) == (8, 16, None)
    (tmp_path / "vae").mkdir()
    vae = AutoencoderKLQwenImage(base_dim=8, dim_mult=[1, 2, 4], temperal_downsample=[False, True])
    (tmp_path / "vae" / "config.json").write_text(json.dumps(dict(vae.config)))
    assert spec_of(str(tmp_path / "transformer" / "config.json")).vae_scale_factor == vae.spatial_compression_ratio == 4
    with torch.device("meta"):
        published_vae = AutoencoderKLQwenImage().config  # the class defaults: Qwen/Qwen-Image vae/config.json
    assert FAMILY.codec.vae_facts(dict(published_vae)) == FAMILY.published_vae(published.config)


def test_edit_variants_train_and_layered_plans_only():
    """Edit-2511's zero_cond_t trains (the Plus pipeline's); Qwen-Image-Layered's flags stay plan-only."""
    spec = spec_of("qwen-image", zero_cond_t=True)
    assert not is_plan_only(spec) and of(spec).pipeline_name(spec) == "QwenImageEditPlusPipeline"
    check_trainable(spec)
    layered = spec_of("qwen-image", use_additional_t_cond=True)
    assert is_plan_only(layered)
    with pytest.raises(ZerotrainError, match="plan-only: zerotrain plans image-conditioned Qwen-Image"):
        check_trainable(layered)


# --- 2. planning -----------------------------------------------------------------------------------

# --- 3. the tiny model -----------------------------------------------------------------------------


def test_tiny_folder_builds_and_loads_offline_and_generates(folder, pipeline, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    again = build_tiny_pipeline(TINY, tmp_path / "again")  # no download, and the same bytes every time
    assert files_digest(again) == files_digest(folder)
    loaded = diffusers.DiffusionPipeline.from_pretrained(again)
    assert type(loaded) is QwenImagePipeline
    assert {k: type(v).__name__ for k, v in loaded.components.items()} == {
        "vae": "AutoencoderKLQwenImage", "text_encoder": "Qwen2_5_VLForConditionalGeneration",
        "tokenizer": "Qwen2Tokenizer", "transformer": "QwenImageTransformer2DModel",
        "scheduler": "FlowMatchEulerDiscreteScheduler"}
    assert {k: loaded.scheduler.config[k] for k in QWEN_SCHEDULER} == QWEN_SCHEDULER
    # The template's system prefix is as many tokens as with Qwen's vocabulary: what encode_prompt drops.
    prefix = pipeline.prompt_template_encode.split("{}")[0]
    assert len(pipeline.tokenizer(prefix).input_ids) == pipeline.prompt_template_encode_start_idx == 34
    image = pipeline(CAPTIONS[0], num_inference_steps=2, height=SIDE, width=SIDE, output_type="pt",
                     generator=gen()).images
    assert image.shape == (1, 3, SIDE, SIDE) and torch.isfinite(image).all() and image.std() > 0


# --- 4. the cache ----------------------------------------------------------------------------------


def test_encode_prompts_is_encode_prompt_padded_with_its_mask(encoders, pipeline):
    got = encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)
    assert tuple(got) == FAMILY.text_outputs
    with torch.no_grad():
        embeds, mask = pipeline.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=TEXT_TOKENS)
    length = embeds.shape[1]
    assert length < TEXT_TOKENS and mask.dtype == got["prompt_embeds_mask"].dtype == torch.long
    assert got["prompt_embeds"].shape == (2, TEXT_TOKENS, 32)
    torch.testing.assert_close(got["prompt_embeds"][:, :length], embeds)
    assert not got["prompt_embeds"][:, length:].any() and not got["prompt_embeds_mask"][:, length:].any()
    assert torch.equal(got["prompt_embeds_mask"][:, :length], mask)
    # Each row the caption encoded alone (mask None), then zeros: test_families.py's.
    # Fewer tokens than a caption: truncated as the pipeline truncates (after encoding), mask all ones.
    short = encode_prompts(encoders, CAPTIONS, 6)
    with torch.no_grad():
        embeds, mask = pipeline.encode_prompt(CAPTIONS, device="cpu", max_sequence_length=6)
    torch.testing.assert_close(short["prompt_embeds"], embeds)
    assert mask is None and short["prompt_embeds_mask"].all()
    for bad in (0, 1025):
        with pytest.raises(ZerotrainError, match=f"text_tokens={bad}"):
            encode_prompts(encoders, CAPTIONS, bad)


# --- 5. the objective ------------------------------------------------------------------------------


def cached_batch(encoders, captions: list[str], std: float = 0.0, seed: int = 1) -> dict[str, torch.Tensor]:
    """A batch as CachedDataset's items collate: bf16 moments and the cached text."""
    text = encode_prompts(encoders, captions, TEXT_TOKENS)
    shape = (len(captions), 16, SIDE // 8, SIDE // 8)
    return {"latent_mean": torch.randn(shape, generator=gen(seed)).bfloat16(),
            "latent_std": torch.full(shape, std).bfloat16(),
            **{name: value.bfloat16() for name, value in text.items()}}


def test_the_terminal_stretch_is_inference_only():
    """Training's sigma is the shift alone (test_families.py's); QwenImagePipeline's 50-step grid is shifted the
    same, then stretched so that its last sigma is 0.02."""
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(QWEN_SCHEDULER)
    for seq_len in (16, 4096):
        mu = calculate_shift(seq_len, 256, 8192, 0.5, 0.9)
        grid = np.linspace(1.0, 1 / 50, 50)
        scheduler.set_timesteps(sigmas=grid, mu=mu)
        shifted = shift_sigmas(torch.from_numpy(grid).float(), dynamic_shift(QWEN_SCHEDULER, "qwen_image", seq_len))
        torch.testing.assert_close(scheduler.sigmas[:-1], scheduler.stretch_shift_to_terminal(shifted))
        assert scheduler.sigmas[-2].item() == pytest.approx(0.02) and scheduler.sigmas[0].item() == 1.0
    # Without shift settings, calculate_shift's defaults as QwenImagePipeline writes them.
    bare = {"use_dynamic_shifting": True}
    assert dynamic_shift(bare, "qwen_image", 1024) == pytest.approx(math.exp(calculate_shift(1024, 256, 4096, 0.5, 1.15)))


def test_prepare_noises_packs_and_conditions_as_the_pipeline(encoders):
    spec = spec_of(TINY)
    objective = make_objective(spec, QWEN_SCHEDULER, ObjectiveConfig(), SIDE)
    batch = cached_batch(encoders, CAPTIONS)
    prepared = objective.prepare(batch, gen(5))
    # Replay prepare's draws: the posterior (std 0: x0 is the mean), t, then the noise.
    g = gen(5)
    x0 = batch["latent_mean"].float()
    randn_tensor(x0.shape, generator=g)
    t = sample_flow_timesteps(ObjectiveConfig(), 2, g)
    noise = randn_tensor(x0.shape, generator=g, dtype=torch.float32)
    sigma = shift_sigmas(t, dynamic_shift(QWEN_SCHEDULER, "qwen_image", 16))
    kwargs = prepared.model_kwargs
    torch.testing.assert_close(kwargs["timestep"], sigma)  # the pipeline passes t / 1000 = sigma
    s = sigma.view(-1, 1, 1, 1)
    torch.testing.assert_close(kwargs["hidden_states"], pack_latents((1 - s) * x0 + s * noise))
    assert kwargs["img_shapes"] == [[(1, 4, 4)]] * 2 and "guidance" not in kwargs
    # Trimmed to the longer caption, masked where the shorter one is padded.
    lengths = batch["prompt_embeds_mask"].sum(dim=1).long()
    longest = int(lengths.max())
    assert kwargs["encoder_hidden_states"].shape == (2, longest, 32)
    assert torch.equal(kwargs["encoder_hidden_states_mask"].sum(dim=1), lengths)
    # Captions of one length need no mask (encode_prompt's None), so SDPA may use flash attention.
    same = objective.prepare(cached_batch(encoders, [CAPTIONS[0]] * 2), gen(5)).model_kwargs
    assert same["encoder_hidden_states_mask"] is None and same["encoder_hidden_states"].shape[1] == lengths[0]
    # The planner's example inputs are laid out as training's.
    example = example_inputs(spec, 2, SIDE, SIDE, int(lengths[0]), "cpu", torch.bfloat16)
    assert example["img_shapes"] == same["img_shapes"]
    assert {k: v.shape for k, v in example.items() if k != "img_shapes"} == \
        {k: v.shape for k, v in same.items() if k not in ("img_shapes", "encoder_hidden_states_mask")}


def test_the_shorter_caption_padded_and_masked_predicts_what_it_predicts_alone(encoders, pipeline):
    objective = make_objective(spec_of(TINY), QWEN_SCHEDULER, ObjectiveConfig(), SIDE)
    kwargs = objective.prepare(cached_batch(encoders, CAPTIONS, std=0.5), gen()).model_kwargs
    short = int(kwargs["encoder_hidden_states_mask"][0].sum())
    assert short < kwargs["encoder_hidden_states"].shape[1]
    with torch.no_grad():
        batched = pipeline.transformer(**{**kwargs, "hidden_states": kwargs["hidden_states"].float(),
                                          "encoder_hidden_states": kwargs["encoder_hidden_states"].float()},
                                       return_dict=False)[0]
        alone = pipeline.transformer(hidden_states=kwargs["hidden_states"][:1].float(),
                                     encoder_hidden_states=kwargs["encoder_hidden_states"][:1, :short].float(),
                                     timestep=kwargs["timestep"][:1], img_shapes=kwargs["img_shapes"][:1],
                                     return_dict=False)[0]
    torch.testing.assert_close(batched[:1], alone, atol=1e-5, rtol=1e-5)


# --- 6. validation ---------------------------------------------------------------------------------


def test_validation_without_guidance_passes_no_negative(encoders):
    """Guidance is true_cfg_scale (the render against the pipeline's is test_families.py's); at 1.0 no negative."""
    cached = encode_prompts(encoders, CAPTIONS[:1], TEXT_TOKENS)
    kwargs = FAMILY.validation_kwargs(cached, cached, FAMILY.default_guidance)
    assert kwargs["true_cfg_scale"] == 4.0 and "guidance_scale" not in kwargs and "negative_prompt_embeds" in kwargs
    no_cfg = FAMILY.validation_kwargs(cached, None, 1.0)
    assert "negative_prompt_embeds" not in no_cfg and no_cfg["true_cfg_scale"] == 1.0


# --- 8. export -------------------------------------------------------------------------------------


def test_the_diffusers_lora_file_loads_back_as_the_trained_model(folder, pipeline, tmp_path):
    """(The ComfyUI file is test_families.py's.)"""
    from zerotrain.export import lora_metadata

    spec = resolve_model(ModelConfig(name_or_path=str(folder)))
    rank, alpha = 4, 8.0
    model = QwenImageTransformer2DModel.from_pretrained(folder, subfolder="transformer").eval()
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(of(spec).default_lora_targets(spec))))
    torch.manual_seed(3)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    inputs = example_inputs(spec, 1, SIDE, SIDE, 8, "cpu", torch.float32)
    with torch.no_grad():
        trained = model(**inputs, return_dict=False)[0]
    layers = get_peft_model_state_dict(model)
    assert len(layers) == 2 * 4 * 2  # blocks x (to_q, to_k, to_v, to_out.0) x (A, B)
    QwenImagePipeline.save_lora_weights(tmp_path / "lora", transformer_lora_layers=layers,
                                        transformer_lora_adapter_metadata=lora_metadata(model.peft_config["default"]))
    pipeline.load_lora_weights(tmp_path / "lora", adapter_name="trained")
    try:
        with torch.no_grad():
            torch.testing.assert_close(pipeline.transformer(**inputs, return_dict=False)[0], trained, atol=1e-5, rtol=1e-5)
    finally:
        pipeline.unload_lora_weights()


def test_edit_2511_full_export_carries_comfyuis_2511_mark_and_2509_none(tmp_path):
    """ComfyUI (comfy/model_detection.py) reads a Qwen-Image file by txt_norm.weight, and switches to Edit-2511's
    reference method (t = 0 for the reference tokens, "index_timestep_zero") only when it also holds
    __index_timestep_zero__, the empty float32 buffer its model registers then. The rest loads with diffusers'
    names, which are ComfyUI's."""
    from safetensors.torch import load_file

    from zerotrain.export import COMFYUI_DIR, _write_full

    for zero_cond_t, name in ((True, "edit-2511"), (False, "edit-2509")):
        spec = spec_of("tiny-qwen-image-edit-2511", zero_cond_t=zero_cond_t)
        weights = {k: v.clone() for k, v in QwenImageTransformer2DModel.from_config(spec.config).state_dict().items()}
        _write_full(tmp_path / name, spec, weights, True, name)
        comfy = load_file(str(tmp_path / name / COMFYUI_DIR / f"{name}.safetensors"))
        assert "txt_norm.weight" in comfy
        if zero_cond_t:
            mark = comfy.pop("__index_timestep_zero__")
            assert mark.dtype == torch.float32 and tuple(mark.shape) == (0,)
        assert "__index_timestep_zero__" not in comfy
        model = QwenImageTransformer2DModel.from_config(spec.config)
        model.load_state_dict(comfy, strict=True)
