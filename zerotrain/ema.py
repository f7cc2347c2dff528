"""An exponential moving average (EMA) of the trainable weights that never needs the full model
on one GPU: each rank keeps, in fp32 on the host, the EMA of exactly the part of each trainable
parameter that its own optimizer partition owns (its fp32 master fragment), and updates it after
every optimizer step from that fragment alone, with no collective.

Where the master fragments are, by DeepSpeed optimizer (all of DeepSpeed 0.19's bf16 paths; reached
through deepspeed_compat.master_fragments, the only module that touches DeepSpeed's private state):

- ZeRO-1/2 (DeepSpeedZeroOptimizer) and BF16_Optimizer: each trainable parameter's
  `_hp_mapping` (deepspeed/utils/tensor_fragment.py) names the slice of the flattened parameter
  this rank owns (lp_fragment_address) and is a view of its fp32 master (get_hp_fragment()).
  Parameters outside the rank's partition have `_hp_mapping = None`. The bf16 weights the forward
  uses are whole on every rank; the optimizer refreshes them from the masters with
  `update_lp_params()` (copy fp32 -> bf16 partition, all-gather), the call DeepSpeed makes itself
  after loading a universal checkpoint.
- ZeRO-3 (DeepSpeedZeroOptimizer_Stage3): rank r (optimizer._get_param_partition_rank) owns
  elements [r*p, r*p + p) of each flattened parameter, p = param.ds_tensor.ds_numel (the last
  rank's tail is padding), read and written with deepspeed.utils.safe_get_local_fp32_param /
  safe_set_local_fp32_param. The bf16 partition is param.ds_tensor, gathered in forward. Its
  step releases every gathered parameter (_partition_all_parameters), copies each fp32 partition
  into the bf16 one, and re-gathers the persistent parameters (small ones, kept gathered); the
  EMA does the same. (Without the release, a parameter still gathered keeps its old values.)
- ZeRO-0 (FP16_Optimizer with flat fp32 groups, or FP16_UnfusedOptimizer, running in bf16; the
  engine picks these when bf16 runs without ZeRO and without fp32 gradient accumulation): every
  rank holds every master whole, so every rank keeps the whole EMA (host memory comparable to what
  the GPU already holds replicated), rank 0 alone saves it, and the bf16 weights are copied from
  the masters as that optimizer's step copies them.

CPU offload of the optimizer (and under ZeRO-3 of the parameters) works unchanged: the masters are
then on the host already. NVMe offload of either is refused: the masters are not resident there.
Each update copies this rank's masters to the host (one device-to-host copy of 4 bytes per owned
element, per step); the EMA takes 4 bytes per owned element of host memory, twice that inside
applied().

`applied()` swaps the EMA into the weights the forward computes with and puts the trained ones
back exactly: the trained master fragments are copied to the host, the EMA written into the
masters and propagated to the bf16 weights as the optimizer propagates a step; on exit the trained
masters go back and are propagated the same way. The bf16 weights are always the bf16 rounding of
the masters (DeepSpeed keeps that invariant at initialisation, after each step and after loading),
so re-deriving them restores them bit for bit; applied() checks the invariant first.

On disk, <checkpoint>/ema-<rank>.pt holds each rank's fragments with where they sit in their
parameter ({name: {offset, numel, shape, tensor}}), plus decay, start step, last step and world
size. Full tensors are rebuilt from the files alone (ema_state_dict, no DeepSpeed, no process
group), checking that every element is covered exactly once; load() takes, for each fragment of
the running layout, the matching range out of the files, so a checkpoint saved by another world
size or ZeRO stage loads too."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from zerotrain.deepspeed_compat import MasterFragments, Span, master_fragments
from zerotrain.errors import ZerotrainError

FORMAT = 1
FILE_PATTERN = re.compile(r"ema-(\d+)\.pt")


def ema_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"ema-{rank}.pt"


def total(shape: Iterable[int]) -> int:
    n = 1
    for dim in shape:
        n *= int(dim)
    return n


def check_coverage(name: str, intervals: Iterable[tuple[int, int]], start: int, end: int) -> None:
    """The half-open intervals must tile [start, end) exactly once (no gap, no overlap)."""
    position = start
    for lo, hi in sorted(intervals):
        if lo > position:
            raise ZerotrainError(f"EMA of {name}: elements {position}..{lo - 1} are in no ema-*.pt file "
                                 "(a rank's file is missing or was written by another run)")
        if lo < position:
            raise ZerotrainError(f"EMA of {name}: elements {lo}..{min(hi, position) - 1} are in more than one "
                                 "ema-*.pt file (files of different runs mixed in one checkpoint)")
        position = hi
    if position < end:
        raise ZerotrainError(f"EMA of {name}: elements {position}..{end - 1} are in no ema-*.pt file "
                             "(a rank's file is missing or was written by another run)")


def overlap(span: Span, offset: int, numel: int) -> tuple[int, int] | None:
    """The part [lo, hi) of the flattened parameter that `span` and [offset, offset + numel) share."""
    lo, hi = max(span.offset, offset), min(span.end, offset + numel)
    return (lo, hi) if lo < hi else None


def fill_span(out: torch.Tensor, span: Span, fragments: Iterable[Mapping[str, Any]]) -> None:
    """Fill `out` (1-D, span.numel) with the elements of `span` taken out of saved fragments of the
    same parameter ({offset, numel, shape, tensor}, laid out by any partitioning); every element
    must come from exactly one of them."""
    covered = []
    for fragment in fragments:
        if tuple(fragment["shape"]) != span.shape:
            raise ZerotrainError(f"EMA of {span.name}: saved with shape {tuple(fragment['shape'])}, the parameter "
                                 f"has {span.shape}")
        shared = overlap(span, fragment["offset"], fragment["numel"])
        if shared is not None:
            lo, hi = shared
            out[lo - span.offset:hi - span.offset].copy_(fragment["tensor"][lo - fragment["offset"]:hi - fragment["offset"]])
            covered.append(shared)
    check_coverage(span.name, covered, span.offset, span.end)


def ema_step(ema: torch.Tensor, master: torch.Tensor, step: int, start_step: int, decay: float) -> None:
    """Fold the master weights after optimizer step `step` into `ema` (in place): a copy up to
    start_step, then ema = decay * ema + (1 - decay) * master."""
    if step <= start_step:
        ema.copy_(master)
    else:
        ema.lerp_(master, 1.0 - decay)


def read_files(checkpoint: Path) -> list[dict[str, Any]]:
    """Every ema-<rank>.pt of a checkpoint, memory-mapped (tensors are read when touched), after
    checking that they belong together: one file per rank of the saving run, same format, decay,
    start step and step."""
    checkpoint = Path(checkpoint)
    paths = {int(m.group(1)): checkpoint / m.group(0)
             for m in (FILE_PATTERN.fullmatch(p.name) for p in checkpoint.glob("ema-*.pt")) if m}
    if not paths:
        raise ZerotrainError(f"{checkpoint}: holds no EMA (no ema-<rank>.pt); it was saved without ema.enabled")
    payloads = []
    for rank in sorted(paths):
        try:
            payload = torch.load(paths[rank], map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # torch raises assorted types for a damaged file
            raise ZerotrainError(f"{paths[rank]}: cannot read the EMA ({' '.join(str(err).split())[:200]})") from err
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise ZerotrainError(f"{paths[rank]}: not a zerotrain EMA file of format {FORMAT}")
        payloads.append(payload)
    for key in ("world_size", "decay", "start_step", "step"):
        values = {p[key] for p in payloads}
        if len(values) > 1:
            raise ZerotrainError(f"{checkpoint}: the ema-*.pt files disagree on {key} ({sorted(values)}): they come "
                                 "from different saves")
    world = payloads[0]["world_size"]
    if sorted(paths) != list(range(world)):
        raise ZerotrainError(f"{checkpoint}: the EMA was saved by {world} rank(s) but holds the files of ranks "
                             f"{sorted(paths)}")
    return payloads


def by_name(payloads: Iterable[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Every saved fragment, grouped by parameter name."""
    pieces: dict[str, list[dict[str, Any]]] = {}
    for payload in payloads:
        for name, fragment in payload["fragments"].items():
            pieces.setdefault(name, []).append(fragment)
    return pieces


def reassemble(payloads: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Full fp32 tensors, by parameter name, from the fragments of every rank's payload."""
    full = {}
    for name, fragments in by_name(payloads).items():
        shape = tuple(fragments[0]["shape"])
        flat = torch.empty(total(shape), dtype=torch.float32)
        fill_span(flat, Span(name, shape, 0, flat.numel()), fragments)
        full[name] = flat.view(shape)
    return full


def ema_state_dict(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Offline (no engine, no process group): the full fp32 EMA of every trainable parameter of the
    run that saved `checkpoint`, by the names of engine.module.named_parameters(), shaped like it."""
    return reassemble(read_files(checkpoint))


def _offload_device(setting: Any) -> str:
    device = getattr(setting, "device", None)
    return str(getattr(device, "value", device) or "none")


def _masters(engine: Any, rank: int) -> MasterFragments:
    """The master-fragment access for this engine's optimizer, or a ZerotrainError naming what is
    not supported."""
    stage = engine.zero_optimization_stage()
    for what, setting in (("offload_optimizer", engine.zero_offload_optimizer()),
                          ("offload_param", engine.zero_offload_param())):
        if _offload_device(setting) == "nvme":
            raise ZerotrainError(f"ema.enabled: not supported with ZeRO-{stage} {what} to NVMe (the fp32 master "
                                 "weights the EMA follows are swapped out); offload to cpu, or disable ema")
    return master_fragments(engine, rank)


class ShardedEMA:
    """EMA of this rank's fp32 master fragments, on the host. Every rank constructs it after
    deepspeed.initialize (and before or after loading a checkpoint) and calls update() after each
    optimizer step. It starts as a copy of the current weights."""

    def __init__(self, engine: Any, decay: float, start_step: int):
        if not 0.0 < decay < 1.0:
            raise ZerotrainError(f"ema.decay={decay}: must be between 0 and 1 (exclusive)")
        self.decay = float(decay)
        self.start_step = int(start_step)
        self.step = 0
        self.world_size = int(engine.dp_world_size)
        self.names = [name for name, p in engine.module.named_parameters() if p.requires_grad]
        self._masters = _masters(engine, int(engine.global_rank))
        with torch.no_grad():
            self._ema = [self._masters.read(i).to("cpu", torch.float32, copy=True)
                         for i in range(len(self._masters.spans))]

    def fragments(self) -> list[tuple[Span, torch.Tensor]]:
        """This rank's EMA fragments (host fp32, 1-D; the live tensors)."""
        return list(zip(self._masters.spans, self._ema, strict=True))

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Fold in the masters after optimizer step `step` (the new global step): a copy up to
        start_step, then ema = decay * ema + (1 - decay) * master."""
        for i, ema in enumerate(self._ema):
            ema_step(ema, self._masters.read(i).to("cpu", torch.float32), step, self.start_step, self.decay)
        self.step = int(step)

    def save(self, checkpoint: Path, rank: int) -> Path:
        """Write this rank's fragments to checkpoint/ema-<rank>.pt (atomically). Every rank calls
        this; rank 0 also removes the files of ranks this run does not have (left in the folder by
        an earlier save of the same step on more ranks)."""
        if rank == 0:
            for stale in Path(checkpoint).glob("ema-*.pt"):
                match = FILE_PATTERN.fullmatch(stale.name)
                if match and int(match.group(1)) >= self.world_size:
                    stale.unlink(missing_ok=True)
        fragments = {span.name: {"offset": span.offset, "numel": span.numel, "shape": list(span.shape),
                                 "tensor": ema}
                     for span, ema, saved in zip(self._masters.spans, self._ema, self._masters.saved, strict=True)
                     if saved}
        payload = {"format": FORMAT, "decay": self.decay, "start_step": self.start_step, "step": self.step,
                   "rank": rank, "world_size": self.world_size, "fragments": fragments}
        path = ema_file(Path(checkpoint), rank)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
        return path

    @torch.no_grad()
    def load(self, checkpoint: Path) -> None:
        """Take this rank's fragments out of a checkpoint's ema-*.pt files, whatever world size or
        ZeRO stage saved them, and the last step folded in; decay and start step stay this
        object's (the run's config). Every rank calls this (no collective); each reads every file,
        memory-mapped, touching only the ranges it needs."""
        payloads = read_files(checkpoint)
        saved = by_name(payloads)
        missing, extra = sorted(set(self.names) - set(saved)), sorted(set(saved) - set(self.names))
        if missing or extra:
            raise ZerotrainError(f"{checkpoint}: its EMA is of other parameters than this run trains "
                                 f"(missing {len(missing)}, e.g. {missing[:3]}; unexpected {len(extra)}, e.g. "
                                 f"{extra[:3]}); was it saved with another training.mode or LoRA setting?")
        for span, ema in zip(self._masters.spans, self._ema, strict=True):
            fill_span(ema, span, saved[span.name])
        self.step = int(payloads[0]["step"])

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Inside, the engine's model computes with the EMA weights (bf16-rounded); on exit the
        trained weights are back bit for bit. Every rank enters and leaves together (collectives)."""
        masters = self._masters
        mismatched = [masters.spans[i].name for i in range(len(masters.spans)) if not masters.lp_matches(i)]
        if any_rank(bool(mismatched)):
            raise ZerotrainError("ema: the bf16 weights are not the rounding of the fp32 master weights "
                                 f"(e.g. {mismatched[:3]}), so they could not be restored exactly after "
                                 "rendering with the EMA; render after an optimizer step or a checkpoint load")
        with torch.no_grad():
            trained = [masters.read(i).to("cpu", torch.float32, copy=True) for i in range(len(masters.spans))]
            for i, ema in enumerate(self._ema):
                masters.write(i, ema)
        try:
            masters.refresh()
            yield
        finally:
            with torch.no_grad():
                for i, value in enumerate(trained):
                    masters.write(i, value)
            masters.refresh()


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (every rank calls this; True/False alone without a process group)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    tensor = torch.tensor([int(flag)], device=get_accelerator().current_device_name())
    comm.all_reduce(tensor, op=comm.ReduceOp.MAX)
    return bool(tensor.item())
