"""deepspeed_configs/ and examples/ stay true: presets are regenerated through the real CLI and
compared with what is committed; every example config plans.

The presets' tests are regression guards (test_regression_guard_*): what the planner writes and
predicts today against what it wrote and predicted when the preset was committed. Neither is a
measurement; a GPU measures the planner in benchmarks/gpu_suite.py."""

import json
from pathlib import Path

import pytest

from zerotrain.cli import main, regenerate_presets
from zerotrain.planner.presets import PRESETS, ROOT

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.fixture(autouse=True)
def facts_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))


def test_regression_guard_presets_do_not_drift(tmp_path, capsys):
    """A regression guard: planner output against a planner target, not a measurement. The committed
    presets are the planner's own output; a change to the planner that changes one fails here."""
    regenerate_presets(tmp_path)
    capsys.readouterr()
    for name in PRESETS:
        committed = ROOT / name
        assert committed.is_file(), f"{name} missing: run zerotrain presets"
        fresh = json.loads((tmp_path / name).read_text())
        assert json.loads(committed.read_text()) == fresh, (
            f"deepspeed_configs/{name} drifted from the planner; regenerate with zerotrain presets")
        assert fresh["_zerotrain"]["command"].startswith("zerotrain plan ")
    assert sorted(p.name for p in ROOT.glob("*.json")) == sorted(PRESETS)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_examples_plan(example, capsys):
    assert main(["plan", "--config", str(example), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["chosen"] is not None


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_regression_guard_every_preset_used_as_given_fits_with_the_settings_it_was_written_for(name):
    """A regression guard: planner output against a planner target, not a measurement ("fits" is
    the planner's prediction). Each preset as `deepspeed: <file>` through the path train.py plans
    with (train.plan_run, on the world size of the preset's GPUs): its "_zerotrain" header's
    training settings apply, and the planner's evaluation of the file fits with them, in the layout
    the preset was written for."""
    from zerotrain.cli import build_parser
    from zerotrain.config.flags import config_from_args
    from zerotrain.distributed import Topology
    from zerotrain.hardware import hardware_facts
    from zerotrain.models.catalog import resolve_model
    from zerotrain.train import plan_run

    path = ROOT / name
    preset = json.loads(path.read_text())
    args = build_parser().parse_args(["plan", *PRESETS[name], "--set", f"deepspeed={path}"])
    run = config_from_args(args)
    world = hardware_facts(run.hardware).world_size
    planned = plan_run(run, resolve_model(run.model), Topology(0, world, 0))
    assert planned.result.given is not None and planned.used.fits, planned.used.rejected
    header = preset["_zerotrain"]["training"]
    layout = planned.layout
    assert layout.gradient_checkpointing == header["gradient_checkpointing"]
    assert layout.offload_activations == header.get("activation_offload", False)
    if "checkpoint_blocks" in header:
        assert layout.checkpointed_blocks == header["checkpoint_blocks"]
    zero = preset["zero_optimization"]
    assert layout.stage == zero["stage"]
    assert layout.micro_batch == preset["train_micro_batch_size_per_gpu"]
    assert planned.notes == []
