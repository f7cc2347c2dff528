"""zerotrain/faults.py pieces that need no process group: the out-of-memory advice, and the signal
flag with its grace-period watchdog."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from zerotrain.config import load_config
from zerotrain.faults import StopSignal, oom_advice

ROOT = Path(__file__).resolve().parents[2]


def test_oom_advice_names_the_plan_with_a_lower_budget(tmp_path):
    from zerotrain.hardware import hardware_facts
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.measure import measure_model
    from zerotrain.planner.search import describe, plan

    def run_with(*overrides: str):
        return load_config(ROOT / "examples" / "tiny-cpu.yaml", [f"planner.cache_dir={tmp_path}",
                                                                 "training.global_batch_size=8", *overrides])

    run = run_with("hardware.gpu_memory=80GiB")
    facts = measure_model(resolve_model(run.model), run)
    largest = max(c.memory.device_total for c in plan(facts, hardware_facts(run.hardware), run).candidates)
    # A GPU just large enough for every candidate: the fastest is chosen, and some need less.
    gpu = f"gpu_memory={int(largest * 1.01 / (1 - run.planner.headroom)) // 2**20}MiB"
    run = run_with(f"hardware.{gpu}")
    result = plan(facts, hardware_facts(run.hardware), run)
    used = result.chosen
    advice = oom_advice(result, used, run.planner.headroom)
    match = re.match(r"--set planner.headroom=(0\.\d{4}) makes the planner choose (.+) \(predicted", advice)
    assert match, advice
    lower = run_with(f"hardware.{gpu}", f"planner.headroom={match.group(1)}")
    replanned = plan(facts, hardware_facts(lower.hardware), lower)
    assert replanned.chosen is not None and describe(replanned.chosen.layout) == match.group(2)
    assert replanned.chosen.memory.device_total < used.memory.device_total


def test_a_signal_sets_the_flag_and_the_watchdog_ends_a_stuck_process():
    stop = StopSignal(grace_seconds=60)
    watchdogs = set(threading.enumerate())
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == "SIGUSR1"
        watchdogs = set(threading.enumerate()) - watchdogs
        assert len(watchdogs) == 1
    finally:
        stop.restore()
    # restore() stops the watchdog: it would otherwise end this process (pytest itself) 60 s later.
    watchdog = watchdogs.pop()
    watchdog.join(timeout=5)
    assert not watchdog.is_alive()
    script = ("import os, signal, time\nfrom zerotrain.faults import StopSignal\ns = StopSignal(0.5)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)\n")
    result = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60,
                            cwd=ROOT)
    assert result.returncode == 1
    assert "no checkpoint within the 0 s grace period after SIGTERM" in result.stderr
