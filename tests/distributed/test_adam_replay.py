"""checkpoint.replay_cpu_adam_steps: a CPU Adam rebuilt at a resume, with the saved state and the
replay, continues bit for bit like the optimizer that never stopped, at every step. (DeepSpeed's
CPU kernels keep beta^t as a running product but recompute it with pow() after a jump.)

A single process, but here with the distributed tests: it needs DeepSpeed's CPU Adam op, which the
session builds in the background (tests/conftest.py) while the unit and e2e tests run; first among
the unit tests, it made them all wait for that build (about 2.5 minutes on CI's 2 cores)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.distributed

STEPS = 7


def train(resume_at: int | None, replay: bool) -> torch.Tensor:
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    from zerotrain.checkpoint import replay_cpu_adam_steps

    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(1000))
    optimizer = DeepSpeedCPUAdam([param], lr=1e-2)
    for step in range(STEPS):
        if step == resume_at:  # a resume: a new optimizer (a new C++ object) with the saved state
            state = {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[param].items()}
            optimizer = DeepSpeedCPUAdam([param], lr=1e-2)
            optimizer.state[param].update(state)
            if replay:
                replay_cpu_adam_steps(SimpleNamespace(optimizer=optimizer))
        torch.manual_seed(100 + step)
        param.grad = torch.randn(1000)
        optimizer.step()
    return param.detach().clone()


# Where a resume without the replay drifts (DeepSpeed 0.19's CPU Adam, measured): pow() and the
# running product of beta^t differ in the last bit only at some steps. The replay must matter at
# these resume points, or this test would not show that it works.
DRIFTS_WITHOUT_REPLAY = [2, 5]


def test_replay_makes_every_resume_point_exact():
    pytest.importorskip("deepspeed")
    straight = train(None, replay=False)
    exact = [torch.equal(straight, train(k, replay=True)) for k in range(1, STEPS)]
    assert all(exact), f"resumed at steps {[k for k, ok in enumerate(exact, 1) if not ok]} drift"
    drifted = [k for k in range(1, STEPS) if not torch.equal(straight, train(k, replay=False))]
    assert drifted == DRIFTS_WITHOUT_REPLAY, f"without the replay, resuming at steps {drifted} drifts"
