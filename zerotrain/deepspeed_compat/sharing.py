"""Buffer sharing: the tested-version gate (buffer_sharing, the flag the planner and the engine read), and
deepspeed.initialize with the ZeRO buffers that only repeat another dropped, then checked (unshared)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerotrain import versions
from zerotrain.units import gib

if TYPE_CHECKING:  # torch is imported where it is used: the planner reads the gate without it
    import torch
from zerotrain.deepspeed_compat.jit import say_jit_builds

PIN_BACKEND = "DS_PIN_MEMORY_BACKEND"


# ---- the tested-version gate ----

@dataclass(frozen=True)
class Sharing:
    """Whether zerotrain shares DeepSpeed's repeated buffers; `why` says why not."""

    enabled: bool
    why: str = ""


def buffer_sharing(version: str | None = None, environ: Mapping[str, str] | None = None) -> Sharing:
    """The gate, as a value: `version` is DeepSpeed's (default: the installed one)."""
    deepspeed = versions.check("deepspeed", version)
    if not deepspeed.is_tested:
        return Sharing(False, f"DeepSpeed {deepspeed.installed} is not a version zerotrain's buffer sharing was "
                              f"checked against ({', '.join(deepspeed.tested)})")
    environ = os.environ if environ is None else environ
    if environ.get(PIN_BACKEND, "torch").strip().lower() == "native":
        # deepspeed/utils/pin_memory.py: the native backend unpins each buffer by its pointer.
        return Sharing(False, f"{PIN_BACKEND}=native unpins DeepSpeed's host buffers by pointer, and a shared "
                              "buffer would be freed twice")
    return Sharing(True)


@functools.cache
def sharing_in_force() -> Sharing:
    """buffer_sharing() for this process, with its one warning when it is off."""
    sharing = buffer_sharing()
    if not sharing.enabled:
        print(f"zerotrain: warning: buffer sharing off: {sharing.why}; DeepSpeed keeps its own copies (up to 2 "
              "bytes per trainable parameter more with bf16 master weights), and the plan counts them",
              file=sys.stderr, flush=True)
    return sharing


# ---- deepspeed.initialize with the sharing ----

def initialize(sharing: Sharing, **kwargs: Any) -> tuple[Any, ...]:
    """deepspeed.initialize(**kwargs), with the buffer sharing where `sharing` allows it; warns
    with the byte difference where a sharing the plan counts on did not happen."""
    import deepspeed
    import torch

    say_jit_builds(initialize_ops(kwargs.get("config") or {}, kwargs.get("optimizer")))
    if not sharing.enabled:
        return deepspeed.initialize(**kwargs)
    # DeepSpeed's decoupled checkpoint writer hands the master partitions to another process,
    # which would move a shared one's whole pinned buffer into shared memory.
    writer = ((kwargs.get("config") or {}).get("checkpoint") or {}).get("writer") or {}
    with _zero3_shares_bf16_masters(offloaded=not writer.get("decoupled", False)):
        out = deepspeed.initialize(**kwargs)
    _share_upload_copies(out[1])
    missed = unshared(out[1])
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if missed and rank == 0:
        total = sum(n for _, n in missed)
        print(f"zerotrain: warning: DeepSpeed kept {gib(total, units=('MiB',))} per rank more than planned: "
              + "; ".join(f"{what} not shared ({gib(n, units=('MiB',))})" for what, n in missed), file=sys.stderr,
              flush=True)
    return out


def initialize_ops(config: Mapping[str, Any], optimizer: Any = None) -> list[str]:
    """The JIT ops deepspeed.initialize loads for `config` (OP_BUILDERS' names), as DeepSpeed 0.19.8 chooses them:
    its AdamW (no client `optimizer`) is torch's under "torch_adam", DeepSpeedCPUAdam (cpu_adam) with the
    optimizer offloaded to cpu or nvme, FusedAdam (fused_adam) otherwise (runtime/engine.py
    get_optimizer_configuration); anything on NVMe swaps through async_io (runtime/swap_tensor); offloaded
    buffers pinned under DS_PIN_MEMORY_BACKEND=native need pin_memory (utils/pin_memory.py)."""
    # the optimizer types DeepSpeed builds its own Adam for
    from deepspeed.runtime.config import ADAM_OPTIMIZER, ADAMW_OPTIMIZER

    zero = config.get("zero_optimization") or {}
    devices = {(zero.get(part) or {}).get("device") or "none" for part in ("offload_optimizer", "offload_param")}
    offloaded = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme") and int(zero.get("stage") or 0) > 0
    section = config.get("optimizer") or {}
    ops = []
    if (optimizer is None and str(section.get("type", "")).lower() in (ADAM_OPTIMIZER, ADAMW_OPTIMIZER)
            and not (section.get("params") or {}).get("torch_adam")):
        ops.append("cpu_adam" if offloaded else "fused_adam")
    if "nvme" in devices:
        ops.append("async_io")
    if devices - {"none"} and os.environ.get(PIN_BACKEND, "torch").strip().lower() == "native":
        ops.append("pin_memory")
    return ops


def _share_upload_copies(optimizer: Any) -> None:
    """ZeRO 1/2 with the optimizer offloaded keep a pinned bf16 copy of each master partition, which
    every step fills from the master before copying it to the GPU (stage_1_and_2.py
    param_buffer_of_bit16_for_cpu_offload_groups). With bf16 masters (adamw-bf16) the copy equals
    the master: the master takes its place, and the copy's pinned memory goes back before the
    first step allocates the moments. DeepSpeed's own step then copies the master into itself and
    uploads it as before."""
    pairs = _upload_pairs(optimizer)
    shared = False
    for i, (buffer, master) in enumerate(pairs):
        if _same_layout(buffer, master) and buffer.data_ptr() != master.data_ptr():
            optimizer.param_buffer_of_bit16_for_cpu_offload_groups[i] = master
            shared = True
    if shared:
        empty_host_cache()


def _upload_pairs(optimizer: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ZeRO 1/2 offloaded: (upload copy, master) per group; [] for any other optimizer."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or not optimizer.cpu_offload:
        return []
    return list(zip(optimizer.param_buffer_of_bit16_for_cpu_offload_groups,
                    optimizer.single_partition_of_fp32_groups, strict=True))


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape, a.device) == (b.dtype, b.shape, b.device)


@contextlib.contextmanager
def _zero3_shares_bf16_masters(offloaded: bool = True) -> Iterator[None]:
    """ZeRO-3 with bf16 masters keeps no buffer that only repeats another (2 bytes per trainable
    parameter each), while deepspeed.initialize runs:
    - On the GPU (the optimizer not offloaded), a sub-group's bf16 partition is its own master, as
      stage3.py _create_fp32_partitions means it to be when the partition already has the master
      dtype and sits on the optimizer's device ("we don't need another copy"). DeepSpeed 0.19.8
      compares the partition's torch.device with its own device, which it keeps as the
      accelerator's device name, a string: never equal, so it always copies. While that method
      runs, the name is given as the torch.device it names.
    - Offloaded with the parameters (offload_param and offload_optimizer cpu), the partition is a
      pinned host buffer (param_groups_fp16_flat_cpu_memory) of the master dtype on the
      optimizer's device, yet DeepSpeed takes the offload branch first and clones it. The clone is
      dropped for the partition itself (_share_offloaded_masters).
    - Offloaded, each sub-group's master gradient is a pinned buffer the boundary fills by copying
      the gradient partition (grad_partitions_flat_buffer, pinned too) into it; with bf16 masters
      both are bf16 with the same layout, so the master's gradient becomes its sub-group's range of
      the gradient partition (_share_offloaded_grads). The boundary's copy then writes the same
      bytes to the same place (on a GPU a second download on the same stream, on the CPU a copy
      onto itself, which torch skips).
    Everything else DeepSpeed does with these tensors is unchanged: the step updates the master in
    place and copies it into the partition (the same memory now), and unscaling or clipping the
    master's gradient acts on the gradient partition, which the next window's first micro-step
    overwrites. Two consequences for code outside zerotrain's: DeepSpeed's gradient accessors
    (safe_get_full_grad) read the running sum between micro-steps, and writing the fp32 master
    (safe_set_full_fp32_param) writes the weights at once. offloaded=False keeps only the first
    point (DeepSpeed's decoupled checkpoint writer, which moves what it saves into shared
    memory). The offloaded sharing is left out where another process steps or reads the master
    (ZenFlow, SuperOffload, _sharable_subgroups)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    create_original = DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions
    positions_original = DeepSpeedZeroOptimizer_Stage3.set_grad_positions

    def create(self: Any) -> Any:
        import torch
        name = self.device
        if isinstance(name, str) and not self.offload_optimizer:
            self.device = torch.device(name)
        try:
            out = create_original(self)
        finally:
            self.device = name
        if offloaded:
            _share_offloaded_masters(self)
        return out

    def set_positions(self: Any) -> Any:  # the last step of __init__ that shapes the gradient buffers
        out = positions_original(self)
        if offloaded:
            _share_offloaded_grads(self)
        return out

    DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = create
    DeepSpeedZeroOptimizer_Stage3.set_grad_positions = set_positions
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = create_original
        DeepSpeedZeroOptimizer_Stage3.set_grad_positions = positions_original


def _host_subgroups(zero: Any) -> list[int]:
    """ZeRO-3 sub-groups whose optimizer steps in host memory (not on NVMe, not on the GPU):
    stage3.py subgroup_to_device and _swappable_optimizer_subgroup."""
    if not zero.offload_optimizer:
        return []
    return [i for i in range(len(zero.fp16_groups))
            if zero.subgroup_to_device.get(i) == "cpu" and not zero._swappable_optimizer_subgroup(i)]


def _sharable_subgroups(zero: Any) -> list[int]:
    """_host_subgroups, but none with Muon, whose state DeepSpeed keys by the master while it
    creates it, and none where another process steps the master during the backward (ZenFlow,
    SuperOffload's subclass of the ZeRO-3 optimizer): it would move the whole shared buffer into
    shared, unpinned memory."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if type(zero) is not DeepSpeedZeroOptimizer_Stage3 or getattr(zero, "use_muon", False) \
            or getattr(zero, "zenflow", False):
        return []
    return _host_subgroups(zero)


def _share_offloaded_masters(zero: Any) -> None:
    """ZeRO-3 with the parameters and the optimizer offloaded: each host sub-group's master is its
    bf16 partition when the master dtype is bf16 (see _zero3_shares_bf16_masters)."""
    if not zero.offload_param:
        return
    shared = False
    for i in _sharable_subgroups(zero):
        partition, master = zero.fp16_partitioned_groups_flat[i], zero.fp32_partitioned_groups_flat[i]
        if partition is None or partition.device.type != "cpu" or partition.data_ptr() == master.data_ptr() \
                or (partition.dtype, partition.shape) != (master.dtype, master.shape):
            continue
        partition.ds_id = master.ds_id
        partition.requires_grad = True
        zero.fp32_partitioned_groups_flat[i] = partition
        shared = True
    if shared:
        empty_host_cache()


def _grad_views(zero: Any) -> Iterator[tuple[int, torch.Tensor]]:
    """(sub-group, its range of the pinned gradient partition grad_partitions_flat_buffer), in
    sub-group order (stage3.py _create_fp16_sub_groups lays them out one after another)."""
    flat = getattr(zero, "grad_partitions_flat_buffer", None)
    if flat is None or flat.device.type != "cpu":
        return
    offset = 0
    for i in range(len(zero.fp16_groups)):
        numel = int(zero.fp16_partitioned_groups_flat_numel[i])
        yield i, flat.narrow(0, offset, numel)
        offset += numel


def _share_offloaded_grads(zero: Any) -> None:
    """ZeRO-3 with the optimizer offloaded: each host sub-group's master gradient is its range of
    the pinned gradient partition when both have the master dtype and the sub-group's parameters lie
    in it in the order of their gradient positions (see _zero3_shares_bf16_masters)."""
    subgroups = set(_sharable_subgroups(zero))
    # The gradient partitions DeepSpeed copies by position (stage3.py set_grad_positions and the
    # name-mangled __param_id_to_grad_partition) must be the same places.
    partitions = zero._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    shared = False
    for i, view in _grad_views(zero):
        master = zero.fp32_partitioned_groups_flat[i]
        grad = master.grad
        if i not in subgroups or grad is None or (grad.dtype, grad.numel()) != (view.dtype, view.numel()) \
                or grad.data_ptr() == view.data_ptr():
            continue
        if not all(partitions[p.ds_id].data_ptr() == view.data_ptr() + view.element_size() * zero.grad_position[
                zero.get_param_id(p)][1] for p in zero.fp16_groups[i]):
            continue
        master.grad = view
        shared = True
    if shared:
        empty_host_cache()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def unshared(optimizer: Any) -> list[tuple[str, int]]:
    """Each sharing the planner counts on (planner/memory.py master_weights, offload_buffers) that
    did not happen on this rank, with the bytes it costs: (what, bytes). Read from the buffers
    themselves (the same storage or not), not from what the sharing code meant to do."""
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    missed = [("bf16 upload copy", _nbytes(buffer)) for buffer, master in _upload_pairs(optimizer)
              if master.dtype == torch.bfloat16 and buffer.data_ptr() != master.data_ptr()]
    if not isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return missed
    zero = optimizer
    host = set(_host_subgroups(zero))
    for i, master in enumerate(zero.fp32_partitioned_groups_flat):
        partition = zero.fp16_partitioned_groups_flat[i]
        if master.dtype != torch.bfloat16 or partition is None:
            continue
        # planner/memory.py master_weights and offload_buffers: the partition is the master on the
        # GPU (nothing offloaded) and on the host (the optimizer and the parameters offloaded)
        on_gpu = not zero.offload_optimizer and not zero.offload_param
        if (on_gpu or (i in host and zero.offload_param)) and master.data_ptr() != partition.data_ptr():
            missed.append((f"bf16 master of sub-group {i}", _nbytes(master)))
    for i, view in _grad_views(zero):
        grad = zero.fp32_partitioned_groups_flat[i].grad
        if i in host and grad is not None and grad.dtype == torch.bfloat16 and grad.data_ptr() != view.data_ptr():
            missed.append((f"master gradient of sub-group {i}", _nbytes(grad)))
    return missed


def empty_host_cache() -> None:
    """Give freed pinned buffers back: torch's caching host allocator keeps them otherwise."""
    import torch
    if not torch.accelerator.is_available():
        return
    if hasattr(torch.accelerator, "empty_host_cache"):
        torch.accelerator.empty_host_cache()
    else:  # torch before torch.accelerator.empty_host_cache: its private binding
        torch._C._host_emptyCache()


def master_dtype(optimizer: Any) -> torch.dtype:
    """The dtype of the master weights a DeepSpeed optimizer steps (stage_1_and_2.py, stage3.py
    master_weights_and_grads_dtype; fp32 for the optimizers without it)."""
    import torch
    return getattr(optimizer, "master_weights_and_grads_dtype", torch.float32)
