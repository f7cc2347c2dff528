"""Model facts for a run: from the user's disk cache, from the facts shipped for the catalog models
(shipped_facts/, written by `zerotrain regenerate`), or measured on the meta device
(zerotrain.planner.trace, imported only when a measurement is needed) and cached."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import time
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotrain import families
from zerotrain.adapters import measured, targets
from zerotrain.config.sections import Mode, RunConfig
from zerotrain.planner.facts import ModelFacts, unpack_facts
from zerotrain.planner.references import plan_references

if TYPE_CHECKING:
    from zerotrain.protocols import ModelSpec

# Bump when the measurement changes, so cached facts from older code are not reused.
FACTS_VERSION = 9

# Facts of the catalog models, one file per model (see zerotrain.planner.shipped).
SHIPPED_DIR = Path(__file__).with_name("shipped_facts")


def _measurement(spec: ModelSpec, run: RunConfig, text_tokens: int, defaults: dict[str, Any]) -> dict[str, Any]:
    """Everything the measurement depends on: the architecture (not its name or location, nor how its config
    spells the class defaults), resolution, conditioning length, mode, quantization and LoRA settings."""
    lora = run.training.mode is Mode.lora
    references = plan_references(spec, run)
    text_rows = families.of(spec).reference_text_rows(spec, references)
    return {
        "version": FACTS_VERSION, "class": spec.class_name, "config": architecture(spec.config, defaults),
        "vae_scale_factor": spec.vae_scale_factor,
        "resolution": run.data.resolution, "text_tokens": text_tokens, "mode": run.training.mode.value,
        "quantize": run.training.quantize_base.value,
        "lora": measured(run.training.lora) if lora else None,
        "targets": targets(spec, run) if lora else None,
        # only where there are references, so that the keys of text-to-image runs stay as they were
        **({"references": references} if references else {}),
        # the references' rows in the text (Qwen-Image-Edit), traced since these were
        **({"reference_text_rows": text_rows} if text_rows else {}),
    }


def architecture(config: dict[str, Any], defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """A denoiser config as far as it shapes the model and its training: its _class_name, the family it names
    (families.FAMILY_KEY: facts of one family never serve another of the same class) and its arguments,
    without the private keys diffusers writes beside them (_diffusers_version, _name_or_path, ...), which
    from_config ignores, and without the arguments at their class default (`defaults`, as
    shipped.class_defaults records them; None keeps them): diffusers builds an argument left out with its default, and
    save_pretrained writes every argument, so a catalog config that leaves some out and a saved one that
    spells them out are one architecture. So a fine-tune's config.json has its base model's key."""
    kept = ("_class_name", families.FAMILY_KEY)
    defaults = defaults or {}
    return {key: value for key, value in config.items()
            if key in kept or not (key.startswith("_") or (key in defaults and value == defaults[key]))}


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def facts_key(spec: ModelSpec, run: RunConfig, text_tokens: int) -> str:
    """The user cache's key: the measurement and the versions of the code that builds the model. The class
    defaults are those the shipped files record (read without torch); a class none of them has keeps its
    config as written."""
    return _digest({**_measurement(spec, run, text_tokens, shipped_defaults(spec.class_name)),
                    "versions": [version(name) for name in ("torch", "diffusers", "peft")]})


def shipped_key(spec: ModelSpec, run: RunConfig, text_tokens: int, defaults: dict[str, Any]) -> str:
    """The shipped facts' key: the measurement alone, with the class defaults of the file that holds them.
    They were measured once, with the versions their file records, and serve whatever versions are
    installed (tests/unit/test_shipped_facts.py traces a sample again with those)."""
    return _digest(_measurement(spec, run, text_tokens, defaults))


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "zerotrain" / "facts"


@functools.cache
def _shipped_file(name: str) -> dict[str, Any] | None:
    path = SHIPPED_DIR / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _class_models(class_name: str) -> list[str]:
    """The catalog models of this denoiser class."""
    from zerotrain.models.catalog import catalog_class, catalog_names

    return [name for name in catalog_names() if catalog_class(name) == class_name]


def shipped_defaults(class_name: str) -> dict[str, Any]:
    """The class defaults that the shipped files of this class record, without torch. All of them: a file
    regenerated with a newer diffusers may know an argument the others do not, and every argument known at
    its default is one a saved config spells out."""
    files = filter(None, map(_shipped_file, _class_models(class_name)))
    return {key: value for data in files for key, value in data["defaults"][class_name].items()}


def shipped_facts(spec: ModelSpec, run: RunConfig, text_tokens: int) -> ModelFacts | None:
    """The shipped facts of this run, if a file holds them: the catalog model's own, or, for a model outside
    the catalog (a fine-tune's folder or config.json), those of a catalog model of the same denoiser class,
    whose architecture the key names, so that only the same architecture finds them. Each file is looked up
    with the class defaults it records, those its keys were made with."""
    names = [spec.name] if spec.source == "catalog" else _class_models(spec.class_name)
    for data in filter(None, map(_shipped_file, names)):
        facts = unpack_facts(data, shipped_key(spec, run, text_tokens, data["defaults"][spec.class_name]))
        if facts is not None:
            return facts
    return None


def measure_model(spec: ModelSpec, run: RunConfig, cache: bool = True) -> ModelFacts:
    """Facts for this run's model, mode and resolution: from the disk cache when present, else
    shipped with zerotrain for a catalog model, otherwise measured on the meta device and cached
    (written atomically). cache=False measures again."""
    families.check_resolution(spec, run.data.resolution)
    text_tokens = run.data.text_tokens or families.of(spec).default_text_tokens
    cache_dir = run.planner.cache_dir or default_cache_dir()
    cache_file = cache_dir / f"{facts_key(spec, run, text_tokens)}.json"
    if cache and cache_file.is_file():
        with contextlib.suppress(ValueError, TypeError, KeyError):
            facts = ModelFacts.from_json(json.loads(cache_file.read_text()))
            # The key is the architecture, so the same facts serve a catalog name and a folder.
            return dataclasses.replace(facts, model=spec.name, cached=True, source="cached")
    shipped = shipped_facts(spec, run, text_tokens) if cache else None
    if shipped is not None:
        return dataclasses.replace(shipped, model=spec.name, cached=True, source="shipped")
    from zerotrain.planner.trace import measure

    facts = measure(spec, run, text_tokens)
    if cache:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{time.monotonic_ns()}")
        tmp.write_text(json.dumps(facts.to_json(), indent=1))
        tmp.replace(cache_file)
    return facts
