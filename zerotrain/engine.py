"""The only module that calls deepspeed.initialize: load the denoiser, apply the training mode
(full, LoRA), gradient checkpointing, and wrap it in a DeepSpeed engine with the planned config.

Model code knows nothing of ZeRO (DESIGN rule 1). The model is loaded whole on the host and
DeepSpeed partitions it at initialize; zero.Init is not used, because it partitions Flux's
embedding while it is being built ("'weight' must be 2-D", SimpleTuner#1239)."""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path
from typing import Any

import torch

from zerotrain.config.sections import Mode, Quantization, RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import ModelSpec
from zerotrain.models.families import DENOISER_FOLDER


def load_denoiser(spec: ModelSpec, folder: Path) -> torch.nn.Module:
    """The family's diffusers denoiser from a model folder, in bf16, on the host."""
    subfolder = spec.subfolder or DENOISER_FOLDER[spec.family]
    try:
        return spec.denoiser_class().from_pretrained(folder, subfolder=subfolder, torch_dtype=torch.bfloat16)
    except (OSError, ValueError) as err:
        raise ZerotrainError(f"model.name_or_path={spec.name}: cannot load {subfolder}/ from {folder} "
                             f"({' '.join(str(err).split())[:300]})") from err


def apply_mode(model: torch.nn.Module, spec: ModelSpec, run: RunConfig, gradient_checkpointing: bool) -> None:
    """LoRA adapters (the base frozen) or a full fine-tune; gradient checkpointing as planned."""
    if run.training.quantize_base is not Quantization.none:
        raise ZerotrainError("training.quantize_base: training over a quantized base is not available yet in "
                             "zerotrain train; plan it with zerotrain plan, train with quantize_base=none")
    if run.training.mode is Mode.lora:
        from zerotrain.planner.trace import apply_lora

        apply_lora(model, spec, run)
    else:
        model.requires_grad_(True)
    if gradient_checkpointing:
        model.enable_gradient_checkpointing()
    model.train()


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


def build_engine(model: torch.nn.Module, ds_config: dict[str, Any], run: RunConfig) -> Any:
    """deepspeed.initialize with the trainable parameters; DeepSpeed builds AdamW (CPU Adam when
    the optimizer is offloaded) and steps the LR schedule at every optimizer step."""
    import deepspeed

    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise ZerotrainError("nothing to train: no parameter requires a gradient (check training.lora.target_modules)")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=ds_config,
                                           lr_scheduler=partial(make_scheduler, run=run))
    return engine
