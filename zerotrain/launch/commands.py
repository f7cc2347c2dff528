"""The command lines each launcher runs: what every rank starts (zerotrain/train.py with the config
and the planner told the topology), the DeepSpeed launcher's and torchrun's commands, and the bash
script around one of them with the environment zerotrain wants."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from pathlib import Path

from zerotrain.errors import ZerotrainError

ALLOC_CONF = "expandable_segments:True"
# The DeepSpeed launcher's and torchrun's default rendezvous port.
DEFAULT_PORT = 29500
_SPEC_RE = re.compile(r"^\s*(\d+)\s*x\s*(\S.*?)\s*$", re.IGNORECASE)


def train_script(cwd: Path | None = None) -> str:
    """zerotrain/train.py of this installation, relative to `cwd` when it lies below it (as in a
    checkout: `zerotrain/train.py`), else absolute (an installed package, the Docker image)."""
    script = Path(__file__).resolve().parents[1] / "train.py"
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
