"""Heartbeats name a lost rank, a fault line another rank posted (one rank out of memory), or a stall (a watched
phase longer than the collective timeout): through verdict() when a collective failed, or by ending a rank that
stays blocked (exit 3, one line)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from zerotrain.distributed import Heartbeat, Topology

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def beating(world: int, lost_after: float = 30):
    """`world` heartbeats of one job on a local store, stopped after."""
    port = free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    beats = [Heartbeat(Topology(rank, world, rank), lost_after=lost_after, interval=0.1, handover=60, environ=env)
             for rank in range(world)]
    try:
        yield beats
    finally:
        for beat in beats:
            beat.stop()
        del server


def test_heartbeats_name_the_rank_that_stopped():
    with beating(3, lost_after=1.5) as beats:
        time.sleep(0.5)
        assert [b.verdict(wait=0) for b in beats] == [None, None, None]
        beats[2].stop()  # as a killed rank's thread would
        started = time.monotonic()
        assert beats[0].verdict(wait=10) == [2]
        assert beats[1].verdict(wait=10) == [2]
        assert time.monotonic() - started < 5
        assert beats[0].describe().startswith("rank 2 was lost (no heartbeat for 2 s")


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


def test_a_fault_line_posted_by_one_rank_reaches_the_others():
    """One rank that cannot go on (out of memory alone) posts its line; the others' verdict is that line (the
    first posted wins), and a rank asking whether every rank reached a point learns it within its window."""
    with beating(3) as beats:
        started = time.monotonic()
        assert not beats[1].everyone("oom/2/3", within=0.5), "ranks 0 and 2 never got there"
        assert time.monotonic() - started < 5
        assert beats[0].verdict(wait=0) is None
        beats[1].post("rank 1 ran out of memory in the backward of step 2")
        beats[2].post("rank 2 stopped: later")
        assert beats[0].verdict(wait=10) == "rank 1 ran out of memory in the backward of step 2"
        assert beats[2].verdict(wait=10) == "rank 1 ran out of memory in the backward of step 2"
        assert beats[1].verdict(wait=0.5) is None, "a rank does not stop on its own line"


def test_every_rank_that_arrives_in_time_agrees():
    import threading

    with beating(2) as beats:
        answers = [None, None]

        def arrive(rank: int, delay: float) -> None:
            time.sleep(delay)
            answers[rank] = beats[rank].everyone("oom/5/3", within=10)

        threads = [threading.Thread(target=arrive, args=(rank, rank * 1.0)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert answers == [True, True]


BLOCKED = """
import sys, time, torch
from zerotrain.distributed import PROGRESS, Heartbeat, Topology
store = torch.distributed.TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False)
env = {{'MASTER_ADDR': '127.0.0.1', 'MASTER_PORT': str(store.port)}}
beat = Heartbeat(Topology(0, 2, 0), lost_after=60, interval=0.1, handover=0.5, environ=env, stall_after={stall})
peer = torch.distributed.TCPStore('127.0.0.1', store.port, is_master=False, wait_for_workers=False)
PROGRESS.step = 7
PROGRESS.at("backward")
started = time.monotonic()
for _ in range(600):  # rank 1: alive, in the data of step 7 (or posting its fault line)
    peer.add('zerotrain/heartbeat/1', 1)
    if time.monotonic() - started < {vanish}:
        peer.set('zerotrain/phase/1', f'7\\t0\\t{{time.time() - 1}}\\tthe data of step 7')
    else:  # as when rank 0's process, which holds the store, has ended first: its phase no longer reads
        peer.delete_key('zerotrain/phase/1')
    if {fault!r}:
        peer.compare_set('zerotrain/fault', '', '1\\t' + {fault!r})
    time.sleep(0.1)
"""


def blocked(stall: float | None, fault: str, vanish: float = 600) -> subprocess.CompletedProcess:
    """Rank 0 of two with its main thread blocked in the backward of step 7 (as NCCL blocks in a collective), rank 1
    alive in the data of step 7 (played by a store client; its phase unreadable after `vanish` seconds)."""
    code = BLOCKED.format(port=free_port(), stall=stall, fault=fault, vanish=vanish)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, cwd=REPO,
                          check=False)


def test_a_rank_blocked_while_another_posts_its_fault_stops_with_that_line():
    started = time.monotonic()
    done = blocked(None, "rank 1 ran out of memory in the forward of step 7 (CUDA out of memory)")
    assert done.returncode == Heartbeat.EXIT_CODE, done.stderr
    assert time.monotonic() - started < 30
    errors = [line for line in done.stderr.splitlines() if line.startswith("zerotrain: error:")]
    assert errors == [("zerotrain: error: rank 0: rank 1 ran out of memory in the forward of step 7 (CUDA out of "
                       "memory); stopping this rank (it was blocked in the backward of step 7); resume with the same "
                       "command (training.resume: auto)")], done.stderr


@pytest.mark.parametrize("vanish", [600, 3.0], ids=["the peer readable", "the peer gone before the stall"])
def test_a_watched_phase_that_outlasts_the_collective_timeout_ends_the_rank_naming_the_one_behind(vanish):
    """Also where the peer's phase no longer reads when the stall is declared (in CI, rank 0 ended first and took
    the store with it): what it read half-way names it."""
    started = time.monotonic()
    done = blocked(4.0, "", vanish)
    assert done.returncode == Heartbeat.EXIT_CODE, done.stderr
    assert 4 <= time.monotonic() - started < 30
    errors = [line for line in done.stderr.splitlines() if line.startswith("zerotrain: error:")]
    assert len(errors) == 1, done.stderr
    assert errors[0].startswith("zerotrain: error: rank 0: no progress for 4 s in the backward of step 7 "
                                "(faults.collective_timeout_seconds=4); rank 1 in the data of step 7 for "), errors
    assert "; rank 1 is behind, in the data of step 7: look at what it does there" in errors[0], errors
