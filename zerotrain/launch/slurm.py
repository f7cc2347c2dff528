"""Slurm: the sbatch script that starts one task per GPU with srun and signals the tasks early enough
for zerotrain to write a checkpoint before the time limit."""

from __future__ import annotations

import shlex

from zerotrain.errors import ZerotrainError
from zerotrain.launch.commands import ALLOC_CONF
from zerotrain.launch.image import IMAGE_WORKDIR

# Slurm's --signal may come up to 60 s before the time asked for (sbatch(1)), and the checkpoint
# must be complete before the time limit's SIGTERM/SIGKILL: the signal leads the limit by the
# grace period plus this margin.
SLURM_SIGNAL_MARGIN_S = 60


def sbatch_script(train_args: list[str], *, nodes: int, gpus_per_node: int, grace_seconds: float,
                  signal_seconds: int | None = None, job_name: str = "zerotrain", time: str | None = None,
                  partition: str | None = None, account: str | None = None, cpus_per_task: int | None = None,
                  requeue: bool = False, output_dir: str | None = None, python: str = "python",
                  plan_command: str | None = None, image: tuple[str, str] | None = None) -> str:
    """A Slurm batch script: one task per GPU started by srun (zerotrain takes its rank from
    SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID), MASTER_ADDR the first node, and SIGUSR1 to every
    task `signal_seconds` before the time limit so that zerotrain checkpoints and exits in time. With
    image (IMAGE, the folder to mount), srun runs zerotrain in that image through Pyxis/Enroot, the
    folder at the image's working folder."""
    if nodes < 1 or gpus_per_node < 1:
        raise ZerotrainError(f"a Slurm job needs at least one node and one GPU per node (got {nodes} x {gpus_per_node})")
    signal_seconds = signal_seconds or int(grace_seconds) + SLURM_SIGNAL_MARGIN_S
    if signal_seconds <= grace_seconds:
        raise ZerotrainError(f"--grace {signal_seconds}: the signal must come more than faults.grace_seconds "
                             f"({grace_seconds:g} s) before the time limit, or the checkpoint cannot finish")
    if requeue and output_dir is None:
        raise ZerotrainError("--requeue needs the run's output_dir to tell a finished run from a stopped one")
    srun = [python, "-u", *train_args]
    if image is not None:  # Pyxis starts the command itself, not the image's entrypoint: `zerotrain train`
        srun = [f"--container-image={image[0]}", f"--container-mounts={image[1]}:{IMAGE_WORKDIR}",
                f"--container-workdir={IMAGE_WORKDIR}", "zerotrain", "train", *train_args[1:]]
    sbatch = [f"--job-name={job_name}", f"--nodes={nodes}", f"--ntasks-per-node={gpus_per_node}",
              f"--gpus-per-node={gpus_per_node}"]
    if cpus_per_task is not None:
        sbatch.append(f"--cpus-per-task={cpus_per_task}")
    for flag, value in (("time", time), ("partition", partition), ("account", account)):
        if value is not None:
            sbatch.append(f"--{flag}={value}")
    sbatch.append(f"--signal=USR1@{signal_seconds}")
    if requeue:
        sbatch.append("--requeue")
    sbatch += ["--open-mode=append", "--output=%x-%j.out"]
    lines = ["#!/bin/bash", *(f"#SBATCH {s}" for s in sbatch), "",
             f"# zerotrain on {nodes} node(s) x {gpus_per_node} GPUs = {nodes * gpus_per_node} ranks: srun starts one task per",
             "# GPU; zerotrain reads its rank from SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID.",
             "# Submit from the folder the config's relative paths start from: sbatch THIS_FILE",
             "# Resume: submit it again. training.resume: auto continues from the run's checkpoints/latest,",
             "# also on another number of nodes (universal checkpoint).",
             f"# Time limit: --signal=USR1@{signal_seconds} sends SIGUSR1 to every task of the job step {signal_seconds} s before",
             "# the limit (without B:, which would signal only this batch shell). zerotrain then writes a",
             f"# checkpoint within faults.grace_seconds ({grace_seconds:g} s) and exits 0. Preemption's SIGTERM is handled",
             "# the same way.",
             "# Bare metal needs no --ipc=host or --shm-size (those are for containers): /dev/shm is the host's."]
    if plan_command:
        lines.append(f"# The plan this job trains with: {plan_command}")
    lines += ["", "set -euo pipefail",
              'MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
              "# One port per job, so that jobs sharing a node do not collide.",
              "MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))",
              "export MASTER_ADDR MASTER_PORT",
              f'export PYTORCH_CUDA_ALLOC_CONF="${{PYTORCH_CUDA_ALLOC_CONF:-{ALLOC_CONF}}}"']
    if cpus_per_task is not None:
        lines += ["# srun does not inherit --cpus-per-task from sbatch (Slurm >= 22.05).",
                  'export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"',
                  'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$SLURM_CPUS_PER_TASK}"']
    lines += ["", "# Slurm signals this batch shell too (a preemption's SIGTERM, scancel): it waits for the job step, whose",
              "# ranks checkpoint and exit 0, instead of dying of the signal and ending the job before they are done.",
              ("trap 'echo \"zerotrain: the batch shell got a stop signal: waiting for the ranks to checkpoint\" >&2' "
               "TERM INT USR1"),
              "srun --kill-on-bad-exit=1 " + shlex.join(srun) + " &",
              "SRUN_PID=$! status=0",
              "while kill -0 \"$SRUN_PID\" 2>/dev/null; do status=0; wait \"$SRUN_PID\" || status=$?; done",
              "if [[ $status -ne 0 ]]; then exit \"$status\"; fi"]
    if requeue:
        done = shlex.quote(f"{output_dir}/export/export.json")
        lines += ["", "# Stopped by the time-limit signal before the last step (the export is written at the end):",
                  "# queue the job again; it resumes from the checkpoint it just wrote.",
                  f'if [[ ! -f {done} ]]; then scontrol requeue "$SLURM_JOB_ID"; fi']
    return "\n".join(lines) + "\n"
