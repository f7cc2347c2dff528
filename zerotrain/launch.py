"""`zerotrain launch`: the command (or script) that starts zerotrain/train.py on one node or many,
with the topology also given to the planner, so that it plans for nodes x GPUs:

    zerotrain launch --config run.yaml --gpus 8                                 # DeepSpeed launcher, 8 GPUs
    zerotrain launch --config run.yaml --include localhost:0,1                  # GPUs 0 and 1
    zerotrain launch --config run.yaml --launcher hostfile --hosts n1,n2 --gpus 8   # 2 nodes, over ssh (pdsh)
    zerotrain launch --config run.yaml --launcher torchrun --gpus 8 --run
    zerotrain launch --config run.yaml --launcher slurm --nodes 4 --gpus-per-node 8 --time 24:00:00 --write jobs/
    zerotrain launch --config run.yaml --gpus 8 --image zerotrain:0.1.0 --run   # in the Docker image (docker/)

It prints the script (or writes it with --write, or runs it with --run). The rules it enforces are
the ones users trip over (FIELD_NOTES): the DeepSpeed launcher rewrites CUDA_VISIBLE_DEVICES, so
GPUs are chosen with --include; torchrun's --nproc_per_node must not exceed the visible GPUs; a
Slurm job must signal the training tasks (not the batch shell) early enough for zerotrain to write a
checkpoint before the time limit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerotrain.errors import ZerotrainError

LAUNCHERS = ("deepspeed", "torchrun", "slurm", "hostfile")
ALLOC_CONF = "expandable_segments:True"
# The DeepSpeed launcher's and torchrun's default rendezvous port.
DEFAULT_PORT = 29500
# Slurm's --signal may come up to 60 s before the time asked for (sbatch(1)), and the checkpoint
# must be complete before the time limit's SIGTERM/SIGKILL: the signal leads the limit by the
# grace period plus this margin.
SLURM_SIGNAL_MARGIN_S = 60
_SPEC_RE = re.compile(r"^\s*(\d+)\s*x\s*(\S.*?)\s*$", re.IGNORECASE)
# The Docker image's (docker/Dockerfile) working folder, where the current folder is mounted, and its
# cache volume (Hugging Face models, planner facts); tests/unit/test_launch.py checks them against it.
IMAGE_WORKDIR = "/workspace"
IMAGE_CACHE = "/cache"
# The named volume `--image` mounts at IMAGE_CACHE, so that downloads outlive the container.
IMAGE_CACHE_VOLUME = "zerotrain-cache"
# `docker stop` waits this long past faults.grace_seconds before its SIGKILL.
STOP_MARGIN_S = 60


@dataclass
class Recipe:
    """What `zerotrain launch` produces: the command --run executes (None for Slurm), the files
    to write (name -> text; the first is the script), and notes for the person launching."""

    launcher: str
    nodes: int
    gpus_per_node: int | None
    command: list[str] | None
    files: dict[str, str]
    notes: list[str] = field(default_factory=list)
    hostfile: Path | None = None  # where a generated hostfile must be written for --run


# ---- pure pieces -------------------------------------------------------------------------------


def train_script(cwd: Path | None = None) -> str:
    """zerotrain/train.py of this installation, relative to `cwd` when it lies below it (as in a
    checkout: `zerotrain/train.py`), else absolute (an installed package, the Docker image)."""
    script = Path(__file__).resolve().with_name("train.py")
    try:
        return str(script.relative_to((cwd or Path.cwd()).resolve()))
    except ValueError:
        return str(script)


def planner_overrides(hardware_gpus: str, nodes: int, gpus_per_node: int | None) -> list[str]:
    """--set overrides that make the planner plan for `nodes` x `gpus_per_node`: hardware.nodes, and
    hardware.gpus when the config names a count or a profile (`auto` stays: NVML on each node then
    sees the GPUs the launcher gives the rank)."""
    overrides = [f"hardware.nodes={nodes}"]
    spec = str(hardware_gpus).strip()
    if gpus_per_node is not None:
        if spec.isdigit():
            overrides.append(f"hardware.gpus={gpus_per_node}")
        elif match := _SPEC_RE.match(spec):
            overrides.append(f"hardware.gpus={gpus_per_node}x{match.group(2)}")
    return overrides


def config_gpus_per_node(hardware_gpus: str) -> int | None:
    """The per-node GPU count a config's hardware.gpus names (8xA100-80GB -> 8, 4 -> 4, auto -> None)."""
    spec = str(hardware_gpus).strip()
    if spec.isdigit():
        return int(spec)
    match = _SPEC_RE.match(spec)
    return int(match.group(1)) if match else None


def train_arguments(script: str, config: Path | str, overrides: list[str]) -> list[str]:
    """`script --config CONFIG --set K=V ...`: what every launcher starts on every rank."""
    args = [script, "--config", str(config)]
    for override in overrides:
        args += ["--set", override]
    return args


def hostfile_text(hosts: list[str], slots: int) -> str:
    """A DeepSpeed hostfile: one `host slots=N` line per node."""
    hosts = validate_hosts(hosts)
    if slots < 1:
        raise ZerotrainError(f"--gpus {slots}: a node needs at least one GPU slot")
    return "".join(f"{host} slots={slots}\n" for host in hosts)


def validate_hosts(hosts: list[str]) -> list[str]:
    hosts = [h.strip() for h in hosts if h.strip()]
    if not hosts:
        raise ZerotrainError("--hosts: name at least one host, e.g. --hosts node1,node2")
    bad = [h for h in hosts if not re.fullmatch(r"[A-Za-z0-9_.:\-\[\]]+", h)]
    if bad:
        raise ZerotrainError(f"--hosts: '{bad[0]}' is not a host name")
    if len(set(hosts)) != len(hosts):
        raise ZerotrainError(f"--hosts: {','.join(hosts)} names a host twice; one entry per node")
    return hosts


def parse_hostfile(text: str, source: str = "hostfile") -> dict[str, int]:
    """host -> slots from a DeepSpeed hostfile (`host slots=N` lines, # comments). zerotrain plans
    for identical nodes, so every host must have the same number of slots."""
    hosts: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        match = re.fullmatch(r"slots=(\d+)", parts[1]) if len(parts) == 2 else None
        if match is None or int(match.group(1)) < 1:
            raise ZerotrainError(f"{source}:{number}: '{raw.strip()}' is not `HOST slots=N` (N >= 1)")
        if parts[0] in hosts:
            raise ZerotrainError(f"{source}:{number}: host {parts[0]} is listed twice; one line per node")
        hosts[parts[0]] = int(match.group(1))
    if not hosts:
        raise ZerotrainError(f"{source}: no hosts; write one `HOST slots=N` line per node")
    if len(set(hosts.values())) > 1:
        listed = ", ".join(f"{h}={s}" for h, s in hosts.items())
        raise ZerotrainError(f"{source}: hosts have different slot counts ({listed}); zerotrain plans for identical "
                             "nodes: give every host the same slots, or use --gpus N for fewer per node")
    return hosts


def parse_include(spec: str) -> dict[str, list[int] | None]:
    """DeepSpeed's --include syntax, `host:0,1@host2:2,3` (a host without slots means all of it)."""
    result: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        host, sep, slots = part.strip().partition(":")
        if not host or (sep and not re.fullmatch(r"\d+(,\d+)*", slots)):
            raise ZerotrainError(f"--include {spec}: write HOST:GPU,GPU[@HOST:GPU,...], e.g. localhost:0,1")
        indices = [int(s) for s in slots.split(",")] if sep else None
        if indices is not None and len(set(indices)) != len(indices):
            raise ZerotrainError(f"--include {spec}: GPU listed twice on {host}")
        result[host] = indices
    return result


def deepspeed_command(train_args: list[str], *, gpus: int | None = None, include: str | None = None,
                      hostfile: str | None = None, nodes: int | None = None, master_addr: str | None = None,
                      master_port: int = DEFAULT_PORT, ssh_check: bool = True,
                      executable: str = "deepspeed") -> list[str]:
    """The DeepSpeed launcher's command. GPUs are chosen with --include (or --num_gpus, the first N);
    CUDA_VISIBLE_DEVICES is never used: the launcher rewrites it for every rank. With a hostfile,
    the launcher starts the other nodes' ranks over ssh (pdsh); `nodes` takes the first N hosts."""
    if include is not None and (gpus is not None or nodes is not None):
        raise ZerotrainError("--include names the GPUs itself; it cannot be combined with --gpus or --nodes "
                             "(the DeepSpeed launcher refuses that)")
    command = [executable]
    if hostfile is not None:
        command += ["--hostfile", hostfile]
        if nodes is not None:
            command += ["--num_nodes", str(nodes)]
        if not ssh_check:
            command.append("--no_ssh_check")
    if include is not None:
        command += ["--include", include]
    elif gpus is not None:
        command += ["--num_gpus", str(gpus)]
    if master_addr is not None:
        command += ["--master_addr", master_addr]
    return [*command, "--master_port", str(master_port), *train_args]


def torchrun_command(train_args: list[str], *, nproc_per_node: int, nodes: int = 1,
                     rdzv_endpoint: str | None = None, executable: str = "torchrun") -> list[str]:
    """torchrun on one node (--standalone: a free local port), or the command every node runs for
    a multi-node job (c10d rendezvous at rdzv_endpoint, so no node needs its own rank)."""
    if nproc_per_node < 1:
        raise ZerotrainError(f"--gpus {nproc_per_node}: torchrun needs at least one process per node")
    if nodes == 1:
        return [executable, "--standalone", "--nproc_per_node", str(nproc_per_node), *train_args]
    if rdzv_endpoint is None:
        raise ZerotrainError(f"torchrun on {nodes} nodes needs a rendezvous host: --master-addr HOST or --hosts H1,H2")
    return [executable, "--nnodes", str(nodes), "--nproc_per_node", str(nproc_per_node), "--rdzv_backend", "c10d",
            "--rdzv_endpoint", rdzv_endpoint, "--rdzv_id", "zerotrain", *train_args]


def shell_script(command: list[str], description: list[str], ranks_per_node: int | None,
                 prelude: Sequence[str] = ()) -> str:
    """A bash script around one launcher command, with the environment zerotrain wants."""
    threads = "1" if not ranks_per_node else f"$(( $(nproc) / {ranks_per_node} > 0 ? $(nproc) / {ranks_per_node} : 1 ))"
    lines = ["#!/usr/bin/env bash", *(f"# {line}" for line in description),
             "set -euo pipefail",
             "# Fewer allocator segments lost to fragmentation when aspect buckets change shapes.",
             f'export PYTORCH_CUDA_ALLOC_CONF="${{PYTORCH_CUDA_ALLOC_CONF:-{ALLOC_CONF}}}"',
             "# One share of the cores per rank (torchrun would set 1, which starves CPU Adam under offload).",
             f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-{threads}}}"',
             *prelude,
             "exec " + shlex.join(command)]
    return "\n".join(lines) + "\n"


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
    lines += ["", "srun --kill-on-bad-exit=1 " + shlex.join(srun)]
    if requeue:
        done = shlex.quote(f"{output_dir}/export/export.json")
        lines += ["", "# Stopped by the time-limit signal before the last step (the export is written at the end):",
                  "# queue the job again; it resumes from the checkpoint it just wrote.",
                  f'if [[ ! -f {done} ]]; then scontrol requeue "$SLURM_JOB_ID"; fi']
    return "\n".join(lines) + "\n"


# ---- checks against this machine ----------------------------------------------------------------


def local_gpus(environ: Mapping[str, str], nvml: Any = None, apply_mask: bool = True) -> int | None:
    """GPUs a process started here would see through NVML (honouring CUDA_VISIBLE_DEVICES when
    apply_mask), or None when NVML cannot be used (no GPU, no driver)."""
    from zerotrain.hardware import NvmlUnavailable, detect_nvml_gpus, visible_gpu_indices

    try:
        detected = detect_nvml_gpus(nvml)
    except NvmlUnavailable:
        return None
    if not apply_mask:
        return len(detected)
    return len(visible_gpu_indices(environ.get("CUDA_VISIBLE_DEVICES"), detected))


def check_local_gpus(wanted: int, environ: Mapping[str, str], nvml: Any, *, what: str, apply_mask: bool,
                     will_run: bool, highest_index: int | None = None) -> str | None:
    """Refuse to start more ranks here than there are GPUs. CPU ranks (DS_ACCELERATOR=cpu) are
    not limited. Without any GPU visible, --run is refused, and a printed command gets a note."""
    if environ.get("DS_ACCELERATOR") == "cpu":
        return None
    count = local_gpus(environ, nvml, apply_mask)
    if count is None or count == 0:
        if will_run:
            raise ZerotrainError(f"{what}: no GPU is visible here (NVML cannot be used); for CPU ranks (tests, "
                                 "a laptop) set DS_ACCELERATOR=cpu")
        return f"not checked against this machine's GPUs (none visible): {what}"
    mask = environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{count} GPU(s) visible" + (f" with CUDA_VISIBLE_DEVICES={mask}" if apply_mask and mask is not None else "")
    if wanted > count:
        raise ZerotrainError(f"{what}: {wanted} processes per node but {seen}; one process per GPU, so use "
                             f"--gpus {count} or fewer")
    if highest_index is not None and highest_index >= count:
        raise ZerotrainError(f"{what}: GPU {highest_index} does not exist here ({seen}, indices 0-{count - 1})")
    return None


def refuse_cuda_visible_devices(environ: Mapping[str, str], selection: str) -> None:
    mask = environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return
    raise ZerotrainError(
        f"CUDA_VISIBLE_DEVICES={mask} is set, and the DeepSpeed launcher {selection}: it ignores the variable and "
        "sets its own for every rank, so the ranks would not run on the GPUs you masked (\"invalid device "
        "ordinal\" or the wrong cards). Unset CUDA_VISIBLE_DEVICES and choose GPUs with --include localhost:"
        f"{mask if re.fullmatch(r'[0-9,]+', mask) else '0,1'} (physical indices, as nvidia-smi lists them)")


# ---- the command -------------------------------------------------------------------------------


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("launch", help="print, write or run the command that starts training: DeepSpeed "
                                           "launcher, hostfile, torchrun or a Slurm batch script",
                            description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, required=True, help="run config (YAML, JSON or TOML)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (repeatable); passed on to every rank")
    p.add_argument("--launcher", choices=LAUNCHERS, default="deepspeed",
                   help="deepspeed (one node), hostfile (DeepSpeed launcher over ssh on several nodes), torchrun, "
                        "slurm (an sbatch script)")
    p.add_argument("--gpus", "--gpus-per-node", dest="gpus", type=int, metavar="N",
                   help="GPUs (ranks) per node; default: every visible GPU, or the hostfile's slots")
    p.add_argument("--include", metavar="HOST:GPU,...", help="DeepSpeed launcher: which GPUs, e.g. localhost:0,1 "
                                                             "(never CUDA_VISIBLE_DEVICES, which it rewrites)")
    p.add_argument("--nodes", type=int, metavar="N", help="number of nodes (default: 1, or every host given)")
    p.add_argument("--hostfile", type=Path, help="DeepSpeed hostfile (`HOST slots=N` lines) to use")
    p.add_argument("--hosts", help="comma-separated hosts: writes a hostfile (DeepSpeed) or names the rendezvous "
                                   "host (torchrun, the first)")
    p.add_argument("--master-addr", help="rendezvous host (default: the first host)")
    p.add_argument("--master-port", type=int, default=DEFAULT_PORT, help=f"rendezvous port (default {DEFAULT_PORT})")
    p.add_argument("--write", type=Path, metavar="DIR", help="write the script (and hostfile) to DIR instead of "
                                                             "printing")
    p.add_argument("--run", action="store_true", help="run it now (deepspeed, hostfile, torchrun) and return its "
                                                      "exit code")
    s = p.add_argument_group("slurm")
    s.add_argument("--partition")
    s.add_argument("--time", help="time limit, e.g. 24:00:00")
    s.add_argument("--account")
    s.add_argument("--cpus-per-task", type=int, help="CPU cores per GPU task (CPU Adam uses them under offload)")
    s.add_argument("--job-name", default="zerotrain")
    s.add_argument("--grace", type=int, metavar="SECONDS",
                   help=f"send SIGUSR1 this long before the time limit (default faults.grace_seconds + "
                        f"{SLURM_SIGNAL_MARGIN_S})")
    s.add_argument("--requeue", action="store_true",
                   help="requeue the job after a time-limit stop (and on preemption) until the run is done")
    p.add_argument("--image", metavar="IMAGE",
                   help="run in zerotrain's Docker image (docker/): `docker run` with the current folder at "
                        f"{IMAGE_WORKDIR} (deepspeed, torchrun), or srun --container-image (slurm, Pyxis)")


def executable(name: str) -> str:
    """A launcher from this Python environment (next to sys.executable), else from PATH."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file():
        return str(beside)
    return shutil.which(name) or name


@dataclass
class Request:
    """One `zerotrain launch`: its arguments, the config they load, and this machine's state."""

    args: argparse.Namespace
    run: Any  # RunConfig
    hosts: list[str] | None
    environ: Mapping[str, str]
    nvml: Any
    script: str

    def train_args(self, nodes: int, gpus: int | None) -> tuple[list[str], str]:
        """train.py's arguments with the planner told the topology, and the `zerotrain plan` command
        that shows the same plan."""
        overrides = [*self.args.overrides, *planner_overrides(self.run.hardware.gpus, nodes, gpus)]
        plan = "zerotrain plan --config " + shlex.quote(str(self.args.config))
        plan += "".join(f" --set {shlex.quote(o)}" for o in overrides)
        return train_arguments(self.script, self.args.config, overrides), plan


def make_recipe(args: argparse.Namespace, environ: Mapping[str, str] | None = None, nvml: Any = None,
                cwd: Path | None = None) -> Recipe:
    """Everything `zerotrain launch` prints, writes or runs, from its arguments; checks the request
    against the config and (for commands that start here) this machine's GPUs."""
    from zerotrain.config import load_config

    if args.nodes is not None and args.nodes < 1:
        raise ZerotrainError(f"--nodes {args.nodes}: at least one node")
    if args.gpus is not None and args.gpus < 1:
        raise ZerotrainError(f"--gpus {args.gpus}: at least one GPU per node")
    if args.include is not None and args.launcher not in ("deepspeed", "hostfile"):
        raise ZerotrainError(f"--include is the DeepSpeed launcher's; with --launcher {args.launcher} use --gpus N")
    if args.run and args.launcher == "slurm":
        raise ZerotrainError("--run starts deepspeed or torchrun here; submit a Slurm script with sbatch (use --write)")
    image = getattr(args, "image", None)
    config = image_path(args.config, cwd, "--config") if image else args.config
    request = Request(args, load_config(args.config, args.overrides),
                      validate_hosts(args.hosts.split(",")) if args.hosts else None,
                      os.environ if environ is None else environ, nvml, train_script(cwd))
    if image:  # the ranks read the config at its path in the container: relative to its working folder
        request.args = argparse.Namespace(**{**vars(args), "config": config})
    if args.launcher == "slurm":
        return slurm_recipe(request, (image, str((cwd or Path.cwd()).resolve())) if image else None)
    if args.launcher == "torchrun":
        recipe = torchrun_recipe(request)
    elif args.launcher == "hostfile" or args.hostfile is not None or request.hosts is not None:
        if image:
            raise ZerotrainError("--image: the image runs no ssh server, so the DeepSpeed launcher cannot start the "
                                 "other nodes' ranks in it; use --launcher torchrun (one container per node) or slurm")
        return hostfile_recipe(request)
    else:
        recipe = deepspeed_recipe(request)
    return in_image(recipe, request, image, config, cwd) if image else recipe


def image_path(path: Path, cwd: Path | None, what: str) -> Path:
    """`path` relative to the current folder, which --image mounts at the image's working folder; one
    line when it lies outside (it would not be in the container)."""
    folder = (cwd or Path.cwd()).resolve()
    try:
        return path.resolve().relative_to(folder)
    except ValueError:
        raise ZerotrainError(f"{what} {path}: --image mounts only the current folder ({folder}) at "
                             f"{IMAGE_WORKDIR}; run from a folder that holds it") from None


def docker_run(image: str, cwd: Path | None, grace_seconds: float, multi_node: bool) -> list[str]:
    """`docker run` of the zerotrain image with the GPUs, the current folder at its working folder,
    the cache volume, the caller's uid (files in the run folder are theirs), the host's IPC (NCCL and
    the data loader's shared memory) and a stop timeout that lets zerotrain write its checkpoint."""
    command = ["docker", "run", "--rm", "--gpus", "all", "--ipc=host",
               f"--stop-timeout={int(grace_seconds) + STOP_MARGIN_S}", f"--user={os.getuid()}:{os.getgid()}",
               "-v", f"{(cwd or Path.cwd()).resolve()}:{IMAGE_WORKDIR}", "-v", f"{IMAGE_CACHE_VOLUME}:{IMAGE_CACHE}"]
    if multi_node:  # NCCL and the rendezvous reach the other nodes; InfiniBand needs its devices too
        command += ["--network=host", "--ulimit", "memlock=-1"]
    return [*command, image]


def in_image(recipe: Recipe, request: Request, image: str, config: Path, cwd: Path | None) -> Recipe:
    """The deepspeed or torchrun recipe run in the image: `docker run IMAGE launch ... --run`, whose
    entrypoint runs `zerotrain launch` in the container (which passes a `docker stop`'s SIGTERM straight
    to the ranks); the topology this side resolved is passed on as flags."""
    args = request.args
    inner = ["launch", "--config", str(config), "--launcher", recipe.launcher]
    if recipe.launcher == "deepspeed" and args.include:
        inner += ["--include", args.include]
    else:
        inner += ["--gpus", str(recipe.gpus_per_node)]
    if recipe.launcher == "torchrun" and recipe.nodes > 1:
        inner += ["--nodes", str(recipe.nodes)]
        if args.hosts:
            inner += ["--hosts", args.hosts]
        if args.master_addr:
            inner += ["--master-addr", args.master_addr]
    inner += ["--master-port", str(args.master_port)]
    for override in args.overrides:
        inner += ["--set", override]
    command = [*docker_run(image, cwd, request.run.faults.grace_seconds, recipe.nodes > 1), *inner, "--run"]
    where = "on each node (one container per node)" if recipe.nodes > 1 else "on this node"
    description = [f"zerotrain in the image {image}, {where}: `zerotrain launch` in the container starts",
                   f"{recipe.launcher} for {recipe.nodes} x {recipe.gpus_per_node} ranks. This folder is the container's",
                   f"{IMAGE_WORKDIR}: the config's relative paths must stay inside it."]
    if recipe.nodes > 1:
        description.append("On InfiniBand, add --device /dev/infiniband to docker run.")
    script = "\n".join(["#!/usr/bin/env bash", *(f"# {line}" for line in description), "set -euo pipefail",
                        "exec " + shlex.join(command)]) + "\n"
    return Recipe(recipe.launcher, recipe.nodes, recipe.gpus_per_node, command, {"launch.sh": script}, recipe.notes)


def slurm_recipe(request: Request, image: tuple[str, str] | None = None) -> Recipe:
    args, run = request.args, request.run
    nodes = args.nodes or 1
    gpus = args.gpus or config_gpus_per_node(run.hardware.gpus)
    if gpus is None:
        raise ZerotrainError("--launcher slurm: name the GPUs per node with --gpus-per-node N (the config's "
                             "hardware.gpus is auto, and this machine is not the one the job runs on)")
    train_args, plan = request.train_args(nodes, gpus)
    text = sbatch_script(train_args, nodes=nodes, gpus_per_node=gpus, grace_seconds=run.faults.grace_seconds,
                         signal_seconds=args.grace, job_name=args.job_name, time=args.time,
                         partition=args.partition, account=args.account, cpus_per_task=args.cpus_per_task,
                         requeue=args.requeue, output_dir=str(run.output_dir), python=sys.executable,
                         plan_command=plan, image=image)
    return Recipe("slurm", nodes, gpus, None, {"zerotrain.sbatch": text})


def torchrun_recipe(request: Request) -> Recipe:
    args, hosts, notes = request.args, request.hosts, []
    nodes = args.nodes or (len(hosts) if hosts else 1)
    if nodes == 1:
        gpus = args.gpus or local_gpus(request.environ, request.nvml)
        if not gpus:
            raise ZerotrainError("--launcher torchrun: no GPU is visible here; name the processes per node with "
                                 "--gpus N (with DS_ACCELERATOR=cpu for CPU ranks)")
        note = check_local_gpus(gpus, request.environ, request.nvml, what=f"torchrun --nproc_per_node {gpus}",
                                apply_mask=True, will_run=args.run)
        notes += [note] if note else []
    elif args.gpus is None:
        raise ZerotrainError(f"torchrun on {nodes} nodes: name the processes per node with --gpus N")
    else:
        gpus = args.gpus
        notes.append(f"run the same command on each of the {nodes} nodes; each must show {gpus} GPUs")
    endpoint_host = args.master_addr or (hosts[0] if hosts else None)
    endpoint = f"{endpoint_host}:{args.master_port}" if endpoint_host else None
    train_args, plan = request.train_args(nodes, gpus)
    command = torchrun_command(train_args, nproc_per_node=gpus, nodes=nodes, rdzv_endpoint=endpoint,
                               executable=executable("torchrun"))
    where = "this node" if nodes == 1 else f"each of {nodes} nodes (the same command on every node)"
    description = [f"zerotrain with torchrun: {gpus} process(es) on {where};",
                   f"the planner plans for {nodes} x {gpus} ranks. The plan it trains with:", plan,
                   "Run from the folder the config's relative paths start from."]
    return Recipe("torchrun", nodes, gpus, command, {"launch.sh": shell_script(command, description, gpus)}, notes)


def deepspeed_recipe(request: Request) -> Recipe:
    """The DeepSpeed launcher on this node: GPUs by --include, --gpus N (--num_gpus) or all of them."""
    args, environ, notes = request.args, request.environ, []
    if args.nodes not in (None, 1):
        raise ZerotrainError(f"--nodes {args.nodes} with the DeepSpeed launcher needs the hosts: --launcher hostfile "
                             "--hosts H1,H2 (or --hostfile FILE), or use --launcher slurm")
    include, highest, mask = args.include, None, environ.get("CUDA_VISIBLE_DEVICES")
    if include is not None:
        refuse_cuda_visible_devices(environ, f"is given --include {include}")
        chosen = parse_include(include)
        if list(chosen) != ["localhost"] or chosen["localhost"] is None:
            raise ZerotrainError(f"--include {include}: on one node name GPUs of localhost, e.g. localhost:0,1 "
                                 "(other hosts need --launcher hostfile)")
        gpus, highest = len(chosen["localhost"]), max(chosen["localhost"])
    elif args.gpus is not None:
        refuse_cuda_visible_devices(environ, f"is given --num_gpus {args.gpus}")
        gpus = args.gpus
    elif mask is not None:
        if not re.fullmatch(r"\d+(,\d+)*", mask):
            refuse_cuda_visible_devices(environ, "cannot take GPU UUIDs or an empty list from it")
        include = f"localhost:{mask}"
        indices = [int(i) for i in mask.split(",")]
        gpus, highest = len(indices), max(indices)
        notes.append(f"CUDA_VISIBLE_DEVICES={mask} became --include {include} (the launcher replaces the variable "
                     "for every rank)")
    else:
        gpus = local_gpus(environ, request.nvml, apply_mask=False)
        if not gpus:
            raise ZerotrainError("the DeepSpeed launcher: no GPU is visible here; name the GPUs with --gpus N or "
                                 "--include localhost:0,1 (with DS_ACCELERATOR=cpu for CPU ranks)")
    what = f"deepspeed --include {include}" if include else f"deepspeed --num_gpus {gpus}"
    note = check_local_gpus(gpus, environ, request.nvml, what=what, apply_mask=False, will_run=args.run,
                            highest_index=highest)
    notes += [note] if note else []
    train_args, plan = request.train_args(1, gpus)
    command = deepspeed_command(train_args, gpus=None if include else gpus, include=include,
                                master_port=args.master_port, executable=executable("deepspeed"))
    description = [f"zerotrain with the DeepSpeed launcher: {gpus} GPU(s) on this node; the planner plans for 1 x {gpus}.",
                   "GPUs are chosen with --include/--num_gpus, never CUDA_VISIBLE_DEVICES (the launcher rewrites it).",
                   "The plan it trains with:", plan, "Run from the folder the config's relative paths start from."]
    return Recipe("deepspeed", 1, gpus, command, {"launch.sh": shell_script(command, description, gpus)}, notes)


def hostfile_recipe(request: Request) -> Recipe:
    """The DeepSpeed launcher over a hostfile: given (--hostfile, validated) or written (--hosts)."""
    args, run, hosts = request.args, request.run, request.hosts
    if args.hostfile is not None and hosts is not None:
        raise ZerotrainError("--hostfile and --hosts both name the nodes; give one")
    refuse_cuda_visible_devices(request.environ, "is given a hostfile")
    files: dict[str, str] = {}
    if args.hostfile is not None:
        try:
            pool = parse_hostfile(args.hostfile.read_text(), str(args.hostfile))
        except OSError as err:
            raise ZerotrainError(f"--hostfile {args.hostfile}: cannot be read ({err.strerror})") from err
        hostfile_path = str(args.hostfile)
    elif hosts is not None:
        slots = args.gpus or config_gpus_per_node(run.hardware.gpus)
        if slots is None:
            raise ZerotrainError("--hosts: name the GPUs per node with --gpus N (they become the hostfile's slots)")
        files["hostfile"] = hostfile_text(hosts, slots)
        pool = dict.fromkeys(hosts, slots)
        # Written next to the script (--write), into the run folder (--run), or by the printed script.
        target = args.write if args.write is not None else run.output_dir if args.run else None
        hostfile_path = str((target / "hostfile").resolve()) if target is not None else "hostfile"
    else:
        raise ZerotrainError("--launcher hostfile: name the nodes with --hosts H1,H2 --gpus N, or --hostfile FILE")
    slots = next(iter(pool.values()))
    include, num_nodes = args.include, None
    if include is not None:
        chosen = parse_include(include)
        unknown = [h for h in chosen if h not in pool]
        if unknown:
            raise ZerotrainError(f"--include {include}: host {unknown[0]} is not in the hostfile ({', '.join(pool)})")
        counts = {len(s) if s is not None else slots for s in chosen.values()}
        if len(counts) > 1:
            raise ZerotrainError(f"--include {include}: the same number of GPUs on every host, please (zerotrain "
                                 "plans for identical nodes)")
        nodes, gpus, first = len(chosen), counts.pop(), next(iter(chosen))
    else:
        nodes = args.nodes or len(pool)
        if nodes > len(pool):
            raise ZerotrainError(f"--nodes {nodes}: the hostfile lists only {len(pool)} host(s)")
        gpus = args.gpus or slots
        if gpus > slots:
            raise ZerotrainError(f"--gpus {gpus}: the hostfile gives each host {slots} slot(s)")
        num_nodes, first = (nodes if nodes < len(pool) else None), next(iter(pool))
    train_args, plan = request.train_args(nodes, gpus)
    # One host: the launcher starts the ranks locally and needs no ssh; its ssh check would only fail.
    command = deepspeed_command(train_args, gpus=gpus if include is None and gpus < slots else None, include=include,
                                hostfile=hostfile_path, nodes=num_nodes, master_addr=args.master_addr or first,
                                master_port=args.master_port, ssh_check=nodes > 1, executable=executable("deepspeed"))
    description = [f"zerotrain with the DeepSpeed launcher on {nodes} node(s) x {gpus} GPU(s) from the hostfile;",
                   f"the planner plans for {nodes} x {gpus}. The plan it trains with:", plan,
                   "The launcher starts the other nodes' ranks over passwordless ssh (pdsh), in this same folder,",
                   "passing on only NCCL_*, PYTHON*, UCX_* variables and the lines of ./.deepspeed_env (the",
                   "allocator setting is added there)."]
    prelude = []
    if nodes > 1:
        prelude.append(f"grep -qs '^PYTORCH_CUDA_ALLOC_CONF=' .deepspeed_env || echo "
                       f"'PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF}' >> .deepspeed_env")
    if hostfile_path == "hostfile" and files:  # printed: the script writes the hostfile itself
        prelude = ["cat > hostfile <<'EOF'", files["hostfile"].rstrip("\n"), "EOF", *prelude]
    script = shell_script(command, description, gpus, prelude)
    written = Path(hostfile_path) if files and hostfile_path != "hostfile" else None
    return Recipe("hostfile", nodes, gpus, command, {"launch.sh": script, **files}, hostfile=written)


def main(args: argparse.Namespace, environ: Mapping[str, str] | None = None, nvml: Any = None) -> int:
    """`zerotrain launch`: print the script, write it (--write DIR) and/or run it (--run)."""
    environ = dict(os.environ if environ is None else environ)
    recipe = make_recipe(args, environ, nvml)
    for note in recipe.notes:
        print(f"zerotrain: note: {note}", file=sys.stderr)
    if args.write is not None:
        args.write.mkdir(parents=True, exist_ok=True)
        for name, text in recipe.files.items():
            (args.write / name).write_text(text)
            if name.endswith((".sh", ".sbatch")):
                (args.write / name).chmod(0o755)
        script = args.write / next(iter(recipe.files))
        how = f"sbatch {script}" if recipe.launcher == "slurm" else f"bash {script}"
        print(f"wrote {', '.join(str(args.write / n) for n in recipe.files)}; start it with: {how}")
    elif not args.run:
        print(next(iter(recipe.files.values())), end="")
    if not args.run:
        return 0
    if recipe.hostfile is not None and args.write is None:
        recipe.hostfile.parent.mkdir(parents=True, exist_ok=True)
        recipe.hostfile.write_text(recipe.files["hostfile"])
    env = {**environ, "PYTORCH_CUDA_ALLOC_CONF": environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)}
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (recipe.gpus_per_node or 1)))
    print("zerotrain: running " + shlex.join(recipe.command), file=sys.stderr, flush=True)
    return run_forwarding_sigterm(recipe.command, env)


def run_forwarding_sigterm(command: list[str], env: Mapping[str, str]) -> int:
    """Run the launcher; a SIGTERM or SIGUSR1 this process gets goes straight to the ranks.

    As a container's main process (`docker stop`, a Kubernetes eviction), `zerotrain launch --run` is
    what receives SIGTERM. Passed to the launcher, it would reach the ranks too, but torchrun and the
    DeepSpeed launcher SIGKILL them 30 s later, which is too soon for a large checkpoint. Signalled
    directly, the ranks take faults.grace_seconds, exit 0, and the launcher then ends normally.
    Ctrl-C's SIGINT already reaches the whole process group; here it only must not end the wait."""
    proc = subprocess.Popen(command, env=dict(env))

    def forward(signum: int, _frame: Any) -> None:
        for target in rank_processes(proc.pid) or [proc]:
            with contextlib.suppress(ProcessLookupError, OSError):
                target.send_signal(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            previous[sig] = signal.signal(sig, forward)
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def rank_processes(launcher_pid: int) -> list[Any]:
    """The ranks a launcher started: its descendants whose environment has LOCAL_RANK (torchrun and
    the DeepSpeed launcher set it for each rank) while their parent's has not (a data loader worker
    inherits it from its rank). Empty when none has started or psutil (a DeepSpeed dependency) is missing."""
    try:
        import psutil
    except ImportError:
        return []
    try:
        descendants = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return []
    flagged = set()
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            if "LOCAL_RANK" in process.environ():
                flagged.add(process.pid)
    ranks = []
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            if process.pid in flagged and process.ppid() not in flagged:
                ranks.append(process)
    return ranks
