"""faults.collective_timeout_seconds ends a rank blocked in a collective whose peer is alive but
never joins it (a hung data loader, a deadlock in one rank's main thread): the heartbeats cannot
help there, since the peer's background thread still beats.

Two CPU ranks of train.py on the tiny example (through tests/distributed/patched.py): rank 1's main
thread stops before the collective of step HANG_AT (sleeping, so its heartbeat thread runs on).
Rank 0 waits in that all-reduce until gloo's timeout (the process group's, set from
collective_timeout_seconds), asks the heartbeat which rank was lost (none: lost_rank_seconds plus
3 s), and exits 2 with train.py's one line, while rank 1 is still alive. test_chaos.py covers the
peer that dies (the heartbeat names it)."""

from __future__ import annotations

import os
import re
import time

import pytest

from tests.distributed import patched
from tests.distributed.conftest import start_ranks

pytestmark = pytest.mark.distributed

HANG_AT = 3
TIMEOUT_S = 10
LOST_S = 5
HANGS = re.compile(r"rank 1 hangs before the collective of step (\d+)")


def hang_rank1() -> None:
    """Installed in each rank (patched.py): on rank 1, the HANG_AT-th call of the loop's per-step
    collective (trainer.agree) sleeps instead, the heartbeat thread left running."""
    if os.environ.get("RANK") != "1":
        return
    import zerotrain.trainer

    agree = zerotrain.trainer.agree
    calls = 0

    def hanging(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == HANG_AT:
            print(f"rank 1 hangs before the collective of step {calls}", flush=True)
            time.sleep(3600)
        return agree(*args, **kwargs)

    zerotrain.trainer.agree = hanging


def test_a_rank_blocked_by_a_live_peer_stops_after_the_collective_timeout(train, monkeypatch):
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.measure import measure_model

    overrides = ("planner.stages=[2]", "planner.offload=[none]", "training.max_steps=6", "training.checkpoint_every=2",
                 f"faults.collective_timeout_seconds={TIMEOUT_S}", f"faults.lost_rank_seconds={LOST_S}")
    # Every wait of one rank for another must stay below the short timeout: the planner's facts are
    # measured here, so that rank 0 plans from the cache while rank 1 waits for the plan.
    run = train.run_config(*overrides)
    measure_model(resolve_model(run.model), run)
    monkeypatch.setenv(patched.PATCH_ENV, "tests.distributed.test_collective_timeout:hang_rank1")
    procs, logs = start_ranks(patched.args(train, "hang", *overrides), train.tmp_path / "logs", "hang")
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and procs[0].poll() is None and not HANGS.search(logs[1].read_text()):
            time.sleep(0.1)
        hung = time.monotonic()
        assert HANGS.search(logs[1].read_text()), "rank 1 never reached the hang:\n" + "\n".join(
            f"--- rank {r}\n{log.read_text(errors='replace')[-3000:]}" for r, log in enumerate(logs))
        bound = TIMEOUT_S + LOST_S + 3 + 25  # timeout, the heartbeat's verdict, leaving; slack for a loaded machine
        while time.monotonic() < hung + bound and procs[0].poll() is None:
            time.sleep(0.1)
        waited = time.monotonic() - hung
        rank1_alive = procs[1].poll() is None
        log0 = logs[0].read_text(errors="replace")
        assert procs[0].poll() is not None, f"rank 0 still blocked {waited:.0f} s after rank 1 hung:\n{log0[-3000:]}"
        assert procs[0].returncode == 2, f"rank 0 exited {procs[0].returncode}:\n{log0[-3000:]}"
        assert waited >= TIMEOUT_S - 2, f"rank 0 stopped after {waited:.1f} s, before the timeout:\n{log0[-3000:]}"
        assert rank1_alive, "rank 1 (its heartbeat alive) ended before rank 0 gave up"
        errors = [line for line in log0.splitlines() if line.startswith("zerotrain: error:")]
        assert len(errors) == 1 and "Traceback" not in log0, log0[-3000:]
        assert errors[0].startswith("zerotrain: error: rank 0: a collective failed (") and \
            "while every rank's heartbeat still moves; stopping; " in errors[0] and \
            "step-00000002 is the latest complete checkpoint: resume with the same command" in errors[0], errors[0]
        print(f"rank 0 stopped {waited:.1f} s after rank 1 hung (timeout {TIMEOUT_S} s): {errors[0][:300]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
