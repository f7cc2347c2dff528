"""Issue 50 §3: does ZeRO-3 with activation checkpointing leave the frozen base's parameters gathered? Since
DeepSpeed 0.19.3 that has been reported (recomputation re-gathers them, and nothing releases them), which would make
a LoRA plan at ZeRO-3 with checkpointing under-predict by the whole base. Two CPU ranks (retention_worker.py):
tiny-flux under LoRA at ZeRO-3, every parameter partitioned, with every block checkpointed and without; after the
forward, the backward and the step, how many frozen parameters each still holds gathered. This pins what the
installed DeepSpeed does, so that an upgrade that changes it fails here and the planner's ZeRO-3 terms are looked
at again."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import run_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("retention_worker.py")


def test_zero3_with_checkpointing_releases_the_frozen_base_after_the_backward(shared_cache, tmp_path):
    out = tmp_path / "retention.json"
    codes, logs, _ = run_ranks([sys.executable, "-u", str(WORKER), str(shared_cache / "models" / "tiny-flux"),
                                str(out)], tmp_path, "retention")
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    found = json.loads(out.read_text())
    print(json.dumps(found))
    for case, phases in found.items():
        assert phases["forward"]["frozen"] > 0 and phases["three held"]["gathered"] == 3, case
        for phase in ("backward", "step"):
            assert phases[phase]["gathered"] == 0, f"{case}: {phases[phase]} frozen parameters still gathered " \
                                                   f"after the {phase}"
