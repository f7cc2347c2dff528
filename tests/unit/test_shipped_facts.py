"""The facts shipped for the catalog models (zerotrain/planner/shipped_facts/): every catalog model,
usual resolution and training mode is there, a sample equals a fresh trace with the installed
torch, diffusers and peft, and a first plan of a catalog model imports none of them; a fine-tune's
config.json as save_pretrained writes it (the class defaults spelled out) plans from them too."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

from zerotrain import families
from zerotrain.config import ModelConfig, RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import catalog_names, resolve_model
from zerotrain.planner import trace
from zerotrain.planner.facts import pack_facts, unpack_facts
from zerotrain.planner.measure import SHIPPED_DIR, facts_key, measure_model, shipped_facts
from zerotrain.planner.references import plan_references
from zerotrain.planner.shipped import class_defaults, shipped_models, shipped_runs

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


def saved_config(name: str, folder: Path) -> Path:
    """A fine-tune's denoiser config.json as diffusers writes it (save_pretrained calls save_config): every argument
    of the real class, those the catalog config leaves out at their defaults, and the private keys, from_pretrained's
    _name_or_path among them. Built from the catalog config on the meta device."""
    spec = resolve_model(ModelConfig(name_or_path=name))
    with torch.device("meta"):
        model = spec.denoiser_class().from_config(spec.config)
    model.register_to_config(_name_or_path=f"someone/{name}-fine-tune")
    model.save_config(folder)
    return folder / "config.json"


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
                rows = families.of(spec).reference_text_rows(spec, plan_references(spec, run))  # an edit's images
                assert facts.text_tokens == families.of(spec).default_text_tokens + rows
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


def test_files_record_the_defaults_of_the_installed_denoiser_class():
    """The class defaults a file's keys were made with are the installed diffusers' (shipped.class_defaults): a
    diffusers that adds an argument writes it into every saved config, which the shipped facts then miss."""
    for name in shipped_models():
        spec = resolve_model(ModelConfig(name_or_path=name))
        recorded = json.loads((SHIPPED_DIR / f"{name}.json").read_text())["defaults"]
        assert recorded == {spec.class_name: class_defaults(spec.denoiser_class())}, (
            f"{name}.json records the defaults of another diffusers; regenerate it: zerotrain regenerate {name}")


@pytest.mark.parametrize("name", shipped_models())
def test_a_save_pretrained_config_plans_every_shipped_run_from_the_shipped_facts(name, tmp_path, monkeypatch):
    """A fine-tune's config.json as save_pretrained writes it spells out the arguments the catalog config leaves
    at their class defaults (Qwen-Image's zero_cond_t, use_additional_t_cond, use_layer3d_rope): the same
    architecture, so every shipped run of the catalog model plans from the shipped facts, not a trace."""
    monkeypatch.setattr(trace, "measure", no_tracing)
    path = saved_config(name, tmp_path / "fine-tune" / "transformer")
    catalog = resolve_model(ModelConfig(name_or_path=name))
    if catalog.pipeline_class:  # an edit model's fine-tune is its folder: the index names the edit pipeline
        (tmp_path / "fine-tune" / "model_index.json").write_text(json.dumps(
            {"_class_name": catalog.pipeline_class, "transformer": ["diffusers", catalog.class_name]}))
        path = tmp_path / "fine-tune"
    spec = resolve_model(ModelConfig(name_or_path=str(path)))
    assert spec.config.keys() >= {*catalog.config, *class_defaults(spec.denoiser_class())}
    for run in shipped_runs(name):
        resolution, training = run.data.resolution, run.training.model_dump(include={"mode", "quantize_base"})
        facts = measure_model(spec, catalog_run(str(path), resolution, training, tmp_path))
        assert facts.source == "shipped" and facts.model == str(path)
        base = measure_model(catalog, catalog_run(name, resolution, training, tmp_path))
        assert dataclasses.replace(facts, model=name) == base
    assert not list(tmp_path.glob("*.json")), "nothing traced, nothing cached"


def test_a_saved_config_with_another_value_for_an_argument_the_catalog_leaves_out_is_another_architecture(tmp_path):
    """Only an argument at its class default is the argument left out: sd3.5-large's config leaves out
    dual_attention_layers (default none); a saved config with dual attention in block 0 is another model."""
    path = saved_config("sd3.5-large", tmp_path / "transformer")
    assert "dual_attention_layers" not in resolve_model(ModelConfig(name_or_path="sd3.5-large")).config
    config = json.loads(path.read_text())
    assert config["dual_attention_layers"] == []
    spec = resolve_model(ModelConfig(name_or_path=str(path)))
    changed = dataclasses.replace(spec, config={**config, "dual_attention_layers": [0]})
    run = RunConfig(model={"name_or_path": str(path)}, data={"resolution": 1024}, training={"mode": "lora"})
    tokens = families.of(spec).default_text_tokens
    assert shipped_facts(spec, run, tokens) is not None
    assert shipped_facts(changed, run, tokens) is None
    assert facts_key(changed, run, tokens) != facts_key(spec, run, tokens)


# One tiny model of each denoiser class whose tiny config leaves arguments out (two traces of 1-4 s each).
TINY = ["tiny-chroma", "tiny-flux", "tiny-flux2", "tiny-qwen-image", "tiny-sdxl", "tiny-z-image"]


@pytest.mark.parametrize("name", TINY)
def test_an_argument_at_its_class_default_traces_and_caches_as_the_argument_left_out(name, tmp_path, monkeypatch):
    """What the normalisation rests on: diffusers and zerotrain's families build and read an argument left out as
    its class default, so the saved config traces to the catalog config's facts; and the user cache's key is the
    same, so a trace of one serves the other."""
    catalog = resolve_model(ModelConfig(name_or_path=name))
    assert class_defaults(catalog.denoiser_class()).keys() - catalog.config.keys(), f"{name} leaves nothing out"
    saved = json.loads(saved_config(name, tmp_path / "transformer").read_text())
    spec = dataclasses.replace(catalog, source="config.json", config=saved)  # the tiny VAE kept: only the config differs
    run = catalog_run(name, 128, {"mode": "lora"}, tmp_path / "cache")
    traced = measure_model(catalog, run)
    fresh = measure_model(spec, run, cache=False)
    assert dataclasses.replace(fresh, trace_seconds=0.0) == dataclasses.replace(traced, trace_seconds=0.0)
    monkeypatch.setattr(trace, "measure", no_tracing)
    cached = measure_model(spec, run)
    assert cached.source == "cached" and cached == traced


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
    """A model outside the catalog with a catalog model's architecture (a fine-tune's transformer/config.json as
    save_pretrained writes it: every argument, defaults included, and private keys) plans from that model's shipped
    facts: no trace, no torch, the same plan; a changed architecture does not (its facts would be another model's)."""
    path = saved_config(name, tmp_path / "fine-tune" / "transformer")
    config = json.loads(path.read_text())
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
    assert shipped_facts(dataclasses.replace(spec, source="config.json", config=config), run, tokens)
    assert shipped_facts(dataclasses.replace(spec, source="config.json", config=deeper), run, tokens) is None


def test_regenerate_refuses_a_model_it_does_not_ship_in_one_line(capsys):
    from zerotrain.cli import main

    assert main(["regenerate", "flux-dev", "tiny-flux"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("zerotrain: error: tiny-flux: not shipped catalog models;") and "\n" not in err
