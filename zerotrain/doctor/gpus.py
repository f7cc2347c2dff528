"""`zerotrain doctor`'s GPU checks: the GPUs NVML, CUDA_VISIBLE_DEVICES and torch see, NCCL peer-to-peer,
and free GPU memory against the plan."""

from __future__ import annotations

import contextlib
import dataclasses

from zerotrain.doctor.base import (
    OTHER_PROCESS_NOTICE,
    Context,
    Finding,
    Missing,
    _combine,
    _layout_words,
    _no_plan,
    _size,
    _truthy,
)
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import (
    GPUInfo,
    parse_gpu_spec,
)


def _gpu_list(gpus: list[GPUInfo]) -> str:
    return ", ".join(f"{g.index}: {g.name} ({_size(g.total_bytes)})" for g in gpus)


def check_gpus(ctx: Context) -> Finding:
    import torch

    gpus, mask, torch_count = ctx.nvml_gpus, ctx.environ.get("CUDA_VISIBLE_DEVICES"), ctx.torch_gpus
    if isinstance(gpus, Missing):
        if torch_count == 0:
            return Finding("skip", f"no GPU visible (NVML absent: {gpus.reason}); torch sees none either")
        return Finding("warn", f"torch sees {torch_count} GPU(s) but NVML is unavailable ({gpus.reason}), so "
                               "hardware.gpus=auto and these checks cannot read them",
                       "pip install nvidia-ml-py, and in a container make libnvidia-ml visible (docker run --gpus "
                       "all); or name the GPUs: --gpus 8xA100-80GB")
    visible = ctx.visible_gpus
    if isinstance(visible, Missing):
        return Finding("warn", visible.reason, "name the GPUs with --gpus N --gpu-memory SIZE")
    n = len(gpus)
    ids = ",".join(str(i) for i in range(n))
    include = f"deepspeed --include localhost:{ids}"
    shown = f"CUDA_VISIBLE_DEVICES={mask}" if mask is not None else "CUDA_VISIBLE_DEVICES unset"
    detail = f"NVML: {n} GPU(s) ({_gpu_list(gpus)}); {shown}; torch sees {torch_count}"
    entries = [e.strip() for e in mask.split(",")] if mask is not None and mask.strip() else []
    if n and mask is not None and not visible:
        why = "lists a GPU twice, which makes CUDA hide every GPU" if len(set(entries)) < len(entries) \
            else f"hides all {n} GPUs"
        return Finding("fail", f"{detail}: CUDA_VISIBLE_DEVICES {why}",
                       f"unset CUDA_VISIBLE_DEVICES or list distinct GPUs (0 to {n - 1}); with the DeepSpeed "
                       f"launcher choose them with `{include}` instead")
    if len(visible) < len(entries):
        bad = entries[len(visible)]
        return Finding(
            "fail", f"{detail}: CUDA_VISIBLE_DEVICES lists {len(entries)} GPUs but this node has {n} (NVML "
                    f"0-{n - 1}); CUDA stops at '{bad}', so processes see only {len(visible)}, and a rank that "
                    f"asks for cuda:{len(visible)} fails with 'invalid device ordinal'",
            f"list only GPUs 0 to {n - 1} (e.g. CUDA_VISIBLE_DEVICES={ids}) or unset it; the DeepSpeed launcher "
            f"rewrites CUDA_VISIBLE_DEVICES, so choose GPUs with `{include}` instead")
    problems: list[Finding] = []
    if torch.cuda.is_available() and torch_count != len(visible):
        problems.append(Finding("fail", f"torch sees {torch_count} GPU(s) where NVML and CUDA_VISIBLE_DEVICES give "
                                        f"{len(visible)}",
                                "check CUDA_VISIBLE_DEVICES and that torch and NVML talk to the same driver "
                                "(nvidia-smi)"))
    from zerotrain.distributed import device_index, local_world_size, topology

    local = local_world_size(ctx.environ)
    if local and local > len(visible) != 1:  # one GPU per task sees 1 of its own: that is its device
        problems.append(Finding("fail", f"the launcher starts {local} processes on this node but {len(visible)} "
                                        "GPU(s) are visible; the extra ranks fail with 'invalid device ordinal'",
                                f"start one process per visible GPU (torchrun --nproc_per_node {len(visible)}, "
                                f"or `{include}`)"))
    if any(name in ctx.environ for name in ("LOCAL_RANK", "SLURM_LOCALID")) and visible:
        try:
            device_index(topology(ctx.environ).local_rank, len(visible), ctx.environ)
        except ZerotrainError as err:
            problems.append(Finding("fail", str(err), "see the line: one GPU per task, or every GPU to each task"))
    spec = ctx.run.hardware.gpus.strip()
    if spec.lower() != "auto":
        with contextlib.suppress(ZerotrainError):
            planned = parse_gpu_spec(spec, ctx.run.hardware.gpu_memory)[0]
            if planned != len(visible):
                problems.append(Finding("warn", f"the config plans for {planned} GPU(s) per node "
                                                f"(hardware.gpus={spec}) but {len(visible)} are visible here",
                                        "on the training node use hardware.gpus=auto (--gpus auto), or fix the "
                                        "count"))
    if len({g.name for g in visible}) > 1 and ctx.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        problems.append(Finding("warn", "the GPUs differ, and CUDA numbers them fastest first while NVML and "
                                        "nvidia-smi number them by PCI bus, so cuda:N need not be NVML's N",
                                "export CUDA_DEVICE_ORDER=PCI_BUS_ID"))
    if not problems:
        note = f" (the DeepSpeed launcher rewrites CUDA_VISIBLE_DEVICES: use `{include}`)" if mask is not None else ""
        return Finding("ok", f"{detail}; {len(visible)} visible{note}")
    return _combine(f"{detail}: ", problems)


def check_p2p(ctx: Context) -> Finding:
    import torch

    count = ctx.torch_gpus
    if count == 0:
        return Finding("skip", "no GPU visible to torch: no peer-to-peer traffic to check")
    if count == 1:
        return Finding("skip", "one GPU: no peer-to-peer traffic within the node")
    missing = [(i, j) for i in range(count) for j in range(count)
               if i != j and not torch.cuda.can_device_access_peer(i, j)]
    disabled = _truthy(ctx.environ.get("NCCL_P2P_DISABLE"))
    pairs = ", ".join(f"{i}->{j}" for i, j in missing[:8]) + (" ..." if len(missing) > 8 else "")
    if missing and disabled:
        return Finding("ok", f"no peer access for {pairs}, and NCCL_P2P_DISABLE=1 is set, so NCCL goes through "
                             "host shared memory")
    if missing:
        return Finding(
            "warn", f"{len(missing)} of {count * (count - 1)} GPU pairs have no peer-to-peer access ({pairs}): "
                    "NCCL falls back to host shared memory, and on some systems (consumer cards, VMs with "
                    "IOMMU/ACS) hangs or errors when it tries P2P",
            "if collectives hang or fail at start, export NCCL_P2P_DISABLE=1; NCCL_P2P_LEVEL (LOC, NVL, PIX, PXB, "
            "PHB, SYS) limits which paths NCCL uses for P2P")
    if disabled:
        return Finding("warn", f"all {count} GPUs reach each other directly, but NCCL_P2P_DISABLE=1 makes NCCL "
                               "copy through host memory (slower)", "unset NCCL_P2P_DISABLE")
    return Finding("ok", f"all {count * (count - 1)} GPU pairs have peer-to-peer access (NVLink or PCIe)")


def _free_memory(ctx: Context) -> list[GPUInfo] | Missing:
    """Total and free memory of each visible GPU: NVML's, or torch's when NVML is absent."""
    import torch

    visible = ctx.visible_gpus
    if isinstance(visible, list) or ctx.torch_gpus == 0:
        return visible
    gpus = []
    for i in range(ctx.torch_gpus):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(GPUInfo(i, torch.cuda.get_device_name(i), "", int(total), int(free)))
    return gpus


def check_gpu_memory(ctx: Context) -> Finding:
    gpus = _free_memory(ctx)
    if isinstance(gpus, Missing):
        absent = "NVML absent" if gpus.expected else "NVML unusable"
        return Finding("skip", f"no GPU visible ({absent}: {gpus.reason})")
    if not gpus:
        return Finding("skip", "no GPU visible (CUDA_VISIBLE_DEVICES hides them; see gpus)")
    held = {g.index: g.total_bytes - g.free_bytes for g in gpus}
    usage = ", ".join(f"GPU {g.index}: {_size(g.free_bytes)} free of {_size(g.total_bytes)}" for g in gpus)
    idle = ctx.idle_plan
    if isinstance(idle, Missing) or idle.chosen is None:
        busy = [i for i, n in held.items() if n > OTHER_PROCESS_NOTICE]
        if busy:
            return Finding("warn", f"{usage}; other processes hold memory on GPU {', '.join(map(str, busy))}; "
                                   f"{_no_plan(idle)}",
                           "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv shows who")
        return Finding("ok", f"{usage}; {_no_plan(idle)}")
    need = idle.chosen.memory.device_total
    headroom = ctx.run.planner.headroom
    short = [g for g in gpus if need > int(min(g.total_bytes, g.free_bytes) * (1 - headroom))]
    planned = f"the plan ({_layout_words(idle.chosen)}) needs {_size(need)} per GPU plus {headroom:.0%} headroom"
    if not short:
        return Finding("ok", f"{usage}; {planned}")
    worst = min(short, key=lambda g: g.free_bytes)
    shortfall = (f"GPU {worst.index} ({worst.name}) has {_size(worst.free_bytes)} free of {_size(worst.total_bytes)} "
                 f"({_size(held[worst.index])} in use), but {planned}")
    who = "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv shows which processes hold it"
    hw = ctx.hardware
    fallback = None if isinstance(hw, Missing) else ctx.plan_for(
        dataclasses.replace(hw, gpu_free_bytes=min(g.free_bytes for g in gpus)))
    if fallback is not None and not isinstance(fallback, Missing) and fallback.chosen is not None:
        return Finding("warn", f"{shortfall}; with what is free the planner falls back to "
                               f"{_layout_words(fallback.chosen)} ({fallback.chosen.images_per_second:.2f} vs "
                               f"{idle.chosen.images_per_second:.2f} images/s)",
                       f"free the GPUs before a long job ({who}), or accept the slower plan")
    return Finding("fail", f"{shortfall}; nothing fits in the free memory",
                   f"stop the processes holding GPU memory ({who}), or choose idle GPUs (deepspeed --include "
                   "localhost:...)")
