"""Resuming on another number of processes, through DeepSpeed's universal checkpointing.

1. Exactness (universal_worker.py): a run of `before` ranks takes one optimizer step of tiny-flux
   and checkpoints; a run of `after` ranks resumes from it. The resumed engine must hold exactly
   the saved fp32 master weights and Adam moments of every parameter, and the same step counters.
   ZeRO-2 and ZeRO-3, 2 -> 1 and 1 -> 2 processes. Resuming on the same world size and stage
   must not convert.
2. The training script: train.py stopped after 2 steps on `before` ranks continues on `after`
   ranks to step 4. It converts once, says so, and continues the global step, epoch, images and
   learning rate where the uninterrupted run has them. (Its losses cannot equal the uninterrupted
   run's: each rank draws the noise of its own samples, so other ranks draw other noise.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import run_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("universal_worker.py")
CASES = [(2, 2, 1), (2, 1, 2), (3, 2, 1), (3, 1, 2)]


def worker(mode: str, run_dir: Path, model_dir: Path, stage: int, world: int, tmp_path: Path,
           dump: bool = True) -> dict | None:
    import torch

    out = tmp_path / f"{mode}.pt" if dump else "-"
    returncodes, logs, _ = run_ranks([sys.executable, "-u", str(WORKER), mode, str(run_dir), str(model_dir),
                                      str(stage), str(out)], tmp_path / "logs", f"{mode}-w{world}", world=world)
    assert all(rc == 0 for rc in returncodes), "\n".join(log.read_text()[-3000:] for log in logs)
    return torch.load(out, weights_only=False) if dump else None


@pytest.mark.parametrize(("stage", "before", "after"), CASES,
                         ids=[f"zero{s}-{b}to{a}" for s, b, a in CASES])
def test_resumed_engine_holds_the_saved_state(shared_cache, tmp_path, stage, before, after):
    import torch

    run_dir, model_dir = tmp_path / "run", shared_cache / "models" / "tiny-flux"
    saved = worker("save", run_dir, model_dir, stage, before, tmp_path)
    loaded = worker("load", run_dir, model_dir, stage, after, tmp_path)
    assert (run_dir / "checkpoints" / "step-00000001" / "universal").is_dir()

    assert (loaded["global_steps"], loaded["scheduler_steps"]) == (saved["global_steps"], saved["scheduler_steps"]) \
        == (1, 1)
    assert loaded["params"].keys() == saved["params"].keys() and len(saved["params"]) > 50
    moved = sum(bool(state["exp_avg"].abs().sum()) for state in saved["params"].values())
    assert moved > len(saved["params"]) // 2, "the saved step left the Adam moments at zero: nothing to compare"
    differ = [f"{name}.{key}" for name, state in saved["params"].items() for key, tensor in state.items()
              if not torch.equal(tensor, loaded["params"][name][key])]
    assert not differ, f"ZeRO-{stage} {before}->{after}: {len(differ)} tensors differ after resuming, e.g. {differ[:4]}"


def test_same_world_size_loads_without_conversion(shared_cache, tmp_path):
    run_dir, model_dir = tmp_path / "run", shared_cache / "models" / "tiny-flux"
    worker("save", run_dir, model_dir, 2, 2, tmp_path)
    worker("load", run_dir, model_dir, 2, 2, tmp_path, dump=False)
    assert not (run_dir / "checkpoints" / "step-00000001" / "universal").exists()


@pytest.mark.parametrize(("stage", "before", "after"), [(2, 2, 1), (3, 1, 2)],
                         ids=["zero2-2to1", "zero3-1to2"])
def test_training_continues_on_another_world_size(train, stage, before, after):
    common = (f"planner.stages=[{stage}]", "planner.offload=[none]", "training.mode=full",
              "training.checkpoint_every=2", "training.resume=auto")
    a = train("A", *common, "training.max_steps=4").check()
    train("B", *common, "training.max_steps=2", world=before).check()
    b = train("B", *common, "training.max_steps=4", world=after).check()

    checkpoint = b.output_dir / "checkpoints" / "step-00000002"
    assert f"converting {checkpoint} to a universal checkpoint for {after} process(es)" in b.log, b.tails()
    assert f"resumed from {checkpoint} at step 2" in b.log, b.tails()
    assert (checkpoint / "universal").is_dir()
    assert (b.output_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    records_a, records_b = a.metrics(), b.metrics()
    for key in ("step", "epoch", "images", "lr"):
        assert [r[key] for r in records_b] == [r[key] for r in records_a], key
    print(f"ZeRO-{stage} {before}->{after}: uninterrupted {a.losses()} resumed {b.losses()}")
    assert all(0 < loss < 10 for loss in b.losses())
