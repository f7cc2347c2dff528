"""training.activation_offload=true as a user runs it: two CPU ranks of train.py on the tiny
example, with every block checkpointed and its large inputs kept as host copies until backward.

On the CPU accelerator recompute's offload moves nothing (host and device are one memory), so each
rank first installs tests/unit/test_activation_offload.py's CpuAsAccelerator (through
tests/distributed/patched.py): the engine's OffloadingCheckpoint with the product's predicate, host
copy and recomputation, CPU tensors counting as the accelerator's, and the tiny model's 1 KiB
threshold (the planner measures what moves with it too, into a facts cache of its own). Its
host copies and gradients are checked in the unit test; here the run plans the offload, says so,
really moves every checkpointed block's inputs at every step, trains and checkpoints.

With training.gradient_checkpointing left at auto, activation_offload=true is not applied where the
activations fit without checkpointing (the planner then checkpoints nothing, so offloads nothing):
the run sets both, as benchmarks/gpu_suite.py does."""

from __future__ import annotations

import atexit
import json
import re

import pytest

from tests.distributed import patched

pytestmark = pytest.mark.distributed

STEPS = 4
PROBE = re.compile(r"offload probe: (\d+) host copies of (\d+) bytes, (\d+) separate")


def offload_on_cpu() -> None:
    """Installed in each rank (patched.py): CpuAsAccelerator, and a line at exit with what it moved."""
    from tests.unit.test_activation_offload import CpuAsAccelerator

    CpuAsAccelerator.install()

    def report() -> None:
        copies = sum(len(m.copies) for m in CpuAsAccelerator.made)
        moved = sum(m.moved_bytes for m in CpuAsAccelerator.made)
        separate = sum(sum(m.separate) for m in CpuAsAccelerator.made)
        print(f"offload probe: {copies} host copies of {moved} bytes, {separate} separate", flush=True)

    atexit.register(report)


def test_activation_offload_trains_through_train_py(train, monkeypatch, tmp_path):
    result = patched.run(train, monkeypatch, "tests.distributed.test_train_activation_offload:offload_on_cpu", "offload",
                         "training.activation_offload=true", "training.gradient_checkpointing=true",
                         f"training.max_steps={STEPS}", "training.checkpoint_every=1000",
                         f"planner.cache_dir={tmp_path / 'offload-facts'}").check()
    assert "gradient checkpointing, activation offload on" in result.log, result.tails()
    layout = json.loads((result.output_dir / "plan.json").read_text())["chosen"]["layout"]
    assert layout["offload_activations"] and layout["gradient_checkpointing"], layout
    assert layout["checkpointed_blocks"] is None, layout
    for rank, log in enumerate(result.logs):
        probe = PROBE.search(log.read_text(errors="replace"))
        assert probe, f"rank {rank} printed no offload probe:\n{result.tails()}"
        copies, moved, separate = (int(x) for x in probe.groups())
        # every step moves the inputs of every block (tiny-flux: the image and text states into its
        # double block, and into its single block)
        assert copies >= STEPS * 2 and moved > 0 and separate == copies, probe[0]
    losses = result.losses()
    assert len(losses) == STEPS and len(set(losses)) == STEPS, losses
    assert (result.output_dir / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:08d}"
