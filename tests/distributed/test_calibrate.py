"""`zerotrain calibrate` on the tiny Flux model with DeepSpeed's CPU accelerator: one rank per
layout with faults injected (a crash, a hang) and the same layouts measured twice, and two ranks per
layout (torchrun) over the star grid. The command runs real optimizer steps through zerotrain's
engine in processes of its own for each layout, writes a calibration.json that a later plan uses,
and says what it could not measure here (GPU memory, MFU). Time and host memory only: no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CONFIG, REPO, process_env, tiny_data

FAULTS = Path(__file__).parent / "calibrate_faults"  # its sitecustomize injects the faults


def calibrate_args(cache, out, *extra: str) -> list[str]:
    args = [sys.executable, "-m", "zerotrain.cli", "calibrate", "--config", str(CONFIG), "--out", str(out),
            "--steps", "1", "--json", *extra]
    for override in tiny_data(cache):
        args += ["--set", override]
    return args


def document(out) -> dict:
    data = json.loads(out.read_text())
    assert data["version"] == 1 and data["device"].startswith("cpu")
    return data


def test_calibrate_two_ranks_runs_the_star_grid(shared_cache, tmp_path):
    """Two ranks (torchrun, a process group for each layout), the star grid: ZeRO stages,
    checkpointing, micro-batch and CPU offload around the plan's choice, each measured on both
    ranks, and DeepSpeedCPUAdam's rate fitted from the offloaded layouts' optimizer phase."""
    from zerotrain.config.sections import PlannerConfig

    out = tmp_path / "calibration.json"
    # ZeRO-2 and 3 (the other stages' layouts differ from these only in DeepSpeed's own code)
    done = subprocess.run(calibrate_args(shared_cache, out, "--ranks", "2", "--set", "planner.stages=[2,3]"),
                          check=False, capture_output=True, text=True, env=process_env(), cwd=tmp_path, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    data = document(out)
    assert data["complete"]
    assert data["world_size"] == 2
    rows = data["measurements"]
    assert {r["layout"]["stage"] for r in rows} == {2, 3}
    assert any(r["layout"]["gradient_checkpointing"] for r in rows)
    assert all(r["status"] == "ok" and r["measured"]["forward_backward_s"] > 0 for r in rows), \
        [r["status"] for r in rows]
    offloaded = [r for r in rows if r["layout"]["offload_optimizer"] == "cpu"]
    # CPU offload at ZeRO-3 and at ZeRO-2
    assert {r["layout"]["stage"] for r in offloaded} == {2, 3}
    # The fitted rate steps the offloaded layouts' parameters in the optimizer time measured for them
    # (on CPU there are no host<->device copies to take out). The planner's "cpu adam" term at the
    # default rate says how many parameters each step updates.
    rate = data["constants"]["cpu_adam_params_per_second"]
    default = PlannerConfig().cpu_adam_params_per_second
    stepped = sum(r["predicted"]["time_terms"]["cpu adam"] * default for r in offloaded)
    measured = sum(r["measured"]["optimizer_s"] for r in offloaded)
    assert stepped / rate == pytest.approx(measured, rel=0.01)


def test_a_layout_that_crashes_or_hangs_leaves_every_other_row_measured(shared_cache, tmp_path):
    """Each layout in a process of its own: one that dies (SIGABRT, as a CUDA illegal memory access
    ends a process) and one that hangs past --layout-timeout get rows saying so, with their last
    lines, and every other layout is measured and written. A layout measured again after a ZeRO-3
    layout holds the same tensor bytes after its init as the first time: nothing of an earlier
    layout is left in its process (in one process, ZeRO-3 keeps its module and optimizer
    reachable). A later plan uses what the clean rows fitted."""
    out = tmp_path / "calibration.json"
    # The grid is ZeRO-0, ZeRO-2, ZeRO-3 (one rank: the plan rejects ZeRO-3 without parameter offload, so it comes
    # last, and calibrate measures it all the same), twice over: ZeRO-2 dies the first time and hangs the second.
    env = {**process_env(), "ZEROTRAIN_TEST_CALIBRATE_FAULTS": "1:abort,4:hang"}
    env["PYTHONPATH"] = os.pathsep.join([str(FAULTS), env["PYTHONPATH"]])
    grid = ["--grid", "full", "--repeat", "2", "--layout-timeout", "45", "--set", "planner.stages=[0,2,3]",
            "--set", "planner.offload=[none]", "--set", "training.gradient_checkpointing=false",
            "--set", "planner.max_micro_batch=1"]
    done = subprocess.run(calibrate_args(shared_cache, out, *grid), check=False, capture_output=True, text=True,
                          env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = document(out)
    assert json.loads(done.stdout) == data and data["complete"]  # --json prints what it wrote
    rows = data["measurements"]
    assert [r["layout"]["stage"] for r in rows] == [0, 2, 3, 0, 2, 3]
    assert [r["status"].split(":")[0] for r in rows] == ["ok", "crashed", "ok", "ok", "timeout", "ok"], \
        [r["status"] for r in rows]
    assert rows[1]["status"] == "crashed: killed by SIGABRT" and rows[1]["measured"] is None
    assert rows[1]["error"][-1] == "injected fault: an illegal memory access was encountered"
    assert rows[4]["status"] == "timeout: not finished after 45 s (--layout-timeout)" and rows[4]["measured"] is None
    assert "crashed: killed by SIGABRT; its last lines:\ninjected fault" in done.stderr
    for first, again in ((rows[0], rows[3]), (rows[2], rows[5])):
        assert first["measured"]["init_tensor_bytes"] == again["measured"]["init_tensor_bytes"], first["config"]
    for row in (rows[0], rows[2], rows[3], rows[5]):
        measured = row["measured"]
        assert measured["forward_backward_s"] > 0 and measured["optimizer_s"] > 0 and measured["images_per_second"] > 0
        assert measured["skipped_steps"] == 0 and measured["host_rss_peak"] is not None and measured["mfu"] is None
    # No GPU, no offload: nothing to fit, and it says so.
    assert {"fragmentation", "assumed_mfu", "cuda_context_bytes"} <= set(data["defaults"])
    assert not set(data["defaults"]) & set(data["constants"])

    plan = subprocess.run([sys.executable, "-m", "zerotrain.cli", "plan", "--config", str(CONFIG), "--json",
                           "--set", f"planner.calibration={out}", "--set", f"planner.cache_dir={shared_cache / 'facts'}"],
                          check=False, capture_output=True, text=True, env=process_env(), cwd=REPO, timeout=300)
    assert plan.returncode == 0, plan.stderr[-2000:]
    reasons = json.loads(plan.stdout)["plan"]["reasons"]
    assert any(line.startswith(f"Calibrated on {data['device']}, {data['date']}") for line in reasons), reasons


def test_calibrate_refuses_a_launcher_in_one_line(tmp_path):
    """calibrate starts each layout's ranks itself: started by torchrun (WORLD_SIZE 2), it says so."""
    env = {**process_env(), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    done = subprocess.run(calibrate_args(tmp_path, tmp_path / "c.json"), check=False, capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "--ranks N" in done.stderr.strip().splitlines()[-1]
