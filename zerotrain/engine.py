"""The only module that calls deepspeed.initialize: load the denoiser, apply the training mode
(full, LoRA), gradient checkpointing, and wrap it in a DeepSpeed engine with the planned config.

Model code knows nothing of ZeRO (DESIGN rule 1). The model is loaded whole on the host and
DeepSpeed partitions it at initialize; zero.Init is not used, because it partitions Flux's
embedding while it is being built ("'weight' must be 2-D", SimpleTuner#1239).

LoRA over a quantized base: DeepSpeed moves, casts and (ZeRO-3) partitions every parameter of the
module it is given, and optimum-quanto's weights break there ("_apply(): Couldn't swap
QLinear.weight", accelerate#2378, optimum-quanto#396). So the engine is given a TrainableView: a
module that registers only the modules owning trainable parameters (the LoRA A/B layers), under
their own names, and calls the quantized model, which it holds outside the module tree. DeepSpeed
shards the adapters and their optimizer state at any stage; the frozen quantized base is placed on
the device once and replicated, as the planner assumes (Sizes.frozen_shardable)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from zerotrain import families, optimizers
from zerotrain.config.sections import Mode, Quantization, RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import ModelSpec
from zerotrain.planner.deepspeed_json import client_optimizer_of


def load_denoiser(spec: ModelSpec, folder: Path) -> torch.nn.Module:
    """The family's diffusers denoiser from a model folder, in bf16, on the host."""
    subfolder = spec.subfolder or families.of(spec).denoiser_folder
    try:
        return spec.denoiser_class().from_pretrained(folder, subfolder=subfolder, torch_dtype=torch.bfloat16)
    except (OSError, ValueError) as err:
        raise ZerotrainError(f"model.name_or_path={spec.name}: cannot load {subfolder}/ from {folder} "
                             f"({' '.join(str(err).split())[:300]})") from err


def quantize_base(model: torch.nn.Module, quantization: Quantization) -> str:
    """Quantize every Linear and Conv2d weight of the (still adapter-free) model with optimum-quanto,
    as the planner counts them (trace.frozen_storage_bytes), and freeze it: the float weights are
    replaced by quantized ones. Returns what was done, in words."""
    from optimum import quanto

    before = sum(p.numel() * p.element_size() for p in model.parameters())
    quanto.quantize(model, weights=getattr(quanto, quantization.value))
    quanto.freeze(model)
    layers = sum(isinstance(m, quanto.QModuleMixin) for m in model.modules())
    after = sum(quanto_bytes(p) for p in model.parameters())
    return (f"quantized the frozen base to {quantization.value} with optimum-quanto: {layers} layers, "
            f"{_size(before)} -> {_size(after)}")


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"


def quanto_bytes(tensor: torch.Tensor) -> int:
    """Storage bytes of a parameter, quantized (data plus scales) or not."""
    if hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(quanto_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


class TrainableView(torch.nn.Module):
    """What DeepSpeed sees of a model whose frozen part it must not touch: the modules that own
    the trainable parameters, registered at their paths in the model (so parameter names and
    checkpoints are the same as for the whole model), and a forward that runs the whole model.

    The model itself is kept outside the module tree (not a registered child): DeepSpeed's
    .to(), bf16 casts and ZeRO-3 partitioning never reach it, while its forward still calls the
    very adapter modules DeepSpeed manages (ZeRO-3's gather hooks are on those modules)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "model", model)
        owners = sorted({name.rpartition(".")[0] for name, p in model.named_parameters() if p.requires_grad})
        for path in owners:
            parent: torch.nn.Module = self
            *containers, leaf = path.split(".")
            for part in containers:
                if part not in parent._modules:
                    parent.add_module(part, torch.nn.Module())
                parent = parent._modules[part]
            parent.add_module(leaf, model.get_submodule(path))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def train(self, mode: bool = True) -> TrainableView:
        self.model.train(mode)
        return super().train(mode)


def apply_mode(model: torch.nn.Module, spec: ModelSpec, run: RunConfig,
               gradient_checkpointing: bool | list[str], offload_activations: bool = False,
               stage: int | None = None) -> list[str]:
    """LoRA adapters (the base frozen, quantized if asked) or a full fine-tune; gradient
    checkpointing as planned: of every block (True), none (False, []) or the named blocks
    (Plan.checkpointed), with the checkpointed blocks' inputs in host memory when
    offload_activations (recompute.OffloadingCheckpoint); its blocks compiled as training.compile and
    the ZeRO stage allow (compile_choice; stage None: not compiled). Returns what was done, in lines
    for the log."""
    done = []
    if run.training.quantize_base is not Quantization.none:
        done.append(quantize_base(model, run.training.quantize_base))
    if run.training.mode is Mode.lora:
        from zerotrain.planner.trace import apply_lora

        apply_lora(model, spec, run)
    else:
        model.requires_grad_(True)
    some = None if gradient_checkpointing is True else gradient_checkpointing
    if gradient_checkpointing:
        from zerotrain import recompute

        families.of(spec).enable_checkpointing(model, some,
                                               recompute.OffloadingCheckpoint() if offload_activations else None)
    model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    checkpointing = "" if not gradient_checkpointing else ", gradient checkpointing" + (
        f" of {len(some)} blocks ({', '.join(some[:3])}{', ...' if len(some) > 3 else ''})" if some else "") + (
        offload_line(offload_activations))
    done.append(f"{run.training.mode.value} training: {trainable:,} trainable parameters{checkpointing}")
    if stage is not None:
        compiled, why = compile_choice(run, stage)
        if compiled:
            why = f"{why}: {', '.join(compile_blocks(model))}"
        done.append(why)
    return done


def compile_choice(run: RunConfig, stage: int) -> tuple[bool, str]:
    """Whether the run compiles its blocks (training.compile), and why, in a line for the log."""
    from zerotrain.distributed import accelerator

    asked = run.training.compile
    if asked is False:
        return False, "blocks run eagerly (training.compile=false)"
    if stage == 3:
        if asked is True:
            raise ZerotrainError("training.compile=true with ZeRO-3: DeepSpeed's parameter hooks (compiler-disabled) "
                                 "split every compiled block into pieces; set training.compile to auto or false, or "
                                 "planner.stages to [0, 1, 2]")
        return False, "blocks run eagerly: ZeRO-3's parameter hooks would split compiled blocks (training.compile=auto)"
    if asked == "auto" and accelerator()[0] == "cpu":
        return False, ("blocks run eagerly on the CPU accelerator, where compiling takes longer than tiny runs last "
                       "(training.compile=auto; true compiles)")
    if asked == "auto" and run.training.quantize_base is not Quantization.none:
        return False, "blocks run eagerly over a quantized base (training.compile=auto; true compiles)"
    return True, "each repeated block compiled with torch.compile (regional compilation; the first steps compile)"


def compile_blocks(model: torch.nn.Module) -> list[str]:
    """Regional compilation through diffusers' compile_repeated_blocks: each module of the classes in
    the model's _repeated_blocks gets torch.compile'd forward (one compiled graph shared by a
    class's blocks). A model class without _repeated_blocks (SD3's) compiles its checkpoint units'
    transformer block classes instead. Returns the compiled classes."""
    from zerotrain import recompute

    if not getattr(model, "_repeated_blocks", None):
        model._repeated_blocks = sorted({type(m).__name__ for m in recompute.checkpoint_units(model).values()
                                         if type(m).__name__.endswith("TransformerBlock")})
    if not model._repeated_blocks:
        raise ZerotrainError(f"training.compile=true: {type(model).__name__} has no repeated transformer blocks to "
                             "compile; set training.compile to auto or false")
    model.compile_repeated_blocks()
    return list(model._repeated_blocks)


def offload_line(offload_activations: bool) -> str:
    if not offload_activations:
        return ""
    from zerotrain.distributed import accelerator

    if accelerator()[0] == "cpu":  # recompute.offloaded moves only accelerator tensors
        return ", activation offload on (a no-op on the CPU accelerator: host and device are one memory)"
    return ", the checkpointed blocks' inputs offloaded to pinned host memory"


def lr_lambda(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of the peak learning rate at optimizer step `step`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, run: RunConfig) -> torch.optim.lr_scheduler.LambdaLR:
    opt = run.optimizer
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(
        lr_lambda, warmup=opt.warmup_steps, total=run.training.max_steps, schedule=opt.schedule))


def build_engine(model: torch.nn.Module, ds_config: dict[str, Any], run: RunConfig, device: torch.device) -> Any:
    """deepspeed.initialize with the trainable parameters; DeepSpeed builds AdamW (CPU Adam when
    the optimizer is offloaded), or zerotrain a client optimizer the config names under "_zerotrain"
    (zerotrain/optimizers.py), and DeepSpeed steps the LR schedule at every optimizer step. A quantized
    model is moved to `device` here and given to DeepSpeed as a TrainableView (see denoiser())."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ZerotrainError("nothing to train: no parameter requires a gradient (check training.lora.target_modules)")
    if run.training.quantize_base is not Quantization.none:
        model = TrainableView(model.to(device))
    engine, _, _, _ = initialize(model, trainable, ds_config, lr_scheduler=partial(make_scheduler, run=run))
    return engine


def initialize(model: torch.nn.Module, trainable: list[torch.nn.Parameter], ds_config: dict[str, Any],
               **kwargs: Any) -> tuple[Any, ...]:
    """deepspeed.initialize as zerotrain calls it: with the client optimizer the config names under
    "_zerotrain" (built here; DeepSpeed gets the config without that key), and ZeRO-3 sharing its
    bf16 partitions as bf16 masters (zero3_shares_bf16_masters)."""
    import deepspeed

    settings = ds_config["_zerotrain"]["optimizer"] if client_optimizer_of(ds_config) else None
    optimizer = optimizers.build(settings, trainable) if settings else None
    config = {k: v for k, v in ds_config.items() if k != "_zerotrain"}
    # DeepSpeed's decoupled checkpoint writer hands the master partitions to another process,
    # which would move a shared one's whole pinned buffer into shared memory.
    writer = (config.get("checkpoint") or {}).get("writer") or {}
    with zero3_shares_bf16_masters(offloaded=not writer.get("decoupled", False)):
        out = deepspeed.initialize(model=model, model_parameters=trainable, optimizer=optimizer, config=config,
                                   **kwargs)
    share_upload_copies(out[1])
    return out


def share_upload_copies(optimizer: Any) -> None:
    """ZeRO 1/2 with the optimizer offloaded keep a pinned bf16 copy of each master partition, which
    every step fills from the master before copying it to the GPU (stage_1_and_2.py
    param_buffer_of_bit16_for_cpu_offload_groups). With bf16 masters (adamw-bf16) the copy equals
    the master: the master takes its place, and the copy's pinned memory (2 bytes per trainable
    parameter) goes back before the first step allocates the moments. DeepSpeed's own step then
    copies the master into itself and uploads it as before."""
    buffers = getattr(optimizer, "param_buffer_of_bit16_for_cpu_offload_groups", None)
    masters = getattr(optimizer, "single_partition_of_fp32_groups", None)
    if not buffers or not masters:
        return
    shared = False
    for i, (buffer, master) in enumerate(zip(buffers, masters, strict=True)):
        if (buffer.dtype, buffer.shape, buffer.device) == (master.dtype, master.shape, master.device) \
                and buffer.data_ptr() != master.data_ptr():
            buffers[i] = master
            shared = True
    if shared:
        gc_host_memory()


@contextlib.contextmanager
def zero3_shares_bf16_masters(offloaded: bool = True) -> Iterator[None]:
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
      dropped for the partition itself (share_offloaded_masters).
    - Offloaded, each sub-group's master gradient is a pinned buffer the boundary fills by copying
      the gradient partition (grad_partitions_flat_buffer, pinned too) into it; with bf16 masters
      both are bf16 with the same layout, so the master's gradient becomes its sub-group's range of
      the gradient partition (share_offloaded_grads). The boundary's copy then writes the same
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
    (ZenFlow, SuperOffload, _host_offloaded_subgroups)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    create_original = DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions
    positions_original = DeepSpeedZeroOptimizer_Stage3.set_grad_positions

    def create(self: Any) -> Any:
        name = self.device
        if isinstance(name, str) and not self.offload_optimizer:
            self.device = torch.device(name)
        try:
            out = create_original(self)
        finally:
            self.device = name
        if offloaded:
            share_offloaded_masters(self)
        return out

    def set_positions(self: Any) -> Any:  # the last step of __init__ that shapes the gradient buffers
        out = positions_original(self)
        if offloaded:
            share_offloaded_grads(self)
        return out

    DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = create
    DeepSpeedZeroOptimizer_Stage3.set_grad_positions = set_positions
    try:
        yield
    finally:
        DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = create_original
        DeepSpeedZeroOptimizer_Stage3.set_grad_positions = positions_original


def _host_offloaded_subgroups(zero: Any) -> list[int]:
    """ZeRO-3 sub-groups whose optimizer steps in host memory (not on NVMe, not on the GPU). None
    with Muon, whose state DeepSpeed keys by the master while it creates it, and none where another
    process steps the master during the backward (ZenFlow, SuperOffload's subclass of the ZeRO-3
    optimizer): it would move the whole shared buffer into shared, unpinned memory."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if not zero.offload_optimizer or type(zero) is not DeepSpeedZeroOptimizer_Stage3 \
            or getattr(zero, "use_muon", False) or getattr(zero, "zenflow", False):
        return []
    return [i for i in range(len(zero.fp16_groups))
            if zero.subgroup_to_device.get(i) == "cpu" and not zero._swappable_optimizer_subgroup(i)]


def share_offloaded_masters(zero: Any) -> None:
    """ZeRO-3 with the parameters and the optimizer offloaded: each host sub-group's master is its
    bf16 partition when the master dtype is bf16 (see zero3_shares_bf16_masters)."""
    if not zero.offload_param:
        return
    shared = False
    for i in _host_offloaded_subgroups(zero):
        partition, master = zero.fp16_partitioned_groups_flat[i], zero.fp32_partitioned_groups_flat[i]
        if partition is None or partition.device.type != "cpu" or partition.data_ptr() == master.data_ptr() \
                or (partition.dtype, partition.shape) != (master.dtype, master.shape):
            continue
        partition.ds_id = master.ds_id
        partition.requires_grad = True
        zero.fp32_partitioned_groups_flat[i] = partition
        shared = True
    if shared:
        gc_host_memory()


def share_offloaded_grads(zero: Any) -> None:
    """ZeRO-3 with the optimizer offloaded: each host sub-group's master gradient is its range of
    the pinned gradient partition when both have the master dtype and the sub-group's parameters lie
    in it in the order of their gradient positions (see zero3_shares_bf16_masters)."""
    flat = getattr(zero, "grad_partitions_flat_buffer", None)
    subgroups = _host_offloaded_subgroups(zero)
    if flat is None or flat.device.type != "cpu" or not subgroups:
        return
    partitions = zero._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition
    element = flat.element_size()
    shared = False
    offset = 0
    for i, group in enumerate(zero.fp16_groups):
        numel = int(zero.fp16_partitioned_groups_flat_numel[i])
        master = zero.fp32_partitioned_groups_flat[i]
        view = flat.narrow(0, offset, numel)
        offset += numel
        grad = master.grad
        if i not in subgroups or grad is None or (grad.dtype, grad.numel()) != (flat.dtype, numel) \
                or grad.data_ptr() == view.data_ptr():
            continue
        # The gradient positions DeepSpeed copies by (set_grad_positions) must be the same places.
        if not all(partitions[p.ds_id].data_ptr() == view.data_ptr() + element * zero.grad_position[
                zero.get_param_id(p)][1] for p in group):
            continue
        master.grad = view
        shared = True
    if shared:
        gc_host_memory()


def gc_host_memory() -> None:
    """Give freed pinned buffers back: torch's caching host allocator keeps them otherwise."""
    if torch.cuda.is_available():
        torch._C._host_emptyCache()


def cpu_adam_unavailable() -> str | None:
    """Build (or load from the torch extensions cache) DeepSpeedCPUAdam's C++ op one rank at a time,
    before an offloaded engine needs it: left to deepspeed.initialize, every rank JIT-compiles it at
    once on a fresh machine. Returns why it cannot be built here, or None. Every rank must call it."""
    import subprocess

    from deepspeed.accelerator import get_accelerator

    error = None
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    for turn in range(world):
        if turn == rank:
            try:
                get_accelerator().create_op_builder("CPUAdamBuilder").load()
            except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as err:
                error = f"DeepSpeedCPUAdam's op does not build here: {' '.join(str(err).split())[-400:]}"
        if world > 1:
            torch.distributed.barrier()
    return error


def denoiser(engine: Any) -> torch.nn.Module:
    """The diffusers model an engine trains (inside a TrainableView for a quantized base)."""
    module = engine.module
    return module.model if isinstance(module, TrainableView) else module
