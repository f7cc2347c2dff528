"""A run survives what stops long runs (zerotrain/faults.py), on two CPU ranks of the tiny example:

- A NaN loss on rank 0 at one step: every rank skips that step (no hang, no update), the metrics
  and the log say so, and the run goes on. The same run's metrics.jsonl and TensorBoard events are
  read back for every scalar the monitor writes.
- NaN losses at K consecutive steps: the run stops with a checkpoint and a message (exit 2).
- A checkpoint that fails to write on rank 0 only (as a node-local disk filling up would): the
  partial folder is removed, `latest` still names the previous checkpoint, every rank stops with one
  clear line, and resuming works.

SIGTERM preemption, kill -9, kills during checkpoint writes and a real full disk: test_chaos.py.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.conftest import WORLD

pytestmark = pytest.mark.distributed

COMMON = ("planner.stages=[2]", "planner.offload=[none]", "training.mode=full", "training.resume=auto")


def scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_a_nan_step_is_skipped_on_every_rank_and_metrics_read_back(train):
    import math

    result = train("nan", *COMMON, "training.max_steps=5", "training.checkpoint_every=1000",
                   "testing.nan_at=[3]").check()
    records = result.metrics()
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [r["skipped"] for r in records] == [False, False, True, False, False]
    assert math.isnan(records[2]["loss"]), "the NaN loss must be reported as NaN, not replaced"
    assert records[2]["grad_norm"] is None or not math.isfinite(records[2]["grad_norm"])
    assert [r["skipped_total"] for r in records] == [0, 0, 1, 1, 1]
    assert all(math.isfinite(r["loss"]) for r in records if not r["skipped"])
    assert "SKIPPED (non-finite loss or gradients; 1 so far)" in result.log

    for record in records:  # every scalar the monitor writes is in the JSONL
        for key in ("epoch", "images", "loss_smoothed", "lr", "grad_norm", "images_per_second", "step_seconds",
                    "data_seconds", "forward_backward_seconds", "optimizer_seconds", "peak_allocated_bytes",
                    "peak_reserved_bytes", "mfu"):
            assert key in record, key
        assert record["step_seconds"] >= record["forward_backward_seconds"] > 0
    logged = scalars(result.output_dir)
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/skipped_steps", "perf/images_per_second",
                "perf/step_seconds", "perf/data_seconds", "perf/forward_backward_seconds", "perf/optimizer_seconds"):
        assert tag in logged, f"{tag} not in TensorBoard events: {sorted(logged)}"
    assert [step for step, _ in logged["train/lr"]] == [1, 2, 3, 4, 5]
    assert logged["train/skipped_steps"][-1][1] == 1
    assert "memory/peak_allocated_gib" not in logged and "perf/mfu" not in logged  # no GPU here
    memory = json.loads((result.output_dir / "memory.json").read_text())
    assert memory["step"] == 3 and len(memory["measured"]) == WORLD and memory["predicted"]["allocated"] > 0
    assert "memory after step 3: planner predicted" in result.log


def test_consecutive_nan_steps_stop_with_a_checkpoint(train):
    result = train("nans", *COMMON, "training.max_steps=10", "training.checkpoint_every=1000",
                   "testing.nan_at=[2,3,4]", "faults.max_bad_steps=3")
    assert result.returncodes == [2] * WORLD, result.tails()
    checkpoints = result.output_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000004"
    assert f"3 consecutive steps (up to step 4) had a non-finite loss or gradient norm and were skipped; " \
           f"stopped with {checkpoints / 'step-00000004'}" in result.log, result.tails()
    assert "Traceback" not in result.log
    resumed = train("nans", *COMMON, "training.max_steps=6", "training.checkpoint_every=1000").check()
    assert "at step 4" in resumed.log and [r["step"] for r in resumed.metrics()][-2:] == [5, 6]


def test_a_failed_checkpoint_write_keeps_the_previous_one(train):
    result = train("disk", *COMMON, "training.max_steps=6", "training.checkpoint_every=2",
                   "testing.save_failure_at=[4]")
    assert result.returncodes == [2] * WORLD, result.tails()
    checkpoints = result.output_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000002"
    assert not (checkpoints / "step-00000004").exists(), "the partial checkpoint must be removed"
    assert f"checkpoint {checkpoints / 'step-00000004'} could not be written (No space left on device" in result.log
    assert f"{checkpoints / 'step-00000002'} is still the latest checkpoint" in result.log
    assert "Traceback" not in result.log
    resumed = train("disk", *COMMON, "training.max_steps=6", "training.checkpoint_every=2").check()
    assert f"resumed from {checkpoints / 'step-00000002'} at step 2" in resumed.log
    assert (checkpoints / "latest").read_text().strip() == "step-00000006"


def test_data_changed_between_runs_restarts_the_epoch(train, tmp_path):
    """Training reads the cache, so a dataset file that disappears or changes during a run changes
    nothing until the next start. There, the cache is checked again (data policy), and the
    sampling order, which no longer matches, restarts the interrupted epoch with a warning."""
    import shutil

    from tests.distributed.conftest import TINY_DATA

    data = tmp_path / "data"
    shutil.copytree(TINY_DATA, data)
    dataset = f"data.datasets=[{{path: '{data}', repeats: 1}}]"
    first = train("data", *COMMON, dataset, "training.max_steps=3", "training.checkpoint_every=1000").check()
    assert [r["epoch"] for r in first.metrics()] == [0, 0, 0]
    removed = min(p for p in data.iterdir() if p.suffix in (".png", ".jpg", ".jpeg", ".webp"))
    removed.unlink()
    resumed = train("data", *COMMON, dataset, "training.max_steps=5", "training.checkpoint_every=1000").check()
    assert "cannot resume the sampling order exactly" in resumed.log and "epoch 0 starts over" in resumed.log
    assert "resumed from" in resumed.log and [r["step"] for r in resumed.metrics()] == [1, 2, 3, 4, 5]
