"""Per-GPU and per-node memory of a DeepSpeed training configuration: pure byte formulas.

Notation: P_t trainable parameters, N data-parallel ranks (all GPUs of all nodes), bf16
training with fp32 master weights and AdamW. Every term is a named function whose constants
say where they come from; DeepSpeed sources are deepspeed/runtime/engine.py,
fp16/fused_optimizer.py, zero/stage_1_and_2.py, zero/stage3.py and
zero/partitioned_param_coordinator.py (0.19.8). Without ZeRO (stage 0) the config zerotrain writes
(bf16, no grad_accum_dtype) makes DeepSpeed wrap its FusedAdam in FP16_Optimizer running in bf16
(engine._do_optimizer_sanity_check returns DDP_BFLOAT16), not BF16_Optimizer.
tests/distributed compares these against the tensors a real engine holds, and tests/unit against
DeepSpeed's own estimators."""

from __future__ import annotations

from dataclasses import dataclass, field

from zerotrain import optimizers

LP = 2  # bf16 parameter / gradient element
FP32 = 4  # fp32 master weight / gradient element
# The optimizers (optimizer.name) are zerotrain.optimizers' registry: what each keeps per element
# (master_element, state_bytes), what its step moves (step_bytes) and allocates (step_transient).
# Without ZeRO, DeepSpeed all-reduces the gradients in buckets of this many elements whatever the
# config's reduce_bucket_size (engine.py: MEMORY_OPT_ALLREDUCE_SIZE, the default bucket_size of
# allreduce_gradients).
ZERO0_ALLREDUCE_ELEMENTS = 500_000_000
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
    checkpointed_blocks: int | None = None
    """With gradient_checkpointing: the first this many blocks of ModelFacts.checkpoint_order()
    (partial checkpointing); None: every block."""
    optimizer: str = "adamw"
    """adamw (fp32 master weights and moments); adamw-bf16 (bf16 master weights, gradients and
    moments: DeepSpeed's bf16_master_weights_and_grads and bf16_optimizer_states, ZeRO 1-3);
    adamw-8bit (bitsandbytes' blockwise 8-bit moments) and adafactor (transformers', one fp32
    second moment) step the same bf16 masters, ZeRO 1-3 with the optimizer on the GPU."""
    zeropp: str = "none"
    """ZeRO-3 across nodes: none, hpz (secondary partition per node) or hpz-qwz-qgz (and quantized
    weight gathers and gradient reductions)."""
    offload_activations: bool = False
    """With every block checkpointed: the checkpointed blocks' inputs wait in pinned host memory
    for the backward (zerotrain.recompute.OffloadingCheckpoint)."""

    @property
    def bf16_masters(self) -> bool:
        return optimizers.get(self.optimizer).bf16_masters

    def label(self) -> str:
        parts = [f"ZeRO-{self.stage}"]
        if self.offload_optimizer != "none":
            parts.append(f"opt->{self.offload_optimizer}")
        if self.offload_param != "none":
            parts.append(f"param->{self.offload_param}")
        if self.offload_activations:
            parts.append("act->cpu")
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
    load_whole: bool = False
    """model.load: whole, or a DoRA (loading.partitionable): every rank loads the whole model on the
    host at once."""
    total_params: int = 0
    param_numels: tuple[int, ...] = ()
    """Elements of every parameter: DeepSpeed pins some host buffers per parameter, and each
    allocation rounds up on its own."""
    all_trainable: bool = True
    """A full fine-tune: every entry of param_numels is trainable (LoRA: only the adapters)."""
    offload_activation_bytes: tuple[int, ...] = ()
    """Per sample, each checkpoint input activation offload moves to the host
    (ModelFacts.offload_input_bytes)."""
    validation_host_bytes: int = 0
    """Per rank, the weights that rendering validation images loads into host memory beside the trained
    model (Family.validation_params: Ideogram 4's unconditional transformer); 0 without validation."""
    ema: bool = False
    """ema.enabled: every rank keeps the EMA of the trainable elements its optimizer partition owns on the host
    (zerotrain/ema.py)."""
    loader_bytes: int = 0
    """Host RAM of one rank's DataLoader workers: data.num_workers processes forked from the rank, each
    planner.loader_worker_bytes (the rank's Python heap a worker touches, its prefetched batches;
    benchmarks/loader_workers_ram.py), alive while the run trains and validates."""
    dataset_bytes: int = 0
    """Host RAM of one rank's dataset index, samples and sampler (dataset_index_bytes), alive while it trains."""
    ema_validation: bool = False
    """Validation renders with the EMA (validation.use_ema, with prompts): while it does, each rank holds its
    trained masters on the host beside the EMA (ShardedEMA.applied)."""


@dataclass(frozen=True)
class Buffers:
    """DeepSpeed's communication buffers and allocator constants (elements, bytes, fraction)."""

    reduce_bucket_size: int = 200_000_000
    overlap_comm: bool = True
    stage3_prefetch_bucket_size: int = 50_000_000
    stage3_max_live_parameters: int = 1_000_000_000
    """Caps ZeRO-3's prefetch; zerotrain also writes it as stage3_max_reuse_distance
    (deepspeed_json.py), which decides how many gathered parameters stay gathered."""
    sub_group_size: int = 1_000_000_000
    cuda_context_bytes: int = 0
    nccl_workspace_bytes: int = 0
    fragmentation: float = 0.0
    pinned_exact_above: int | None = PINNED_EXACT_ABOVE_MIB * 2**20
    """Pinned host allocations above this many bytes are exact, smaller ones round up to a power
    of two; None: torch's default, every pinned allocation rounds up."""
    host_offload_factor: float = 1.0
    """Measured over predicted offload host bytes (zerotrain calibrate)."""
    shares_copies: bool = True
    """Whether zerotrain drops DeepSpeed's buffers that only repeat another with bf16 masters
    (deepspeed_compat.sharing_in_force, the flag the engine reads too): off on an untested
    DeepSpeed version and under DS_PIN_MEMORY_BACKEND=native, where DeepSpeed keeps its own copies."""


def master_element(layout: Layout) -> int:
    """Bytes of one master weight (and of its gradient at the step): fp32, or bf16 with every
    optimizer but adamw (DeepSpeed's master_weights_and_grads_dtype)."""
    return optimizers.get(layout.optimizer).master_element


def moment_bytes(layout: Layout) -> int:
    """DeepSpeed's AdamW's two moments per trainable parameter (optimizers.Optimizer.state_bytes):
    only adamw and adamw-bf16 are ever offloaded (search.layouts)."""
    return optimizers.get(layout.optimizer).state_bytes(1)


def state_bytes(layout: Layout, numel: int) -> int:
    """The optimizer state of one tensor of `numel` elements, as the optimizer allocates it
    (optimizers.Optimizer.state_bytes and its subclasses)."""
    return optimizers.get(layout.optimizer).state_bytes(numel)


def optimizer_tensors(layout: Layout, s: Sizes, b: Buffers) -> tuple[int, ...]:
    """Elements of each tensor the basic optimizer steps on one rank: every trainable parameter at
    ZeRO-0 (per-parameter fp32 masters; adamw only), the rank's flat partition at ZeRO 1/2 (one
    parameter group), and that partition in sub_group_size pieces at ZeRO-3."""
    if layout.stage == 0:
        return (s.trainable_params,)
    partition = s.trainable_params // s.world_size
    return _chunks(partition, b.sub_group_size) if layout.stage == 3 else (partition,)


def step_transient(layout: Layout, s: Sizes, b: Buffers) -> int:
    """What the optimizer step allocates for itself on the GPU. FusedAdam and bitsandbytes' 8-bit
    kernel update in place: nothing. transformers' Adafactor.step works on fp32 copies of the
    largest tensor it steps: the gradient (grad.float()), the master (p.float()), update =
    grad**2 + eps and exp_avg_sq.rsqrt() beside it before the old update is dropped: 4 x FP32 per
    element."""
    if layout.offload_optimizer != "none":
        return 0
    return optimizers.get(layout.optimizer).step_transient(max(optimizer_tensors(layout, s, b)))


def lp_params(layout: Layout, s: Sizes) -> int:
    """bf16 parameters resident on the GPU. ZeRO 0-2 replicate them; ZeRO-3 partitions them
    (fp16_partitioned_groups_flat), except a quantized frozen base, which stays whole."""
    trainable = LP * s.trainable_params
    if layout.stage < 3:
        return trainable + s.frozen_bytes
    if layout.offload_param != "none":  # the persistent ones stay gathered on the GPU
        sharded = LP * s.persistent_params
    else:
        shardable = trainable + (s.frozen_bytes if s.frozen_shardable else 0)
        sharded = shardable // s.world_size + LP * s.persistent_params
    return sharded + (0 if s.frozen_shardable else s.frozen_bytes)


def _partitioned_params(s: Sizes) -> int:
    """Parameters ZeRO-3 partitions: every one (over a quantized base only the adapters, which are
    all the engine is given) less the persistent ones."""
    total = s.total_params or s.trainable_params + s.frozen_bytes // LP
    return max(0, (total if s.frozen_shardable else s.trainable_params) - s.persistent_params)


def gathered_params(layout: Layout, s: Sizes, b: Buffers) -> int:
    """ZeRO-3's full bf16 parameters gathered at once (with unreduced_gradient, what DeepSpeed's
    estimator counts as 4 x largest layer: it assumes one layer gathered).

    After a module runs, its parameters stay gathered if they are used again within
    stage3_max_reuse_distance elements of the recorded parameter order
    (partitioned_param_coordinator.py __params_to_release), which zerotrain writes equal to
    stage3_max_live_parameters (R). Every parameter kept that way but the earliest kept one was used
    since that one was released, within R elements of it: they hold less than R + one largest
    layer (none when R is 0). The module running adds a layer, and the prefetch
    stage3_prefetch_bucket_size, capped by stage3_max_live_parameters; never more than every
    partitioned parameter. tests/distributed measures the parameters gathered on a real engine."""
    if layout.stage < 3:
        return 0
    reuse = b.stage3_max_live_parameters
    kept = reuse + s.largest_layer_params if reuse else 0
    prefetch = min(b.stage3_prefetch_bucket_size, b.stage3_max_live_parameters)
    return LP * min(_partitioned_params(s), kept + s.largest_layer_params + prefetch)


def hpz_secondary(layout: Layout, s: Sizes) -> int:
    """ZeRO++ hpZ: each GPU keeps a second bf16 partition of the partitioned parameters over its
    node's GPUs (partition_parameters.py ds_secondary_tensor, numel = the partition x the number of
    groups), so that backward gathers them within the node."""
    if layout.zeropp == "none" or layout.stage != 3:
        return 0
    return LP * _partitioned_params(s) // max(s.gpus_per_node, 1)


def quantized_gather(layout: Layout, s: Sizes, b: Buffers) -> int:
    """ZeRO++ qwZ: the int8 copy of what is being gathered, beside the bf16 result (one byte per
    gathered element, block scales aside). An estimate from the format, to be calibrated on GPUs."""
    if layout.zeropp != "hpz-qwz-qgz":
        return 0
    return gathered_params(layout, s, b) // LP


def unreduced_gradient(layout: Layout, s: Sizes) -> int:
    """ZeRO-3: a layer's full bf16 gradient exists in backward until it is copied into the
    reduction bucket; the largest layer's at most."""
    return LP * min(s.largest_layer_params, s.trainable_params) if layout.stage == 3 else 0


def lp_grads(layout: Layout, s: Sizes) -> int:
    """bf16 gradients held through backward. ZeRO 0/1 keep a full-size gradient per trainable
    parameter until the accumulation boundary (ZeRO-0: autograd accumulates into each .grad, and
    FP16_Optimizer.step frees them once flattened); ZeRO-2 keeps its partition (grads_in_partition);
    ZeRO-3 its grad_partitions_flat_buffer. With the optimizer offloaded, ZeRO-2 copies each
    reduced gradient straight into the host fp32 buffer (copy_grads_in_partition) and ZeRO-3
    pins its buffer in host memory, so neither keeps a GPU partition."""
    if layout.stage <= 1:
        return LP * s.trainable_params
    if layout.offload_optimizer != "none":
        return 0
    return LP * s.trainable_params // s.world_size


def fp32_grads(layout: Layout, s: Sizes, b: Buffers) -> int:
    """fp32 gradients at the optimizer step. ZeRO-0's FP16_Optimizer.step converts each bf16
    gradient to an fp32 copy and flattens the copies into one fp32 gradient per group
    (_flatten_dense_tensors of p.grad.to(fp32)): both exist while it flattens, 2 x fp32 of the
    trainable parameters. ZeRO 1/2 build the fp32 partition gradient at the step
    (single_partition_of_fp32_groups[i].grad). ZeRO-3 builds it one sub-group at a time
    (_prepare_fp32_grad_for_sub_group). With the optimizer offloaded they live on the host."""
    if layout.offload_optimizer != "none":
        return 0
    if layout.stage == 0:
        return 2 * FP32 * s.trainable_params
    partition = s.trainable_params // s.world_size
    if layout.stage == 3:
        return master_element(layout) * min(b.sub_group_size, partition)
    return master_element(layout) * partition


def master_weights(layout: Layout, s: Sizes, b: Buffers | None = None) -> int:
    """fp32 master copy of the trainable parameters: whole at stage 0 (FP16_Optimizer's
    fp32_groups_flat, unpadded), partitioned from stage 1. adamw-bf16: a bf16 copy of the partition
    (single_partition_of_fp32_groups, fp32_partitioned_groups_flat in master_weights_and_grads_dtype).
    ZeRO-3 shares the bf16 partition itself when it already has the master dtype on the optimizer's
    device (stage3.py _create_fp32_partitions): with bf16 masters and the parameters on the GPU it
    holds no second copy. (DeepSpeed 0.19.8 compares the partition's torch.device with the
    accelerator's device name, a string, which is never equal; zerotrain gives it the name as a
    torch.device, deepspeed_compat; not without b.shares_copies.)"""
    if layout.offload_optimizer != "none":
        return 0
    if layout.bf16_masters and layout.stage == 3 and layout.offload_param == "none" and (b or Buffers()).shares_copies:
        return 0
    if layout.bf16_masters:
        return LP * s.trainable_params // s.world_size
    return FP32 * s.trainable_params // (1 if layout.stage == 0 else s.world_size)


def optimizer_states(layout: Layout, s: Sizes, b: Buffers | None = None) -> int:
    """The optimizer's state (state_bytes) for each tensor it steps (optimizer_tensors), only for
    trainable parameters; partitioned from stage 1. At stage 0 FP16_Optimizer creates AdamW's at
    init (initialize_optimizer_states steps once on zero gradients); ZeRO 1-3 at the first step."""
    if layout.offload_optimizer != "none":
        return 0
    return sum(state_bytes(layout, n) for n in optimizer_tensors(layout, s, b or Buffers()))


def reduce_buckets(layout: Layout, s: Sizes, b: Buffers) -> int:
    """Gradient reduction buffers, bf16. Stage 0: at the accumulation boundary the engine flattens
    the gradients into buckets, one at a time, each closed once it exceeds ZERO0_ALLREDUCE_ELEMENTS
    (engine.allreduce_no_retain; reduce_bucket_size is not read). ZeRO 1/2: reduce_bucket_size
    elements, two buffers with overlap_comm (stage_1_and_2.py setup_buckets, for each backward).
    ZeRO-3: one buffer of reduce_bucket_size elements whatever overlap_comm (stage3.py
    _setup_for_real_optimizer, from init). The buffers are allocated whole, even for fewer
    trainable parameters."""
    if layout.stage == 0:
        return LP * min(s.trainable_params, ZERO0_ALLREDUCE_ELEMENTS + s.largest_trainable_param)
    copies = 2 if b.overlap_comm and layout.stage < 3 else 1
    return LP * b.reduce_bucket_size * copies


def offload_grad_staging(layout: Layout, s: Sizes) -> int:
    """ZeRO 1/2 with the optimizer offloaded stage each gradient through a bf16 GPU buffer the
    size of the largest trainable parameter (temp_grad_buffer_for_gpu_offload)."""
    if layout.stage in (1, 2) and layout.offload_optimizer != "none":
        return LP * s.largest_trainable_param
    return 0


def init_transient(layout: Layout, s: Sizes, b: Buffers) -> int:
    """What deepspeed.initialize holds beyond what it leaves (the init phase's other terms).
    - ZeRO-0: FP16_Optimizer.initialize_optimizer_states steps once on a zero fp32 gradient of
      every trainable parameter, to create the Adam moments: FP32 x P_t.
    - ZeRO 1/2 (stage_1_and_2.py): the flat bf16 copy of the trainable parameters is made beside
      the originals on the GPU (when it has room; the engine moves the model there whole first),
      LP x P_t, before the fp32 master partition exists; then initialize_optimizer_states builds a
      zero fp32 gradient partition beside the master (both on the host when offloaded). Above the
      flat parameters and the master partition it leaves: the larger of the two.
    - ZeRO-3 (stage3.py initialize_optimizer_states): a zero fp32 gradient buffer of the largest
      sub-group's partition, as at the step (on the host when offloaded). zerotrain.loading has
      converted the model one parameter at a time before (a whole parameter on the GPU, then its
      partition)."""
    if layout.stage == 0:
        return FP32 * s.trainable_params
    if layout.stage == 3:
        return fp32_grads(layout, s, b)
    return max(LP * s.trainable_params - master_weights(layout, s, b), fp32_grads(layout, s, b))


def save_gather(layout: Layout, s: Sizes) -> int:
    """Saving a checkpoint (engine.save_checkpoint, as zerotrain saves) writes each rank's
    partitions as they are: nothing is gathered at ZeRO 0-2, nor into 16-bit weights at ZeRO-3
    (stage3_gather_16bit_weights_on_model_save acts in save_16bit_model only). ZeRO-3 releases
    every gathered parameter before (checkpoint_event_prologue) and all-gathers the persistent
    ones into new tensors after (checkpoint_event_epilogue), beside the old ones."""
    return LP * s.persistent_params if layout.stage == 3 else 0


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
    host_buffers: dict[str, int] = field(default_factory=dict)
    """The offload's host buffers per node by name (host_buffers), as the plan prints them."""


def estimate(layout: Layout, s: Sizes, b: Buffers, activation_peak: int, input_bytes: int) -> MemoryEstimate:
    """Per-GPU memory of each phase; the plan uses the highest. activation_peak and
    input_bytes are for one micro-batch. Forward and backward count the gradient buffers: the
    first micro-batch of an accumulation has none yet, but every later one does."""
    states = {
        "bf16 params": lp_params(layout, s),
        "fp32 master": master_weights(layout, s, b),
        "optimizer states": optimizer_states(layout, s, b),
        "buffers": s.buffer_bytes,
        "hpz secondary params": hpz_secondary(layout, s),
    }
    grads = lp_grads(layout, s)
    gathered = gathered_params(layout, s, b)
    buckets = reduce_buckets(layout, s, b)
    # ZeRO-3 allocates its gradient partition and reduction buffer at init and keeps them; ZeRO 0-2
    # hold gradients from the first backward to the step, and buckets only while reducing.
    resident = {"bf16 grads": grads, "reduce buckets": buckets} if layout.stage == 3 else {}
    # ZeRO 1-3 create the moments at the first step, not at init.
    after_init = {**states, "optimizer states": states["optimizer states"] if layout.stage == 0 else 0}
    phase_terms = {
        "init": {**after_init, **resident, "init transient": init_transient(layout, s, b)},
        "forward": {**states, "bf16 grads": grads, **resident, "gathered params": gathered,
                    "quantized gather": quantized_gather(layout, s, b),
                    "activations": activation_peak, "inputs": input_bytes},
        "backward": {**states, "bf16 grads": grads, "gathered params": gathered,
                     "unreduced gradient": unreduced_gradient(layout, s), "reduce buckets": buckets,
                     "offload staging": offload_grad_staging(layout, s),
                     "activations": activation_peak,
                     "inputs": input_bytes},
        "optimizer step": {**states, "bf16 grads": grads, **resident, "fp32 grads": fp32_grads(layout, s, b),
                           "step transient": step_transient(layout, s, b)},
        "checkpoint save": {**states, **resident, "save gather": save_gather(layout, s)},
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
        host_terms=host_terms, host_buffers=host_buffers(layout, s, b),
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
      (param_buffer_of_bit16_for_cpu_offload_groups; with bf16 masters the master itself,
      deepspeed_compat.sharing._share_upload_copies) and a bf16 gradient of the largest parameter
      (temp_grad_buffer_for_cpu_offload) are pinned; with gradient accumulation, ZeRO-2 pins a
      bf16 accumulator per parameter (accumulated_grads_in_cpu). DeepSpeedCPUAdam's moments are
      plain host tensors (cpu_adam.py: zeros_like).
    - ZeRO-3 (stage3.py): the fp32 master per sub-group is plain (a clone), its fp32 gradient
      pinned; the bf16 gradient partition (grad_partitions_flat_buffer) is pinned. With bf16
      masters the master's gradient is its range of that partition, and with the parameters
      offloaded too the master is the bf16 partition (deepspeed_compat.sharing._zero3_shares_bf16_masters).
      With the
      parameters offloaded, the trainable bf16 partition is one pinned flat buffer per sub-group
      (param_groups_fp16_flat_cpu_memory) and each frozen parameter's partition is pinned on its own
      (partition_parameters.py)."""
    per_rank = s.trainable_params // s.world_size
    out: list[HostBuffer] = []
    if layout.offload_activations:
        # one pinned copy of each offloaded input (recompute._to_pinned_host), a micro-batch's worth
        out.append(HostBuffer("offloaded activations",
                              tuple(n * layout.micro_batch for n in s.offload_activation_bytes), pinned=True))
    m = master_element(layout)
    if layout.offload_optimizer == "cpu":
        if layout.stage == 3:
            groups = _chunks(per_rank, b.sub_group_size)
            # bf16 masters: the master is the offloaded bf16 partition itself, and its gradient a
            # range of the bf16 gradient partition (deepspeed_compat), where b.shares_copies
            shared = layout.bf16_masters and b.shares_copies
            if not (shared and layout.offload_param == "cpu"):
                out.append(HostBuffer("fp32 master", tuple(m * n for n in groups), pinned=False))
            if not shared:
                out.append(HostBuffer("fp32 grads", tuple(m * n for n in groups), pinned=True))
            out.append(HostBuffer("bf16 grad partition", (LP * per_rank,), pinned=True))
        else:
            out += [HostBuffer("fp32 master", (m * per_rank,), pinned=True),
                    HostBuffer("fp32 grads", (m * per_rank,), pinned=True),
                    HostBuffer("grad staging", (LP * s.largest_trainable_param,), pinned=True)]
            if not (layout.bf16_masters and b.shares_copies):  # a bf16 master is its own upload copy
                out.append(HostBuffer("bf16 upload copy", (LP * per_rank,), pinned=True))
            if layout.stage == 2 and layout.accumulation > 1:
                if s.all_trainable and s.param_numels:
                    sizes = tuple(LP * n for n in _rank_share(s.param_numels, s.world_size))
                else:  # adapters of unknown sizes: the partition, each one rounded up at worst
                    sizes = (LP * per_rank,)
                out.append(HostBuffer("grad accumulators", sizes, pinned=True))
        out.append(HostBuffer("adam moments", (moment_bytes(layout) // 2 * per_rank,) * 2, pinned=False))
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


def partitioned_load(layout: Layout, s: Sizes) -> bool:
    """Whether zerotrain.loading loads this layout's model partitioned (ZeRO-3, the base not
    quantized, parameters not offloaded to NVMe), as loading.choose decides."""
    return not s.load_whole and layout.stage == 3 and s.frozen_shardable and layout.offload_param != "nvme"


def load_bytes(layout: Layout, s: Sizes) -> int:
    """Host RAM per node while the model loads (zerotrain.loading):
    - partitioned: the file's pages once on rank 0's node (rank 0 reads every weight) and one
      parameter in flight per rank; the partitions kept on the host are the offload's;
    - staggered (ZeRO 0-2 or a quantized base, model.load: auto): one rank's copy at a time (a
      quantized base replaces the bf16 weights layer by layer as optimum-quanto freezes them);
    - whole (model.load: whole; ZeRO-3 with the parameters offloaded to NVMe): a copy per rank
      (a checkpoint stored in bf16 loads memory-mapped, and the ranks share the page cache until
      DeepSpeed writes to it; one stored in fp32 converts on every rank)."""
    copy = s.load_bytes_per_param * (s.total_params or s.trainable_params)
    if partitioned_load(layout, s):
        largest = max(s.param_numels, default=s.largest_layer_params)
        return copy + s.gpus_per_node * s.load_bytes_per_param * largest
    if s.load_whole or (layout.stage == 3 and s.frozen_shardable):  # NVMe: initialize converts it whole
        return s.gpus_per_node * copy
    return copy


def host_bytes(layout: Layout, s: Sizes, b: Buffers | None = None) -> dict[str, int]:
    """Host RAM per node, by phase: loading (load_bytes), offload (the node's ranks' offload buffers,
    each pinned allocation as torch's host allocator rounds it), training where it holds more (the offload's
    buffers, the node's EMA, ema_bytes, and its DataLoader workers, loader_bytes) and, where rendering validation
    images loads more weights into host memory or renders with the EMA, validation (what training holds stays;
    every rank of the node holds its own copy of those weights while it renders, and its trained masters
    beside the EMA it renders with)."""
    b = b or Buffers()
    offload = int(sum(host_buffers(layout, s, b).values()) * b.host_offload_factor)
    ema, workers = ema_bytes(layout, s), s.gpus_per_node * (s.loader_bytes + s.dataset_bytes)
    terms = {"model load": int(load_bytes(layout, s)), "offload": offload}
    if ema or workers:
        terms["training"] = offload + ema + workers
    if s.validation_host_bytes or s.ema_validation:
        terms["validation"] = (offload + ema * (2 if s.ema_validation else 1) + workers
                               + s.gpus_per_node * s.validation_host_bytes)
    return terms


def dataset_index_bytes(entries: int, entry_bytes: int | None = None) -> int:
    """One rank process's host RAM for a dataset of this many entries: planner.dataset_entry_bytes each (the
    default where not given). Its DataLoader workers map the same index file and add none."""
    from zerotrain.config.sections import DATASET_ENTRY_BYTES

    return entries * (DATASET_ENTRY_BYTES if entry_bytes is None else entry_bytes)


def ema_bytes(layout: Layout, s: Sizes) -> int:
    """Host bytes per node of the EMA (zerotrain/ema.py): each rank keeps in fp32 the trainable elements its
    optimizer partition owns (at ZeRO-0, whose optimizer is every rank's whole, all of them), so a node holds
    4 bytes per trainable element for each of its ranks' shares: for a FLUX.1 full fine-tune on 8 GPUs of one
    node about 48 GB, at ZeRO-0 eight times that. 0 without ema.enabled."""
    if not s.ema:
        return 0
    owned = s.trainable_params if layout.stage == 0 else -(-s.trainable_params // s.world_size)
    return s.gpus_per_node * FP32 * owned


def host_buffers(layout: Layout, s: Sizes, b: Buffers) -> dict[str, int]:
    """The node's offload buffers by name (offload_buffers), each pinned allocation as torch's
    host allocator rounds it, before host_offload_factor: what the "offload" of host_bytes adds up."""
    return {f"{buf.name} (pinned)" if buf.pinned else buf.name:
            s.gpus_per_node * sum(pinned_bytes(n, b.pinned_exact_above) if buf.pinned else n for n in buf.sizes)
            for buf in offload_buffers(layout, s, b)}


def nvme_bytes(layout: Layout, s: Sizes) -> int:
    """NVMe space per node for ZeRO-Infinity swap files."""
    ranks, per_rank = s.gpus_per_node, s.trainable_params // s.world_size
    used = 0
    if layout.offload_optimizer == "nvme":
        used += ranks * (2 * master_element(layout) + moment_bytes(layout)) * per_rank
    if layout.offload_param == "nvme":
        used += ranks * (LP * per_rank + (s.frozen_bytes // s.world_size if s.frozen_shardable else 0))
    return used
