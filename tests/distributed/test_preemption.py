"""A preemption as real launchers make it: the signal reaches every process of the job, the DataLoader workers
(data.num_workers: 2, the default) included. Slurm signals every process of the job step; torchrun's agent, and a
terminal's Ctrl-C, the process group. Each rank finishes its step, checkpoints and exits 0, and the same command
run again resumes and logs the uninterrupted run's losses bit for bit. Before, the workers died of the signal and
the rank failed mid-step with "DataLoader worker ... is killed by signal", with no checkpoint.

The ranks here are real interpreters in a process group of their own (the forked ranks of the other tests share
the test session's), signalled with os.killpg as a launcher signals its job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.distributed.conftest import (
    TIMEOUT_S,
    WORLD,
    Trainer,
    free_port,
    logged_steps,
    process_env,
    rank_env,
    train_args,
)
from zerotrain.checkpoint import tag_for

pytestmark = pytest.mark.distributed

STEPS = 8
COMMON = ("planner.stages=[2]", "planner.offload=[none]", "training.resume=auto", "training.checkpoint_every=1000",
          "data.num_workers=2", f"training.max_steps={STEPS}", "faults.collective_timeout_seconds=120")
STOP_AFTER = 3
LAUNCHERS = {"torchrun": "torch.distributed.run", "deepspeed": "deepspeed.launcher.runner"}


@pytest.fixture(scope="module")
def trainer(shared_cache, tmp_path_factory) -> Trainer:
    return Trainer(shared_cache, tmp_path_factory.mktemp("preemption"))


@pytest.fixture(scope="module")
def straight(trainer) -> list[float]:
    losses = trainer("straight", *COMMON).check().losses()
    assert len(losses) == STEPS
    return losses


def start_job(launcher: str, out: Path, overrides: list[str], log: Path) -> list[subprocess.Popen]:
    """The job's processes, the first leading a new process group the others join: two ranks as srun starts
    them (ranks from SLURM_*), or torchrun's agent, or the DeepSpeed launcher (`deepspeed --num_gpus 2`: its
    runner starts launch.py, which starts the ranks), or `zerotrain launch --run` over torchrun, each of which
    starts the ranks itself."""
    env = {k: v for k, v in process_env().items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") and not k.startswith("SLURM_")}
    args = train_args(out, overrides)
    port = free_port()
    with log.open("w") as sink:
        if launcher == "zerotrain-launch":  # its own --set flags as train.py's; the rendezvous the recipe's
            return [subprocess.Popen([sys.executable, "-m", "zerotrain.cli", "launch", *args[1:], "--launcher",
                                      "torchrun", "--gpus", str(WORLD), "--master-port", str(port), "--run"],
                                     env=env, stdout=sink, stderr=subprocess.STDOUT, process_group=0)]
        if launcher in LAUNCHERS:
            return [subprocess.Popen([sys.executable, "-m", LAUNCHERS[launcher], "--master_port", str(port),
                                      f"--{'nproc_per_node' if launcher == 'torchrun' else 'num_gpus'}", str(WORLD),
                                      *args], env=env, stdout=sink, stderr=subprocess.STDOUT, process_group=0)]
        first = subprocess.Popen([sys.executable, "-u", *args], env={**env, **rank_env(0, WORLD, port, True)},
                                 stdout=sink, stderr=subprocess.STDOUT, process_group=0)
        return [first, *(subprocess.Popen([sys.executable, "-u", *args], env={**env, **rank_env(r, WORLD, port, True)},
                                          stdout=sink, stderr=subprocess.STDOUT, process_group=first.pid)
                         for r in range(1, WORLD))]


def signal_the_job(processes: list[subprocess.Popen], out: Path, sig: int) -> list[int | None]:
    """Wait for STOP_AFTER logged steps, signal the whole process group, and wait for every process."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline and all(p.poll() is None for p in processes) and logged_steps(out) < STOP_AFTER:
        time.sleep(0.05)
    assert all(p.poll() is None for p in processes), "the job ended before it could be signalled"
    group = processes[0].pid
    os.killpg(group, sig)
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=150))
        except subprocess.TimeoutExpired:
            os.killpg(group, signal.SIGKILL)
            codes.append(None)
    deadline = time.monotonic() + 150  # a launcher may leave before its ranks (DeepSpeed's runner does)
    while time.monotonic() < deadline and group_alive(group):
        time.sleep(0.1)
    if group_alive(group):
        os.killpg(group, signal.SIGKILL)
        codes.append(None)
    return codes


def group_alive(group: int) -> bool:
    """Whether a process of the group is still running (not a zombie waiting for its parent)."""
    import psutil

    return any(p.info["status"] != psutil.STATUS_ZOMBIE for p in psutil.process_iter(["status"])
               if _pgid(p.pid) == group)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@pytest.mark.parametrize(("launcher", "sig"), [
    pytest.param(launcher, sig, id=f"{launcher}-{sig.name}")
    for launcher, sig in (("srun", signal.SIGTERM), ("srun", signal.SIGUSR1), ("torchrun", signal.SIGINT),
                          ("deepspeed", signal.SIGTERM), ("zerotrain-launch", signal.SIGINT))])
def test_a_signal_to_the_whole_job_with_data_workers_checkpoints_and_resumes_exactly(launcher, sig, trainer,
                                                                                       straight):
    name = f"{launcher}-{sig.name}"
    out = trainer.tmp_path / name
    log = trainer.tmp_path / f"{name}.log"
    overrides = [*trainer.base, *COMMON]
    codes = signal_the_job(start_job(launcher, out, overrides, log), out, sig)
    text = log.read_text(errors="replace")
    done = logged_steps(out)
    assert "DataLoader worker" not in text, text[-4000:]
    assert f"stopped by {sig.name} during step {done + 1}" in text, text[-4000:]
    if launcher == "srun":
        assert codes == [0] * WORLD and "Traceback" not in text, (codes, text[-4000:])
    elif launcher in ("torchrun", "zerotrain-launch"):  # the agent was signalled too, and ends with its own SignalException; a rank
        assert codes[0] is not None and "ChildFailedError" not in text, (codes, text[-4000:])  # that failed, it reports
    else:  # the runner leaves at once; launch.py passes SIGTERM on and gives its ranks 30 s before SIGKILL
        assert None not in codes and "Traceback" not in text and "exits with return code" not in text, \
            (codes, text[-4000:])
    assert STOP_AFTER <= done < STEPS
    assert (out / "checkpoints" / tag_for(done) / "zerotrain_state.json").is_file()
    resumed = trainer(name, *COMMON).check()
    assert f"resumed from {out / 'checkpoints' / tag_for(done)} at step {done}" in resumed.log, resumed.tails()
    assert resumed.losses() == straight, f"resumed {resumed.losses()}\nstraight {straight}"
