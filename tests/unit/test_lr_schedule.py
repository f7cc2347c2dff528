"""The learning-rate schedules (engine.lr_lambda, engine.make_scheduler): the learning rate every
optimizer step uses, as DeepSpeed drives the scheduler (built at initialize, stepped after each
applied optimizer step), through the warmup, its boundary and the last step.

Step k (counted from 1) of a warmup of W steps uses lr x k / W, so the first step trains (at
lr / W) and step W uses the peak. The decay then runs over the remaining max_steps - W steps from
the peak: linear reaches lr / (max_steps - W) at the last step, cosine (1 + cos(pi (n-1)/n)) / 2
of the peak, with n = max_steps - W; neither reaches 0 within the run."""

from __future__ import annotations

import math

import pytest
import torch

from zerotrain.engine import lr_lambda, make_scheduler

ROOT_2 = math.sqrt(2)


def lrs_used(warmup: int, total: int, schedule: str, peak: float = 1.0) -> list[float]:
    """The learning rate of each of `total` optimizer steps, read from the optimizer when the step
    runs: make_scheduler on a real optimizer, stepped after every optimizer step as DeepSpeed's
    engine.step() does."""
    from zerotrain.config import RunConfig

    run = RunConfig.model_validate({"training": {"max_steps": total},
                                    "optimizer": {"lr": peak, "schedule": schedule, "warmup_steps": warmup}})
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=peak)
    scheduler = make_scheduler(optimizer, run)
    used = []
    for _ in range(total):
        used.append(optimizer.param_groups[0]["lr"])
        param.grad = torch.ones(1)
        optimizer.step()
        scheduler.step()
    return used


@pytest.mark.parametrize(("warmup", "total", "schedule", "expected"), [
    # constant, no warmup: the peak throughout
    (0, 3, "constant", [1.0, 1.0, 1.0]),
    # warmup 4: 1/4, 2/4, 3/4, then the peak at step 4 and on
    (4, 6, "constant", [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]),
    # linear without warmup over 4 steps: the last step uses 1/4 of the peak
    (0, 4, "linear", [1.0, 0.75, 0.5, 0.25]),
    # warmup 4, then linear over the remaining 6 steps: the peak twice (steps 4 and 5), down to 1/6
    (4, 10, "linear", [0.25, 0.5, 0.75, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]),
    # warmup 2, then cosine over 4 steps: cos(0), cos(pi/4), cos(pi/2), cos(3pi/4) mapped to [0, 1]
    (2, 6, "cosine", [0.5, 1.0, 1.0, (2 + ROOT_2) / 4, 0.5, (2 - ROOT_2) / 4]),
    # the test runs' schedule (tests/distributed/test_train_resume.py): warmup 4 of 6 steps
    (4, 6, "cosine", [0.25, 0.5, 0.75, 1.0, 1.0, 0.5]),
    # a warmup as long as the run never decays; a longer one never reaches the peak
    (3, 3, "linear", [1 / 3, 2 / 3, 1.0]),
    (5, 3, "cosine", [0.2, 0.4, 0.6]),
])
def test_each_step_uses_the_scheduled_learning_rate(warmup, total, schedule, expected):
    assert lrs_used(warmup, total, schedule) == pytest.approx(expected, rel=1e-12, abs=0)
    assert lrs_used(warmup, total, schedule, peak=1e-4) == pytest.approx([1e-4 * e for e in expected], rel=1e-12)
    # lr_lambda is the multiplier of the step with 0-based index i
    assert [lr_lambda(i, warmup, total, schedule) for i in range(total)] == pytest.approx(expected, rel=1e-12)


def test_the_first_warmup_step_trains_and_step_w_is_the_peak():
    for warmup in (1, 2, 10, 1000):
        used = lrs_used(warmup, warmup + 2, "linear", peak=1e-3)
        assert used[0] == pytest.approx(1e-3 / warmup, rel=1e-12) and used[0] > 0
        assert used[warmup - 1] == pytest.approx(1e-3, rel=1e-12)
        assert max(used) == pytest.approx(1e-3, rel=1e-12)
        assert used[:warmup] == sorted(used[:warmup])


def test_a_scheduler_restored_from_its_state_continues_the_schedule():
    """What a resume does: a new scheduler for the rebuilt optimizer, loaded with the saved
    scheduler state (DeepSpeed's lr_scheduler.state_dict in the checkpoint), continues the
    uninterrupted schedule, also in the middle of the warmup."""
    from zerotrain.config import RunConfig

    run = RunConfig.model_validate({"training": {"max_steps": 8},
                                    "optimizer": {"lr": 1.0, "schedule": "cosine", "warmup_steps": 4}})
    straight = lrs_used(4, 8, "cosine")
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = make_scheduler(optimizer, run)
    for _ in range(2):  # two steps, then "checkpoint"
        optimizer.step()
        scheduler.step()
    saved = scheduler.state_dict()
    optimizer = torch.optim.SGD([param], lr=1.0)
    scheduler = make_scheduler(optimizer, run)
    scheduler.load_state_dict(saved)
    optimizer.param_groups[0]["lr"] = scheduler.get_last_lr()[0]  # as the optimizer state's param_groups restore it
    resumed = []
    for _ in range(6):
        resumed.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert resumed == straight[2:]
