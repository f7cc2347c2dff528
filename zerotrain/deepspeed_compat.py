"""Everything zerotrain does inside DeepSpeed: the one module that reads or writes DeepSpeed's
private state, patches it or calls it in a version-specific way. The rest of zerotrain uses
DeepSpeed's public API (deepspeed.initialize, the engine's methods, deepspeed.utils' safe_*
accessors, deepspeed.comm, the accelerator) and this module.

Each reach names the DeepSpeed source it mirrors. They were read in, and tested against, the
versions in zerotrain.versions.TESTED["deepspeed"]; pyproject.toml bounds DeepSpeed below its next
minor version.

The reaches, by what they serve, and their guard:

- Buffer sharing (initialize): ZeRO-3 and ZeRO 1/2 keep buffers that only repeat another when the
  master weights are bf16 (2 bytes per trainable parameter each); zerotrain drops them during and
  after deepspeed.initialize. Guard: buffer_sharing() switches it off, with one warning, on a
  DeepSpeed version not tested, under DS_PIN_MEMORY_BACKEND=native (DeepSpeed unpins its pinned
  buffers by pointer, and a shared one would be freed twice) and where another process takes the
  master (DeepSpeed's decoupled checkpoint writer, ZenFlow, SuperOffload). The planner reads the
  same flag (planner.search.buffers_from), so a plan counts the unshared buffers then. After
  initialize, unshared() checks that each sharing the plan counted on really happened (the same
  storage), and initialize warns with the byte difference where it did not.
- Master fragments for the EMA (master_fragments): ZeRO-1/2's per-parameter _hp_mapping,
  ZeRO-3's partition rank and re-gather, ZeRO-0's fp32 groups. Guard: each class checks the
  attributes it uses and stops with one line naming what is missing.
- The checkpoint writer (guarded_writes): DeepSpeed has no extension point for a checkpoint engine
  of the client's (deepspeed/runtime/checkpoint_engine/utils.py create_checkpoint_engine picks
  torch, fast, decoupled or DataStates from the config), so the engine's checkpoint_engine is
  wrapped for one save. Guard: the attribute is checked before it is swapped.
- CPU Adam's bias-correction replay after a resume (replay_adam_steps): the C++ op's
  adam_update, called positionally (csrc/adam/cpu_adam.cpp). Guard: only on a tested version;
  elsewhere a resumed run may differ from an uninterrupted one in the last bit, and a warning says so.
- ZeRO-3 partitions made before initialize (Partitioner, for zerotrain.loading): zero.Init(module=...)
  with the arguments initialize passes it, then the converted parameters' own
  convert_to_zero_parameters, as runtime/zero/parameter_offload.py does; its _keep_in_fp32 at the
  end. Guard: the attributes are checked, and a missing one stops with one line (model.load: whole
  loads the old way).
- The optimizer's master dtype (master_dtype) and DeepSpeed's op report for `zerotrain doctor`
  (op_report: git_version_info, op_builder.all_ops).
- CPU ranks without a compiler (init_distributed): deepspeed.comm's TorchBackend builds the CPU
  accelerator's shared-memory collective op just in time (comm/torch.py build_shm_op), which fails
  where no C++ compiler is installed (zerotrain's Docker image). The op is marked incompatible in
  deepspeed.ops.__compatible_ops__ (the dict build_shm_op reads; DeepSpeed caches it at first access
  so that edits persist), and the collectives stay gloo's. Guard: only with the CPU accelerator and
  no compiler; the dict is checked to be one.
- One line before an op is compiled just in time (say_jit_builds, from init_distributed, initialize and
  engine.cpu_adam_unavailable): whether load() would compile, as OpBuilder.load decides (its _loaded_ops,
  git_version_info) and torch's extension cache holds it (cpp_extension._get_build_directory, and ninja's
  dry run there), and which ops initialize loads for a config (initialize_ops, after runtime/engine.py
  get_optimizer_configuration). Guard: only on a tested version; elsewhere nothing is said, as before.

- What ZeRO-3 leaves in a process after engine.destroy() (release_process_state): the root module
  in runtime/zero/parameter_offload.py's FWD_MODULE_STACK, `_z3_optimizer` on every parameter
  (stage3.py), and torch.nn.functional.linear replaced by zero3_linear_wrap for the rest of the
  process (partition_parameters.py, memory_efficient_linear). zerotrain runs one engine per process
  (calibrate measures each layout in processes of its own); this is for in-process uses that stay
  (test workers that build several engines). Guard: each global is checked to be what these
  versions make before it is reset.

Public APIs used where they exist: torch.accelerator.empty_host_cache() to give freed pinned memory
back, and the ds_to_universal command line (to_universal) for universal checkpoints."""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotrain import versions
from zerotrain.errors import ZerotrainError, one_line
from zerotrain.units import gib

if TYPE_CHECKING:  # torch is imported where it is used: the planner reads the gate without it
    import torch

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


# ---- the master fragments the EMA follows ----

@dataclass(frozen=True)
class Span:
    """Where a fragment sits in its parameter: elements [offset, offset + numel) of the flattened
    parameter `name` of shape `shape`."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


def _require(obj: Any, names: tuple[str, ...], what: str, remedy: str = "disable ema") -> None:
    missing = [name for name in names if not hasattr(obj, name)]
    if missing:
        raise ZerotrainError(f"{what}: DeepSpeed {versions.installed('deepspeed')}'s {type(obj).__name__} has no "
                             f"{', '.join(missing)} (zerotrain was checked against DeepSpeed "
                             f"{', '.join(versions.TESTED['deepspeed'])}); install that version, or {remedy}")


class MasterFragments:
    """How one rank reaches its fp32 master fragments and refreshes the bf16 weights from them.
    `spans[i]` is where fragment i sits in its parameter; `saved` says which fragments this rank
    writes to its ema-<rank>.pt."""

    spans: list[Span]
    saved: list[bool]

    def read(self, i: int) -> torch.Tensor:
        """Fragment i of the fp32 master, 1-D (a view where possible; do not write into it)."""
        raise NotImplementedError

    def write(self, i: int, value: torch.Tensor) -> None:
        raise NotImplementedError

    def lp_matches(self, i: int) -> bool:
        """Whether this rank's bf16 copy of fragment i is the bf16 rounding of its master."""
        raise NotImplementedError

    def refresh(self) -> None:
        """bf16 weights := bf16(masters), as the optimizer does after a step. Every rank calls this."""
        raise NotImplementedError


class _HpMapped(MasterFragments):
    """ZeRO-1/2 (DeepSpeedZeroOptimizer) and BF16_Optimizer: each trainable parameter's _hp_mapping
    (deepspeed/utils/tensor_fragment.py) names the slice of the flattened parameter this rank owns
    (lp_fragment_address) and is a view of its fp32 master (get_hp_fragment()); None outside the
    rank's partition. update_lp_params() copies the masters into the bf16 weights and all-gathers,
    as DeepSpeed does after loading a universal checkpoint."""

    def __init__(self, optimizer: Any, params: list[tuple[str, torch.nn.Parameter]]):
        self.optimizer = optimizer
        self.params = [p for _, p in params if p._hp_mapping is not None]
        self.spans = [Span(name, tuple(p.shape), p._hp_mapping.lp_fragment_address.start,
                           p._hp_mapping.lp_fragment_address.numel)
                      for name, p in params if p._hp_mapping is not None]
        self.saved = [True] * len(self.spans)

    def read(self, i: int) -> torch.Tensor:
        return self.params[i]._hp_mapping.get_hp_fragment().detach()

    def write(self, i: int, value: torch.Tensor) -> None:
        self.params[i]._hp_mapping.get_hp_fragment().data.copy_(value)

    def lp_matches(self, i: int) -> bool:
        import torch
        mapping = self.params[i]._hp_mapping
        lp = mapping.lp_fragment.detach()
        return torch.equal(lp, mapping.get_hp_fragment().detach().to(lp.device, lp.dtype))

    def refresh(self) -> None:
        self.optimizer.update_lp_params()


class _Partitioned(MasterFragments):
    """ZeRO-3: rank r (stage3.py _get_param_partition_rank) owns [r*p, r*p + p) of each flattened
    parameter, p = ds_tensor.ds_numel (the last rank's tail is padding), read and written with
    deepspeed.utils.safe_get_local_fp32_param / safe_set_local_fp32_param."""

    ATTRIBUTES = ("_get_param_partition_rank", "_partition_all_parameters", "persistent_parameters",
                  "invalidate_secondary_tensor")

    def __init__(self, optimizer: Any, params: list[tuple[str, torch.nn.Parameter]]):
        _require(optimizer, self.ATTRIBUTES, "ema.enabled under ZeRO-3")
        self.optimizer = optimizer
        self.all_params = [p for _, p in params]
        self.params, self.spans = [], []
        for name, p in params:
            size = p.ds_tensor.ds_numel
            offset = optimizer._get_param_partition_rank(p) * size
            numel = min(size, p.ds_numel - offset)
            if numel > 0:
                self.params.append(p)
                self.spans.append(Span(name, tuple(p.ds_shape), offset, numel))
        self.saved = [True] * len(self.spans)

    def read(self, i: int) -> torch.Tensor:
        from deepspeed.utils import safe_get_local_fp32_param

        return safe_get_local_fp32_param(self.params[i]).detach()[:self.spans[i].numel]

    def write(self, i: int, value: torch.Tensor) -> None:
        from deepspeed.utils import safe_get_local_fp32_param, safe_set_local_fp32_param

        # The local partition includes the last rank's padding: keep it as it is.
        partition = safe_get_local_fp32_param(self.params[i]).detach().clone()
        partition[:self.spans[i].numel].copy_(value)
        safe_set_local_fp32_param(self.params[i], partition)

    def lp_matches(self, i: int) -> bool:
        import torch
        lp = self.params[i].ds_tensor.detach()[:self.spans[i].numel]
        return torch.equal(lp, self.read(i).to(lp.device, lp.dtype))

    def refresh(self) -> None:
        import torch
        from deepspeed.utils import safe_get_local_fp32_param

        # As DeepSpeedZeroOptimizer_Stage3.step: release every gathered parameter (without it, a
        # parameter still gathered keeps its old values), copy each fp32 partition into its bf16
        # partition, re-gather the persistent parameters.
        self.optimizer._partition_all_parameters()
        with torch.no_grad():
            for p in self.all_params:
                p.ds_tensor.data.copy_(safe_get_local_fp32_param(p))
        persistent = self.optimizer.persistent_parameters
        if persistent:
            persistent[0].all_gather(persistent)
        self.optimizer.invalidate_secondary_tensor()


class _Replicated(MasterFragments):
    """ZeRO-0 (fp16/fused_optimizer.py FP16_Optimizer with flat fp32 groups, or
    unfused_optimizer.py FP16_UnfusedOptimizer with one fp32 tensor per parameter): every rank holds
    every master whole; rank 0 saves."""

    def __init__(self, optimizer: Any, names: Mapping[int, str], save: bool):
        self.params, self.masters, self.spans = [], [], []
        flat = getattr(optimizer, "fp32_groups_flat", None)
        for g, group in enumerate(optimizer.fp16_groups):
            offset = 0
            for j, p in enumerate(group):
                # FP16_Optimizer flattens each group without padding (_flatten_dense_tensors).
                master = flat[g].narrow(0, offset, p.numel()) if flat is not None else optimizer.fp32_groups[g][j]
                offset += p.numel()
                if not p.requires_grad:
                    continue
                self.params.append(p)
                self.masters.append(master)
                self.spans.append(Span(names[id(p)], tuple(p.shape), 0, p.numel()))
        self.saved = [save] * len(self.spans)

    def read(self, i: int) -> torch.Tensor:
        return self.masters[i].detach().view(-1)

    def write(self, i: int, value: torch.Tensor) -> None:
        self.masters[i].data.view(-1).copy_(value)

    def lp_matches(self, i: int) -> bool:
        import torch
        lp = self.params[i].detach().view(-1)
        return torch.equal(lp, self.read(i).to(lp.device, lp.dtype))

    def refresh(self) -> None:
        import torch
        with torch.no_grad():
            for p, master in zip(self.params, self.masters, strict=True):
                p.data.copy_(master.data.view_as(p))


def master_fragments(engine: Any, rank: int) -> MasterFragments:
    """This rank's master fragments of the engine's trainable parameters, by its optimizer."""
    stage = engine.zero_optimization_stage()
    optimizer = engine.optimizer
    params = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    if stage == 3:
        return _Partitioned(optimizer, params)
    if hasattr(optimizer, "update_lp_params") and all(hasattr(p, "_hp_mapping") for _, p in params):
        return _HpMapped(optimizer, params)
    if stage == 0 and hasattr(optimizer, "fp16_groups") and (hasattr(optimizer, "fp32_groups_flat")
                                                             or hasattr(optimizer, "fp32_groups")):
        return _Replicated(optimizer, {id(p): name for name, p in params}, save=rank == 0)
    raise ZerotrainError(f"ema.enabled: DeepSpeed's {type(optimizer).__name__} (ZeRO stage {stage}) is not "
                         "supported; the EMA follows the fp32 master weights of bf16 training under ZeRO 0-3")


# ---- checkpoints ----

@contextlib.contextmanager
def guarded_writes(engine: Any, wrap: Any) -> Iterator[Any]:
    """engine.save_checkpoint writes through wrap(the engine's checkpoint engine) inside; yields the
    wrapper. No public extension point exists (see the module docstring): the engine attribute
    (runtime/engine.py _configure_checkpointing) is swapped for the one save."""
    _require(engine, ("checkpoint_engine",), "checkpoint.save")
    inner = engine.checkpoint_engine
    guard = wrap(inner)
    engine.checkpoint_engine = guard
    try:
        yield guard
    finally:
        engine.checkpoint_engine = inner


def to_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's documented ds_to_universal command line (deepspeed/checkpoint/ds_to_universal.py),
    in a process of its own: `checkpoint` converted into `out`. Raises ZerotrainError with the
    end of its output when it fails."""
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint),
               "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1",
               "--inject_missing_state"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise ZerotrainError(" ".join(" ".join(lines[-3:]).split())[:300] or f"exit code {done.returncode}")


def replay_adam_steps(basic: Any, steps: int) -> bool:
    """Replay CPU Adam's bias-correction product through steps 1..`steps` on empty tensors (see
    checkpoint.replay_cpu_adam_steps). DeepSpeedCPUAdam's op: ds_opt_adam.adam_update
    (csrc/adam/cpu_adam.cpp, positional: id, step, lr, beta1, beta2, eps, weight decay, bias
    correction, params, grads, exp_avg, exp_avg_sq); FusedAdam on the CPU accelerator:
    multi_tensor_adam (ops/adam/fused_adam.py step). Returns False, doing nothing, on an untested
    DeepSpeed version."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not versions.check("deepspeed").is_tested:
        return False
    empty = torch.zeros(0, dtype=torch.float32)
    for step in range(1, steps + 1):
        for group in basic.param_groups:
            beta1, beta2 = group["betas"]
            common = (group["lr"], beta1, beta2, group["eps"])
            if isinstance(basic, DeepSpeedCPUAdam):
                basic.ds_opt_adam.adam_update(basic.opt_id, step, *common, group["weight_decay"],
                                              group["bias_correction"], empty, empty, empty, empty)
            else:
                basic.multi_tensor_adam(2048 * 32, basic._dummy_overflow_buf, [[empty]] * 4, *common, step,
                                        basic.adam_w_mode, int(group["bias_correction"]), group["weight_decay"])
    return True


# ---- what `zerotrain doctor` reports ----

def op_report() -> dict[str, Any]:
    """What ds_report shows, as data: the accelerator, the torch/CUDA the ops were prebuilt with, and
    for each op whether it is prebuilt and whether it could be JIT-compiled here (ds_report's
    sources: git_version_info, op_builder.all_ops, op_builder.builder.probe_is_compatible)."""
    # DeepSpeed's logger binds the stdout it finds at import, and its probes print; keep both on
    # stderr so that --json prints only JSON.
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops, torch_info
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible
        from torch.utils.cpp_extension import is_ninja_available

        accelerator = get_accelerator()._name
        ops = {name: {"prebuilt": bool(installed_ops.get(name)) and accelerator_name == accelerator,
                      "compatible": bool(probe_is_compatible(builder, False))}
               for name, builder in ALL_OPS.items()}
        return {"accelerator": accelerator, "torch_info": dict(torch_info), "ops": ops,
                "ninja": is_ninja_available()}


# DeepSpeed's JIT-compiled ops that zerotrain's layouts load, by op builder class (each accelerator maps
# the class to its own builder, or to none): AdamW with the optimizer offloaded (cpu_adam) or on the
# accelerator (fused_adam), NVMe offload (async_io), and on the CPU accelerator its shared-memory
# collectives (init_distributed) and pinned host buffers (offload). Async I/O, the longest build by far
# (about 8 minutes on 2 cores), last.
TRAINING_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")


@dataclass(frozen=True)
class OpBuild:
    name: str
    status: str
    """built, prebuilt (installed with DeepSpeed), skipped (cannot be built here) or failed."""
    detail: str


def build_ops(builders: tuple[str, ...] = TRAINING_OPS) -> list[OpBuild]:
    """Compile the ops `builders` names for this machine's DeepSpeed accelerator now, into torch's
    extension cache (TORCH_EXTENSIONS_DIR), as their first use would (builder.load(), DeepSpeed's
    JIT path): a run then loads them instead of stalling its first step on a compiler, a stall that on
    many nodes can outlast a collective's timeout. Ops DeepSpeed was installed with are left alone;
    ops this machine cannot build (no libaio, no nvcc) are skipped with DeepSpeed's reason."""
    import io
    import time

    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    accelerator = get_accelerator()
    out: list[OpBuild] = []
    for class_name in builders:
        builder = accelerator.create_op_builder(class_name)
        if builder is None or builder.name == "deepspeed_not_implemented":
            continue
        if installed_ops.get(builder.name):
            out.append(OpBuild(builder.name, "prebuilt", "installed with DeepSpeed"))
            continue
        probe = io.StringIO()
        with contextlib.redirect_stdout(probe):  # DeepSpeed's compatibility probes print their reasons
            compatible = builder.is_compatible(verbose=True)
        if not compatible:
            reason = " ".join(probe.getvalue().split())[:200] or "its compatibility check failed"
            out.append(OpBuild(builder.name, "skipped", reason))
            continue
        clear_stale_build_lock(builder.name)
        start = time.perf_counter()
        try:
            with contextlib.redirect_stdout(sys.stderr):
                builder.load(verbose=False)
        except Exception as err:  # noqa: BLE001 - a compiler error: DeepSpeed raises whatever the build raised
            out.append(OpBuild(builder.name, "failed", one_line(err, 300)))
            continue
        out.append(OpBuild(builder.name, "built", f"{time.perf_counter() - start:.0f} s"))
    return out


# An op's build takes minutes (CPU Adam: about 5 on 2 cores); a lock older than this was left by a killed build.
STALE_BUILD_LOCK_S = 30 * 60


def clear_stale_build_lock(name: str, poll_s: float = 5.0) -> Path | None:
    """Wait for op `name`'s build lock (torch's FileBaton, `<extensions dir>/<name>/lock`) to go, saying whose it
    is on stderr, and remove it once it is older than STALE_BUILD_LOCK_S: a build killed while compiling (Ctrl-C,
    a preempted node) leaves it, and torch's own wait for it never ends, silently. A build that is running
    removes its lock within minutes. Returns the lock's path when it was removed as stale."""
    import time

    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, False)) / "lock"
    said = False
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return None
        if age >= STALE_BUILD_LOCK_S:
            lock.unlink(missing_ok=True)
            print(f"zerotrain: removed {lock}, left {age / 60:.0f} min ago by a build of {name} that did not finish",
                  file=sys.stderr, flush=True)
            return lock
        if not said:
            print(f"zerotrain: waiting for {lock}, another build of {name} (started {age / 60:.0f} min ago); "
                  f"a lock that old from a build that stopped is removed at {STALE_BUILD_LOCK_S // 60} min, or "
                  "delete it now", file=sys.stderr, flush=True)
            said = True
        time.sleep(poll_s)


# ---- one line before an op is compiled just in time ----

# TRAINING_OPS by the op's name (builder.NAME: the name build-ops, doctor and torch's extension cache use).
OP_BUILDERS = dict(zip(("deepspeed_shm_comm", "cpu_adam", "fused_adam", "pin_memory", "async_io"), TRAINING_OPS,
                       strict=True))

# How long a first build takes, for the notice. `zerotrain build-ops` on the project's 2-core CPU machine
# (2026-11-28, its cores shared with other work): deepspeed_shm_comm 43 s, cpu_adam 81 s, fused_adam (the CPU
# accelerator's C++ op) 60 s, pin_memory 31 s. Busier, the same kind of machine took over 4 minutes for
# deepspeed_shm_comm (issue 38), about 5 for cpu_adam (STALE_BUILD_LOCK_S) and about 8 for async_io
# (tests/distributed/test_nvme_offload.py). FusedAdam's CUDA op with nvcc on a 16-core GPU node: about a
# minute (issue 38).
BUILD_TIME = {"deepspeed_shm_comm": "1 to 4 minutes on 2 CPU cores", "cpu_adam": "1 to 5 minutes on 2 CPU cores",
              "fused_adam": "about a minute", "pin_memory": "about 30 s on 2 CPU cores",
              "async_io": "about 8 minutes on 2 CPU cores"}


def jit_builds(names: Iterable[str]) -> list[tuple[str, Path]] | None:
    """The ops among `names` (OP_BUILDERS' keys), with their build directories, that their first load() in
    this process would compile now, as DeepSpeed 0.19.8's OpBuilder.load and jit_load and torch's
    cpp_extension.load decide: not loaded in this process yet (OpBuilder._loaded_ops), not installed with
    DeepSpeed for this accelerator (git_version_info), and not built in torch's extension cache for this
    Python and torch build (_cached). An op that cannot be built here (incompatible, no ninja) is left out:
    load() raises before compiling anything. None on a DeepSpeed not tested, whose load() may decide otherwise."""
    if not versions.check("deepspeed").is_tested:
        return None
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger and probes print as they load
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops
        from deepspeed.ops.op_builder.builder import OpBuilder
        from torch.utils.cpp_extension import is_ninja_available

        if not is_ninja_available():  # torch's load() needs ninja even to load a built op: nothing compiles
            return []
        accelerator = get_accelerator()
        pending = []
        for name in names:
            builder = accelerator.create_op_builder(OP_BUILDERS[name])
            if builder is None or builder.name == "deepspeed_not_implemented" or builder.name in OpBuilder._loaded_ops:
                continue
            if installed_ops.get(builder.name) and accelerator_name == accelerator._name:
                continue
            directory, built = _cached(builder.name)
            if not built and builder.is_compatible(False):
                pending.append((builder.name, directory))
        return pending


def _cached(name: str) -> tuple[Path, bool]:
    """Op `name`'s build directory in torch's extension cache (TORCH_EXTENSIONS_DIR, by default one folder per
    Python and CUDA/CPU build under ~/.cache/torch_extensions), and whether it holds the op built. A fresh
    process's first load of an extension always runs ninja there (cpp_extension._jit_compile); ninja compiles
    nothing when <name>.so is there and no source or command changed since, which its dry run (-n) reports."""
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(name, False))
    built = (directory / f"{name}.so").exists() and "no work to do" in subprocess.run(
        ["ninja", "-n"], cwd=directory, capture_output=True, text=True, check=False).stdout
    if not built:
        with contextlib.suppress(OSError):  # _get_build_directory made the folder; asking leaves nothing behind
            directory.rmdir()
    return directory, built


def say_jit_builds(names: Iterable[str]) -> list[str]:
    """Before a run loads the ops `names`: one line on stderr for each that jit_builds finds would be compiled
    now, a silence of minutes otherwise. The first process on each machine says it (LOCAL_RANK 0 as the
    launchers set it, or else rank 0), since each machine compiles into its own cache. Returns the ops said."""
    import torch

    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit():
        first = int(local) == 0
    else:
        first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if not first:
        return []
    pending = jit_builds(names) or []
    for name, directory in pending:
        print(f"zerotrain: compiling DeepSpeed's {name} op before the run goes on, once per machine (and Python and "
              f"torch build), {BUILD_TIME[name]}, into {directory}; `zerotrain build-ops` compiles the ops ahead",
              file=sys.stderr, flush=True)
    return [name for name, _ in pending]


# ---- dropping a step that ran out of memory ----

def abandon_step(engine: Any, micro_steps: int) -> None:
    """Put the engine back where it stood before a step whose forward or backward raised (an
    out-of-memory error), so that the same micro-batches can run again with nothing of the failed
    attempt left: no gathered ZeRO-3 parameters, no half-filled reduction buckets, no gradients
    accumulated by its earlier micro-batches. `micro_steps` is engine.micro_steps at the step's
    start. The optimizer has not stepped (that happens after the last backward), so its state and
    the weights are untouched.

    DeepSpeed has no call for this; it mirrors what the optimizers' own step() and zero_grad()
    reset after a step (runtime/zero/stage_1_and_2.py DeepSpeedZeroOptimizer.step, zero_grad,
    reset_partition_gradient_structures; runtime/zero/stage3.py zero_grad and the parameter
    coordinator's release_and_reset_all; runtime/base_optimizer.py's backward hook state), read in
    the tested versions. tests/distributed/test_oom_recovery.py checks, for ZeRO 0-3, with and
    without offload and gradient accumulation, that training after it equals training that never
    failed."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()  # reductions in flight on a side stream land before their buffers are reset
    engine.micro_steps = micro_steps
    optimizer = engine.optimizer
    offload = getattr(optimizer, "parameter_offload", None)
    if offload is not None:  # ZeRO-3: parameters gathered for the failed forward or backward go back
        coordinator = offload.get_param_coordinator()
        coordinator.release_and_reset_all(engine.module)
        _require(coordinator, ("is_invalid_trace", "_invalidate_trace"), "ZeRO-3's parameter coordinator")
        if not coordinator.is_invalid_trace():  # the recorded order ended in the middle: record anew
            coordinator._invalidate_trace()
    getattr(optimizer, "extra_large_param_to_reduce", {}).clear()
    for bucket in getattr(optimizer, "ipg_buckets", {}).values():
        bucket.params.clear()
        bucket.elements = 0
        if hasattr(bucket, "grads"):  # ZeRO 1/2
            bucket.grads.clear()
            bucket.index = 0
    reduced = getattr(optimizer, "params_already_reduced", None)
    for key in (range(len(reduced)) if isinstance(reduced, list) else list(reduced or ())):
        reduced[key] = False
    previous = getattr(optimizer, "previous_reduced_grads", None)
    if isinstance(previous, dict):
        for grads in previous.values():
            grads.clear()
    if hasattr(optimizer, "averaged_gradients"):
        for key in list(optimizer.averaged_gradients):
            optimizer.averaged_gradients[key] = None if offload is None else optimizer.averaged_gradients[key]
    for key in list(getattr(optimizer, "all_grad_tensors", {})):
        optimizer.all_grad_tensors[key] = None
    if hasattr(optimizer, "reset_partition_gradient_structures") and getattr(optimizer, "partition_gradients", False):
        optimizer.reset_partition_gradient_structures()
    if hasattr(optimizer, "_release_ipg_buffers"):  # ZeRO 1/2, as the end of every backward does
        optimizer._release_ipg_buffers()
    if hasattr(optimizer, "_offload_accumulated_param_ids"):
        optimizer._offload_accumulated_param_ids = set()
    if offload is None and hasattr(optimizer, "micro_step_id"):
        optimizer.micro_step_id = -1  # stage_1_and_2.INITIAL_MICRO_STEP_ID, as its step() sets it
    elif offload is not None:  # as stage3's zero_grad (whose record_stream fails on the CPU accelerator)
        optimizer.micro_step_id = 0
        optimizer._epilogue_ran_this_backward = False
    for param in engine.module.parameters():
        param.grad = None
        if hasattr(param, "grad_accum"):
            param.grad_accum = None
    state = getattr(optimizer, "_backward_hook_state", None)
    if state is not None:
        state.backward_active_depth = 0
        optimizer.clear_backward_seen_flag()


# ---- ZeRO-3 partitions made one parameter at a time, before initialize ----

LOAD_WHOLE = "set model.load: whole"


class Partitioner:
    """Converts parameters to ZeRO-3 partitioned ones before deepspeed.initialize, exactly as
    initialize converts a whole model (runtime/zero/parameter_offload.py
    DeepSpeedZeRoOffload._convert_to_zero_parameters): the first call through
    deepspeed.zero.Init(module=...) with the arguments initialize passes it (dtype, the config, the
    parameter offload device and pinning, ZeRO++'s quantized weights), every later one through that
    Init's convert_to_zero_parameters, which DeepSpeed itself calls for parameters added to a
    converted model; each parameter is broadcast from rank 0 and partitioned. initialize then finds
    them converted and converts only what was added since (LoRA adapters). finish() keeps the
    buffers the model names for fp32 in fp32, as Init(module=model) does at initialize. The Init is
    never entered as a context: modules are not built under it (SimpleTuner#1239)."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.init: Any = None
        self.first: Any = None

    def __call__(self, params: list[torch.nn.Parameter]) -> None:
        import deepspeed
        import torch

        if self.first is None:
            zero = self.config.get("zero_optimization") or {}
            offload = zero.get("offload_param") or {}
            device = offload.get("device", "none")
            holder = torch.nn.Module()
            for index, param in enumerate(params):
                holder.register_parameter(f"p{index}", param)
            self.init = deepspeed.zero.Init(
                module=holder, dtype=params[0].dtype, config_dict_or_path=self.config,
                remote_device=None if device == "none" else device,
                pin_memory=bool(offload.get("pin_memory", False)) if device != "none" else False,
                zero_quantized_weights=bool(zero.get("zero_quantized_weights", False)),
                zero_quantized_nontrainable_weights=bool(zero.get("zero_quantized_nontrainable_weights", False)))
            _require(params[0], ("ds_id", "convert_to_zero_parameters"), "a ZeRO-3 parameter", LOAD_WHOLE)
            self.first = params[0]
        else:
            self.first.convert_to_zero_parameters(param_list=params)

    def finish(self, model: torch.nn.Module) -> None:
        if self.init is not None:
            _require(self.init, ("_keep_in_fp32",), "zero.Init", LOAD_WHOLE)
            self.init._keep_in_fp32(model)


def init_distributed(backend: str, timeout: Any = None) -> None:
    """deepspeed.init_distributed; on the CPU accelerator with no C++ compiler (CXX, or c++), first marks
    its shared-memory collective op incompatible, so that DeepSpeed keeps gloo's collectives instead of
    failing to build the op (see the module docstring); with one, says so first where the op is not
    built yet (say_jit_builds)."""
    import shutil

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu" and shutil.which(os.environ.get("CXX", "c++")) is None:
        builder = accelerator.create_op_builder("ShareMemCommBuilder")
        compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
        if builder is not None and isinstance(compatible, dict):
            compatible[builder.NAME] = False
    elif accelerator.device_name() == "cpu":
        say_jit_builds(["deepspeed_shm_comm"])  # comm/torch.py build_shm_op, as the process group starts
    deepspeed.init_distributed(dist_backend=backend, **({"timeout": timeout} if timeout is not None else {}))


def release_process_state(module: torch.nn.Module | None = None) -> list[str]:
    """Undo the process-wide state a ZeRO-3 engine leaves behind after its destroy() (the module
    docstring), and dynamo's caches of compiled blocks, so that a later engine in the same process
    runs torch's own F.linear and finds no earlier module on DeepSpeed's stack. `module`: the model
    the engine trained, whose parameters lose their `_z3_optimizer`. Returns what was released.
    It does not make the process as good as new: on the CPU, tiny-flux's ZeRO-3 partitions
    (1.26 MB, the next ZeRO-0 layout's init bytes 2.36 MB instead of 1.10 MB) stay reachable after it,
    held from outside Python's objects. Measurements run one engine per process (calibrate_layout).
    Nothing on a DeepSpeed version not tested."""
    import torch

    released: list[str] = []
    if not versions.check("deepspeed").is_tested:  # other versions may keep this state elsewhere
        return released
    from deepspeed.runtime.zero import parameter_offload, partition_parameters

    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list) and stack:
        stack.clear()
        released.append("FWD_MODULE_STACK")
    original = getattr(partition_parameters.InsertPostInitMethodToModuleSubClasses, "linear_bk", None)
    if original is not None and torch.nn.functional.linear is partition_parameters.zero3_linear_wrap:
        torch.nn.functional.linear = original
        released.append("F.linear")
    if module is not None:
        held = [p for p in module.parameters() if hasattr(p, "_z3_optimizer")]
        for param in held:
            del param._z3_optimizer
        if held:
            released.append("_z3_optimizer")
    torch._dynamo.reset()  # compiled blocks' graphs and guards, and the recompile counters
    return released
