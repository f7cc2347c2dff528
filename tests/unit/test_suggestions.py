"""What `zerotrain plan` suggests when nothing fits (planner/report.py), on catalog models whose
facts are shipped, so that each plan takes a fraction of a second."""

from __future__ import annotations

import pytest

from zerotrain.config import load_config
from zerotrain.hardware import hardware_facts
from zerotrain.models.catalog import resolve_model
from zerotrain.planner.measure import measure_model
from zerotrain.planner.report import suggestions
from zerotrain.planner.search import plan


@pytest.fixture(autouse=True)
def no_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no calibration or cached facts of the user's


def suggested(*overrides: str) -> list[str]:
    run = load_config(None, list(overrides))
    hw = hardware_facts(run.hardware)
    spec = resolve_model(run.model)
    facts = measure_model(spec, run)
    assert facts.cached
    assert plan(facts, hw, run).chosen is None
    return suggestions(spec, facts, hw, run)


def test_a_fixed_micro_batch_skips_what_cannot_apply():
    """Nothing fits at micro-batch 8 without checkpointing; more GPUs would have re-planned 2 GPUs
    with 4 images each, which micro-batch 8 does not divide, and failed."""
    found = suggested("model.name_or_path=sdxl-base", "data.resolution=1024", "hardware.gpus=1xRTX4090-24GB",
                      "training.mode=full", "training.global_batch_size=8", "training.micro_batch_size=8",
                      "planner.stages=[2]", "planner.offload=[cpu]", "training.gradient_checkpointing=false")
    assert found and not any("does not divide" in line for line in found)


def test_a_lower_memory_optimizer_is_suggested():
    base = ("model.name_or_path=flux-dev", "data.resolution=1024", "hardware.gpus=1xA100-80GB", "training.mode=full")
    found = suggested(*base)
    assert ("a lower-memory optimizer (bf16 master weights and moments instead of fp32): "
            "--set optimizer.name=adamw-bf16") in found
    run = load_config(None, [*base, "optimizer.name=adamw-bf16"])
    assert plan(measure_model(resolve_model(run.model), run), hardware_facts(run.hardware), run).chosen is not None
    # optimizer.name auto has tried every listed optimizer already
    assert not any("optimizer.name" in line for line in suggested(*base, "optimizer.name=auto",
                                                                  "hardware.host_memory=32GiB"))
