"""faults.collective_timeout_seconds ends ranks blocked by a peer that is alive but never joins their collective (a
hung data loader, a deadlock in one rank's main thread): heartbeats cannot help there, since the peer's background
thread still beats.

1. Two CPU ranks of train.py on the tiny example (through tests/distributed/patched.py): rank 1's main thread
   hangs fetching the data of step HANG_AT (sleeping; its heartbeat thread runs on). Rank 0 goes on into the step
   and waits in the backward's gradient reduction, on DeepSpeed's data-parallel group (ZeRO-2 with overlap_comm).
   After the timeout, each rank's heartbeat ends it (exit 3) with one line: where it is, where the other is,
   which one is behind and what to look at; the checkpoint of the step before stays the latest. The process
   groups' own timeout (60 s longer) is not reached: this is the path NCCL takes too, whose watchdog would
   otherwise abort without a word.
2. DeepSpeed's own groups get the timeout (deepspeed_compat.group_timeouts): two ranks after
   deepspeed.init_distributed with a 3 s timeout, rank 0 alone in an all-reduce on a group made through
   deepspeed.comm (as its data-parallel clone of the world is): gloo raises within seconds, not after torch's
   30-minute default.
test_chaos.py covers the peer that dies (the heartbeat names it)."""

from __future__ import annotations

import os
import re
import sys
import time

import pytest

from tests.distributed import patched
from tests.distributed.conftest import run_ranks, start_ranks

pytestmark = pytest.mark.distributed

HANG_AT = 3
TIMEOUT_S = 10
HANGS = re.compile(r"rank 1 hangs in the data of step (\d+)")


def hang_rank1() -> None:
    """Installed in each rank (patched.py): on rank 1, fetching the first micro-batch of step HANG_AT sleeps,
    the heartbeat thread left running."""
    if os.environ.get("RANK") != "1":
        return
    import zerotrain.trainer

    call = zerotrain.trainer.DataFeed.__call__

    def hanging(self, index):
        if self.step == HANG_AT:
            print(f"rank 1 hangs in the data of step {self.step}", flush=True)
            time.sleep(3600)
        return call(self, index)

    zerotrain.trainer.DataFeed.__call__ = hanging


def test_ranks_blocked_by_a_live_peer_stop_after_the_collective_timeout_with_one_line_each(train, monkeypatch):
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.measure import measure_model

    overrides = ("planner.stages=[2]", "planner.offload=[none]", "planner.overlap_comm=true", "training.max_steps=6",
                 "training.checkpoint_every=2", f"faults.collective_timeout_seconds={TIMEOUT_S}")
    # The planner's facts are measured here, so that rank 0 plans from the cache while rank 1 waits for the plan.
    run = train.run_config(*overrides)
    measure_model(resolve_model(run.model), run)
    monkeypatch.setenv(patched.PATCH_ENV, "tests.distributed.test_collective_timeout:hang_rank1")
    procs, logs = start_ranks(patched.args(train, "hang", *overrides), train.tmp_path / "logs", "hang")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and procs[0].poll() is None and not HANGS.search(logs[1].read_text()):
            time.sleep(0.1)
        hung = time.monotonic()

        def texts() -> list[str]:
            return [log.read_text(errors="replace") for log in logs]

        assert HANGS.search(texts()[1]), "rank 1 never reached the hang:\n" + "\n".join(
            f"--- rank {r}\n{text[-3000:]}" for r, text in enumerate(texts()))
        bound = TIMEOUT_S + 40  # the timeout, the heartbeat's next beat, leaving; slack for a loaded machine
        while time.monotonic() < hung + bound and any(proc.poll() is None for proc in procs):
            time.sleep(0.1)
        waited = time.monotonic() - hung
        tails = "\n".join(f"--- rank {r}\n{text[-3000:]}" for r, text in enumerate(texts()))
        assert [proc.poll() for proc in procs] == [3, 3], f"{waited:.0f} s after rank 1 hung:\n{tails}"
        assert waited >= TIMEOUT_S - 5, f"stopped {waited:.1f} s after rank 1 hung, before the timeout:\n{tails}"
        errors = [[line for line in text.splitlines() if line.startswith("zerotrain: error:")] for text in texts()]
        assert [len(e) for e in errors] == [1, 1] and "Traceback" not in tails, tails
        latest = "step-00000002 is the latest complete checkpoint: resume with the same command"
        assert re.match(rf"zerotrain: error: rank 0: no progress for \d+ s in the backward of step {HANG_AT} "
                        rf"\(faults.collective_timeout_seconds={TIMEOUT_S}\); rank 1 in the data of step {HANG_AT} for "
                        rf"\d+ s; rank 1 is behind, in the data of step {HANG_AT}: look at what it does there .*; "
                        rf"stopping this rank; .*{latest}", errors[0][0]), errors[0]
        assert re.match(rf"zerotrain: error: rank 1: no progress for \d+ s in the data of step {HANG_AT} "
                        rf"\(faults.collective_timeout_seconds={TIMEOUT_S}\); rank 0 in the backward of step {HANG_AT} "
                        rf"for \d+ s; the other ranks wait for this one: look at what it does in the data of step "
                        rf"{HANG_AT} .*{latest}", errors[1][0]), errors[1]
        print(f"stopped {waited:.1f} s after rank 1 hung (timeout {TIMEOUT_S} s):", *errors[0], *errors[1], sep="\n")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


GROUP_WORKER = """
import os, sys, time
from datetime import timedelta
from pathlib import Path
import torch
from zerotrain.deepspeed_compat import init_distributed
init_distributed("gloo", timedelta(seconds=3))
from deepspeed import comm
group = comm.new_group([0, 1])
done = Path(sys.argv[1])
if comm.get_rank() == 1:  # alive, never joining, until rank 0 is done (40 s at most)
    deadline = time.monotonic() + 40
    while not done.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    os._exit(0)
started = time.monotonic()
try:
    torch.distributed.all_reduce(torch.ones(4), group=group)
except RuntimeError as err:
    print(f"failed after {time.monotonic() - started:.1f} s: {' '.join(str(err).split())[:200]}", flush=True)
done.touch()
os._exit(0)
"""


def test_deepspeed_groups_time_out_as_the_world_group_does(tmp_path):
    _, logs, _ = run_ranks([sys.executable, "-u", "-c", GROUP_WORKER, str(tmp_path / "done")], tmp_path, "group",
                           timeout=120, patience=60)
    text = logs[0].read_text(errors="replace")
    found = re.search(r"failed after (\d+\.\d) s: (.*)", text)
    # Without the group's timeout, the all-reduce fails only when rank 1 leaves (40 s), on a closed connection.
    assert found and float(found.group(1)) < 20 and "timed out" in found.group(2).lower(), text[-3000:]
    print(found.group(0))
