"""The master fragments the EMA follows: ZeRO-1/2's per-parameter _hp_mapping, ZeRO-3's partitions, ZeRO-0's
fp32 groups."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zerotrain import versions
from zerotrain.errors import ZerotrainError

if TYPE_CHECKING:  # torch is imported where it is used: the planner reads the gate without it
    import torch

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
