"""A full fine-tune's gradients never read memory that was not written first: two CPU ranks of
train.py on the tiny example at ZeRO-2, every block checkpointed, and a reduce bucket of 10k
elements so that each backward fills several buckets and swaps between the two of overlap_comm
(the tiny Flux has 79k parameters; a full-width model's hundreds of millions fill several 200M
buckets the same way). Each rank first turns on torch's deterministic mode with
fill_uninitialized_memory (through tests/distributed/patched.py), which fills every torch.empty,
and so every bucket, partition and gradient buffer DeepSpeed allocates, with NaN: a read before a
write makes a gradient non-finite and DeepSpeed's bf16 overflow check skips the step.

This was the suspect for the "OVERFLOW! Skipping step" of ZeRO-1/2 full fine-tune steps on the
first H200 run (issue 38), and on CPU it reads nothing unwritten: no skipped step at ZeRO-1 and
ZeRO-2, with overlap_comm on and off, small buckets and one large one, one rank and two, eager and
compiled blocks, and in calibrate's own layouts. What CPU cannot show is a race between CUDA
streams on the same path (DeepSpeed's CPU accelerator runs the stream code not at all)."""

from __future__ import annotations

import atexit
import math
import re

import pytest

from tests.distributed import patched

pytestmark = pytest.mark.distributed

STEPS = 3
BUCKET = 10_000
PROBE = re.compile(r"nan fill probe: (\d+) bucket reductions in (\d+) steps")


def nan_fill() -> None:
    """Installed in each rank (patched.py): NaN in every new floating tensor, and a line at exit with
    how many buckets DeepSpeed reduced."""
    import torch
    import torch.utils.deterministic
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    # torch fills uninitialised memory only under deterministic algorithms.
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    # A torch that dropped or renamed the setting would let the test pass without looking.
    if not torch.isnan(torch.empty(8)).all():
        raise RuntimeError("fill_uninitialized_memory did not fill torch.empty with NaN")
    seen = {"reductions": 0, "steps": 0}
    reduce, step = DeepSpeedZeroOptimizer.average_tensor, DeepSpeedZeroOptimizer.step

    def average_tensor(self, *args, **kwargs):  # one call per bucket reduced
        seen["reductions"] += 1
        return reduce(self, *args, **kwargs)

    def counted_step(self, *args, **kwargs):
        seen["steps"] += 1
        return step(self, *args, **kwargs)

    DeepSpeedZeroOptimizer.average_tensor, DeepSpeedZeroOptimizer.step = average_tensor, counted_step
    atexit.register(lambda: print(f"nan fill probe: {seen['reductions']} bucket reductions in {seen['steps']} steps",
                                  flush=True))


def test_zero2_small_buckets_read_no_uninitialized_memory(train, monkeypatch):
    result = patched.run(train, monkeypatch, "tests.distributed.test_uninitialized_memory:nan_fill", "nan-fill",
                         "training.mode=full", "planner.stages=[2]", "planner.offload=[none]",
                         "training.gradient_checkpointing=true", "planner.overlap_comm=true",
                         f"planner.reduce_bucket_size={BUCKET}", f"planner.allgather_bucket_size={BUCKET}",
                         f"training.max_steps={STEPS}", "training.checkpoint_every=1000")
    records = result.metrics() if (result.output_dir / "metrics.jsonl").is_file() else []
    skipped = [r["step"] for r in records if r["skipped"]]
    assert not skipped, f"steps {skipped} were skipped: their gradients read memory never written\n{result.tails()}"
    result.check()
    for rank, log in enumerate(result.logs):
        probe = PROBE.search(log.read_text(errors="replace"))
        assert probe, f"rank {rank} printed no probe line:\n{result.tails()}"
        reductions, steps = (int(x) for x in probe.groups())
        assert steps == STEPS and reductions >= 3 * STEPS, probe[0]  # several buckets, both buffers reused
    assert len(records) == STEPS, records
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in records), records
