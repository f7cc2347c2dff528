"""benchmarks/gpu_check.py on CPU, for what a CPU can show of it.

- End to end with --tiny (DeepSpeed's CPU accelerator): the check builds its model folder as it does
  on the GPU node (tiny-flux instead of 2-block flux-dev), runs the torch_adam crash case through
  train.py in a process of its own, saves its three result files after every case (seen while the
  next case runs), and records the cases past its budget as not started.
- The case list: every train case's overrides load with the check's run config, every calibrate
  case's arguments are calibrate's own, the crash cases run under compute-sanitizer with its
  allocator settings on --sanitizer, and the torch_adam switch reaches DeepSpeed's optimizer params."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time

import pytest
from conftest import REPO, process_env

from benchmarks import gpu_check

# The cases the end-to-end run selects: the crash case with torch's AdamW (and so prepare, which it
# needs), then the compile case whose limit exceeds the whole budget, and a calibrate case after it.
ONLY = "crash-torch-adam,lora-compile-buckets,calibrate-flux-dev-lora"


def tiny_budget() -> float:
    """A budget that always fits prepare and the crash case (each ends within its limit, or the test
    fails on that) and never the compile case: no timing decides which cases start."""
    limits = {case.name: case.limit for case in gpu_check.cases(gpu_check.TINY, REPO)}
    budget = limits["prepare"] + limits["crash-torch-adam"]
    assert limits["lora-compile-buckets"] > budget
    return budget


def test_the_check_runs_its_cases_saves_after_each_and_stops_at_its_budget(tmp_path):
    out, workdir = tmp_path / "out", tmp_path / "work"
    check = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--tiny", "--only", ONLY,
                              "--budget", str(tiny_budget()), "--out", str(out), "--workdir", str(workdir)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=process_env(), cwd=REPO)
    # While the crash case runs, what finished before it is already written, and packed.
    deadline = time.monotonic() + 300
    running = None
    while check.poll() is None and time.monotonic() < deadline:
        document = read_json(out / gpu_check.RESULT_JSON)
        if document and [c["status"] for c in document["cases"]][:2] == ["ok", "running"]:
            running = document
            with tarfile.open(out / gpu_check.RESULT_LOGS) as tar:
                packed_then = set(tar.getnames())
            break
        time.sleep(0.2)
    output = check.communicate(timeout=600)[0]
    assert check.returncode == 0, output[-3000:]
    assert running is not None, f"never saw the crash case running:\n{output[-3000:]}"
    assert running["cases"][1]["name"] == "crash-torch-adam" and "logs/prepare.log" in packed_then

    assert sorted(p.name for p in out.iterdir()) == sorted(
        [gpu_check.RESULT_JSON, gpu_check.RESULT_MD, gpu_check.RESULT_LOGS])
    document = json.loads((out / gpu_check.RESULT_JSON).read_text())
    cases = {case["name"]: case for case in document["cases"]}
    assert list(cases) == ["prepare", "crash-torch-adam", "lora-compile-buckets", "calibrate-flux-dev-lora"]
    assert [c["status"] for c in cases.values()] == ["ok", "ok", "not started", "not started"]
    assert cases["lora-compile-buckets"]["reason"].startswith("the budget: lora-compile-buckets needs up to 600 s")
    assert cases["calibrate-flux-dev-lora"]["reason"] == cases["lora-compile-buckets"]["reason"]
    crash = cases["crash-torch-adam"]
    assert crash["seconds"] <= crash["limit"] and crash["env"] == {"CUDA_LAUNCH_BLOCKING": "1"}
    run = crash["run"]
    assert run["steps"] == 3 and len(run["losses"]) == 3 and run["zero_stage"] == 1
    assert run["layout"]["gradient_checkpointing"] is True and run["layout"]["micro_batch"] == 1
    assert run["optimizer"]["params"]["torch_adam"] is True and run["optimizer"]["params"]["fused"] is True
    assert not (workdir / "runs" / "crash-torch-adam").exists()  # checkpoints and export removed
    with tarfile.open(out / gpu_check.RESULT_LOGS) as tar:
        names = set(tar.getnames())
        log = tar.extractfile("logs/crash-torch-adam.log").read().decode()
    assert {"logs/prepare.log", "logs/crash-torch-adam.log", "logs/crash-torch-adam/deepspeed.json",
            "logs/crash-torch-adam/metrics.jsonl"} <= names
    assert "step 3/3" in log and "full training" in log
    table = (out / gpu_check.RESULT_MD).read_text()
    assert "| crash-torch-adam | ok |" in table and "| lora-compile-buckets | not started |" in table


def read_json(path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet
        return None


def test_every_case_is_well_formed(tmp_path, monkeypatch):
    """Without running anything: the train cases' overrides load with the run config, the calibrate
    cases use only calibrate's own flags, and --sanitizer wraps the crash cases."""
    from zerotrain import calibrate
    from zerotrain.config import load_config
    from zerotrain.planner.deepspeed_json import optimizer_section

    parser = argparse.ArgumentParser()
    calibrate.add_parser(parser.add_subparsers(dest="command"))
    for setting in (gpu_check.GPU, gpu_check.TINY):
        for folder in ("square", "buckets"):
            (tmp_path / "images" / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / "run.json").write_text(json.dumps(gpu_check.run_config(setting, tmp_path)))
        every = gpu_check.cases(setting, tmp_path)
        assert [c.name for c in every][:5] == ["prepare", "build-fused-adam", "crash-fused-adam", "crash-torch-adam",
                                               "lora-compile-buckets"]
        for case in every:
            if case.kind == "train":
                overrides = case.command[case.command.index("--set") + 1::2]
                run = load_config(tmp_path / "run.json", overrides)
                assert run.output_dir == case.output
            if case.kind == "calibrate":
                parser.parse_args(case.command[case.command.index("calibrate"):])
        crash = {c.name: c for c in every}["crash-torch-adam"]
        run = load_config(tmp_path / "run.json", crash.command[crash.command.index("--set") + 1::2])
        assert optimizer_section("adamw", run)["optimizer"]["params"]["torch_adam"] is True
        assert crash.env == {"CUDA_LAUNCH_BLOCKING": "1"} and "prepare" in crash.needs

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "none"))
    with pytest.raises(SystemExit, match="--sanitizer needs compute-sanitizer"):
        gpu_check.cases(gpu_check.GPU, tmp_path, sanitizer=True)
    sanitizer = tmp_path / "compute-sanitizer"
    sanitizer.write_text("#!/bin/sh\n")
    os.chmod(sanitizer, 0o755)
    for case in gpu_check.cases(gpu_check.GPU, tmp_path, sanitizer=True)[2:4]:
        assert case.command[:3] == [str(sanitizer), "--tool", "memcheck"] and case.limit == gpu_check.SANITIZER_LIMIT_S
        assert case.env == {"CUDA_LAUNCH_BLOCKING": "1", "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
                            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}


def test_torch_adam_is_refused_for_an_optimizer_zerotrain_builds():
    from zerotrain.config import load_config
    from zerotrain.errors import ZerotrainError

    with pytest.raises((ValueError, ZerotrainError), match="torch_adam replaces DeepSpeed's AdamW, and "
                                                            "optimizer.name=adafactor is built by zerotrain"):
        load_config(None, ["optimizer.name=adafactor", "optimizer.torch_adam=true"])
