"""Heartbeats name a lost rank: through verdict() when a collective failed, or by ending a rank
that stays blocked waiting for the lost one (exit 3, one line)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from zerotrain.distributed import Heartbeat, Topology

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_heartbeats_name_the_rank_that_stopped():
    port = free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    beats = [Heartbeat(Topology(rank, 3, rank), lost_after=1.5, interval=0.1, handover=60, environ=env)
             for rank in range(3)]
    try:
        time.sleep(0.5)
        assert [b.verdict(wait=0) for b in beats] == [None, None, None]
        beats[2].stop()  # as a killed rank's thread would
        started = time.monotonic()
        assert beats[0].verdict(wait=10) == [2]
        assert beats[1].verdict(wait=10) == [2]
        assert time.monotonic() - started < 5
        assert beats[0].describe().startswith("rank 2 was lost (no heartbeat for 2 s")
    finally:
        for beat in beats:
            beat.stop()
        del server


def test_a_rank_blocked_waiting_for_a_lost_one_is_ended_with_one_line():
    """Rank 0 of two, whose peer never beats, blocks its main thread (as NCCL blocks in a collective
    until the timeout): the heartbeat thread names rank 1 and ends the process with exit code 3."""
    code = (f"import time, torch\n"
            f"from zerotrain.distributed import Heartbeat, Topology\n"
            f"store = torch.distributed.TCPStore('127.0.0.1', {free_port()}, is_master=True, wait_for_workers=False)\n"
            f"env = {{'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(store.port)}}\n"
            f"beat = Heartbeat(Topology(0, 2, 0), lost_after=1.0, interval=0.1, handover=0.5, environ=env)\n"
            f"time.sleep(60)\n")
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                          check=False)
    assert done.returncode == Heartbeat.EXIT_CODE, done.stderr
    assert time.monotonic() - started < 30
    errors = [line for line in done.stderr.splitlines() if line.startswith("zerotrain: error:")]
    assert len(errors) == 1 and "rank 1 was lost (no heartbeat for 1 s" in errors[0], done.stderr
