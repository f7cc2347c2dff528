"""The facts shipped for the catalog models (zerotrain/planner/shipped_facts/): every catalog model,
usual resolution and training mode is there, a sample equals a fresh trace with the installed
torch, diffusers and peft, and a first plan of a catalog model imports none of them."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from zerotrain import families
from zerotrain.config import ModelConfig, RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import catalog_names, resolve_model
from zerotrain.planner import trace
from zerotrain.planner.facts import pack_facts, unpack_facts
from zerotrain.planner.measure import SHIPPED_DIR, measure_model, shipped_facts, shipped_key

# What should be shipped, as docs/how-the-planner-works.md promises it: every catalog model but the tiny test ones, at
# 512, 768 and 1024 px, fully fine-tuned or LoRA (default settings) over each quantization of the base.
RESOLUTIONS = (512, 768, 1024)
TRAINING = [{"mode": "full"}, *({"mode": "lora", "quantize_base": q} for q in ("none", "qint8", "qfloat8", "qint4"))]
HEAVY = ("torch", "diffusers", "transformers", "peft", "deepspeed", "optimum")


def catalog_run(name: str, resolution: int, training: dict, cache_dir: object) -> RunConfig:
    return RunConfig(model={"name_or_path": name}, data={"resolution": resolution}, training=training,
                     planner={"cache_dir": cache_dir})


def no_tracing(*args, **kwargs):
    raise AssertionError("traced instead of using the shipped facts")


def test_every_catalog_model_resolution_and_mode_is_shipped(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "measure", no_tracing)
    expected = 0
    for name in catalog_names():
        if name.startswith("tiny-"):
            continue
        spec = resolve_model(ModelConfig(name_or_path=name))
        for resolution in RESOLUTIONS:
            try:
                families.check_resolution(spec, resolution)
            except ZerotrainError:
                continue
            for training in TRAINING:
                run = catalog_run(name, resolution, training, tmp_path)
                facts = measure_model(spec, run)
                expected += 1
                assert facts.cached
                assert (facts.model, facts.resolution, facts.mode, facts.quantize) == \
                    (name, resolution, training["mode"], training.get("quantize_base", "none"))
                assert facts.lora_rank == (run.training.lora.rank if training["mode"] == "lora" else None)
                assert facts.text_tokens == families.of(spec).default_text_tokens
    assert not list(tmp_path.iterdir()), "shipped facts are not copied into the user cache"
    shipped = sum(len(json.loads(path.read_text())["facts"]) for path in SHIPPED_DIR.glob("*.json"))
    assert shipped == expected > 0, "facts shipped for runs nobody asks for"


def test_files_are_what_pack_facts_writes():
    """Unpacking every entry and packing them again gives each file back, field for field."""
    for path in sorted(SHIPPED_DIR.glob("*.json")):
        data = json.loads(path.read_text())
        assert data["model"] == path.stem and set(data["measured_with"]) == {"torch", "diffusers", "peft"}
        facts = {key: unpack_facts(data, key) for key in data["facts"]}
        assert all(f.model == path.stem and f.trace_seconds == 0.0 for f in facts.values())
        assert pack_facts(facts) == {"parameters": data["parameters"], "facts": data["facts"]}, path.name


# One run of each family at 512 px, the cheapest (1-5 s a trace on 2 CPU cores), and each
# quantization of the base once: a new diffusers that changes a family's model shows up here.
SAMPLE = [
    ("flux-dev", {"mode": "full"}),
    ("flux-dev", {"mode": "lora", "quantize_base": "qint4"}),
    ("chroma", {"mode": "lora", "quantize_base": "qint8"}),
    ("flux2-klein-4b", {"mode": "lora", "quantize_base": "qfloat8"}),
    ("qwen-image", {"mode": "lora"}),
    ("sd3.5-medium", {"mode": "full"}),
    ("sd1.5", {"mode": "lora", "quantize_base": "qint8"}),
    ("z-image", {"mode": "lora", "quantize_base": "qint4"}),
]


@pytest.mark.parametrize(("name", "training"), SAMPLE, ids=["-".join([n, *t.values()]) for n, t in SAMPLE])
def test_regression_guard_shipped_facts_equal_a_fresh_trace(name, training, tmp_path):
    """A regression guard: planner output against a planner target, not a measurement. The shipped
    facts are the tracer's own output; this catches a torch, diffusers or tracer change that moves
    them. (The tracer against real CPU runs: tests/unit/test_facts.py.)"""
    spec = resolve_model(ModelConfig(name_or_path=name))
    run = catalog_run(name, 512, training, tmp_path)
    shipped = measure_model(spec, run)
    fresh = measure_model(spec, run, cache=False)  # what --no-cache does: trace again
    assert shipped.cached and not fresh.cached and fresh.trace_seconds > 0
    installed = {lib: version(lib) for lib in ("torch", "diffusers", "peft")}
    measured_with = json.loads((SHIPPED_DIR / f"{name}.json").read_text())["measured_with"]
    assert dataclasses.replace(fresh, trace_seconds=0.0) == shipped, (
        f"shipped facts (measured with {measured_with}) differ from a trace with {installed}; "
        f"regenerate them: zerotrain regenerate {name}")


PLANS = [
    # Nothing fits, so the suggestions plan again: LoRA, a qint8 base, lower resolutions.
    ["--model", "flux-dev", "--gpus", "1xRTX4090-24GB", "--mode", "full"],
    ["--model", "sdxl-base", "--resolution", "768", "--gpus", "1xRTX4090-24GB", "--mode", "lora", "--quantize", "qint8"],
]


@pytest.mark.parametrize("args", PLANS, ids=["flux-dev-suggestions", "sdxl-base-lora"])
def test_a_first_plan_of_a_catalog_model_imports_no_torch(args, tmp_path):
    code = ("import json, sys\n"
            "from zerotrain.cli import main\n"
            f"code = main(['plan', *{args!r}, '--json'])\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.partition('.')[0] in {HEAVY!r})), file=sys.stderr)\n"
            "sys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)})
    assert done.returncode in (0, 1), done.stderr
    plan = json.loads(done.stdout)
    assert plan["facts_cached"] is True
    assert plan["plan"]["chosen"] or plan["plan"]["suggestions"]
    assert json.loads(done.stderr.splitlines()[-1]) == []
    assert not list(tmp_path.iterdir()), "nothing measured, nothing cached"


@pytest.mark.parametrize("name", ["flux-dev", "qwen-image"])
def test_a_fine_tunes_config_json_plans_from_its_base_models_shipped_facts_without_torch(name, tmp_path):
    """A model outside the catalog with a catalog model's architecture (a fine-tune's transformer/config.json,
    with the private keys diffusers writes) plans from that model's shipped facts: no trace, no torch, the
    same plan; a changed architecture does not (its facts would be another model's)."""
    config = {**resolve_model(ModelConfig(name_or_path=name)).config, "_diffusers_version": "0.99.0",
              "_name_or_path": "someone/fine-tune"}
    path = tmp_path / "fine-tune" / "transformer" / "config.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(config))
    args = ["--gpus", "8xA100-80GB", "--mode", "lora"]
    code = ("import contextlib, io, json, sys\n"
            "from zerotrain.cli import main\n"
            f"for model in ({name!r}, {str(path)!r}):\n"
            "    out = io.StringIO()\n"
            "    with contextlib.redirect_stdout(out):\n"
            f"        assert main(['plan', '--model', model, *{args!r}, '--json']) == 0\n"
            "    print(json.dumps(json.loads(out.getvalue())))\n"
            f"print(json.dumps(sorted(m for m in sys.modules if m.partition('.')[0] in {HEAVY!r})), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    catalog, fine_tune = (json.loads(line) for line in done.stdout.splitlines())
    assert fine_tune["model"]["facts_source"] == "shipped" and json.loads(done.stderr.splitlines()[-1]) == []
    assert json.loads(json.dumps(fine_tune["plan"]).replace(str(path), name)) == catalog["plan"]
    assert fine_tune["deepspeed_config"] == catalog["deepspeed_config"]
    deeper = {**config, "num_layers": int(config["num_layers"]) + 1}
    spec = resolve_model(ModelConfig(name_or_path=name))
    run = RunConfig(model={"name_or_path": name}, training={"mode": "lora"})
    tokens = families.of(spec).default_text_tokens
    assert shipped_facts(dataclasses.replace(spec, source="config.json", config=config), shipped_key(spec, run, tokens))
    changed = dataclasses.replace(spec, source="config.json", config=deeper)
    assert shipped_facts(changed, shipped_key(changed, run, tokens)) is None


def test_regenerate_refuses_a_model_it_does_not_ship_in_one_line(capsys):
    from zerotrain.cli import main

    assert main(["regenerate", "flux-dev", "tiny-flux"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zerotrain: error: tiny-flux: not shipped catalog models;") and "\n" not in err
