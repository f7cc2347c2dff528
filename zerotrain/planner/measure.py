"""Model facts for a run: from the disk cache, or measured on the meta device (zerotrain.planner.trace,
imported only when a measurement is needed) and cached."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from zerotrain import families
from zerotrain.config.sections import Mode, RunConfig
from zerotrain.planner.facts import ModelFacts, lora_targets

if TYPE_CHECKING:
    from zerotrain.models.catalog import ModelSpec

# Bump when the measurement changes, so cached facts from older code are not reused.
FACTS_VERSION = 5


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
    families.check_resolution(spec, run.data.resolution)
    text_tokens = run.data.text_tokens or families.of(spec).default_text_tokens
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
