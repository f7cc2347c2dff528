"""deepspeed_configs/ and examples/ stay true: presets are regenerated through the real CLI and
compared with what is committed; every example config plans."""

import json
from pathlib import Path

import pytest

from zerotrain.cli import main
from zerotrain.planner.presets import PRESETS, ROOT, regenerate

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.fixture(autouse=True)
def facts_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-cache"))


def test_presets_do_not_drift(tmp_path, capsys):
    regenerate(tmp_path)
    capsys.readouterr()
    for name in PRESETS:
        committed = ROOT / name
        assert committed.is_file(), f"{name} missing: run python -m zerotrain.planner.presets"
        fresh = json.loads((tmp_path / name).read_text())
        assert json.loads(committed.read_text()) == fresh, (
            f"deepspeed_configs/{name} drifted from the planner; regenerate with python -m zerotrain.planner.presets")
        assert fresh["_zerotrain"]["command"].startswith("zerotrain plan ")
    assert sorted(p.name for p in ROOT.glob("*.json")) == sorted(PRESETS)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_examples_plan(example, capsys):
    assert main(["plan", "--config", str(example), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["chosen"] is not None
