"""Where this process sits in a distributed job, from what the launchers set: torchrun and the
DeepSpeed launcher (RANK, WORLD_SIZE, LOCAL_RANK), or Slurm's srun (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID). Nothing else in zerotrain reads these variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def topology(environ: Mapping[str, str] | None = None) -> Topology:
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return Topology(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)))
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return Topology(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]), int(env.get("SLURM_LOCALID", 0)))
    return Topology(0, 1, 0)


def init_process_group(topo: Topology) -> None:
    """Join the job's process group (NCCL on GPUs, gloo on CPU) when there is more than one
    process. MASTER_ADDR/MASTER_PORT come from the launcher."""
    if topo.world_size > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(topo.local_rank)
        torch.distributed.init_process_group(backend, rank=topo.rank, world_size=topo.world_size)


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def gather_objects(value: object) -> list[object]:
    """Every rank's value, on every rank (a list of one without a process group)."""
    if not torch.distributed.is_initialized():
        return [value]
    out: list[object] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, value)
    return out
