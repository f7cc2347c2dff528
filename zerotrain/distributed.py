"""Where this process sits in a distributed job, from what the launchers set: torchrun and the
DeepSpeed launcher (RANK, WORLD_SIZE, LOCAL_RANK), or Slurm's srun (SLURM_PROCID, SLURM_NTASKS,
SLURM_LOCALID). Nothing else in zerotrain reads these variables."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
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


def slurm_rendezvous(environ: MutableMapping[str, str] | None = None) -> None:
    """Under Slurm's srun (SLURM_PROCID and SLURM_NTASKS, no RANK), set the variables torch and
    DeepSpeed read: RANK, WORLD_SIZE and LOCAL_RANK from SLURM_*, MASTER_ADDR (when not set) the
    first host of SLURM_JOB_NODELIST, MASTER_PORT (when not set) 20000 + SLURM_JOB_ID % 20000, so
    that jobs sharing a node do not collide. Anything already set is kept."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return
    env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if "MASTER_ADDR" not in env and nodelist:
        env["MASTER_ADDR"] = first_host(nodelist)
    env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 20000))


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: "gpu[03-05,09],cpu1" -> "gpu03"."""
    head = nodelist.strip()
    depth = 0
    for i, char in enumerate(head):
        depth += char == "["
        depth -= char == "]"
        if char == "," and depth == 0:
            head = head[:i]
            break
    if "[" not in head:
        return head
    prefix, _, ranges = head.partition("[")
    first = ranges.rstrip("]").split(",")[0].split("-")[0]
    return prefix + first + head[head.index("]") + 1:]


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


def agree(values: list[float]) -> list[float]:
    """The element-wise maximum of `values` over all ranks (one small all-reduce; the values
    themselves without a process group). Every rank must call it at the same point."""
    if not torch.distributed.is_initialized():
        return list(values)
    device = "cpu"
    if torch.distributed.get_backend() == "nccl":
        device = f"cuda:{torch.cuda.current_device()}"
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return tensor.tolist()


def all_ok(ok: bool) -> bool:
    """Whether every rank says ok (see agree)."""
    return agree([0.0 if ok else 1.0])[0] == 0.0
