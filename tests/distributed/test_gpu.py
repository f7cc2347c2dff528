"""Checks only a GPU can make (@pytest.mark.gpu; skipped without CUDA, so never in CI): a real CUDA
step of a reduced model with the planner's prediction against the measured peak, the out-of-memory
handler with measured peaks, and the peak memory and MFU a run logs. One process on GPU 0, with
DeepSpeed's CUDA accelerator (DS_ACCELERATOR unset)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from conftest import CONFIG, REPO, process_env, tiny_data

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_env() -> dict[str, str]:
    env = {k: v for k, v in process_env().items() if k != "DS_ACCELERATOR"}
    return {**env, "CUDA_VISIBLE_DEVICES": env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]}


def zerotrain(*args: str, cwd, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zerotrain.cli", *args], check=False, capture_output=True, text=True,
                          env=gpu_env(), cwd=cwd, timeout=timeout)


def test_a_cuda_step_peaks_where_the_planner_said(shared_cache, tmp_path):
    """flux-dev cut to 2 blocks at full width, LoRA at 1024px: the peak allocated bytes of real steps
    against the planner's, and the constants only a GPU can fit."""
    out = tmp_path / "calibration.json"
    done = zerotrain("calibrate", "--model", "flux-dev", "--blocks", "2", "--mode", "lora", "--grid", "chosen",
                     "--global-batch", "1", "--steps", "2", "--out", str(out),
                     "--set", f"planner.cache_dir={shared_cache / 'facts'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    [row] = data["measurements"]
    assert row["status"] == "ok", row["status"]
    predicted, measured = row["predicted"]["allocated"], row["measured"]["allocated"]
    assert abs(predicted - measured) <= 0.25 * measured, f"predicted {predicted} B, measured {measured} B"
    assert row["measured"]["reserved"] >= measured and 0 < row["measured"]["mfu"] < 1
    for name in ("fragmentation", "cuda_context_bytes", "nccl_workspace_bytes", "host_to_device_bandwidth"):
        assert name in data["constants"], data["defaults"]


def train_on_gpu(shared_cache, tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-u", str(REPO / "zerotrain" / "train.py"), "--config", str(CONFIG),
            "--set", f"output_dir={tmp_path / 'run'}", "--set", "training.max_steps=3"]
    for override in [*tiny_data(shared_cache), *overrides]:
        args += ["--set", override]
    return subprocess.run(args, check=False, capture_output=True, text=True, env=gpu_env(), cwd=tmp_path, timeout=900)


def test_a_gpu_run_logs_peak_memory_and_mfu(shared_cache, tmp_path):
    done = train_on_gpu(shared_cache, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and all(r["peak_allocated_bytes"] > 0 and r["peak_reserved_bytes"] >= r["peak_allocated_bytes"]
                           for r in records)
    assert all(r["mfu"] is not None and 0 < r["mfu"] < 1 for r in records)
    memory = json.loads((tmp_path / "run" / "memory.json").read_text())
    assert memory["measured"], memory


def test_an_out_of_memory_step_is_recovered_on_cuda(shared_cache, tmp_path):
    done = train_on_gpu(shared_cache, tmp_path, "testing.oom_at=[2]", "training.gradient_checkpointing=auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"step 2 ran out of memory with .*\d+\.\d GiB allocated when it failed\): dropped on every "
                     r"rank, and run again with .*checkpointing", done.stderr), done.stderr[-3000:]
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["adjusted"][0]["measured_peak"] > 0


def test_the_oom_handler_reports_the_measured_peak(shared_cache, tmp_path):
    done = train_on_gpu(shared_cache, tmp_path, "testing.oom_at=[2]", "faults.oom_recovery_steps=0")
    assert done.returncode == 2, done.stderr[-3000:]
    line = done.stderr.strip().splitlines()[-1]
    assert re.search(r"CUDA out of memory: rank 0 ran out of memory in the forward of step 2 with ZeRO-\d.*the peak measured on this rank was "
                     r"\d+\.\d GiB allocated, \d+\.\d GiB reserved", line), line
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("stage, how", [(3, "rank 0 reads each weight"), (2, "the ranks of a node load in turn")])
def test_a_cuda_load_trains_as_a_whole_load(shared_cache, tmp_path, stage, how):
    """zerotrain.loading on CUDA: ZeRO-3 partitioned from the safetensors onto the GPU, ZeRO-2 in
    turns (moved to the GPU before the engine): the same losses as every rank loading whole."""
    losses = {}
    for load in ("auto", "whole"):
        (tmp_path / load).mkdir()
        done = train_on_gpu(shared_cache, tmp_path / load, f"planner.stages=[{stage}]", "planner.offload=[none]",
                            f"model.load={load}")
        assert done.returncode == 0, done.stderr[-3000:]
        assert (how if load == "auto" else "every rank loads the whole model") in done.stdout, done.stdout[-2000:]
        lines = (tmp_path / load / "run" / "metrics.jsonl").read_text().splitlines()
        losses[load] = [json.loads(line)["loss"] for line in lines]
    assert len(losses["auto"]) == 3 and losses["auto"] == losses["whole"], losses
