"""The recipes of `zerotrain launch` run for real on CPU (DS_ACCELERATOR=cpu, 2 ranks of the tiny
example, the planner told the topology so that plan.json says world_size 2):

- torchrun (`--run`), 2 processes, 2 steps;
- the DeepSpeed launcher from a one-line hostfile (`localhost slots=2`: the launcher's hostfile
  path, which runs a single host locally without ssh), stopped by SIGTERM as `docker stop` would:
  the ranks checkpoint and everything exits 0;
- the Slurm batch script, run by bash with stand-ins for srun and scontrol: SIGUSR1 to the tasks
  (what --signal=USR1@N does before the time limit) checkpoints, exits 0, and requeues the job; SIGTERM to every
  process of the job (a preemption: the batch shell, srun, the ranks and their DataLoader workers) too, the batch
  shell waiting for its ranks instead of dying of the signal (which would end the job before their checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import CONFIG, REPO, TIMEOUT_S, free_port, process_env
from zerotrain import launch

pytestmark = pytest.mark.distributed

STEPS = ("training.max_steps=2", "training.checkpoint_every=2", "planner.stages=[2]", "planner.offload=[none]")


def launch_args(overrides: list[str], *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zerotrain")
    launch.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["launch", "--config", str(CONFIG), *(a for o in overrides for a in ("--set", o)), *argv])


def run_launch(train, name: str, *argv: str, monkeypatch, capfd, steps=STEPS, stop_after: int | None = None):
    """zerotrain launch --run ... in the environment of the other distributed tests (CPU DeepSpeed,
    one thread per rank). With stop_after, this process gets SIGTERM once that many steps are logged,
    as a container's main process does from `docker stop`. Returns the run folder and the output."""
    out = train.tmp_path / name
    monkeypatch.chdir(REPO)  # as a user runs it
    env = {k: v for k, v in process_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")}
    if stop_after is not None:
        threading.Thread(target=signal_after_steps, args=(out / "metrics.jsonl", stop_after), daemon=True).start()
    started = time.monotonic()
    rc = launch.main(launch_args([f"output_dir={out}", *train.base, *steps], "--run", *argv), environ=env)
    output = capfd.readouterr()
    text = output.out + output.err
    assert rc == 0, f"{name}: exit {rc} after {time.monotonic() - started:.0f} s:\n{text[-6000:]}"
    assert time.monotonic() - started < TIMEOUT_S
    return out, text


def signal_after_steps(metrics: Path, steps: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= steps:
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(0.1)


def check_trained(out: Path, world: int) -> list[int]:
    assert json.loads((out / "plan.json").read_text())["world_size"] == world
    assert "nodes: 1" in (out / "config.yaml").read_text()
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_torchrun_recipe_trains_on_two_processes(train, monkeypatch, capfd):
    out, _ = run_launch(train, "torchrun", "--launcher", "torchrun", "--gpus", "2", monkeypatch=monkeypatch,
                        capfd=capfd)
    assert check_trained(out, 2) == [1, 2]
    assert (out / "export" / "export.json").is_file()


def test_deepspeed_hostfile_recipe_runs_one_host_locally_and_stops_cleanly(train, tmp_path, monkeypatch, capfd):
    """A one-line hostfile runs on this host without ssh. SIGTERM to `zerotrain launch --run` goes to
    the ranks, not to the DeepSpeed launcher (which would SIGKILL them 30 s later): they write a
    checkpoint of the last step and exit 0, and so does the launcher."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    steps = (*STEPS[2:], "training.max_steps=1000", "training.checkpoint_every=1000")
    out, text = run_launch(train, "hostfile", "--launcher", "hostfile", "--hostfile", str(hostfile),
                           "--master-port", str(free_port()), monkeypatch=monkeypatch, capfd=capfd, steps=steps,
                           stop_after=2)
    done = check_trained(out, 2)
    assert len(done) >= 2 and done == list(range(1, len(done) + 1))
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{len(done):08d}"
    assert f"stopped by SIGTERM during step {len(done) + 1}" in text, text[-4000:]
    assert "Main process received SIGTERM" not in text  # the launcher's own handler would exit 1


FAKE_SRUN = """#!{python}
# srun as a batch step runs it on one node: one task per SLURM_NTASKS, each with its SLURM_PROCID and
# SLURM_LOCALID, the job's environment otherwise (options such as --kill-on-bad-exit are ignored). A stop signal
# does not end it: srun passes it on to the tasks (here they got it already) and waits for them.
import os, signal, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)
tasks = [subprocess.Popen(args, env={{**os.environ, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)}})
         for i in range(int(os.environ["SLURM_NTASKS"]))]
with open(os.environ["FAKE_SLURM_TASKS"], "w") as out:
    out.write(" ".join(str(t.pid) for t in tasks))
for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
    signal.signal(sig, lambda *_: None)
sys.exit(max(t.wait() for t in tasks))
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
# `scontrol show hostnames LIST` for a one-node job; `scontrol requeue ID` is recorded.
if [[ "$1" == show ]]; then echo localhost; else echo "$*" >> "$FAKE_SLURM_CALLS"; fi
"""


def slurm_job_id() -> int:
    """A job id whose MASTER_PORT (20000 + id % 20000, as the script computes it) is free here."""
    for port in range(20000 + free_port() % 20000, 40000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port - 20000 + 100000
    raise RuntimeError("no free port in 20000-39999")


@pytest.mark.parametrize("preemption", [False, True], ids=["time-limit-USR1-to-the-tasks", "SIGTERM-to-the-job"])
def test_sbatch_script_checkpoints_on_a_stop_signal_and_requeues(train, tmp_path, preemption):
    """The generated sbatch script, run as Slurm would run it on one node with 2 tasks: the
    rendezvous comes from scontrol and SLURM_JOB_ID, srun starts train.py, and SIGUSR1 sent to the
    tasks (what --signal=USR1@N does before the time limit), or SIGTERM to every process of the job, DataLoader
    workers included (a preemption), makes zerotrain checkpoint and exit 0, and the batch shell with it; the run
    is not finished, so the script requeues the job."""
    out = tmp_path / "slurm"
    overrides = [f"output_dir={out}", *train.base, *STEPS[2:], "training.max_steps=1000", "faults.grace_seconds=60",
                 f"data.num_workers={2 if preemption else 0}"]
    args = launch_args(overrides, "--launcher", "slurm", "--gpus-per-node", "2", "--requeue")
    script = launch.make_recipe(args, environ={}).files["zerotrain.sbatch"]
    assert "#SBATCH --signal=USR1@120" in script
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(python=sys.executable))
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script)
    job_id = slurm_job_id()
    env = {k: v for k, v in process_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
    env.update({"PATH": f"{bin_dir}{os.pathsep}{env['PATH']}", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost",
                "SLURM_JOB_ID": str(job_id), "FAKE_SLURM_TASKS": str(tmp_path / "tasks"),
                "FAKE_SLURM_CALLS": str(tmp_path / "calls")})
    log = tmp_path / "job.log"
    with log.open("w") as handle:
        job = subprocess.Popen(["bash", str(tmp_path / "job.sbatch")], env=env, stdout=handle, stderr=subprocess.STDOUT,
                               cwd=REPO, process_group=0)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + TIMEOUT_S
    while job.poll() is None and time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text()):
        time.sleep(0.1)
    assert job.poll() is None, f"the job ended before the signal:\n{log.read_text()[-4000:]}"
    tasks = [int(pid) for pid in (tmp_path / "tasks").read_text().split()]
    if preemption:
        os.killpg(job.pid, signal.SIGTERM)
    else:
        for pid in tasks:
            os.kill(pid, signal.SIGUSR1)
    try:
        rc = job.wait(timeout=90)
        ranks_left = [pid for pid in tasks if alive(pid)]
    finally:
        with contextlib.suppress(ProcessLookupError):  # whatever of the job is left
            os.killpg(job.pid, signal.SIGKILL)
    text = log.read_text()
    sig = "SIGTERM" if preemption else "SIGUSR1"
    assert rc == 0 and not ranks_left, (rc, ranks_left, text[-4000:])
    assert json.loads((out / "plan.json").read_text())["world_size"] == 2
    done = len(metrics.read_text().splitlines())
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step-{done:08d}"
    assert f"stopped by {sig} during step {done + 1}" in text and "DataLoader worker" not in text, text[-4000:]
    assert (tmp_path / "calls").read_text().split() == ["requeue", str(job_id)]


def alive(pid: int) -> bool:
    """Whether a process runs (not a zombie its parent has yet to reap)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
