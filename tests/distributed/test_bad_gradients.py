"""A finite loss with non-finite gradients on one rank (bad_grad_worker.py, two CPU ranks): DeepSpeed
skips the step on every rank at every ZeRO stage, as zerotrain relies on (train.py counts a step
DeepSpeed did not apply as skipped; docs/training.md, "Surviving faults"): the weights stay as they were, the
LR schedule does not advance, and the next good step trains. With bf16.check_grad_overflow: false,
which zerotrain refuses in a given DeepSpeed JSON, ZeRO-2 applies the bad step and the weights
become non-finite: the reason for the refusal."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import WORLD, run_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("bad_grad_worker.py")


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    tmp_path = tmp_path_factory.mktemp("bad_grad")
    out = tmp_path / "seen.json"
    returncodes, logs, _ = run_ranks([sys.executable, "-u", str(WORKER), str(out)], tmp_path / "logs", "bad-grad")
    assert returncodes == [0] * WORLD, "\n".join(log.read_text()[-3000:] for log in logs)
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", ["zero0", "zero1", "zero2", "zero3"])
def test_non_finite_gradients_skip_the_step_on_every_rank(seen, case):
    for rank, steps in enumerate(seen[case]):
        assert steps["loss_finite"] == [True, True, True], (case, rank, steps)
        assert steps["applied"] == [True, False, True], (case, rank, steps)
        assert steps["changed"] == [True, False, True], (case, rank, steps)
        assert steps["weights_finite"] == [True, True, True], (case, rank, steps)
        assert steps["scheduler_steps"] == [1, 1, 2], (case, rank, steps)
        good, bad, _ = steps["grad_norm"]
        assert isinstance(good, float) and good > 0 and bad == "nonfinite", (case, rank, steps)


def test_without_the_overflow_check_the_bad_step_is_applied(seen):
    for rank, steps in enumerate(seen["zero2-no-overflow-check"]):
        assert steps["applied"][:2] == [True, True], (rank, steps)
        assert steps["weights_finite"][1] is False, (rank, steps)
