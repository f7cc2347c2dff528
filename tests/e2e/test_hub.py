"""Models named by hub ids, as users name them, against a hub on 127.0.0.1 (tests/hub_server.py) that the
real huggingface_hub talks to: a file missing while offline stops the run in one line before its cache
build, a gated repo wants a token, a pinned revision is the one downloaded, a modular pipeline (FLUX.3)
fetches its components, and doctor says what is on this node and what a run would download. Each test
starts real interpreters with HF_ENDPOINT and HF_HOME of their own (huggingface_hub reads them once, at
import). The two-rank run from a hub id is tests/distributed/test_hub_model.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hub_server import LocalHub

ROOT = Path(__file__).resolve().parents[2]
FLUX, FLUX3, GATED = "zerotrain-tests/tiny-flux", "zerotrain-tests/tiny-flux3", "zerotrain-tests/gated-flux"
TOKEN = "hf_local_test_token"
# What zerotrain's download before issue 47 left in the hub cache: the VAE and text parts, the denoiser's config.
ENCODERS_ONLY = ["model_index.json", "vae/*", "text_encoder/*", "text_encoder_2/*", "tokenizer/*", "tokenizer_2/*",
                 "transformer/config.json"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    from zerotrain.models.tiny import ensure_tiny_pipeline

    root = tmp_path_factory.mktemp("hub-models")
    flux, flux3 = ensure_tiny_pipeline("tiny-flux", root), ensure_tiny_pipeline("tiny-flux3", root)
    pinned = shutil.copytree(flux, root / "tiny-flux-v1")
    vae = json.loads((pinned / "vae" / "config.json").read_text())
    (pinned / "vae" / "config.json").write_text(json.dumps({**vae, "scaling_factor": 0.5}))
    with LocalHub() as served:
        served.add(FLUX, flux)
        served.pinned = served.add(FLUX, pinned, revision="v1")
        served.add(GATED, flux, gated_token=TOKEN)
        served.add(FLUX3, flux3)
        yield served


def run(args: list[str], hub: LocalHub, home: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
                          env={**environ, "DS_ACCELERATOR": "cpu", "HF_ENDPOINT": hub.url, "HF_HOME": str(home),
                               "XDG_CACHE_HOME": str(home.parent / "xdg"), **env})


def python(code: str, hub: LocalHub, home: Path, **env: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "-c", code], hub, home, **env)


def cache_only(hub: LocalHub, home: Path, patterns: list[str]) -> None:
    """The hub cache holding only `patterns` of the tiny FLUX.1 repo, downloaded by huggingface_hub itself."""
    code = f"from huggingface_hub import snapshot_download; snapshot_download({FLUX!r}, allow_patterns={patterns!r})"
    result = python(code, hub, home)
    assert result.returncode == 0, result.stderr[-2000:]


def train(tmp_path: Path, hub: LocalHub, home: Path, *overrides: str, **env: str) -> subprocess.CompletedProcess:
    args = [sys.executable, str(ROOT / "zerotrain" / "train.py"), "--config", str(ROOT / "examples" / "tiny-cpu.yaml"),
            "--set", f"output_dir={tmp_path / 'run'}", "--set", f"data.cache_dir={tmp_path / 'cache'}",
            "--set", "training.max_steps=1"]
    for override in overrides:
        args += ["--set", override]
    return run(args, hub, home, **env)


@pytest.mark.parametrize("listing", ["kept", "laid by hand"])
def test_offline_with_files_missing_stops_before_the_cache_build(listing, hub, tmp_path):
    """The hub cache holds what the old download left (no scheduler, no denoiser weights) and HF_HUB_OFFLINE is
    set: the run stops in one line naming the missing files, before it encodes anything. With the tree listing
    huggingface_hub keeps, the line names the files; laid by hand (no listing), the components."""
    home = tmp_path / "hf"
    cache_only(hub, home, ENCODERS_ONLY)
    if listing == "laid by hand":
        shutil.rmtree(next((home / "hub").glob("models--*")) / "trees")
    result = train(tmp_path, hub, home, f"model.name_or_path={FLUX}", HF_HUB_OFFLINE="1")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerotrain: error:")]
    assert len(errors) == 1 and "HF_HUB_OFFLINE" in errors[0] and str(home / "hub") in errors[0], result.stderr[-3000:]
    if listing == "kept":
        assert "scheduler/scheduler_config.json" in errors[0] and "transformer/diffusion_pytorch_model.safetensors" \
            in errors[0]
    else:
        assert "scheduler/" in errors[0] and "transformer/ weights" in errors[0]
    assert not list((tmp_path / "cache").glob("latents/*.safetensors")), "it encoded before it stopped"


def test_a_gated_repo_wants_a_token(hub, tmp_path):
    """Without a token a gated repo is one line saying so and what to do; with HF_TOKEN it plans and downloads."""
    plan = [sys.executable, "-m", "zerotrain.cli", "plan", "--model", GATED, "--resolution", "64", "--gpus", "1xH100-80GB"]
    refused = run(plan, hub, tmp_path / "hf")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert "the hub repo is gated" in refused.stderr and "HF_TOKEN" in refused.stderr
    assert run(plan, hub, tmp_path / "hf", HF_TOKEN=TOKEN).returncode == 0
    fetched = python(f"""
from zerotrain.config.sections import ModelConfig
from zerotrain.models.catalog import resolve_model
from zerotrain.models.hub import fetch
print(fetch(resolve_model(ModelConfig(name_or_path={GATED!r})), {GATED!r}, None, "train"))""", hub, tmp_path / "hf",
                     HF_TOKEN=TOKEN)
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    assert (Path(fetched.stdout.strip().splitlines()[-1]) / "transformer" / "diffusion_pytorch_model.safetensors").is_file()


def test_a_pinned_revision_is_the_one_planned_and_downloaded(hub, tmp_path):
    """model.revision: the spec reads v1's VAE config (its scaling factor), the download is v1's commit; a
    revision the repo lacks is one line."""
    result = python(f"""
import json
from pathlib import Path
from zerotrain.config.sections import ModelConfig
from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import resolve_model
from zerotrain.models.hub import fetch
spec = resolve_model(ModelConfig(name_or_path={FLUX!r}, revision="v1"))
folder = fetch(spec, {FLUX!r}, "v1", "train")
print(json.dumps([spec.vae_scaling_factor, folder.name, json.loads((folder / "vae/config.json").read_text())["scaling_factor"]]))
try:
    resolve_model(ModelConfig(name_or_path={FLUX!r}, revision="no-such-tag"))
except ZerotrainError as err:
    print(err)""", hub, tmp_path / "hf")
    assert result.returncode == 0, result.stderr[-2000:]
    values, refused = result.stdout.strip().splitlines()[-2:]
    assert json.loads(values) == [0.5, hub.pinned, 0.5]
    assert refused.startswith("model.revision='no-such-tag': no such revision of hub repo")


def test_a_modular_pipeline_fetches_its_components(hub, tmp_path):
    """FLUX.3's modular repo (modular_model_index.json, no scheduler): `zerotrain cache` downloads the VAE, the text
    encoder and its tokenizer alone and encodes the data with them; training's download adds the denoiser."""
    home = tmp_path / "hf"
    cached = run([sys.executable, "-m", "zerotrain.cli", "cache", "--config", str(ROOT / "examples" / "tiny-cpu.yaml"),
                  "--set", f"model.name_or_path={FLUX3}", "--set", f"data.cache_dir={tmp_path / 'cache'}",
                  "--set", "data.datasets=[{path: examples/tiny-data, repeats: 1}]"], hub, home)
    assert cached.returncode == 0, cached.stderr[-3000:]
    assert "cache: 8 images and 4 captions encoded" in cached.stdout, cached.stdout[-2000:]
    downloaded = set(hub.downloaded(FLUX3))
    assert {"vae/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors",
            "tokenizer/tokenizer.json", "modular_model_index.json"} <= downloaded
    assert "transformer/diffusion_pytorch_model.safetensors" not in downloaded
    fetched = python(f"""
from zerotrain.config.sections import ModelConfig
from zerotrain.models.catalog import resolve_model
from zerotrain.models.hub import fetch
print(fetch(resolve_model(ModelConfig(name_or_path={FLUX3!r})), {FLUX3!r}, None, "train"))""", hub, home)
    assert fetched.returncode == 0, fetched.stderr[-2000:]
    assert "transformer/diffusion_pytorch_model.safetensors" in hub.downloaded(FLUX3)


def doctor_model(hub: LocalHub, home: Path, **env: str) -> dict:
    result = run([sys.executable, "-m", "zerotrain.cli", "doctor", "--config", str(ROOT / "examples" / "tiny-cpu.yaml"),
                  "--model", FLUX, "--gpus", "1xH100-80GB", "--json"], hub, home, **env)
    checks = {check["name"]: check for check in json.loads(result.stdout)["checks"]}
    return checks["model"]


def test_doctor_says_what_is_here_and_what_a_run_downloads(hub, tmp_path):
    """Before any download: how many of the files training reads are missing, how much the run downloads and
    into which cache (warn); after it: all there (ok); offline with files missing: fail, naming them."""
    home = tmp_path / "hf"
    before = doctor_model(hub, home)
    assert before["verdict"] == "warn", before
    assert f"hub repo {FLUX}: " in before["detail"] and "of the 14 files training reads" in before["detail"]
    assert "the run downloads" in before["detail"] and str(home / "hub") in before["detail"]
    cache_only(hub, home, ENCODERS_ONLY)
    offline = doctor_model(hub, home, HF_HUB_OFFLINE="1")
    assert offline["verdict"] == "fail" and "scheduler/scheduler_config.json" in offline["detail"], offline
    cache_only(hub, home, ["*"])
    after = doctor_model(hub, home)
    assert after["verdict"] == "ok" and "all 14 files training reads" in after["detail"], after
