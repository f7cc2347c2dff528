"""Resuming on another number of processes, through DeepSpeed's universal checkpointing.

1. Exactness (universal_worker.py): a run of `before` ranks takes one optimizer step of tiny-flux
   and checkpoints; a run of `after` ranks resumes from it. The resumed engine must hold exactly
   the saved fp32 master weights and Adam moments of every parameter, and the same step counters.
   ZeRO-2 and ZeRO-3, 2 -> 1 and 1 -> 2 processes. Resuming on the same world size and stage must
   not convert. (Another ZeRO stage is not offered: DeepSpeed 0.19's universal loading does not
   cross between ZeRO 0-2 and ZeRO-3 either way, so a resume keeps the saved stage, see
   checkpoint.resume_stage.)
2. The training script: train.py on `before` ranks stops at step 3 with a CUDA out-of-memory
   error (injected: testing.oom_at, past faults.oom_recovery_steps), which leaves its step-2 checkpoint as the latest; it
   continues on `after` ranks to step 4. It converts once, says so, and continues the global
   step, epoch, images and learning rate where the uninterrupted run (on `before` ranks) has
   them, with the same losses up to the resume. After it, the losses cannot equal the
   uninterrupted run's: each rank draws the noise of its own samples, so other ranks draw other
   noise; they must be close (RESUMED_LOSS_TOLERANCE). The uninterrupted run keeps only its
   newest training.keep_checkpoints checkpoints.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import run_ranks
from tests.distributed.quiet_output import assert_quiet

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("universal_worker.py")
# (stage saved, stage loaded, ranks saving, ranks loading)
# The state check in the two directions test_training_continues_on_another_world_size does not
# run end to end (it runs ZeRO-2 2 -> 1 and ZeRO-3 1 -> 2): together every stage goes both ways.
CASES = [(2, 2, 1, 2), (3, 3, 2, 1)]
# After a resume on another world size the ranks draw other noise and timesteps than the
# uninterrupted run's, so a step's loss (the mean over its 2 images) differs by sampling noise. One
# image's loss varies with a relative standard deviation of 2.3% over noise and timestep draws
# (tiny-flux at its initial weights, 4 of the bundled images, 40 draws each: 2.0-2.7%). The resumed
# steps differed from the uninterrupted run's by 0.8% and 3.4% (2 -> 1, ZeRO-2), 4.0% and 0.9%
# (1 -> 2, ZeRO-3). 12% is about 5 standard deviations of a step whose images all draw anew.
RESUMED_LOSS_TOLERANCE = 0.12


def worker(mode: str, run_dir: Path, model_dir: Path, stage: int, world: int, tmp_path: Path,
           dump: bool = True) -> dict | None:
    import torch

    out = tmp_path / f"{mode}.pt" if dump else "-"
    returncodes, logs, _ = run_ranks([sys.executable, "-u", str(WORKER), mode, str(run_dir), str(model_dir),
                                      str(stage), str(out)], tmp_path / "logs", f"{mode}-w{world}", world=world)
    assert all(rc == 0 for rc in returncodes), "\n".join(log.read_text()[-3000:] for log in logs)
    return torch.load(out, weights_only=False) if dump else None


@pytest.mark.parametrize(("saved_stage", "stage", "before", "after"), CASES,
                         ids=["zero2-1to2", "zero3-2to1"])
def test_resumed_engine_holds_the_saved_state(shared_cache, tmp_path, saved_stage, stage, before, after):
    import torch

    run_dir, model_dir = tmp_path / "run", shared_cache / "models" / "tiny-flux"
    saved = worker("save", run_dir, model_dir, saved_stage, before, tmp_path)
    loaded = worker("load", run_dir, model_dir, stage, after, tmp_path)
    assert (run_dir / "checkpoints" / "step-00000001" / "universal").is_dir()

    assert (loaded["global_steps"], loaded["scheduler_steps"]) == (saved["global_steps"], saved["scheduler_steps"]) \
        == (1, 1)
    assert loaded["params"].keys() == saved["params"].keys() and len(saved["params"]) > 50
    moved = sum(bool(state["exp_avg"].abs().sum()) for state in saved["params"].values())
    assert moved > len(saved["params"]) // 2, "the saved step left the Adam moments at zero: nothing to compare"
    differ = [f"{name}.{key}" for name, state in saved["params"].items() for key, tensor in state.items()
              if not torch.equal(tensor, loaded["params"][name][key])]
    assert not differ, f"ZeRO-{saved_stage}->{stage} {before}->{after}: {len(differ)} tensors differ after resuming, " \
                       f"e.g. {differ[:4]}"


def test_same_world_size_loads_without_conversion(shared_cache, tmp_path):
    run_dir, model_dir = tmp_path / "run", shared_cache / "models" / "tiny-flux"
    worker("save", run_dir, model_dir, 2, 2, tmp_path)
    worker("load", run_dir, model_dir, 2, 2, tmp_path, dump=False)
    assert not (run_dir / "checkpoints" / "step-00000001" / "universal").exists()


@pytest.mark.parametrize(("stage", "before", "after"), [(2, 2, 1), (3, 1, 2)],
                         ids=["zero2-2to1", "zero3-1to2"])
def test_training_continues_on_another_world_size(train, stage, before, after):
    common = (f"planner.stages=[{stage}]", "planner.offload=[none]", "training.mode=full",
              "training.checkpoint_every=2", "training.resume=auto", "training.max_steps=4")
    a = train("A", *common, "training.checkpoint_every=1", "training.keep_checkpoints=2", world=before).check()
    assert sorted(p.name for p in (a.output_dir / "checkpoints").glob("step-*")) == \
        ["step-00000003", "step-00000004"], "only the newest training.keep_checkpoints=2 may remain"
    assert (a.output_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"

    stopped = train("B", *common, "testing.oom_at=[3]", "faults.oom_recovery_steps=0", world=before)
    checkpoint = stopped.output_dir / "checkpoints" / "step-00000002"
    assert stopped.returncodes == [2] * before, stopped.tails()
    errors = [line for line in stopped.log.splitlines() if line.startswith("zerotrain: error:")]
    assert len(errors) == 1 and "Traceback" not in stopped.log, stopped.tails()
    assert re.fullmatch(
        rf"zerotrain: error: CUDA out of memory: rank 0 ran out of memory in the forward of step 3 with ZeRO-{stage}, "
        r"(no )?checkpointing, micro-batch \d+ "
        r"x accumulation \d+: the planner predicted \d+\.\d GiB per GPU, the peak measured on this rank was "
        r"0\.0 GiB allocated, 0\.0 GiB reserved \(CUDA out of memory.*\)\. --set planner\.headroom=0\.\d{4} makes "
        rf"the planner choose ZeRO-{stage}, .+ \(predicted \d+\.\d GiB per GPU\)\. The last checkpoint is untouched",
        errors[0]), errors[0]
    assert (stopped.output_dir / "checkpoints" / "latest").read_text().strip() == "step-00000002"
    assert sorted(p.name for p in (stopped.output_dir / "checkpoints").glob("step-*")) == ["step-00000002"]
    assert [r["step"] for r in stopped.metrics()] == [1, 2]

    b = train("B", *common, world=after).check()
    assert f"converting {checkpoint} to a universal checkpoint for {after} process(es)" in b.log, b.tails()
    assert f"resumed from {checkpoint} at step 2" in b.log, b.tails()
    assert_quiet(b)  # ds_to_universal's steps and bars, DeepSpeed's "MPU is not provided" on every rank
    assert (checkpoint / "universal").is_dir()
    assert (b.output_dir / "checkpoints" / "latest").read_text().strip() == "step-00000004"
    records_a, records_b = a.metrics(), b.metrics()
    for key in ("step", "epoch", "images", "lr"):
        assert [r[key] for r in records_b] == [r[key] for r in records_a], key
    losses_a, losses_b = a.losses(), b.losses()
    print(f"ZeRO-{stage} {before}->{after}: uninterrupted {losses_a} resumed {losses_b}; relative differences "
          f"{[round(lb / la - 1, 4) for la, lb in zip(losses_a, losses_b)]}")
    assert losses_b[:2] == losses_a[:2], "up to the resume B is the uninterrupted run on the same ranks"
    assert losses_b[2:] == pytest.approx(losses_a[2:], rel=RESUMED_LOSS_TOLERANCE)
