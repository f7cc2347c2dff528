"""The optimizers (optimizer.name), as a registry: what each keeps per parameter, how the planner
counts it, and, for the client optimizers, how zerotrain builds them. The rest of zerotrain asks
get(name) and never compares names. DeepSpeed's own AdamW (adamw, adamw-bf16) comes from the
JSON's "optimizer" section; the client optimizers are built here and handed to deepspeed.initialize.

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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # a plan imports this module, and a plan needs no torch
    import torch

BF16, FP32 = 2, 4  # bytes of an element
# bitsandbytes' 8-bit AdamW (optim/optimizer.py Optimizer8bit, functional.py, 0.50): each moment is
# one uint8 per element with one fp32 absmax per block of 256 elements (blockwise quantization) and
# a 256-entry fp32 code book (qmap); a tensor of fewer than min_8bit_size = 4096 elements keeps
# fp32 moments instead.
BNB_BLOCK = 256
BNB_MIN_8BIT = 4096
BNB_QMAP = 256 * FP32
LARGE_TENSOR = 2**20  # elements: a tensor whose state costs what a large partition's does per element


@dataclass(frozen=True)
class Optimizer:
    """One optimizer.name. DeepSpeed's AdamW (FusedAdam, or DeepSpeedCPUAdam when offloaded) unless
    `client_class` names the class zerotrain builds."""

    name: str
    master_element: int
    """Bytes of one master weight and of its gradient at the step: fp32, or bf16 (DeepSpeed's
    bf16_master_weights_and_grads)."""
    step_bytes: int
    """Bytes one step reads and writes per trainable parameter on the GPU (its time term, memory
    bandwidth bound), counted from each implementation (see OPTIMIZERS)."""
    numerics: str
    """What it changes against fp32 AdamW, in words."""
    client_class: str | None = None

    @property
    def client(self) -> bool:
        """Built by zerotrain and handed to deepspeed.initialize; steps on the GPU only (DeepSpeed
        keeps bf16 masters for an offloaded optimizer only with its own CPU Adam), and resumes on
        the same number of GPUs only (no universal conversion of its state)."""
        return self.client_class is not None

    @property
    def bf16_masters(self) -> bool:
        return self.master_element == BF16

    @property
    def needs_zero(self) -> bool:
        """bf16 masters need ZeRO 1-3: without ZeRO DeepSpeed wraps FusedAdam in FP16_Optimizer."""
        return self.bf16_masters

    def state_bytes(self, numel: int) -> int:
        """The optimizer state of one tensor of `numel` elements, as the optimizer allocates it:
        AdamW's exp_avg and exp_avg_sq like the master (bf16 ones with adamw-bf16: the basic
        optimizer allocates them like the master; offloaded, DeepSpeed builds DeepSpeedCPUAdam with
        fp32_optimizer_states=False, engine.get_optimizer_configuration)."""
        return 2 * self.master_element * numel

    def step_transient(self, largest: int) -> int:
        """What one step allocates for itself on the GPU, its largest tensor having `largest`
        elements. FusedAdam and bitsandbytes' 8-bit kernel update in place: nothing."""
        return 0

    def training_bytes_per_param(self) -> float:
        """Bytes per trainable parameter while training: the checkpoint's and the bf16 gradient."""
        return BF16 + self.checkpoint_bytes_per_param()

    def checkpoint_bytes_per_param(self) -> float:
        """Bytes a checkpoint holds per trainable parameter: the bf16 module weights, the master and
        the optimizer state (a large tensor's)."""
        return BF16 + self.master_element + self.state_bytes(LARGE_TENSOR) / LARGE_TENSOR


@dataclass(frozen=True)
class AdamW8bit(Optimizer):
    def state_bytes(self, numel: int) -> int:
        """bitsandbytes' state1 and state2 (uint8) with their absmax (fp32 per BNB_BLOCK elements)
        and qmap; fp32 moments below BNB_MIN_8BIT elements."""
        if numel < BNB_MIN_8BIT:
            return 2 * FP32 * numel
        return 2 * (numel + FP32 * -(-numel // BNB_BLOCK) + BNB_QMAP)


@dataclass(frozen=True)
class Adafactor(Optimizer):
    def state_bytes(self, numel: int) -> int:
        """The flat partitions DeepSpeed hands it are 1-D, so transformers' Adafactor keeps the
        unfactored exp_avg_sq, fp32 (zeros_like the fp32 gradient), and a 0-d RMS; with beta1 None
        (zerotrain's setting, as the paper's) there is no first moment."""
        return FP32 * numel

    def step_transient(self, largest: int) -> int:
        """transformers' Adafactor.step works on fp32 copies of the largest tensor it steps: the
        gradient (grad.float()), the master (p.float()), update = grad**2 + eps and
        exp_avg_sq.rsqrt() beside it before the old update is dropped: 4 x FP32 per element."""
        return 4 * FP32 * largest


# In planner.optimizers' order of preference. step_bytes, counted from each implementation:
# - adamw: FusedAdam reads the fp32 gradient, master and two moments and writes the master and
#   moments (28); DeepSpeed then copies the master into the bf16 parameter (4 + 2).
# - adamw-bf16: the same in bf16 (14), then the copy (2 + 2).
# - adamw-8bit: bitsandbytes' fused kernel reads the bf16 gradient and master and the two uint8
#   moments and writes master and moments (10), then the copy (4).
# - adafactor: transformers' Adafactor.step runs unfused on fp32 copies, about 24 passes of 4 bytes
#   over the partition (grad.float(), p.float(), the two RMS, grad**2 + eps, the moment update,
#   rsqrt, the clip, lr, weight decay, the update, the copy back), then the copy (4).
OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    Optimizer("adamw", FP32, 34, "fp32 master weights and moments"),
    Optimizer("adamw-bf16", BF16, 18, "bf16 master weights and moments instead of fp32"),
    AdamW8bit("adamw-8bit", BF16, 14, "bf16 master weights and 8-bit moments instead of fp32; resumes on the "
              "same GPU count only", client_class="bitsandbytes.optim.AdamW8bit"),
    Adafactor("adafactor", BF16, 100, "bf16 masters and no first moment instead of fp32 AdamW; resumes on the "
              "same GPU count only", client_class="transformers.optimization.Adafactor"),
)}
CLIENT_OPTIMIZERS = tuple(name for name, o in OPTIMIZERS.items() if o.client)


def get(name: str) -> Optimizer:
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"optimizer.name={name}: not one of {', '.join(OPTIMIZERS)}") from None


def client_settings(name: str, run: Any) -> dict[str, Any]:
    """What zerotrain builds for a client optimizer, as written into the DeepSpeed JSON."""
    opt = run.optimizer
    kind = get(name)
    if not kind.client:
        raise ValueError(f"{name} is not a client optimizer ({', '.join(CLIENT_OPTIMIZERS)})")
    if isinstance(kind, AdamW8bit):
        params = {"lr": opt.lr, "betas": list(opt.betas), "eps": opt.eps, "weight_decay": opt.weight_decay}
    else:
        params = {"lr": opt.lr, "weight_decay": opt.weight_decay, "beta1": None, "relative_step": False,
                  "scale_parameter": False, "warmup_init": False, "clip_threshold": 1.0, "decay_rate": -0.8,
                  "eps": [1e-30, 1e-3]}
    return {"name": name, "class": kind.client_class, "params": params}


def build(settings: dict[str, Any], params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The client optimizer a DeepSpeed JSON's "_zerotrain" names (client_settings)."""
    kwargs = dict(settings["params"])
    if isinstance(get(settings["name"]), AdamW8bit):
        import bitsandbytes

        kwargs["betas"] = tuple(kwargs["betas"])
        return bitsandbytes.optim.AdamW8bit(params, **kwargs)
    kwargs["eps"] = tuple(kwargs["eps"])
    return _exact_resume_adafactor()(params, **kwargs)


def _exact_resume_adafactor() -> type:
    """transformers' Adafactor whose load_state_dict keeps the saved state's dtypes. torch's
    Optimizer.load_state_dict casts floating state to its parameter's dtype, so a bf16 master's fp32
    exp_avg_sq and RMS came back bf16 and a resumed run left the uninterrupted one's losses from its first step."""
    import torch
    from transformers.optimization import Adafactor as TransformersAdafactor

    class ExactResumeAdafactor(TransformersAdafactor):
        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            saved = {key: dict(value) for key, value in state_dict["state"].items()}
            super().load_state_dict(state_dict)
            ids = [i for group in state_dict["param_groups"] for i in group["params"]]
            params = [p for group in self.param_groups for p in group["params"]]
            for i, param in zip(ids, params, strict=True):
                for key, value in saved.get(i, {}).items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point():
                        self.state[param][key] = value.to(param.device, copy=True)

    return ExactResumeAdafactor


def name_of(optimizer: Any) -> str:
    """The optimizer.name a DeepSpeed engine's optimizer trains with (zerotrain_state.json)."""
    import torch

    from zerotrain.deepspeed_compat import master_dtype

    basic = getattr(optimizer, "optimizer", optimizer)
    for o in OPTIMIZERS.values():  # the client class, or a class of zerotrain's built on it
        if o.client_class and any(cls.__name__ == o.client_class.rsplit(".", 1)[1]
                                  and cls.__module__.split(".")[0] == o.client_class.split(".")[0]
                                  for cls in type(basic).__mro__):
            return o.name
    return deepspeed_adamw(bf16_masters=master_dtype(optimizer) == torch.bfloat16)


def deepspeed_adamw(bf16_masters: bool) -> str:
    """The name of DeepSpeed's own AdamW with fp32 or bf16 master weights."""
    element = BF16 if bf16_masters else FP32
    return next(o.name for o in OPTIMIZERS.values() if not o.client and o.master_element == element)
