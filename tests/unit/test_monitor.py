"""zerotrain/monitor.py on one process without a GPU: what it writes and prints."""

from __future__ import annotations

import json

import pytest
import torch

from zerotrain.distributed import Topology
from zerotrain.monitor import Monitor, StepTimes
from zerotrain.planner.memory import MemoryEstimate

PREDICTED = MemoryEstimate(phases={"forward": 5 * 2**30, "backward": 6 * 2**30}, terms={"activations": 4 * 2**30},
                           peak_phase="backward", allocated=6 * 2**30, reserved=7 * 2**30, device_total=8 * 2**30,
                           host_per_node=0, nvme_per_node=0)


def make_monitor(tmp_path, lines, **kwargs) -> Monitor:
    options = {"max_steps": 4, "start_step": 0, "images_per_step": 8, "predicted": PREDICTED,
               "layout_text": "ZeRO-2, no checkpointing", "flops_per_image": 1e12, "peak_flops_per_gpu": None,
               "tensorboard": False, "progress_bar": "never", "memory_check_step": 2, "print_fn": lines.append}
    options.update(kwargs)
    return Monitor(tmp_path, Topology(0, 1, 0), torch.device("cpu"), **options)


def times(seconds: float) -> StepTimes:
    t = StepTimes()
    t.data, t.forward_backward, t.optimizer = 0.1 * seconds, 0.7 * seconds, 0.2 * seconds
    return t


def test_steps_are_written_and_printed(tmp_path):
    lines: list[str] = []
    monitor = make_monitor(tmp_path, lines)
    for step, loss in enumerate([1.0, 0.5, float("nan"), 0.25], start=1):
        monitor.step(step, 0, loss, 1e-4, 2.0, times(2.0), skipped=step == 3)
        monitor.memory_check(step)
    monitor.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["images_per_second"] == pytest.approx(4.0) and records[0]["images"] == 8
    assert records[1]["loss_smoothed"] == pytest.approx(0.9 * 1.0 + 0.1 * 0.5)
    assert records[2]["loss_smoothed"] == records[1]["loss_smoothed"], "a NaN must not poison the smoothed loss"
    assert records[3]["skipped_total"] == 1 and records[2]["skipped"] is True
    assert records[0]["mfu"] is None and records[0]["peak_allocated_bytes"] is None  # no GPU
    assert lines[0].startswith("step 1/4  epoch 0  loss 1.00000")
    assert "SKIPPED (non-finite loss or gradients; 1 so far)" in lines[3]
    memory_lines = [line for line in lines if line.startswith("memory after step 2")]
    assert len(memory_lines) == 1 and "planner predicted 6.0 GiB allocated, 7.0 GiB reserved" in memory_lines[0]
    memory = json.loads((tmp_path / "memory.json").read_text())
    assert memory["predicted"]["terms"] == {"activations": 4 * 2**30} and memory["measured"][0]["rank"] == 0


def test_every_n_steps_and_the_last(tmp_path):
    lines: list[str] = []
    monitor = make_monitor(tmp_path, lines, every=3, max_steps=7)
    for step in range(1, 8):
        monitor.step(step, 0, 1.0, 1e-4, None, times(1.0), skipped=False)
    monitor.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [3, 6, 7]


def test_mfu_uses_the_planners_flops_and_the_gpu_peak(tmp_path):
    monitor = make_monitor(tmp_path, [], peak_flops_per_gpu=1e15)
    monitor.device = torch.device("cuda")  # only the formula; nothing touches CUDA
    assert monitor.mfu(images_per_second=400.0) == pytest.approx(1e12 * 400 / 1e15)


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_progress_bar_and_tensorboard(tmp_path):
    monitor = make_monitor(tmp_path, [], progress_bar="always", tensorboard=True)
    monitor.step(1, 0, 1.0, 1e-4, 1.5, times(1.0), skipped=False)
    monitor.log("a line above the bar")
    monitor.step(2, 1, 0.5, 2e-4, None, times(2.0), skipped=True)
    monitor.close()
    logged = tensorboard_scalars(tmp_path)
    assert logged["train/loss"] == [(1, 1.0), (2, 0.5)]
    assert logged["train/lr"] == [(1, pytest.approx(1e-4)), (2, pytest.approx(2e-4))]
    assert logged["train/grad_norm"] == [(1, 1.5)], "an unknown gradient norm is not written"
    assert logged["train/skipped_steps"] == [(1, 0), (2, 1)]
    assert logged["train/epoch"] == [(1, 0), (2, 1)]
    assert logged["perf/images_per_second"] == [(1, 8.0), (2, 4.0)]
    assert logged["perf/step_seconds"] == [(1, 1.0), (2, 2.0)]
    assert logged["perf/forward_backward_seconds"] == [(1, pytest.approx(0.7)), (2, pytest.approx(1.4))]
    assert not any(tag.startswith("memory/") for tag in logged) and "perf/mfu" not in logged  # no GPU

    # A resumed run (from step 1) logs step 2 again: TensorBoard keeps only the new value.
    monitor = make_monitor(tmp_path, [], start_step=1, tensorboard=True)
    monitor.step(2, 1, 0.25, 2e-4, 1.0, times(1.0), skipped=False)
    monitor.close()
    logged = tensorboard_scalars(tmp_path)
    assert logged["train/loss"] == [(1, 1.0), (2, 0.25)]
    assert logged["train/skipped_steps"] == [(1, 0), (2, 0)]
