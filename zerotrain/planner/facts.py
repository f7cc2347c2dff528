"""Model facts: what the planner knows about a model for one mode and resolution, and their
disk cache. Measuring them (zerotrain.planner.trace) needs torch, diffusers and peft; reading
cached facts needs none of them, so a second plan is instant."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotrain.config.sections import Mode, RunConfig
from zerotrain.models.families import DEFAULT_TEXT_TOKENS, LORA_TARGETS, check_resolution

if TYPE_CHECKING:
    from zerotrain.models.catalog import ModelSpec

# Bump when the measurement changes, so cached facts from older code are not reused.
FACTS_VERSION = 5


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
    trace_seconds: float = 0.0
    cached: bool = field(default=False, compare=False)

    @property
    def model_flops_per_sample(self) -> float:
        """Training FLOPs without recomputation: the numerator of MFU."""
        return self.no_checkpointing.flops

    def activations(self, gradient_checkpointing: bool) -> ActivationFacts:
        return self.checkpointing if gradient_checkpointing else self.no_checkpointing

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("cached")
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelFacts:
        data = dict(data)
        data["no_checkpointing"] = ActivationFacts(**data["no_checkpointing"])
        data["checkpointing"] = ActivationFacts(**data["checkpointing"])
        return cls(**data)


def lora_targets(spec: ModelSpec, run: RunConfig) -> list[str]:
    return run.training.lora.target_modules or LORA_TARGETS[spec.family]


def facts_key(spec: ModelSpec, run: RunConfig, text_tokens: int) -> str:
    """Everything the measurement depends on: the architecture (not its name or location),
    resolution, conditioning length, mode, and the versions of the code that builds the model."""
    lora = run.training.mode is Mode.lora
    payload = {
        "version": FACTS_VERSION, "class": spec.class_name, "config": spec.config,
        "vae_scale_factor": spec.vae_scale_factor,
        "resolution": run.data.resolution, "text_tokens": text_tokens, "mode": run.training.mode.value,
        "quantize": run.training.quantize_base.value,
        "lora": run.training.lora.model_dump(mode="json") if lora else None,
        "targets": lora_targets(spec, run) if lora else None,
        "versions": [version(name) for name in ("torch", "diffusers", "peft")],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "zerotrain" / "facts"


def measure_model(spec: ModelSpec, run: RunConfig, cache: bool = True) -> ModelFacts:
    """Facts for this run's model, mode and resolution: from the disk cache when present,
    otherwise measured on the meta device and cached (written atomically)."""
    check_resolution(spec, run.data.resolution)
    text_tokens = run.data.text_tokens or DEFAULT_TEXT_TOKENS[spec.family]
    cache_dir = run.planner.cache_dir or default_cache_dir()
    cache_file = cache_dir / f"{facts_key(spec, run, text_tokens)}.json"
    if cache and cache_file.is_file():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            facts = ModelFacts.from_json(json.loads(cache_file.read_text()))
            # The key is the architecture, so the same facts serve a catalog name and a folder.
            return dataclasses.replace(facts, model=spec.name, cached=True)
    from zerotrain.planner.trace import measure

    facts = measure(spec, run, text_tokens)
    if cache:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{time.monotonic_ns()}")
        tmp.write_text(json.dumps(facts.to_json(), indent=1))
        tmp.replace(cache_file)
    return facts
