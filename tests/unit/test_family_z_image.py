"""What is special to Z-Image (zerotrain/families/z_image.py) against diffusers' own ZImagePipeline and
scheduler: the published configs and VAE facts, the block extrapolation and the RoPE table's bounds, the tiny
model, the captions as caption_list reads them back, the model time, each caption at its own length, the pad
token's gradient, the model dtype and classifier-free guidance at any scale above zero. The checks every family
shares are test_families.py's.

The tiny VAE downsamples 2x and the denoiser patches 2x2, so 64 px images are 32x32 latents and 256
image tokens (a multiple of 32: the image needs no pad token), and 6x6 latents 9 tokens (padded to 32)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from diffusers import (
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    ZImageTransformer2DModel,
)
from diffusers.pipelines.z_image.pipeline_z_image import get_default_z_image_sigmas
from PIL import Image

from tests.unit.test_sampling import make_validator
from tests.unit.tiny_family import gen, spec_of, tiny_fixtures
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.errors import ZerotrainError
from zerotrain.families import example_inputs
from zerotrain.families.runtime.parts.tiny import QWEN3_PROMPT
from zerotrain.families.runtime.z_image import caption_list, model_time, pad_captions
from zerotrain.families.z_image import FAMILY, Z_IMAGE_SCHEDULER, max_text_tokens
from zerotrain.models.conditioning import encode_prompts
from zerotrain.models.tiny import build_tiny_pipeline
from zerotrain.objectives import (
    make_objective,
    sample_flow_timesteps,
    shift_sigmas,
)
from zerotrain.planner import trace

# The catalog's parameter counts are test_families.py's (FAMILIES).
CAPTIONS = ["a photo of a cat sitting on a red chair", "An oil painting of Mountains at sunset, unseen words!"]
TEXT_TOKENS = 48
SIDE = 64


root, folder, pipeline, encoders = tiny_fixtures("tiny-z-image", "ZImagePipeline")


def cached_batch(encoders, side: int = SIDE // 2, std: float = 0.5) -> dict[str, torch.Tensor]:
    """A batch of the two captions as CachedDataset's items collate (text at its encoded dtype)."""
    shape = (len(CAPTIONS), 16, side, side)
    return {"latent_mean": torch.randn(shape, generator=gen(1)), "latent_std": torch.full(shape, std),
            **encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)}


def objective_of(folder, model_dtype: torch.dtype = torch.float32):
    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    return make_objective(spec_of(folder), scheduler, ObjectiveConfig(), SIDE, model_dtype=model_dtype)


# --- catalog and planning ----------------------------------------------------------------------------

def test_published_configs_differ_from_the_class_only_in_axes_lens(tmp_path):
    """That axes_lens alone differs from the class defaults is test_families.py's."""
    base, turbo = spec_of("z-image"), spec_of("z-image-turbo")
    assert base.config["axes_lens"] == [1536, 512, 512]
    assert {k: v for k, v in turbo.config.items() if k != "_diffusers_version"} == \
        {k: v for k, v in base.config.items() if k != "_diffusers_version"}
    assert (base.pretrained, turbo.pretrained) == ("Tongyi-MAI/Z-Image", "Tongyi-MAI/Z-Image-Turbo")
    path = tmp_path / "config.json"  # a bare config.json: the family's published (FLUX.1) VAE
    path.write_text(json.dumps(base.config))
    for spec in (base, spec_of(path)):  # the catalog entry's also in test_families.py
        assert (spec.vae_scale_factor, spec.latent_channels, spec.vae_scaling_factor, spec.vae_shift_factor) == \
            (8, 16, 0.3611, 0.1159)
    assert FAMILY.pixel_factor(base) == 16  # ZImagePipeline's height and width multiple

def test_block_extrapolation_equals_a_full_trace():
    """Only `layers` repeats (3+ blocks); the refiners are traced whole every time. The model's first
    forward builds its RoPE table and keeps it (RopeEmbedder caches freqs_cis: 51,200 bytes here, about
    0.4 MB for z-image), which that trace counts as saved; measure()'s first reduced trace does too, so
    the extrapolation takes (n_layers - 1) tables off: about 11 MB for z-image, far below its
    activations. Warmed up, the extrapolation is exact."""
    spec = dataclasses.replace(spec_of("tiny-z-image"), config={**spec_of("tiny-z-image").config, "n_layers": 4})
    model = trace.build_meta_model(spec)
    assert trace.repeated_block_groups(model) == {"layers": [[0, 1, 2, 3]]}
    inputs = example_inputs(spec, 1, SIDE, SIDE, 16, "meta", torch.bfloat16)
    first = trace.trace_activations(model, inputs, False, prediction=FAMILY.prediction)
    full = trace.trace_activations(model, inputs, False, prediction=FAMILY.prediction)
    extrapolated, _ = trace.trace_by_blocks(model, inputs, False, prediction=FAMILY.prediction)
    assert (extrapolated.saved_bytes, extrapolated.flops) == (full.saved_bytes, full.flops)
    assert first.saved_bytes - full.saved_bytes == 8 * (1536 * 4 + 64 * 2 + 64 * 2)  # complex64, axes_dims / 2


def test_caption_and_image_lengths_beyond_the_rope_table_are_one_line():
    spec = spec_of("z-image")
    assert max_text_tokens(spec.config) == 1504
    example_inputs(spec, 1, 1024, 1024, 1504, "meta", torch.bfloat16)
    with pytest.raises(ZerotrainError, match=r"^text_tokens=1505: must be 1\.\.1504 for z-image"):
        example_inputs(spec, 1, 1024, 1024, 1505, "meta", torch.bfloat16)
    with pytest.raises(ZerotrainError, match=r"^data.resolution: 8208x1024 px is more than the 512x512"):
        example_inputs(spec, 1, 8208, 1024, 512, "meta", torch.bfloat16)


def test_the_rope_bound_is_exactly_where_the_model_breaks():
    torch.manual_seed(0)
    config = {**spec_of("tiny-z-image").config, "axes_lens": [130, 8, 8]}
    model = ZImageTransformer2DModel.from_config(config).eval()
    most = max_text_tokens(config)
    assert most == 128
    x = [torch.randn(16, 1, 4, 4)]
    with torch.no_grad():
        model(x, torch.rand(1), [torch.randn(most, 16)])
        with pytest.raises(IndexError):
            model(x, torch.rand(1), [torch.randn(most + 1, 16)])


# --- the tiny model and the cached conditioning ------------------------------------------------------


def test_tiny_folder_is_a_z_image_pipeline_with_qwen3s_template(folder, pipeline):
    assert type(DiffusionPipeline.from_pretrained(folder)).__name__ == "ZImagePipeline"
    assert {k: type(v).__name__ for k, v in pipeline.components.items()} == {
        "scheduler": "FlowMatchEulerDiscreteScheduler", "vae": "AutoencoderKL", "text_encoder": "Qwen3Model",
        "tokenizer": "Qwen2Tokenizer", "transformer": "ZImageTransformer2DModel"}
    assert pipeline.text_encoder.config.hidden_size == pipeline.transformer.config.cap_feat_dim
    assert dict(pipeline.scheduler.config)["shift"] == 6.0 and not pipeline.scheduler.config.use_dynamic_shifting
    tokenizer = pipeline.tokenizer
    messages = [{"role": "user", "content": CAPTIONS[0]}]
    templated = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert templated == QWEN3_PROMPT.format(CAPTIONS[0])
    tokens = tokenizer.convert_ids_to_tokens(tokenizer(templated).input_ids)
    assert tokens[:3] == ["<|im_start|>", "user", "Ċ"] and tokens[-3:] == ["<|im_start|>", "assistant", "Ċ"]
    assert "<|endoftext|>" not in tokens  # Qwen's unk: every byte has a token
    image = pipeline(CAPTIONS[0], height=32, width=32, num_inference_steps=2, output_type="pt",
                     generator=gen()).images
    assert image.shape == (1, 3, 32, 32) and torch.isfinite(image).all()


def test_tiny_build_is_offline_deterministic_and_keeps_the_global_rng(folder, tmp_path, monkeypatch):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    state = torch.get_rng_state()
    again = build_tiny_pipeline("tiny-z-image", tmp_path / "again")
    assert torch.equal(torch.get_rng_state(), state)

    def digest(root: Path) -> dict[str, str]:
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*")) if p.is_file()}

    assert digest(again) == digest(folder)


def test_cached_captions_are_the_pipelines_own_as_caption_list_reads_them(pipeline, encoders):
    """The rows, their padding and mask against encode_prompt are test_families.py's."""
    cached = encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)
    own, _ = pipeline.encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False, max_sequence_length=TEXT_TOKENS)
    for mask in (cached["prompt_embeds_mask"], cached["prompt_embeds_mask"].bfloat16()):  # as the cache stores it
        restored = caption_list(cached["prompt_embeds"], mask, 2)
        assert all(torch.equal(a, b) for a, b in zip(restored, own, strict=True))


def test_caption_masks_must_mark_a_prefix():
    embeds = torch.zeros(2, 4, 3)
    with pytest.raises(ValueError, match="prefix"):
        caption_list(embeds, torch.tensor([[1, 0, 1, 0], [1, 1, 0, 0]]), 2)
    with pytest.raises(ValueError, match="prefix"):
        caption_list(embeds, torch.tensor([[0, 0, 0, 0], [1, 1, 0, 0]]), 2)
    with pytest.raises(ValueError, match=r"\(3, T, D\)"):
        caption_list(embeds, torch.ones(2, 4), 3)
    with pytest.raises(ValueError, match="1..2"):
        pad_captions([torch.zeros(3, 5)], 2)


# --- the objective -----------------------------------------------------------------------------------


def test_the_model_time_is_the_pipelines_in_the_schedulers_shift(folder, encoders):
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(Z_IMAGE_SCHEDULER)
    scheduler.set_timesteps(sigmas=get_default_z_image_sigmas(8), mu=1.0)  # static shift: mu is ignored
    # ZImagePipeline: timestep = (1000 - t) / 1000 for each scheduler timestep t.
    assert torch.equal(model_time(scheduler.sigmas[:-1], 1000), (1000 - scheduler.timesteps) / 1000)

    objective = objective_of(folder)  # its shift (6.0) is test_families.py's
    batch = cached_batch(encoders)
    g = gen(5)
    torch.randn(batch["latent_mean"].shape, generator=g)  # prepare's posterior draw comes first
    t = sample_flow_timesteps(ObjectiveConfig(), 2, g)
    prepared = objective.prepare(batch, gen(5))
    torch.testing.assert_close(prepared.model_kwargs["t"], 1 - shift_sigmas(t, 6.0))

def test_each_caption_reaches_the_denoiser_at_its_own_length(folder, pipeline, encoders):
    objective = objective_of(folder)
    prepared = objective.prepare(cached_batch(encoders), gen())
    kwargs = prepared.model_kwargs
    own, _ = pipeline.encode_prompt(list(CAPTIONS), do_classifier_free_guidance=False, max_sequence_length=TEXT_TOKENS)
    assert all(torch.equal(a, b) for a, b in zip(kwargs["cap_feats"], own, strict=True))
    assert [tuple(x.shape) for x in kwargs["x"]] == [(16, 1, SIDE // 2, SIDE // 2)] * 2
    with torch.no_grad():
        pred = FAMILY.prediction(pipeline.transformer(**kwargs, return_dict=False)[0])
        padded = [encode_prompts(encoders, CAPTIONS, TEXT_TOKENS)["prompt_embeds"][i] for i in range(2)]
        zero_padded = FAMILY.prediction(pipeline.transformer(kwargs["x"], kwargs["t"], padded, return_dict=False)[0])
    assert pred.shape == prepared.target.shape
    # The premise: zeros after a caption are tokens to the denoiser, so padding changes its output.
    assert not torch.allclose(pred, zero_padded, atol=1e-3)


def test_prepare_backpropagates_into_every_parameter_at_a_size_the_pad_token_fills(folder, encoders):
    """x_pad_token fills the image out to a multiple of 32 tokens; it is an input of the forward's
    torch.where whether or not any token needs it, so at 256 tokens (test_families.py's) it gets a zero
    gradient, never None, and at 9 tokens a real one: DeepSpeed (ZeRO 1-3) sees a gradient for every
    parameter at every size."""
    side = 6
    model = ZImageTransformer2DModel.from_pretrained(folder, subfolder="transformer")
    model.train()
    objective = objective_of(folder)
    prepared = objective.prepare(cached_batch(encoders, side=side), gen())
    loss = objective.loss(model(**prepared.model_kwargs, return_dict=False)[0], prepared)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing and all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.x_pad_token.grad.any()
    assert model.cap_pad_token.grad.any()


def test_model_inputs_take_the_model_dtype(folder, encoders):
    kwargs = objective_of(folder, torch.bfloat16).prepare(cached_batch(encoders), gen()).model_kwargs
    assert {x.dtype for x in kwargs["x"] + kwargs["cap_feats"]} == {torch.bfloat16}
    assert kwargs["t"].dtype == torch.float32 and kwargs["t"].shape == (2,)


# --- validation ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("guidance", "cfg"), [("0.0", False), ("0.5", True)])
def test_any_guidance_above_zero_is_classifier_free(root, pipeline, tmp_path, guidance, cfg):
    """ZImagePipeline guides as pos + g * (pos - neg): g = 0 is one prediction (Turbo's setting), and
    any g above it, 0.5 included, needs the negative prompt's embeddings."""
    _, _, validator = make_validator(root, "tiny-z-image", "validation.prompts=['a cat']",
                                     f"validation.guidance_scale={guidance}")
    assert validator.cfg is cfg and bool(validator.negative_embeds) is cfg
    path = validator.render(pipeline.transformer, 1, tmp_path)[0]
    with Image.open(path) as png:
        assert png.text["guidance_scale"] == guidance and ("negative_prompt" in png.text) is cfg


# --- export --------------------------------------------------------------------------------------------
