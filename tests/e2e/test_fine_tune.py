"""A fine-tune as people download it, over its base pipeline (model.denoiser), from the command line: a single
file plans as its base from the shipped facts without torch; a hub folder and a hub file download only
themselves and train; each bad input is one line, before anything is encoded. The two-rank round trip of a
run's own ComfyUI export is tests/distributed/test_train_fine_tune.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.hub_server import LocalHub
from zerotrain.cli import main

ROOT = Path(__file__).resolve().parents[2]
REPO = "zerotrain-tests/tiny-flux-finetune"
HEAVY = ("torch", "diffusers", "transformers", "peft", "deepspeed", "optimum")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    from zerotrain.models.tiny import ensure_tiny_pipeline

    root = tmp_path_factory.mktemp("tiny")
    return {name: ensure_tiny_pipeline(name, root) for name in ("tiny-flux", "tiny-sd3", "tiny-flux2", "tiny-flux2-klein")}


def weights_file(path: Path, names: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({name: torch.zeros(2, 2, dtype=torch.bfloat16) for name in names}, path)
    return path


def plan(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", "--resolution", "64", "--gpus", "1xH100-80GB", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_single_file_plans_as_its_base_from_the_shipped_facts_without_torch(tmp_path):
    """The planner reads the file's header only (no tensor, no torch) and plans FLUX.1 [dev]'s architecture from
    the shipped facts; the plan says where the denoiser comes from."""
    file = weights_file(tmp_path / "flux1-dev-finetune.safetensors", ["double_blocks.0.img_attn.qkv.weight"])
    code = ("import json, sys\nfrom zerotrain.cli import main\n"
            f"assert main(['plan', '--model', 'flux-dev', '--denoiser', {str(file)!r}, '--gpus', '8xH100-80GB', "
            "'--mode', 'full', '--json']) == 0\n"
            f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)), file=sys.stderr)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stderr.strip().splitlines()[-1]) == []
    model = json.loads(result.stdout)["model"]
    assert model["denoiser"] == f"file {file}" and model["facts_source"] == "shipped"
    assert model["name"] == "flux-dev" and model["total_params"] == 11_901_408_320


def _another_class(tiny, tmp_path):
    return str(tiny["tiny-sd3"] / "transformer")


def _another_architecture(tiny, tmp_path):
    folder = shutil.copytree(tiny["tiny-flux"] / "transformer", tmp_path / "deeper")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_layers": config["num_layers"] + 1}))
    return str(folder)


def _lora(tiny, tmp_path):
    return str(weights_file(tmp_path / "lora.safetensors", [f"transformer.x_embedder.lora_{ab}.weight" for ab in "AB"]))


def _pickle(tiny, tmp_path):
    (tmp_path / "model.ckpt").write_bytes(b"\x80\x04")
    return str(tmp_path / "model.ckpt")


def _not_safetensors(tiny, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"<html>a login page</html>")
    return str(tmp_path / "model.safetensors")


@pytest.mark.parametrize(("denoiser", "expected"), [
    (_another_class, "is a SD3Transformer2DModel, but"),
    (_another_architecture, "is another architecture than"),
    (_lora, "is an adapter (LoRA, LoKr or LoHa"),
    (_pickle, "is a pickled checkpoint"),
    (_not_safetensors, "is not a readable safetensors file"),
    (lambda tiny, tmp_path: "./no-such-file.safetensors", "no such file or folder, and not a hub id"),
])
def test_a_denoiser_that_is_no_fine_tune_of_the_base_is_one_line(denoiser, expected, tiny, tmp_path, capsys):
    code, _, err = plan(capsys, "--model", str(tiny["tiny-flux"]), "--denoiser", denoiser(tiny, tmp_path))
    assert code == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("zerotrain: error: model.denoiser=") and expected in line, line


def test_a_single_file_given_as_the_model_is_one_line(tmp_path, capsys):
    file = weights_file(tmp_path / "flux1-dev-finetune.safetensors", ["double_blocks.0.img_attn.qkv.weight"])
    code, _, err = plan(capsys, "--model", str(file))
    (line,) = err.strip().splitlines()
    assert code == 2 and f"model.name_or_path='{file}' is a single weights file" in line
    assert "set model.denoiser to it" in line


def train(tmp_path: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """One process of train.py on examples/tiny-cpu.yaml, one step."""
    args = [sys.executable, str(ROOT / "zerotrain" / "train.py"), "--config", str(ROOT / "examples" / "tiny-cpu.yaml"),
            "--set", f"output_dir={tmp_path / 'run'}", "--set", f"data.cache_dir={tmp_path / 'cache'}",
            "--set", "training.max_steps=1", "--set", "training.global_batch_size=1"]
    for override in overrides:
        args += ["--set", override]
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    return subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=600, check=False,
                          env={**environ, "DS_ACCELERATOR": "cpu", **(env or {})})


def test_a_file_of_another_size_stops_before_the_cache_build(tiny, tmp_path):
    """FLUX.2 [klein]'s transformer given over FLUX.2's pipeline (the same class, other shapes): one line once the
    node reads it, before anything is encoded."""
    from safetensors.torch import load_file

    klein = load_file(tiny["tiny-flux2-klein"] / "transformer" / "diffusion_pytorch_model.safetensors")
    save_file(klein, tmp_path / "klein.safetensors")
    result = train(tmp_path, "model.name_or_path=tiny-flux2", f"model.denoiser={tmp_path / 'klein.safetensors'}")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("zerotrain: error:")]
    assert len(errors) == 1 and "does not read as tiny-flux2's Flux2Transformer2DModel" in errors[0], errors
    assert not list((tmp_path / "cache").glob("latents/*.safetensors")), "it encoded before it stopped"
    assert not list((tmp_path / "cache" / "models").glob("fine-tune-*")), "a half-made folder was left"


@pytest.mark.parametrize("inside", ["transformer", "fine-tune.safetensors"])
def test_a_hub_fine_tune_downloads_only_itself_and_trains(inside, tiny, tmp_path):
    """A hub repo holding a fine-tune (a diffusers folder, and one file at its root, as model makers publish
    them): the run downloads that folder's files or that file, nothing else of the repo, trains one step, and
    doctor says where it is before and after."""
    served = tmp_path / "served"
    shutil.copytree(tiny["tiny-flux"] / "transformer", served / "transformer")
    shutil.copy(served / "transformer" / "diffusion_pytorch_model.safetensors", served / "fine-tune.safetensors")
    (served / "README.md").write_text("a fine-tune")
    with LocalHub() as hub:
        hub.add(REPO, served)
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")}
        doctor = [sys.executable, "-m", "zerotrain.cli", "doctor", "--config", str(ROOT / "examples" / "tiny-cpu.yaml"),
                  "--set", f"model.denoiser={REPO}/{inside}", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--json"]
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}

        def denoiser_check() -> dict:
            checks = json.loads(subprocess.run(doctor, capture_output=True, text=True, cwd=ROOT, timeout=300,
                                               check=False, env={**environ, **env}).stdout)["checks"]
            return next(check for check in checks if check["name"] == "denoiser")

        before = denoiser_check()
        result = train(tmp_path, f"model.denoiser={REPO}/{inside}", env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        wanted = ["transformer/config.json", "transformer/diffusion_pytorch_model.safetensors"] \
            if inside == "transformer" else ["fine-tune.safetensors"]
        assert sorted(hub.downloaded(REPO)) == wanted
        after = denoiser_check()
    assert before["verdict"] == "warn" and f"hub {REPO}/{inside}: the run downloads" in before["detail"], before
    assert after["verdict"] == "ok" and f"hub {REPO}/{inside}: in the hub cache" in after["detail"], after
    assert [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.parametrize(("denoiser", "revision", "expected"), [
    ("zerotrain-tests/no-such-repo/transformer", None, "model.denoiser='zerotrain-tests/no-such-repo': no such hub repo"),
    (f"{REPO}/transformer", "v9", "model.denoiser_revision='v9': no such revision of hub repo"),
    (f"{REPO}/unet", None, "the hub repo has no config.json or pipeline index at 'unet'"),
])
def test_a_hub_denoiser_that_is_not_there_is_one_line_when_planned(denoiser, revision, expected, tiny, tmp_path):
    with LocalHub() as hub:
        hub.add(REPO, tiny["tiny-flux"])
        args = [sys.executable, "-m", "zerotrain.cli", "plan", "--model", "tiny-flux", "--denoiser", denoiser,
                "--resolution", "64", "--gpus", "1xH100-80GB", *(["--set", f"model.denoiser_revision={revision}"]
                                                                   if revision else [])]
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        result = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
                                env={**environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert expected in line, line
