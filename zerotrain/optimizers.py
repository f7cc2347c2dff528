"""The client optimizers: those zerotrain builds and hands to deepspeed.initialize, where DeepSpeed
has none of its own. DeepSpeed's own AdamW (optimizer.name adamw, adamw-bf16) comes from the JSON's
"optimizer" section instead.

- adamw-8bit: bitsandbytes' AdamW8bit (blockwise 8-bit moments, Dettmers et al. 2022). Chosen over
  torchao's low-bit AdamW because it works as a DeepSpeed client optimizer at every ZeRO stage,
  checkpoints included: torchao's quantizes a tensor only when its size is a multiple of its block,
  which ZeRO 1/2's flat partitions rarely are (a silent fp32 fallback), fails at the first step when
  DeepSpeed links the partitions to the parameters (its state cannot be sliced at arbitrary
  offsets), and compiles every step with torch.compile. bitsandbytes updates with one fused kernel
  (CUDA; plain C++ on the CPU).
- adafactor: transformers' Adafactor with an external learning rate (relative_step, scale_parameter
  and warmup_init off, as for fine-tuning) and no first moment (beta1 None).

Both step DeepSpeed's bf16 master weights (bf16_master_weights_and_grads, bf16_optimizer_states), at
ZeRO 1-3 with the optimizer on the GPU: DeepSpeed keeps bf16 masters for an offloaded optimizer only
with its own CPU Adam, so offloaded they would hold fp32 masters and gradients on the host (12 bytes
per parameter and more), above adamw-bf16's offload. Neither has DeepSpeed's per-parameter state
layout, so a checkpoint of theirs resumes on the same number of GPUs only (no universal
conversion). DeepSpeed hands them flat 1-D partitions, so Adafactor cannot factor its second moment
(it keeps the full one) and its RMS scaling and update clipping span a whole partition."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerotrain.planner.memory import CLIENT_OPTIMIZERS

if TYPE_CHECKING:  # a plan imports this module, and a plan needs no torch
    import torch


def client_settings(name: str, run: Any) -> dict[str, Any]:
    """What zerotrain builds for a client optimizer, as written into the DeepSpeed JSON."""
    opt = run.optimizer
    if name == "adamw-8bit":
        return {"name": name, "class": "bitsandbytes.optim.AdamW8bit",
                "params": {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}}
    if name == "adafactor":
        return {"name": name, "class": "transformers.optimization.Adafactor",
                "params": {"lr": opt.lr, "weight_decay": opt.weight_decay, "beta1": None, "relative_step": False,
                           "scale_parameter": False, "warmup_init": False, "clip_threshold": 1.0,
                           "decay_rate": -0.8, "eps": [1e-30, 1e-3]}}
    raise ValueError(f"{name} is not a client optimizer ({', '.join(CLIENT_OPTIMIZERS)})")


def build(settings: dict[str, Any], params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The client optimizer a DeepSpeed JSON's "_zerotrain" names (client_settings)."""
    kwargs = dict(settings["params"])
    if settings["name"] == "adamw-8bit":
        import bitsandbytes

        kwargs["betas"] = tuple(kwargs["betas"])
        return bitsandbytes.optim.AdamW8bit(params, **kwargs)
    from transformers.optimization import Adafactor

    kwargs["eps"] = tuple(kwargs["eps"])
    return Adafactor(params, **kwargs)


def name_of(optimizer: Any) -> str:
    """The optimizer.name a DeepSpeed engine's optimizer trains with (zerotrain_state.json)."""
    import torch

    basic = getattr(optimizer, "optimizer", optimizer)
    module = type(basic).__module__
    if module.startswith("bitsandbytes"):
        return "adamw-8bit"
    if type(basic).__name__ == "Adafactor":
        return "adafactor"
    master = getattr(optimizer, "master_weights_and_grads_dtype", torch.float32)
    return "adamw-bf16" if master == torch.bfloat16 else "adamw"
