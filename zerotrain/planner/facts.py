"""Model facts: what the planner knows about a model for one mode and resolution. Measuring them
(zerotrain.planner.trace) needs torch, diffusers and peft; zerotrain.planner.measure caches them
and ships those of the catalog models (pack_facts), and reading them needs none of those, so a
plan of a catalog model, or a second plan of any model, is instant."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ActivationFacts:
    """Per-sample activation memory of one training forward+backward, with a given checkpointing."""

    saved_bytes: int
    """Held from the end of forward into backward (what autograd saved)."""
    forward_peak_bytes: int
    """Highest live activation bytes during forward."""
    backward_peak_bytes: int
    """Highest live activation bytes during backward, including recomputation and gradients of
    activations; parameter gradients are excluded (ZeRO moves them into its buckets)."""
    flops: float
    """FLOPs of forward + backward (+ recomputation when checkpointing)."""

    @property
    def peak_bytes(self) -> int:
        return max(self.forward_peak_bytes, self.backward_peak_bytes)


@dataclass
class CheckpointUnit:
    """Blocks that cost the same under activation checkpointing (one structural group of a DiT's
    blocks, or one UNet block): what checkpointing one of them frees and adds, per sample."""

    names: list[str]
    """The blocks, as zerotrain.recompute.checkpoint_units names them."""
    freed_bytes: int
    """Saved activation bytes one block no longer holds into backward when checkpointed (it keeps
    its inputs only)."""
    recompute_flops: float
    """FLOPs its recomputation in backward adds."""


@dataclass
class ModelFacts:
    """Everything the planner needs to know about the model, for one mode and resolution."""

    model: str
    class_name: str
    family: str
    resolution: int
    mode: str
    quantize: str
    lora_rank: int | None
    total_params: int
    trainable_params: int
    frozen_params: int
    frozen_bytes: int
    """Bytes of the frozen parameters as stored: bf16, or quantized weights plus scales."""
    buffer_bytes: int
    """Registered buffers (replicated on every GPU; ZeRO does not partition buffers)."""
    largest_layer_params: int
    """Most parameters held directly by one module (DeepSpeed's definition in model_to_params)."""
    block_params: dict[str, int]
    param_numels: list[int]
    """Size of every parameter, for ZeRO-3's persistence threshold."""
    largest_trainable_param: int
    """Elements of the largest trainable tensor."""
    image_tokens: int
    text_tokens: int
    input_bytes: int
    """One sample's conditioning tensors as fed to the denoiser (latents, embeddings, ids)."""
    no_checkpointing: ActivationFacts
    checkpointing: ActivationFacts
    checkpoint_units: list[CheckpointUnit] = field(default_factory=list)
    """The blocks partial checkpointing can choose, best first: the most activation bytes freed
    per FLOP recomputed. Checkpointing k blocks means the first k of checkpoint_order()."""
    offload_input_bytes: list[int] = field(default_factory=list)
    """With every block checkpointed: each checkpoint input activation offload moves to the host
    (zerotrain.recompute.offloaded), once however many blocks it feeds, in bytes per sample."""
    offload_largest_call: int = 0
    """The most of those bytes one block takes (brought back to the GPU for its recomputation)."""
    reference_tokens: int = 0
    """Edit training: the reference images' tokens appended after the image tokens in the trace."""
    module_largest_params: list[int] = field(default_factory=list)
    """For every module that holds parameters itself (not through its children), the elements of
    its largest one, sorted. ZeRO-3 fetches a module's own parameters around each of its calls
    (DeepSpeed's iter_params(module, recurse=False)) unless every one is at most
    stage3_param_persistence_threshold, which keeps it gathered (fetched_modules)."""
    trace_seconds: float = 0.0
    cached: bool = field(default=False, compare=False)
    source: str = field(default="traced", compare=False)
    """Where these facts came from for this plan: "traced" (on the meta device now), "cached" (the
    user's facts cache) or "shipped" (with zerotrain)."""

    @property
    def model_flops_per_sample(self) -> float:
        """Training FLOPs without recomputation: the numerator of MFU."""
        return self.no_checkpointing.flops

    @property
    def checkpoint_blocks(self) -> int:
        """How many blocks partial checkpointing chooses among."""
        return sum(len(unit.names) for unit in self.checkpoint_units)

    def fetched_modules(self, persistence_threshold: int) -> int:
        """The modules whose parameters ZeRO-3 gathers and releases around each call: those holding a
        parameter above the persistence threshold (DeepSpeed 0.19.8 mark_persistent_parameters keeps
        the others gathered, and a module with nothing to gather waits for nothing)."""
        return sum(1 for n in self.module_largest_params if n > persistence_threshold)

    def checkpoint_order(self) -> list[str]:
        """Every checkpointable block, best first."""
        return [name for unit in self.checkpoint_units for name in unit.names]

    def activations(self, gradient_checkpointing: bool, blocks: int | None = None,
                    offload: bool = False) -> ActivationFacts:
        """Activations without checkpointing, with every block checkpointed (blocks None, or all of
        them), or with the first `blocks` of checkpoint_order(): the saved bytes less what those
        blocks free, the FLOPs plus their recomputation, and the larger transient of the two
        extremes on top (one block's recomputation at most; the activation gradients).
        offload (every block checkpointed): its inputs on the host instead (offload_input_bytes),
        and one block's back on the GPU for its recomputation on top of each peak."""
        if not gradient_checkpointing or blocks == 0:
            return self.no_checkpointing
        if blocks is None or blocks >= self.checkpoint_blocks:
            if not offload:
                return self.checkpointing
            every, moved = self.checkpointing, sum(self.offload_input_bytes)
            back = self.offload_largest_call - moved
            return ActivationFacts(saved_bytes=every.saved_bytes - moved, flops=every.flops,
                                   forward_peak_bytes=every.forward_peak_bytes + back,
                                   backward_peak_bytes=every.backward_peak_bytes + back)
        freed, recompute, left = 0, 0.0, blocks
        for unit in self.checkpoint_units:
            n = min(left, len(unit.names))
            freed += n * unit.freed_bytes
            recompute += n * unit.recompute_flops
            left -= n
        none, every = self.no_checkpointing, self.checkpointing
        saved = max(none.saved_bytes - freed, every.saved_bytes)
        return ActivationFacts(
            saved_bytes=saved,
            forward_peak_bytes=saved + max(none.forward_peak_bytes - none.saved_bytes,
                                           every.forward_peak_bytes - every.saved_bytes),
            backward_peak_bytes=saved + max(none.backward_peak_bytes - none.saved_bytes,
                                            every.backward_peak_bytes - every.saved_bytes),
            flops=min(none.flops + recompute, every.flops),
        )

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("cached")
        data.pop("source")
        if not data["reference_tokens"]:  # text-to-image facts keep the form they were shipped in
            data.pop("reference_tokens")
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelFacts:
        data = dict(data)
        data["no_checkpointing"] = ActivationFacts(**data["no_checkpointing"])
        data["checkpointing"] = ActivationFacts(**data["checkpointing"])
        data["checkpoint_units"] = [CheckpointUnit(**unit) for unit in data.get("checkpoint_units", [])]
        return cls(**data)


def pack_facts(facts: dict[str, ModelFacts]) -> dict[str, Any]:
    """Facts under their keys as compact JSON: each distinct set of block_params, param_numels and
    module_largest_params is stored once (they depend on the mode and LoRA settings, not on the
    resolution), the lists as [numel, count] runs of equal sizes. trace_seconds is left out: it is
    the measuring machine's."""
    parameters: list[dict[str, Any]] = []
    packed = {}
    for key, one in facts.items():
        data = one.to_json()
        del data["trace_seconds"]
        shared = {"block_params": data.pop("block_params"), "param_numels": runs(data.pop("param_numels")),
                  "checkpoint_names": [unit.pop("names") for unit in data["checkpoint_units"]],
                  "module_largest_params": runs(data.pop("module_largest_params"))}
        if shared not in parameters:
            parameters.append(shared)
        packed[key] = {**data, "parameters": parameters.index(shared)}
    return {"parameters": parameters, "facts": packed}


def unpack_facts(data: dict[str, Any], key: str) -> ModelFacts | None:
    """The facts pack_facts stored under this key, if any."""
    entry = data["facts"].get(key)
    if entry is None:
        return None
    entry = dict(entry)
    shared = data["parameters"][entry.pop("parameters")]
    units = [{**unit, "names": list(names)} for unit, names in zip(entry.pop("checkpoint_units", []),
                                                                     shared.get("checkpoint_names", []), strict=True)]
    return ModelFacts.from_json({**entry, "block_params": dict(shared["block_params"]), "checkpoint_units": units,
                                 "param_numels": expand(shared["param_numels"]),
                                 "module_largest_params": expand(shared.get("module_largest_params", []))})


def runs(values: list[int]) -> list[list[int]]:
    """[7, 7, 9] -> [[7, 2], [9, 1]]."""
    return [[n, len(list(run))] for n, run in itertools.groupby(values)]


def expand(packed: list[list[int]]) -> list[int]:
    """runs() undone."""
    return [n for n, count in packed for _ in range(count)]


