"""`zerotrain doctor`'s host checks: host RAM against the plan, NVMe offload space, /dev/shm, and the
output folder."""

from __future__ import annotations

import contextlib
import re
import shutil
import tempfile
from pathlib import Path

from zerotrain.doctor.base import (
    EMA_BYTES_PER_PARAM,
    SHM_FOR_NCCL,
    SHM_PER_WORKER,
    Context,
    Finding,
    Missing,
    _layout_words,
    _no_plan,
    _size,
)
from zerotrain.errors import one_line
from zerotrain.hardware import (
    host_memory_bytes,
)


def available_host_memory(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """RAM that can be allocated now: MemAvailable, capped by what the container's cgroup leaves."""
    available = None
    with contextlib.suppress(OSError, AttributeError):
        match = re.search(r"MemAvailable:\s*(\d+)\s*kB", Path("/proc/meminfo").read_text())
        available = int(match.group(1)) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit = (cgroup_root / "memory.max").read_text().strip()
        if limit.isdigit():
            left = int(limit) - int((cgroup_root / "memory.current").read_text())
            available = left if available is None else min(available, left)
    return available


def check_host_ram(ctx: Context) -> Finding:
    total, available = host_memory_bytes(), available_host_memory()
    have = f"{_size(total)} RAM here" + (f" ({_size(available)} available)" if available is not None else "")
    plan = ctx.plan
    if isinstance(plan, Missing) or plan.chosen is None:
        return Finding("skip", f"{have}; {_no_plan(plan)}")
    memory = plan.chosen.memory
    terms = ", ".join(f"{k} {_size(v)}" for k, v in memory.host_terms.items() if v)
    need = f"the plan ({_layout_words(plan.chosen)}) needs {_size(memory.host_per_node)} per node ({terms})"
    if memory.host_per_node > total:
        return Finding("fail", f"{have}, but {need}",
                       "plan with this node's RAM (hardware.gpus=auto measures it, or set hardware.host_memory), "
                       "offload to NVMe (hardware.nvme_path), or train LoRA / on more nodes")
    if available is not None and memory.host_per_node > available:
        return Finding("warn", f"{have}, but {need}: other processes hold the rest",
                       "stop what holds host memory (top, sorted by RES) before the job")
    return Finding("ok", f"{have}; {need}")


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _probe_write(folder: Path) -> str | None:
    """None when a file can be written in `folder`, else why not."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".zerotrain-doctor-"):
            pass
    except OSError as err:
        return one_line(err)
    return None


def check_nvme(ctx: Context) -> Finding:
    config = ctx.run.hardware
    if config.nvme_path is None:
        return Finding("skip", "no NVMe offload (hardware.nvme_path unset)")
    folder = _existing_ancestor(config.nvme_path)
    if not folder.is_dir():
        return Finding("fail", f"hardware.nvme_path={config.nvme_path}: {folder} is a file",
                       "point hardware.nvme_path at a folder on a local NVMe drive")
    error = _probe_write(folder)
    if error:
        return Finding("fail", f"hardware.nvme_path={config.nvme_path}: cannot write in {folder} ({error})",
                       "choose a writable folder on a local NVMe drive, or fix its permissions")
    free = shutil.disk_usage(folder).free
    have = f"{_size(free)} free at {folder}"
    plan = ctx.plan
    if isinstance(plan, Missing) or plan.chosen is None:
        return Finding("ok", f"{have}; {_no_plan(plan)}")
    need = plan.chosen.memory.nvme_per_node
    if not need:
        return Finding("ok", f"{have}; the plan ({_layout_words(plan.chosen)}) does not offload to NVMe")
    planned = f"the plan ({_layout_words(plan.chosen)}) swaps {_size(need)} per node"
    if need > free:
        return Finding("fail", f"{have}, but {planned}" + (
            f" (hardware.nvme_space={config.nvme_space} was planned for)" if config.nvme_space else ""),
                       "free space on the drive, point hardware.nvme_path at a larger one, or plan without NVMe "
                       "(--set planner.offload=[none,cpu])")
    return Finding("ok", f"{have}; {planned}")


def check_shm(ctx: Context) -> Finding:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return Finding("skip", "no /dev/shm on this system")
    usage = shutil.disk_usage(shm)
    workers, ranks = ctx.run.data.num_workers, ctx.ranks_per_node
    need = max(workers * ranks * SHM_PER_WORKER, SHM_FOR_NCCL if ranks > 1 else 0)
    have = f"/dev/shm: {_size(usage.free)} free of {_size(usage.total)}"
    uses = (f"{workers} DataLoader worker(s) x {ranks} rank(s) per node at {_size(SHM_PER_WORKER)} each"
            if workers else f"data.num_workers=0 (no DataLoader workers), {ranks} rank(s) per node")
    if usage.free < need:
        return Finding("warn", f"{have}; {uses} want about {_size(need)}: workers die with 'Bus error' and NCCL "
                               "with 'unhandled system error' when it runs out",
                       "in Docker: docker run --ipc=host (or --shm-size=16g); on Kubernetes mount an emptyDir "
                       "with medium: Memory at /dev/shm; or lower data.num_workers")
    return Finding("ok", f"{have}; {uses}")


def _checkpoint_bytes(ctx: Context) -> int | None:
    facts = ctx.facts
    if isinstance(facts, Missing):
        return None
    # the bf16 weights, the master and the optimizer's state of the optimizer the plan trains with;
    # frozen weights are not saved (exclude_frozen_parameters)
    from zerotrain import optimizers

    plan = ctx.plan
    name = plan.chosen.layout.optimizer if not isinstance(plan, Missing) and plan.chosen else \
        ctx.run.optimizer.name if ctx.run.optimizer.name != "auto" else ctx.run.planner.optimizers[0]
    per_param = optimizers.get(name).checkpoint_bytes_per_param() + (EMA_BYTES_PER_PARAM if ctx.run.ema.enabled else 0)
    return int(per_param * facts.trainable_params)


def check_output(ctx: Context) -> Finding:
    out = ctx.run.output_dir
    if out.exists() and not out.is_dir():
        return Finding("fail", f"output_dir={out} is a file", "set output_dir to a folder (--set output_dir=PATH)")
    folder = _existing_ancestor(out)
    if not folder.is_dir():
        return Finding("fail", f"output_dir={out} cannot be created: {folder} is a file",
                       "set output_dir to a folder path (--set output_dir=PATH)")
    error = _probe_write(folder)
    if error:
        return Finding("fail", f"output_dir={out}: cannot write in {folder} ({error})",
                       "set output_dir to a writable folder (--set output_dir=PATH), or fix its permissions")
    free = shutil.disk_usage(folder).free
    where = f"output_dir={out}" + ("" if folder == out.absolute() else f" (to be created in {folder})")
    checkpoint = _checkpoint_bytes(ctx)
    if checkpoint is None:
        return Finding("ok", f"{where}: writable, {_size(free)} free; checkpoint size unknown ({ctx.facts.reason})")
    keep = ctx.run.training.keep_checkpoints
    # A new checkpoint is written before the oldest is removed.
    need = (keep + 1) * checkpoint
    sizes = (f"{_size(free)} free; a checkpoint is about {_size(checkpoint)}, {keep} kept + 1 being written = "
             f"{_size(need)}")
    if free < checkpoint:
        return Finding("fail", f"{where}: {sizes}: not even one checkpoint fits",
                       "free space, or set output_dir on a larger drive")
    if free < need:
        return Finding("warn", f"{where}: {sizes}: the disk fills before training.keep_checkpoints is reached",
                       "free space, lower training.keep_checkpoints, or use a larger drive")
    return Finding("ok", f"{where}: writable; {sizes}")
