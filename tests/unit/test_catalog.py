"""The model catalog and model resolution (each entry's published parameter count is test_families.py's table): tiny
entries run on CPU, and local folders, bare config.json files and hub ids resolve or fail in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import diffusers
import huggingface_hub.constants
import pytest
import torch

from zerotrain.config import ModelConfig
from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import catalog_names, denoiser_families, is_plan_only, resolve_model
from zerotrain.protocols import ModelSpec

CATALOG_DIR = Path(__file__).resolve().parents[2] / "zerotrain" / "models" / "catalog"

TINY = ["tiny-flux", "tiny-sd3", "tiny-sdxl"]


def spec_of(name_or_path: str | Path, **fields: str) -> ModelSpec:
    return resolve_model(ModelConfig(name_or_path=str(name_or_path), **fields))


def catalog_entry(name: str) -> dict:
    return json.loads((CATALOG_DIR / f"{name}.json").read_text())


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def tiny_inputs(spec: ModelSpec, batch: int = 2) -> dict:
    """One real forward's inputs for a tiny denoiser, on 16x16 latents."""
    config, side = spec.config, 16
    t = torch.rand(batch)
    if spec.family == "flux":
        tokens, text = (side // 2) ** 2, 8
        return {
            "hidden_states": torch.randn(batch, tokens, config["in_channels"]),
            "encoder_hidden_states": torch.randn(batch, text, config["joint_attention_dim"]),
            "pooled_projections": torch.randn(batch, config["pooled_projection_dim"]),
            "timestep": t,
            "img_ids": torch.zeros(tokens, 3),
            "txt_ids": torch.zeros(text, 3),
            "guidance": torch.full((batch,), 3.5),
        }
    if spec.family == "sd3":
        return {
            "hidden_states": torch.randn(batch, config["in_channels"], side, side),
            "encoder_hidden_states": torch.randn(batch, 8, config["joint_attention_dim"]),
            "pooled_projections": torch.randn(batch, config["pooled_projection_dim"]),
            "timestep": t * 1000,
        }
    time_ids_dim = 6  # SDXL's (original size, crop top-left, target size)
    text_embeds = config["projection_class_embeddings_input_dim"] - time_ids_dim * config["addition_time_embed_dim"]
    return {
        "sample": torch.randn(batch, config["in_channels"], side, side),
        "timestep": t * 1000,
        "encoder_hidden_states": torch.randn(batch, 8, config["cross_attention_dim"]),
        "added_cond_kwargs": {"text_embeds": torch.randn(batch, text_embeds), "time_ids": torch.rand(batch, 6)},
    }


def save_tiny_pipeline(name: str, folder: Path) -> ModelSpec:
    """A diffusers-style folder with the tiny denoiser and VAE weights and a model_index.json."""
    spec = spec_of(name)
    torch.manual_seed(0)
    spec.denoiser_class().from_config(spec.config).save_pretrained(folder / spec.subfolder)
    diffusers.AutoencoderKL.from_config(catalog_entry(name)["vae_config"]).save_pretrained(folder / "vae")
    index = {
        "_class_name": "TestPipeline",
        "_diffusers_version": diffusers.__version__,
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        spec.subfolder: ["diffusers", spec.class_name],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    (folder / "model_index.json").write_text(json.dumps(index))
    return spec


@pytest.mark.parametrize("first", ["zerotrain.families", "zerotrain.families.flux2", "zerotrain.models.catalog"])
def test_every_family_is_in_the_catalog_whatever_is_imported_first(first):
    """Once, importing zerotrain.families first left FLUX.2 out: flux2 imported models.tiny_parts, whose
    package __init__ imported the catalog, which listed the families while flux2 was half built."""
    code = f"import {first}\nfrom zerotrain.models.catalog import denoiser_families\nprint(sorted(denoiser_families().values()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(sorted(denoiser_families().values()))
    assert "flux2" in denoiser_families().values()


@pytest.mark.parametrize("name", catalog_names())
def test_catalog_vae_facts_agree_with_denoiser(name, tmp_path):
    """The latent channels a bare denoiser config implies equal the catalog's VAE facts; for the
    published models the family defaults equal them too."""
    spec = spec_of(name)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(spec.config))
    derived = spec_of(path)
    assert derived.latent_channels == spec.latent_channels
    if not name.startswith("tiny-"):
        assert spec.pretrained is not None and "/" in spec.pretrained
        assert (derived.vae_scale_factor, derived.vae_scaling_factor, derived.vae_shift_factor) == (
            spec.vae_scale_factor, spec.vae_scaling_factor, spec.vae_shift_factor
        )


def test_resolved_config_is_a_private_copy():
    spec_of("tiny-flux").config["num_layers"] = 99
    assert spec_of("tiny-flux").config["num_layers"] == 1


@pytest.mark.parametrize("name", TINY)
def test_tiny_denoiser_runs_forward_on_cpu(name):
    spec = spec_of(name)
    torch.manual_seed(0)
    model = spec.denoiser_class().from_config(spec.config).eval()
    inputs = tiny_inputs(spec)
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    expected = inputs["hidden_states"] if "hidden_states" in inputs else inputs["sample"]
    assert out.shape == expected.shape
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", TINY)
def test_tiny_vae_config_matches_vae_facts(name):
    entry, spec = catalog_entry(name), spec_of(name)
    vae = diffusers.AutoencoderKL.from_config(entry["vae_config"]).eval()
    assert spec.vae_scaling_factor == vae.config.scaling_factor
    assert spec.vae_shift_factor == vae.config.shift_factor
    with torch.no_grad():
        latents = vae.encode(torch.randn(1, 3, 16, 16)).latent_dist.mode()
    assert latents.shape == (1, spec.latent_channels, 16 // spec.vae_scale_factor, 16 // spec.vae_scale_factor)


@pytest.mark.parametrize("name", TINY)
def test_saved_folder_resolves_from_model_index(name, tmp_path):
    saved = save_tiny_pipeline(name, tmp_path)
    spec = spec_of(tmp_path)
    assert spec.source == f"folder {tmp_path}"
    assert (spec.pretrained, spec.subfolder) == (str(tmp_path), saved.subfolder)
    assert (spec.family, spec.class_name) == (saved.family, saved.class_name)
    assert (spec.vae_scale_factor, spec.latent_channels) == (saved.vae_scale_factor, saved.latent_channels)
    assert (spec.vae_scaling_factor, spec.vae_shift_factor) == (saved.vae_scaling_factor, saved.vae_shift_factor)
    for key, value in saved.config.items():
        if not key.startswith("_"):
            assert spec.config[key] == value, key
    # What resolution finds is what from_pretrained loads: the saved weights.
    model = spec.denoiser_class().from_pretrained(spec.pretrained, subfolder=spec.subfolder)
    with torch.device("meta"):
        built = saved.denoiser_class().from_config(saved.config)
    assert count_parameters(model) == count_parameters(built) > 0


def test_denoiser_folder_and_its_config_json_resolve(tmp_path):
    save_tiny_pipeline("tiny-sd3", tmp_path)
    folder_spec = spec_of(tmp_path / "transformer")
    assert (folder_spec.pretrained, folder_spec.subfolder) == (str(tmp_path / "transformer"), None)
    file_spec = spec_of(tmp_path / "transformer" / "config.json")
    assert file_spec.source == f"config.json {tmp_path / 'transformer' / 'config.json'}"
    assert file_spec.pretrained is None and file_spec.subfolder is None
    for spec in (folder_spec, file_spec):  # the sibling vae/config.json supplies the VAE facts
        assert (spec.family, spec.vae_scale_factor, spec.latent_channels) == ("sd3", 2, 16)


def test_bare_config_json_uses_family_defaults(tmp_path):
    path = tmp_path / "flux.json"
    path.write_text(json.dumps(catalog_entry("tiny-flux")["denoiser"]))
    spec = spec_of(path)
    assert (spec.family, spec.class_name, spec.pretrained) == ("flux", "FluxTransformer2DModel", None)
    assert (spec.vae_scale_factor, spec.latent_channels) == (8, 4)  # in_channels 16 = 4 x 2x2 packing
    assert (spec.vae_scaling_factor, spec.vae_shift_factor) == (0.3611, 0.1159)


def test_explicit_subfolder_wins_over_model_index(tmp_path):
    save_tiny_pipeline("tiny-sdxl", tmp_path)
    (tmp_path / "unet").rename(tmp_path / "unet_ema")
    assert spec_of(tmp_path, subfolder="unet_ema").subfolder == "unet_ema"
    with pytest.raises(ZerotrainError, match="model.subfolder"):
        spec_of(tmp_path)


def one_line_error(name_or_path: str | Path, match: str, **fields: str) -> str:
    with pytest.raises(ZerotrainError, match=match) as info:
        spec_of(name_or_path, **fields)
    message = str(info.value)
    assert "\n" not in message and "model." in message
    return message


def test_unknown_name_lists_catalog_and_other_forms():
    message = one_line_error("flux-pro", "no catalog entry")
    assert all(name in message for name in catalog_names())
    assert "config.json" in message and "hub id" in message
    # sd1.5, the Qwen-Image-Edit models (their processor needs torchvision) and the flow-map FLUX.3 [klein]
    # are plan-only.
    assert "sd1.5 (plan only)" in message and "flux3-klein (plan only)" in message
    assert message.count("(plan only)") == 2


def test_sd15_is_plan_only_and_cache_and_training_refuse_it_in_one_line(tmp_path, capsys):
    """sd1.5 (an SD 1.x UNet) plans, but zerotrain cannot encode its captions: the catalog listing
    marks it, and `zerotrain cache` and training (both through prepare()) stop with one line
    before fetching anything."""
    from zerotrain.cli import main
    from zerotrain.data.prepare import prepare
    from zerotrain.distributed import Topology
    from zerotrain.models.catalog import catalog_listing, check_trainable

    assert [n for n in catalog_names() if is_plan_only(resolve_model(ModelConfig(name_or_path=n)))] == [
        "flux3-klein", "sd1.5"]
    assert "sd1.5 (plan only)" in catalog_listing() and "sdxl-base (plan only)" not in catalog_listing()
    expected = "model.name_or_path='sd1.5' is plan-only: zerotrain plans SD 1.x/2.x UNets but cannot cache or train them"
    spec = resolve_model(ModelConfig(name_or_path="sd1.5"))
    with pytest.raises(ZerotrainError) as err:
        check_trainable(spec)
    assert str(err.value).startswith(expected) and "\n" not in str(err.value)
    for name in ("sdxl-base", "tiny-sdxl", "flux-dev", "sd3.5-medium"):
        check_trainable(resolve_model(ModelConfig(name_or_path=name)))

    root = Path(__file__).resolve().parents[2]
    overrides = ["model.name_or_path=sd1.5", "data.resolution=512", f"data.cache_dir={tmp_path / 'cache'}",
                 f"data.datasets=[{{path: '{root / 'examples' / 'tiny-data'}'}}]"]
    assert main(["cache", "--config", str(root / "examples" / "tiny-cpu.yaml"),
                 *[arg for o in overrides for arg in ("--set", o)]]) == 2
    err_text = capsys.readouterr().err
    assert err_text.startswith(f"zerotrain: error: {expected}") and err_text.count("\n") == 1, err_text
    assert not (tmp_path / "cache").exists(), "nothing may be fetched or written for a plan-only model"

    from zerotrain.config import load_config

    run = load_config(root / "examples" / "tiny-cpu.yaml", overrides)
    with pytest.raises(ZerotrainError, match="is plan-only"):  # what train.py calls on every rank
        prepare(run, spec, Topology(0, 2, 0))


def test_malformed_config_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"_class_name": "FluxTransformer2DModel",')
    assert str(path) in one_line_error(path, "not valid JSON")


def test_unsupported_class(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"_class_name": "PixArtTransformer2DModel"}))
    message = one_line_error(path, "PixArtTransformer2DModel")
    assert all(name in message for name in denoiser_families())


def test_missing_class_name(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"in_channels": 16}))
    one_line_error(path, "no _class_name")


def test_folder_without_configs(tmp_path):
    one_line_error(tmp_path, "no model_index.json, modular_model_index.json or config.json")


def test_vae_that_does_not_fit_the_denoiser(tmp_path):
    save_tiny_pipeline("tiny-flux", tmp_path)
    vae_config = json.loads((tmp_path / "vae" / "config.json").read_text())
    (tmp_path / "vae" / "config.json").write_text(json.dumps({**vae_config, "latent_channels": 16}))
    one_line_error(tmp_path, "latent_channels 16")


def test_hub_id_offline_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable at import; its functions consult these constants.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    message = one_line_error("zerotrain-tests/no-such-model", "could not reach the Hugging Face hub")
    assert "local diffusers folder" in message and str(tmp_path) in message
