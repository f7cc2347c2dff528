"""The model facts shipped with zerotrain (zerotrain/planner/shipped_facts/), so that planning a
catalog model needs no trace and imports no torch, even the first time.

Every catalog model but the tiny test ones is measured at RESOLUTIONS, for a full fine-tune and for
LoRA with the default settings over each quantization of the base; resolutions the model refuses
are skipped. Regenerate them (half a minute to two minutes per model, on the meta device) with

    zerotrain regenerate [MODEL ...]    (then the presets too; or python -m zerotrain.planner.shipped [MODEL ...])

after changing the tracer (FACTS_VERSION), a family's conditioning or LoRA targets, or a catalog
config, or after a diffusers that changes a denoiser class's arguments (each file records their defaults,
see class_defaults); tests/unit/test_shipped_facts.py checks that nothing is missing, traces a sample again
and compares the recorded defaults with the installed diffusers'."""

from __future__ import annotations

import inspect
import json
import sys
from importlib.metadata import version
from typing import Any

from zerotrain import families
from zerotrain.config.sections import ModelConfig, Quantization, RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import catalog_names, resolve_model
from zerotrain.planner.facts import ModelFacts, pack_facts
from zerotrain.planner.measure import SHIPPED_DIR, measure_model, shipped_key

# The usual training resolutions of the catalog models.
RESOLUTIONS = (512, 768, 1024)
# (mode, quantize_base): a full fine-tune, and LoRA over each base quantization.
MODES = (("full", Quantization.none), *(("lora", q) for q in Quantization))
# Catalog models made for tests, traced in well under a second: not shipped.
TINY_PREFIX = "tiny-"


def shipped_models() -> list[str]:
    return [name for name in catalog_names() if not name.startswith(TINY_PREFIX)]


def shipped_runs(name: str) -> list[RunConfig]:
    """The runs whose facts are shipped for this catalog model."""
    spec = resolve_model(ModelConfig(name_or_path=name))
    runs = []
    for resolution in RESOLUTIONS:
        try:
            families.check_resolution(spec, resolution)
        except ZerotrainError:
            continue
        runs += [RunConfig(model={"name_or_path": name}, data={"resolution": resolution},
                           training={"mode": mode, "quantize_base": quantize}) for mode, quantize in MODES]
    return runs


def class_defaults(cls: type) -> dict[str, Any]:
    """What a config.json that save_pretrained writes holds for each argument a config leaves out: the default
    in the class's __init__ signature (register_to_config records it, ConfigMixin.extract_init_dict reads the
    same signature; ignore_for_config arguments are never recorded), as JSON holds it (tuples become lists).
    Arguments without a default (self, *args, **kwargs, required ones) have none to leave out."""
    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: json.loads(json.dumps(p.default)) for p in parameters
            if p.default is not p.empty and p.name not in cls.ignore_for_config}


def regenerate(name: str) -> int:
    """Trace every shipped run of one catalog model and write its file, with the defaults of its denoiser class
    that its keys were made with (planning reads them without torch, see measure.architecture); returns the
    entry count."""
    spec = resolve_model(ModelConfig(name_or_path=name))
    defaults = class_defaults(spec.denoiser_class())
    facts: dict[str, ModelFacts] = {}
    for run in shipped_runs(name):
        measured = measure_model(spec, run, cache=False)
        # The key's text length is the one measure_model looks up with: the caption's, without the rows an edit
        # model's references add to the text it traces (measured.text_tokens).
        text_tokens = run.data.text_tokens or families.of(spec).default_text_tokens
        facts[shipped_key(spec, run, text_tokens, defaults)] = measured
        print(f"{name} {run.data.resolution} {run.training.mode.value} {run.training.quantize_base.value}: "
              f"{measured.trace_seconds:.1f} s", file=sys.stderr, flush=True)
    data = {"model": name, "measured_with": {lib: version(lib) for lib in ("torch", "diffusers", "peft")},
            "defaults": {spec.class_name: defaults}, **pack_facts(facts)}
    SHIPPED_DIR.mkdir(exist_ok=True)
    (SHIPPED_DIR / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return len(facts)


def main(names: list[str]) -> None:
    """Regenerate the given models, or all of them and drop the files of models no longer shipped."""
    shipped = shipped_models()
    unknown = sorted(set(names) - set(shipped))
    if unknown:
        raise SystemExit(f"not shipped catalog models: {', '.join(unknown)}; use {', '.join(shipped)}")
    if not names:
        names = shipped
        for stale in set(SHIPPED_DIR.glob("*.json")) - {SHIPPED_DIR / f"{name}.json" for name in names}:
            stale.unlink()
    for name in names:
        print(f"{SHIPPED_DIR / name}.json: {regenerate(name)} facts", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1:])
