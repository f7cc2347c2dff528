"""The only module that calls deepspeed.initialize: load the denoiser, apply the training mode
(full, LoRA), gradient checkpointing, and wrap it in a DeepSpeed engine with the planned config.

Model code knows nothing of ZeRO (DESIGN rule 1). zerotrain.loading loads the model (at ZeRO-3
already partitioned, one parameter at a time); zero.Init is never a construction context, because
it partitions Flux's embedding while it is being built ("'weight' must be 2-D", SimpleTuner#1239).

LoRA over a quantized base: DeepSpeed moves, casts and (ZeRO-3) partitions every parameter of the
module it is given, and optimum-quanto's weights break there ("_apply(): Couldn't swap
QLinear.weight", accelerate#2378, optimum-quanto#396). So the engine is given a TrainableView: a
module that registers only the modules owning trainable parameters (the LoRA A/B layers), under
their own names, and calls the quantized model, which it holds outside the module tree. DeepSpeed
shards the adapters and their optimizer state at any stage; the frozen quantized base is placed on
the device once and replicated, as the planner assumes (Sizes.frozen_shardable)."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

import torch

from zerotrain import deepspeed_compat, families, optimizers
from zerotrain.config.sections import Mode, Quantization, RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.planner.deepspeed_json import client_optimizer_of
from zerotrain.protocols import ModelSpec


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


def quantized(model: torch.nn.Module) -> bool:
    """Whether the model's base is quantized already (zerotrain.loading quantizes as it loads)."""
    from optimum import quanto

    return any(isinstance(m, quanto.QModuleMixin) for m in model.modules())


def numel(param: torch.nn.Parameter) -> int:
    """Elements of a parameter, whole also where ZeRO-3 holds only its partition (ds_numel)."""
    return getattr(param, "ds_numel", param.numel())


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
    if run.training.quantize_base is not Quantization.none and not quantized(model):
        done.append(quantize_base(model, run.training.quantize_base))
    if run.training.mode is Mode.lora:
        from zerotrain.adapters import apply_lora

        apply_lora(model, spec, run)
    else:
        model.requires_grad_(True)
    some = None if gradient_checkpointing is True else gradient_checkpointing
    if gradient_checkpointing:
        from zerotrain import recompute

        families.of(spec).enable_checkpointing(model, some,
                                               recompute.OffloadingCheckpoint() if offload_activations else None)
    model.train()
    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    checkpointing = "" if not gradient_checkpointing else ", gradient checkpointing" + (
        f" of {len(some)} blocks ({', '.join(some[:3])}{', ...' if len(some) > 3 else ''})" if some else "") + (
        offload_line(offload_activations))
    done.append(f"{run.training.mode.value} training: {trainable:,} trainable parameters{checkpointing}")
    if stage is not None:
        compiled, why = compile_choice(run, stage)
        done.append(f"{why}: {', '.join(compile_blocks(model))}" if compiled else why)
        if compiled:
            done.append(UNVERIFIED_COMPILE)
    return done


# DESIGN rule 13: auto turns on only what a GPU run has shown to work. The first GPU run (one H200,
# 2026-11-28, torch 2.11) died with "CUDA error: an illegal memory access" at the first change of batch
# shape of a compiled LoRA layout, and real runs change shape at every aspect bucket. Until a bucketed GPU
# run with compiled blocks survives three shapes (benchmarks/gpu_check.py), auto stays eager everywhere.
UNVERIFIED_COMPILE = ("warning: training.compile=true: compiled blocks are not yet verified on GPUs (the first GPU "
                      "run crashed with an illegal memory access at the first change of batch shape); "
                      "training.compile=false runs them eagerly")


def compile_choice(run: RunConfig, stage: int) -> tuple[bool, str]:
    """Whether the run compiles its blocks (training.compile), and why, in a line for the log: only
    when asked (true), never at ZeRO-3; auto stays eager (UNVERIFIED_COMPILE says why)."""
    asked = run.training.compile
    if asked is False:
        return False, "blocks run eagerly (training.compile=false)"
    if stage == 3:
        if asked is True:
            raise ZerotrainError("training.compile=true with ZeRO-3: DeepSpeed's parameter hooks (compiler-disabled) "
                                 "split every compiled block into pieces; set training.compile to auto or false, or "
                                 "planner.stages to [0, 1, 2]")
        return False, "blocks run eagerly: ZeRO-3's parameter hooks would split compiled blocks (training.compile=auto)"
    if asked == "auto":
        return False, ("blocks run eagerly (training.compile=auto): compiled blocks are not yet verified on GPUs, "
                       "where they crashed at the first change of batch shape; true compiles")
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


def build_engine(model: torch.nn.Module, ds_config: dict[str, Any], run: RunConfig, device: torch.device,
                 sharing: deepspeed_compat.Sharing | None = None) -> Any:
    """deepspeed.initialize with the trainable parameters; DeepSpeed builds AdamW (CPU Adam when
    the optimizer is offloaded), or zerotrain a client optimizer the config names under "_zerotrain"
    (zerotrain/optimizers.py), and DeepSpeed steps the LR schedule at every optimizer step. A quantized
    model is moved to `device` here and given to DeepSpeed as a TrainableView (see denoiser()).
    `sharing`: see initialize."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ZerotrainError("nothing to train: no parameter requires a gradient (check training.lora.target_modules)")
    if run.training.quantize_base is not Quantization.none:
        model = TrainableView(model.to(device))
    engine, _, _, _ = initialize(model, trainable, ds_config, sharing, lr_scheduler=partial(make_scheduler, run=run))
    return engine


def initialize(model: torch.nn.Module, trainable: list[torch.nn.Parameter], ds_config: dict[str, Any],
               sharing: deepspeed_compat.Sharing | None = None, **kwargs: Any) -> tuple[Any, ...]:
    """deepspeed.initialize as zerotrain calls it: with the client optimizer the config names under
    "_zerotrain" (built here; DeepSpeed gets the config without that key), and DeepSpeed's repeated
    buffers shared as `sharing` (default: deepspeed_compat.sharing_in_force(), the flag the planner
    reads too) allows."""
    settings = ds_config["_zerotrain"]["optimizer"] if client_optimizer_of(ds_config) else None
    optimizer = optimizers.build(settings, trainable) if settings else None
    config = {k: v for k, v in ds_config.items() if k != "_zerotrain"}
    return deepspeed_compat.initialize(deepspeed_compat.sharing_in_force() if sharing is None else sharing,
                                       model=model, model_parameters=trainable, optimizer=optimizer, config=config,
                                       **kwargs)


def cpu_adam_unavailable() -> str | None:
    """Build (or load from the torch extensions cache) DeepSpeedCPUAdam's C++ op one rank at a time,
    before an offloaded engine needs it: left to deepspeed.initialize, every rank JIT-compiles it at
    once on a fresh machine. Returns why it cannot be built here, or None. Every rank must call it."""
    import subprocess

    from deepspeed.accelerator import get_accelerator

    deepspeed_compat.say_jit_builds(["cpu_adam"])
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
