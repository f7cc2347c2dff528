"""`zerotrain calibrate` on the tiny Flux model with DeepSpeed's CPU accelerator, at world size 1
(the plan's choice only) and 2 (the star around it): the command runs real
optimizer steps through zerotrain's engine, writes a calibration.json that a later plan uses,
and says what it could not measure here (GPU memory, MFU). Time and host memory only: no GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import CONFIG, REPO, process_env, run_ranks, tiny_data


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


def test_calibrate_one_process_then_a_plan_uses_it(shared_cache, tmp_path):
    out = tmp_path / "calibration.json"
    done = subprocess.run(calibrate_args(shared_cache, out, "--grid", "chosen"), check=False, capture_output=True, text=True,
                          env=process_env(), cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    data = document(out)
    assert json.loads(done.stdout) == data  # --json prints what it wrote
    [row] = data["measurements"]
    assert row["status"] == "ok", row
    measured = row["measured"]
    assert measured["forward_backward_s"] > 0 and measured["optimizer_s"] > 0 and measured["images_per_second"] > 0
    assert measured["host_rss_peak"] is not None and measured["mfu"] is None  # Linux RSS; no MFU without a GPU
    # No GPU, no offload in the chosen layout: nothing to fit, and it says so.
    assert {"fragmentation", "assumed_mfu", "cuda_context_bytes"} <= set(data["defaults"])
    assert not set(data["defaults"]) & set(data["constants"])

    plan = subprocess.run([sys.executable, "-m", "zerotrain.cli", "plan", "--config", str(CONFIG), "--json",
                           "--set", f"planner.calibration={out}", "--set", f"planner.cache_dir={shared_cache / 'facts'}"],
                          check=False, capture_output=True, text=True, env=process_env(), cwd=REPO, timeout=300)
    assert plan.returncode == 0, plan.stderr[-2000:]
    reasons = json.loads(plan.stdout)["plan"]["reasons"]
    assert any(line.startswith(f"Calibrated on {data['device']}, {data['date']}") for line in reasons), reasons


def test_calibrate_two_ranks_runs_the_star_grid(shared_cache, tmp_path):
    """Two ranks (as torchrun starts them), the star grid: ZeRO stages, checkpointing, micro-batch
    and CPU offload around the plan's choice, each measured on both ranks, and DeepSpeedCPUAdam's
    rate fitted from the offloaded layouts' optimizer phase."""
    from zerotrain.config.sections import PlannerConfig

    out = tmp_path / "calibration.json"
    codes, logs, _ = run_ranks(calibrate_args(shared_cache, out), tmp_path / "logs", "calibrate")
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    data = document(out)
    assert data["world_size"] == 2
    rows = data["measurements"]
    assert {r["layout"]["stage"] for r in rows} == {0, 1, 2, 3}
    assert any(r["layout"]["gradient_checkpointing"] for r in rows)
    assert all(r["status"] == "ok" and r["measured"]["forward_backward_s"] > 0 for r in rows), \
        [r["status"] for r in rows]
    offloaded = [r for r in rows if r["layout"]["offload_optimizer"] == "cpu"]
    # CPU offload at ZeRO-3 and at the ZeRO 1/2 stage nearest the plan's choice
    stages = {r["layout"]["stage"] for r in offloaded}
    assert 3 in stages and stages & {1, 2}, stages
    # The fitted rate steps the offloaded layouts' parameters in the optimizer time measured for them
    # (on CPU there are no host<->device copies to take out). The planner's "cpu adam" term at the
    # default rate says how many parameters each step updates.
    rate = data["constants"]["cpu_adam_params_per_second"]
    default = PlannerConfig().cpu_adam_params_per_second
    stepped = sum(r["predicted"]["time_terms"]["cpu adam"] * default for r in offloaded)
    measured = sum(r["measured"]["optimizer_s"] for r in offloaded)
    assert stepped / rate == pytest.approx(measured, rel=0.01)
