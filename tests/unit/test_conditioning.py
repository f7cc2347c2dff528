"""Tiny model folders load and generate through the real diffusers pipelines, and the conditioning
zerotrain caches (sampled latents, SDXL time ids) equals what those pipelines compute. The cached text
against each pipeline's encode_prompt is test_families.py's table."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import diffusers
import pytest
import torch
from safetensors.torch import load_file, save_file

from zerotrain.config import ModelConfig
from zerotrain.errors import ZerotrainError
from zerotrain.families.runtime.parts.latents import scale_latents
from zerotrain.families.runtime.sdxl import sdxl_time_ids
from zerotrain.models import conditioning
from zerotrain.models.catalog import resolve_model
from zerotrain.models.conditioning import (
    encode_latent_moments,
    encode_latents,
    encode_prompts,
    free,
    load_encoders,
)
from zerotrain.models.tiny import build_tiny_pipeline
from zerotrain.protocols import ModelSpec

CAPTIONS = [
    "a photo of a cat sitting on a red chair",
    "An oil painting of Mountains at sunset, unseen words!",
]
PIPELINE = {
    "tiny-flux": "FluxPipeline",
    "tiny-sd3": "StableDiffusion3Pipeline",
    "tiny-sdxl": "StableDiffusionXLPipeline",
}
# Sequence lengths the tiny denoisers see: Flux 24 T5 tokens; SD3 77 CLIP + 16 T5; SDXL CLIP's 77.
TEXT_TOKENS = {"tiny-flux": 24, "tiny-sd3": 77 + 16, "tiny-sdxl": 77}
# The tiny VAEs downsample 2x, so 64x64 pixels are 32x32 latents (16x16 tokens for the DiTs).
SIDE = 64


def spec_of(name_or_path: str | Path) -> ModelSpec:
    return resolve_model(ModelConfig(name_or_path=str(name_or_path)))


def files_digest(folder: Path) -> dict[str, str]:
    return {
        path.relative_to(folder).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module", params=list(PIPELINE))
def tiny(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    return name, build_tiny_pipeline(name, tmp_path_factory.mktemp(name) / "model")


@pytest.fixture(scope="module")
def pipeline(tiny):
    name, folder = tiny
    return getattr(diffusers, PIPELINE[name]).from_pretrained(folder)


def pixels(batch: int = 2) -> torch.Tensor:
    return torch.rand(batch, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(0)) * 2 - 1


def test_tiny_folder_generates_through_the_real_pipeline(tiny, pipeline):
    name, folder = tiny
    assert type(pipeline).__name__ == PIPELINE[name]
    assert type(diffusers.DiffusionPipeline.from_pretrained(folder)).__name__ == PIPELINE[name]
    saved = spec_of(folder).config
    assert {key: saved[key] for key in spec_of(name).config} == spec_of(name).config
    image = pipeline(
        CAPTIONS[0],
        num_inference_steps=1,
        height=SIDE,
        width=SIDE,
        output_type="pt",
        generator=torch.Generator().manual_seed(0),
    ).images
    assert image.shape == (1, 3, SIDE, SIDE)
    assert torch.isfinite(image).all()


def test_tiny_build_is_deterministic_and_keeps_the_global_rng(tiny, tmp_path):
    name, folder = tiny
    state = torch.get_rng_state()
    again = build_tiny_pipeline(name, tmp_path / "again")
    assert torch.equal(torch.get_rng_state(), state)
    assert files_digest(again) == files_digest(folder)


def test_tiny_tokenizers_load_with_the_pipeline_classes(tiny, pipeline):
    name, _ = tiny
    clips = [pipeline.tokenizer] + ([pipeline.tokenizer_2] if name != "tiny-flux" else [])
    for tokenizer in clips:
        assert tokenizer.model_max_length == 77
        ids = tokenizer("A photo of a cat").input_ids
        assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
        assert tokenizer.unk_token_id not in ids[1:-1]
    t5 = {"tiny-flux": "tokenizer_2", "tiny-sd3": "tokenizer_3"}.get(name)
    if t5:
        tokenizer = getattr(pipeline, t5)
        assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
        assert tokenizer.unk_token_id not in tokenizer("A photo of a Cat, 85mm!").input_ids


def test_encode_latents_equals_vae_encode_with_the_family_scaling(tiny, pipeline):
    name, folder = tiny
    catalog = spec_of(name)
    encoders = load_encoders(spec_of(folder), folder)
    x = pixels()
    latents = encode_latents(encoders, x, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        raw = pipeline.vae.encode(x).latent_dist.sample(torch.Generator().manual_seed(1))
    shift = catalog.vae_shift_factor or 0.0
    expected = (raw - shift) * catalog.vae_scaling_factor
    assert latents.shape == (2, catalog.latent_channels, SIDE // 2, SIDE // 2)
    assert torch.allclose(latents, expected)
    moments = encode_latent_moments(encoders, x)
    assert torch.allclose(moments.sample(torch.Generator().manual_seed(1)), latents, atol=1e-6)
    with torch.no_grad():
        mode = pipeline.vae.encode(x).latent_dist.mode()
    assert torch.allclose(moments.mean, (mode - shift) * catalog.vae_scaling_factor)


def test_encode_latents_rejects_bad_pixels(tiny):
    _, folder = tiny
    encoders = load_encoders(spec_of(folder), folder)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        encode_latents(encoders, (pixels() + 1) * 127.5)
    with pytest.raises(ValueError, match="multiples"):
        encode_latents(encoders, pixels()[..., :63])
    with pytest.raises(ValueError, match="expected pixels"):
        encode_latents(encoders, pixels()[0])


def test_scale_latents_shape_contract():
    z = torch.ones(1, 4, 2, 2)
    assert torch.equal(scale_latents(z, 0.5, None), z * 0.5)
    assert torch.equal(scale_latents(z, 2.0, 0.25), z * 1.5)
    with pytest.raises(ValueError, match="B, C, h, w"):
        scale_latents(z[0], 0.5, None)


def test_identity_tracks_the_encoder_files(tiny, tmp_path, monkeypatch):
    name, folder = tiny
    spec = spec_of(folder)
    identity = load_encoders(spec, folder).identity
    assert load_encoders(spec, folder).identity == identity
    assert load_encoders(spec, build_tiny_pipeline(name, tmp_path / "copy")).identity == identity
    assert load_encoders(spec, folder, dtype=torch.bfloat16).identity != identity

    weights = tmp_path / "copy" / "text_encoder" / "model.safetensors"
    tensors = load_file(weights)
    first = min(tensors)
    tensors[first] = tensors[first] + 1
    save_file(tensors, weights, metadata={"format": "pt"})
    assert load_encoders(spec, tmp_path / "copy").identity != identity

    # Large files (real weights) enter by size and mtime, not content.
    monkeypatch.setattr(conditioning, "_HASHED_BYTES", 0)
    large = load_encoders(spec, folder).identity
    vae_weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    stat = vae_weights.stat()
    os.utime(vae_weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert load_encoders(spec, folder).identity != large


def test_free_drops_the_models(tiny):
    name, folder = tiny
    encoders = load_encoders(spec_of(folder), folder)
    free(encoders)
    assert encoders.vae is None and encoders.text_encoders == [] and encoders.tokenizers == []
    with pytest.raises(ZerotrainError, match="freed"):
        encode_prompts(encoders, CAPTIONS, TEXT_TOKENS[name])
    with pytest.raises(ZerotrainError, match="freed"):
        encode_latents(encoders, pixels())


def test_text_tokens_outside_what_the_pipeline_accepts(tiny):
    name, folder = tiny
    encoders = load_encoders(spec_of(folder), folder)
    bad = {"tiny-flux": [0, 513], "tiny-sd3": [77, 77 + 513], "tiny-sdxl": [76, 78]}[name]
    for tokens in bad:
        with pytest.raises(ZerotrainError, match=f"text_tokens={tokens}"):
            encode_prompts(encoders, CAPTIONS, tokens)


def test_sdxl_time_ids_match_the_pipeline(tmp_path):
    folder = build_tiny_pipeline("tiny-sdxl", tmp_path / "sdxl")
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(folder)
    original, crop, target = (1024, 768), (16, 8), (512, 384)
    expected = pipe._get_add_time_ids(
        original,
        crop,
        target,
        dtype=torch.float32,
        text_encoder_projection_dim=pipe.text_encoder_2.config.projection_dim,
    )
    assert torch.equal(sdxl_time_ids(original, crop, target), expected[0])
    with pytest.raises(ValueError, match="crop_top_left"):
        sdxl_time_ids(original, (1.5, 0), target)


def test_sd1_style_unet_is_refused_before_loading(tmp_path):
    with pytest.raises(ZerotrainError, match="SD 1.x/2.x"):
        load_encoders(spec_of("sd1.5"), tmp_path)


def test_only_tiny_names_build(tmp_path):
    with pytest.raises(ValueError, match="tiny-flux"):
        build_tiny_pipeline("flux-dev", tmp_path)
