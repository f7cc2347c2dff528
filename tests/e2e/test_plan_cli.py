"""`zerotrain plan` as a user runs it: the acceptance command, JSON and DeepSpeed JSON output,
models from folders saved with save_pretrained, and one-line errors for bad input."""

import json
import os
import subprocess
import sys

import pytest

from zerotrain.cli import main
from zerotrain.config import ModelConfig
from zerotrain.models.catalog import resolve_model


@pytest.fixture(autouse=True)
def facts_cache(tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


def zerotrain(*args, env=None):
    return subprocess.run([sys.executable, "-m", "zerotrain.cli", *args], check=False, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def test_acceptance_flux_dev_full_on_8xa100(tmp_path):
    out = tmp_path / "ds.json"
    result = zerotrain("plan", "--model", "flux-dev", "--resolution", "1024", "--gpus", "8xA100-80GB",
                       "--mode", "full", "--write-config", str(out))
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "fits" in text and "Chosen:" in text and "Reasons:" in text
    assert "activations" in text and "optimizer states" in text  # the breakdown
    config = json.loads(out.read_text())
    assert config["_zerotrain"]["command"].startswith("zerotrain plan --model flux-dev")
    assert config["train_batch_size"] == 8
    assert config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 8 == 8
    assert "auto" not in json.dumps(config)
    from deepspeed.runtime.config import DeepSpeedConfig

    config.pop("_zerotrain")
    # Offline DeepSpeed sees a world of 1, so check the per-GPU share of the batch.
    config["train_batch_size"] //= 8
    DeepSpeedConfig(config)


def test_json_output_and_cache(capsys):
    args = ["plan", "--model", "tiny-flux", "--resolution", "256", "--gpus", "2xH100-80GB", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["plan"]["chosen"]["fits"] is True
    assert first["deepspeed_config"]["zero_optimization"]["stage"] == first["plan"]["chosen"]["layout"]["stage"]
    assert first["facts_cached"] is False
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["facts_cached"] is True
    assert second["plan"]["chosen"] == first["plan"]["chosen"]


def test_the_json_plan_states_the_model_it_planned_for(capsys):
    """plan --json's "model": the denoiser's exact parameter counts (the catalog's, as test_families.py counts them),
    name, family, tokens per sample (tiny-flux: 192 px through its 2x VAE in 2x2 patches), and where the facts
    came from (traced, then cached; shipped)."""
    parameters = {"tiny-flux": 78_544, "flux-dev": 11_901_408_320}

    def planned(*args):
        assert main(["plan", *args, "--gpus", "1xH100-80GB", "--json"]) in (0, 1)
        return json.loads(capsys.readouterr().out)["model"]

    first = planned("--model", "tiny-flux", "--resolution", "192", "--mode", "full")
    assert first == {"name": "tiny-flux", "family": "flux", "class": "FluxTransformer2DModel", "denoiser": None,
                     "total_params": parameters["tiny-flux"], "trainable_params": parameters["tiny-flux"],
                     "frozen_params": 0, "image_tokens": 48 * 48, "text_tokens": 512, "reference_tokens": 0,
                     "facts_source": "traced", "calibration": None}
    assert planned("--model", "tiny-flux", "--resolution", "192", "--mode", "full")["facts_source"] == "cached"
    lora = planned("--model", "flux-dev", "--resolution", "1024", "--mode", "lora")
    assert lora["total_params"] == parameters["flux-dev"] + lora["trainable_params"] and lora["facts_source"] == "shipped"
    assert lora["frozen_params"] == parameters["flux-dev"] and 0 < lora["trainable_params"] < 10**8
    edit = planned("--model", "flux-kontext-dev", "--resolution", "1024", "--mode", "lora", "--references", "1")
    assert (edit["image_tokens"], edit["reference_tokens"]) == (4096, 4096)


def test_plans_from_a_saved_folder_and_a_config_json(tmp_path, capsys):
    spec = resolve_model(ModelConfig(name_or_path="tiny-sdxl"))
    model = spec.denoiser_class().from_config(spec.config)
    model.save_pretrained(tmp_path / "unet")
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionXLPipeline",
                                                           "unet": ["diffusers", "UNet2DConditionModel"]}))
    for target in (tmp_path, tmp_path / "unet" / "config.json"):
        assert main(["plan", "--model", str(target), "--resolution", "256", "--gpus", "1xRTX4090-24GB",
                     "--global-batch", "4", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["plan"]["model"] == str(target)
        assert out["plan"]["chosen"] is not None


def test_nothing_fits_exits_1_with_suggestions(capsys):
    """A flux-dev full fine-tune on one 24 GB GPU without offload: the suggestions are exactly the
    changes that fit, each true when planned again. Its bf16 weights alone (23.8 GB) exceed the
    budget, so plain LoRA is not suggested, LoRA over a qint8 base is; more nodes of the same GPU
    are the fewest that fit."""
    import re

    from zerotrain.config.flags import config_from_args
    from zerotrain.hardware import hardware_facts
    from zerotrain.planner.measure import measure_model
    from zerotrain.planner.search import plan

    argv = ["plan", "--model", "flux-dev", "--gpus", "1xRTX4090-24GB", "--mode", "full",
            "--global-batch", "1", "--set", "planner.offload=[none]"]
    code = main(argv)
    out = capsys.readouterr().out
    assert code == 1
    assert "Nothing fits" in out and "What would make it fit:" in out
    lines = out.split("What would make it fit:\n", 1)[1].splitlines()
    assert len(lines) == 3, lines
    nodes = re.fullmatch(r"  - more nodes: (\d+) nodes of 1 GPU \(global batch (\d+)\)", lines[0])
    memory = re.fullmatch(r"  - GPUs with at least (\d+\.\d) GiB each", lines[1])
    assert nodes and memory, lines
    assert lines[2] == "  - LoRA over a qint8-quantized base: --mode lora --quantize qint8"

    def fits(*overrides: str) -> bool:
        from zerotrain.cli import build_parser

        args = build_parser().parse_args([*argv, *[a for o in overrides for a in ("--set", o)]])
        run = config_from_args(args)
        return plan(measure_model(resolve_model(run.model), run), hardware_facts(run.hardware), run).chosen is not None

    n = int(nodes.group(1))
    assert int(nodes.group(2)) == n  # one image per GPU: the smallest global batch n GPUs can take
    assert fits(f"hardware.nodes={n}", f"training.global_batch_size={n}")
    assert not fits(f"hardware.nodes={n - 1}", f"training.global_batch_size={n - 1}")
    assert fits("training.mode=lora", "training.quantize_base=qint8")
    assert not fits("training.mode=lora")
    assert fits("hardware.gpus=1", f"hardware.gpu_memory={memory.group(1)}GiB")


def test_a_plan_only_model_plans_and_says_so(capsys):
    assert main(["plan", "--model", "sd1.5", "--resolution", "256", "--gpus", "1xA100-80GB", "--json"]) == 0
    reasons = json.loads(capsys.readouterr().out)["plan"]["reasons"]
    assert reasons[-1] == "sd1.5 is plan-only: zerotrain cannot cache or train SD 1.x/2.x UNets"


@pytest.mark.parametrize("args,expected", [
    (["--model", "flux-deev", "--gpus", "8xA100-80GB"], "model.name_or_path"),
    (["--model", "flux-dev", "--gpus", "9xZ100"], "hardware.gpus"),
    (["--model", "flux-dev", "--gpus", "8xA100-80GB", "--resolution", "1000"], "data.resolution=1000"),
    (["--model", "flux-dev", "--gpus", "8xA100-80GB", "--mode", "lora", "--lora-rank", "0"], "training.lora.rank"),
    (["--model", "flux-dev", "--gpus", "8xA100-80GB", "--global-batch", "12"], "not divisible by the world size 8"),
    (["--model", "flux-dev", "--gpus", "8xA100-80GB", "--set", "training.bogus=1"], "training.bogus"),
])
def test_bad_input_is_one_line_without_traceback(args, expected, capsys):
    assert main(["plan", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_malformed_files_are_one_line(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text("model: {name_or_path: flux-dev\n")
    assert main(["plan", "--config", str(run), "--gpus", "8xA100-80GB"]) == 2
    err = capsys.readouterr().err
    assert "run.yaml: not valid YAML" in err and err.count("\n") == 1
    config_json = tmp_path / "config.json"
    config_json.write_text('{"_class_name": "FluxTransformer2DModel", ')
    assert main(["plan", "--model", str(config_json), "--gpus", "8xA100-80GB"]) == 2
    err = capsys.readouterr().err
    assert "config.json" in err and err.count("\n") == 1


def test_no_gpu_and_no_profile_says_how_to_name_one():
    # This machine has no NVML; CI neither.
    result = zerotrain("plan", "--model", "tiny-flux", "--resolution", "256", env={"CUDA_VISIBLE_DEVICES": "0"})
    if result.returncode == 0:
        pytest.skip("a GPU is visible here")
    assert result.returncode == 2
    assert "--gpus 8xA100-80GB" in result.stderr and result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback():
    result = zerotrain("--debug", "plan", "--model", "nope", "--gpus", "8xA100-80GB")
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_a_library_error_is_still_one_line(tmp_path, capsys):
    config_json = tmp_path / "config.json"
    config_json.write_text('{"_class_name": "FluxTransformer2DModel", "num_layers": "many"}')
    code = main(["plan", "--model", str(config_json), "--gpus", "8xA100-80GB", "--resolution", "256"])
    err = capsys.readouterr().err
    assert code in (2, 3)
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(("model", "args", "references", "why"), [
    ("qwen-image-edit-2511", [], 1, "QwenImageEditPlusPipeline always takes one"),
    ("flux-kontext-dev", [], 1, "FluxKontextPipeline always takes one"),
    ("qwen-image-edit-2511", ["--references", "0"], 0, None),
    ("qwen-image-edit-2511", ["--references", "1"], 1, "data.references (--references)"),
    ("flux2-dev", [], 0, None),
])
def test_an_edit_model_plans_with_the_reference_its_pipeline_always_takes(model, args, references, why, capsys):
    """Issue 48 §8: an edit pipeline always takes a reference, so a dry run without --references plans an edit
    sample (the image tokens twice, about twice the activations), from the shipped facts, and says so; --references
    0 plans text to image; FLUX.2, whose references are optional, plans none unless told."""
    assert main(["plan", "--model", model, "--gpus", "8xH100-80GB", "--mode", "lora", "--json", *args]) in (0, 1)
    document = json.loads(capsys.readouterr().out)
    model_facts, reasons = document["model"], document["plan"]["reasons"]
    assert model_facts["facts_source"] == "shipped" or args  # the default plans are shipped
    assert model_facts["reference_tokens"] == references * model_facts["image_tokens"]
    lines = [line for line in reasons if "reference image" in line]
    if why is None:
        assert lines == []
    else:
        (line,) = lines
        assert line.startswith(f"{references} reference image") and why in line, line
