"""Per-GPU and per-node memory of a DeepSpeed training configuration: pure byte formulas.

Notation: P_t trainable parameters, N data-parallel ranks (all GPUs of all nodes), bf16
training with fp32 master weights and AdamW. Every term is a named function whose constants
say where they come from; DeepSpeed sources are deepspeed/runtime/zero/stage_1_and_2.py,
stage3.py and bf16_optimizer.py (0.19). tests/distributed compares these against the tensors
a real engine holds, and tests/unit against DeepSpeed's own estimators."""

from __future__ import annotations

from dataclasses import dataclass, field

LP = 2  # bf16 parameter / gradient element
FP32 = 4  # fp32 master weight / gradient element
ADAM = 8  # AdamW exp_avg + exp_avg_sq, fp32 each
# Pinned host allocations above this size are pinned exactly: zerotrain sets torch's
# PYTORCH_CUDA_ALLOC_CONF pinned_max_round_threshold_mb to it (train.py). Below it, torch's caching
# host allocator rounds each allocation up to a power of two for reuse (CachingHostAllocator.h;
# pytorch#95823). 64 MiB: DeepSpeed's large offload buffers (partitions of whole parameter groups)
# are pinned exactly, while per-parameter buffers mostly stay cached and reusable.
PINNED_EXACT_ABOVE_MIB = 64


@dataclass(frozen=True)
class Layout:
    """One candidate DeepSpeed configuration."""

    stage: int
    offload_optimizer: str = "none"  # none | cpu | nvme
    offload_param: str = "none"  # none | cpu | nvme (ZeRO-3 only)
    gradient_checkpointing: bool = False
    micro_batch: int = 1
    accumulation: int = 1

    def label(self) -> str:
        parts = [f"ZeRO-{self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param->{self.offload_param}")
        return " ".join(parts)


@dataclass(frozen=True)
class Sizes:
    """What the formulas need about the model and the world."""

    trainable_params: int
    frozen_bytes: int
    """Frozen parameters as stored (bf16 or quantized)."""
    frozen_shardable: bool
    """False for a quantized base, which ZeRO-3 cannot partition (it stays replicated)."""
    largest_layer_params: int
    buffer_bytes: int
    world_size: int
    gpus_per_node: int
    largest_trainable_param: int = 0
    """Elements of the largest trainable tensor (sizes DeepSpeed's offload staging buffers)."""
    persistent_params: int = 0
    """ZeRO-3: parameters below stage3_param_persistence_threshold, kept whole on every GPU."""
    load_bytes_per_param: int = LP
    """How each process materialises the model on the host before DeepSpeed takes it."""
    total_params: int = 0
    param_numels: tuple[int, ...] = ()
    """Elements of every parameter: DeepSpeed pins some host buffers per parameter, and each
    allocation rounds up on its own."""
    all_trainable: bool = True
    """A full fine-tune: every entry of param_numels is trainable (LoRA: only the adapters)."""


@dataclass(frozen=True)
class Buffers:
    """DeepSpeed's communication buffers and allocator constants (elements, bytes, fraction)."""

    reduce_bucket_size: int = 200_000_000
    allgather_bucket_size: int = 200_000_000
    overlap_comm: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    cuda_context_bytes: int = 0
    nccl_workspace_bytes: int = 0
    fragmentation: float = 0.0
    pinned_exact_above: int | None = PINNED_EXACT_ABOVE_MIB * 2**20
    """Pinned host allocations above this many bytes are exact, smaller ones round up to a power
    of two; None: torch's default, every pinned allocation rounds up."""
    host_offload_factor: float = 1.0
    """Measured over predicted offload host bytes (zerotrain calibrate)."""


def lp_params(layout: Layout, s: Sizes) -> int:
    """bf16 parameters resident on the GPU. ZeRO 0-2 replicate them; ZeRO-3 partitions them
    (fp16_partitioned_groups_flat), except a quantized frozen base, which stays whole."""
    trainable = LP * s.trainable_params
    if layout.stage < 3:
        return trainable + s.frozen_bytes
    if layout.offload_param != "none":
        sharded = 0
    else:
        shardable = trainable + (s.frozen_bytes if s.frozen_shardable else 0)
        sharded = shardable // s.world_size + LP * s.persistent_params
    return sharded + (0 if s.frozen_shardable else s.frozen_bytes)


def gathered_params(layout: Layout, s: Sizes, b: Buffers) -> int:
    """ZeRO-3 gathers each module's full bf16 parameters for its forward and backward, plus
    the prefetch bucket, capped by stage3_max_live_parameters; and the largest layer's full
    bf16 gradient exists before its reduce-scatter. DeepSpeed's estimator calls this
    4 * largest_layer (2 bytes of parameter + 2 of gradient)."""
    if layout.stage < 3:
        return 0
    live = min(b.stage3_max_live_parameters, s.largest_layer_params + b.stage3_prefetch_bucket_size)
    return LP * live + LP * min(s.largest_layer_params, s.trainable_params)


def lp_grads(layout: Layout, s: Sizes) -> int:
    """bf16 gradients held through backward. ZeRO 0/1 keep a full-size gradient per trainable
    parameter until the accumulation boundary; ZeRO-2 keeps its partition (grads_in_partition);
    ZeRO-3 its grad_partitions_flat_buffer. With the optimizer offloaded, ZeRO-2 copies each
    reduced gradient straight into the host fp32 buffer (copy_grads_in_partition) and ZeRO-3
    pins its buffer in host memory, so neither keeps a GPU partition."""
    if layout.stage <= 1:
        return LP * s.trainable_params
    if layout.offload_optimizer != "none":
        return 0
    return LP * s.trainable_params // s.world_size


def fp32_grads(layout: Layout, s: Sizes, b: Buffers) -> int:
    """fp32 gradients. Stage 0's BF16_Optimizer accumulates into a full fp32 copy
    (fp32_groups_gradients). ZeRO 1/2 build the fp32 partition gradient at the step
    (single_partition_of_fp32_groups[i].grad). ZeRO-3 builds it one sub-group at a time
    (_prepare_fp32_grad_for_sub_group). With the optimizer offloaded they live on the host."""
    if layout.offload_optimizer != "none":
        return 0
    if layout.stage == 0:
        return FP32 * s.trainable_params
    partition = s.trainable_params // s.world_size
    if layout.stage == 3:
        return FP32 * min(b.sub_group_size, partition)
    return FP32 * partition


def master_weights(layout: Layout, s: Sizes) -> int:
    """fp32 master copy of the trainable parameters: whole at stage 0, partitioned from stage 1."""
    if layout.offload_optimizer != "none":
        return 0
    return FP32 * s.trainable_params // (1 if layout.stage == 0 else s.world_size)


def optimizer_states(layout: Layout, s: Sizes) -> int:
    """AdamW's two fp32 moments, only for trainable parameters; partitioned from stage 1."""
    if layout.offload_optimizer != "none":
        return 0
    return ADAM * s.trainable_params // (1 if layout.stage == 0 else s.world_size)


def reduce_buckets(layout: Layout, s: Sizes, b: Buffers) -> int:
    """Gradient reduction buckets in bf16: stage 0 flattens up to a bucket for its all-reduce;
    ZeRO 1-3 fill reduce_bucket_size elements, doubled with overlap_comm (two ipg buffers)."""
    elements = min(b.reduce_bucket_size, s.trainable_params)
    copies = 2 if b.overlap_comm and layout.stage > 0 else 1
    return LP * elements * copies


def allgather_bucket(layout: Layout, s: Sizes, b: Buffers) -> int:
    """ZeRO 1/2 all-gather the updated bf16 partitions after the step in chunks of
    allgather_bucket_size elements."""
    if layout.stage not in (1, 2):
        return 0
    return LP * min(b.allgather_bucket_size, s.trainable_params)


def offload_grad_staging(layout: Layout, s: Sizes) -> int:
    """ZeRO 1/2 with the optimizer offloaded stage each gradient through a bf16 GPU buffer the
    size of the largest trainable parameter (temp_grad_buffer_for_gpu_offload)."""
    if layout.stage in (1, 2) and layout.offload_optimizer != "none":
        return LP * s.largest_trainable_param
    return 0


def init_flatten(layout: Layout, s: Sizes) -> int:
    """While DeepSpeed flattens the bf16 parameters into contiguous groups at init, the
    originals and the flat copy coexist: a transient second copy of the trainable bf16 weights
    (ZeRO-3: of its partition)."""
    copy = LP * s.trainable_params
    return copy // s.world_size if layout.stage == 3 else copy


def save_gather(layout: Layout, s: Sizes) -> int:
    """Saving 16-bit weights under ZeRO-3 gathers one module at a time on the GPU
    (stage3_gather_16bit_weights_on_model_save) before copying it to the host."""
    return LP * s.largest_layer_params if layout.stage == 3 else 0


@dataclass
class MemoryEstimate:
    """Per-GPU bytes by phase, the terms of the peak phase, and host/NVMe bytes per node."""

    phases: dict[str, int]
    terms: dict[str, int]
    peak_phase: str
    allocated: int
    reserved: int
    device_total: int
    host_per_node: int
    nvme_per_node: int
    host_terms: dict[str, int] = field(default_factory=dict)


def estimate(layout: Layout, s: Sizes, b: Buffers, activation_peak: int, input_bytes: int) -> MemoryEstimate:
    """Per-GPU memory of each phase; the plan uses the highest. activation_peak and
    input_bytes are for one micro-batch. Forward and backward count the gradient buffers: the
    first micro-batch of an accumulation has none yet, but every later one does."""
    states = {
        "bf16 params": lp_params(layout, s),
        "fp32 master": master_weights(layout, s),
        "optimizer states": optimizer_states(layout, s),
        "buffers": s.buffer_bytes,
    }
    grads = lp_grads(layout, s)
    gathered = gathered_params(layout, s, b)
    phase_terms = {
        "init": {**states, "init flatten": init_flatten(layout, s)},
        "forward": {**states, "bf16 grads": grads, "gathered params": gathered,
                    "activations": activation_peak, "inputs": input_bytes},
        "backward": {**states, "bf16 grads": grads, "gathered params": gathered,
                     "reduce buckets": reduce_buckets(layout, s, b), "offload staging": offload_grad_staging(layout, s),
                     "activations": activation_peak,
                     "inputs": input_bytes},
        "optimizer step": {**states, "bf16 grads": grads, "fp32 grads": fp32_grads(layout, s, b),
                           "allgather bucket": allgather_bucket(layout, s, b)},
        "checkpoint save": {**states, "save gather": save_gather(layout, s)},
    }
    phases = {name: sum(terms.values()) for name, terms in phase_terms.items()}
    peak_phase = max(phases, key=phases.__getitem__)
    allocated = phases[peak_phase]
    # The caching allocator reserves more than is allocated (fragmentation); the CUDA context
    # and NCCL/cuBLAS workspaces sit outside the allocator (FIELD_NOTES).
    reserved = int(allocated * (1 + b.fragmentation))
    device_total = reserved + b.cuda_context_bytes + b.nccl_workspace_bytes
    host_terms = host_bytes(layout, s, b)
    return MemoryEstimate(
        phases=phases, terms={k: v for k, v in phase_terms[peak_phase].items() if v}, peak_phase=peak_phase,
        allocated=allocated, reserved=reserved, device_total=device_total,
        host_per_node=max(host_terms.values()) if host_terms else 0, nvme_per_node=nvme_bytes(layout, s),
        host_terms=host_terms,
    )


@dataclass(frozen=True)
class HostBuffer:
    """Host allocations DeepSpeed makes for one rank's offload, of one kind."""

    name: str
    sizes: tuple[int, ...]
    """Bytes of each allocation."""
    pinned: bool
    """Page-locked through torch's caching host allocator (rounded up, see pinned_bytes)."""


def pinned_bytes(nbytes: int, exact_above: int | None) -> int:
    """Host bytes one pinned allocation takes: torch's caching host allocator rounds it up to the
    next power of two (CachingHostAllocator.h, torch 2.13), unless it exceeds
    pinned_max_round_threshold_mb (exact_above; None: torch's default, no threshold)."""
    if nbytes <= 0:
        return 0
    if exact_above is not None and nbytes > exact_above:
        return nbytes
    return 1 << (nbytes - 1).bit_length()


def _chunks(total: int, size: int) -> tuple[int, ...]:
    """`total` elements split into groups of at most `size` (ZeRO-3's sub-groups)."""
    full, rest = divmod(total, size)
    return (size,) * full + ((rest,) if rest else ())


def _rank_share(numels: tuple[int, ...], world: int) -> tuple[int, ...]:
    """The whole parameters one rank's partition covers: every world-th of the sorted sizes, a
    share of 1/world of the total (partitions split the flat buffer, not the parameter list)."""
    return tuple(sorted(numels)[::world]) if world > 1 else numels


def offload_buffers(layout: Layout, s: Sizes, b: Buffers) -> list[HostBuffer]:
    """Host buffers of one rank's offload, as DeepSpeed 0.19 allocates them (offload
    pin_memory: true, as zerotrain writes it). tests/distributed measures their sizes on a
    real CPU engine; what is pinned is read from the source:
    - ZeRO 1/2 (stage_1_and_2.py): the fp32 master partition (single_partition_of_fp32_groups)
      and its fp32 gradient, a bf16 copy of the partition for the upload after the step
      (param_buffer_of_bit16_for_cpu_offload_groups) and a bf16 gradient of the largest parameter
      (temp_grad_buffer_for_cpu_offload) are pinned; with gradient accumulation, ZeRO-2 pins a
      bf16 accumulator per parameter (accumulated_grads_in_cpu). DeepSpeedCPUAdam's moments are
      plain host tensors (cpu_adam.py: zeros_like).
    - ZeRO-3 (stage3.py): the fp32 master per sub-group is plain (a clone), its fp32 gradient
      pinned; the bf16 gradient partition (grad_partitions_flat_buffer) is pinned. With the
      parameters offloaded, the trainable bf16 partition is one pinned flat buffer per sub-group
      (param_groups_fp16_flat_cpu_memory) and each frozen parameter's partition is pinned on its own
      (partition_parameters.py)."""
    per_rank = s.trainable_params // s.world_size
    out: list[HostBuffer] = []
    if layout.offload_optimizer == "cpu":
        if layout.stage == 3:
            groups = _chunks(per_rank, b.sub_group_size)
            out += [HostBuffer("fp32 master", tuple(FP32 * n for n in groups), pinned=False),
                    HostBuffer("fp32 grads", tuple(FP32 * n for n in groups), pinned=True),
                    HostBuffer("bf16 grad partition", (LP * per_rank,), pinned=True)]
        else:
            out += [HostBuffer("fp32 master", (FP32 * per_rank,), pinned=True),
                    HostBuffer("fp32 grads", (FP32 * per_rank,), pinned=True),
                    HostBuffer("bf16 upload copy", (LP * per_rank,), pinned=True),
                    HostBuffer("grad staging", (LP * s.largest_trainable_param,), pinned=True)]
            if layout.stage == 2 and layout.accumulation > 1:
                if s.all_trainable and s.param_numels:
                    sizes = tuple(LP * n for n in _rank_share(s.param_numels, s.world_size))
                else:  # adapters of unknown sizes: the partition, each one rounded up at worst
                    sizes = (LP * per_rank,)
                out.append(HostBuffer("grad accumulators", sizes, pinned=True))
        out.append(HostBuffer("adam moments", (FP32 * per_rank, FP32 * per_rank), pinned=False))
    if layout.offload_param == "cpu":
        out.append(HostBuffer("bf16 params", tuple(LP * n for n in _chunks(per_rank, b.sub_group_size)), pinned=True))
        if s.frozen_shardable and s.frozen_bytes:
            if not s.all_trainable and s.param_numels:
                # the adapters among them are a rounding error
                sizes = tuple(LP * -(-n // s.world_size) for n in s.param_numels)
            else:
                sizes = (s.frozen_bytes // s.world_size,)
            out.append(HostBuffer("frozen params", sizes, pinned=True))
    return out


def host_bytes(layout: Layout, s: Sizes, b: Buffers | None = None) -> dict[str, int]:
    """Host RAM per node, by phase: loading (every process materialises the model once before
    DeepSpeed takes it) and offload (the node's ranks' offload buffers, each pinned allocation
    as torch's host allocator rounds it)."""
    b = b or Buffers()
    total = s.total_params or s.trainable_params
    load = s.gpus_per_node * s.load_bytes_per_param * total
    per_rank = sum(pinned_bytes(n, b.pinned_exact_above) if buf.pinned else n
                   for buf in offload_buffers(layout, s, b) for n in buf.sizes)
    return {"model load": int(load), "offload": int(s.gpus_per_node * per_rank * b.host_offload_factor)}


def nvme_bytes(layout: Layout, s: Sizes) -> int:
    """NVMe space per node for ZeRO-Infinity swap files."""
    ranks, per_rank = s.gpus_per_node, s.trainable_params // s.world_size
    used = 0
    if layout.offload_optimizer == "nvme":
        used += ranks * (FP32 + ADAM + FP32) * per_rank
    if layout.offload_param == "nvme":
        used += ranks * (LP * per_rank + (s.frozen_bytes // s.world_size if s.frozen_shardable else 0))
    return used
