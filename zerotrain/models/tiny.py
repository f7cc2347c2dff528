"""Complete, tiny diffusers model folders for the catalog's tiny-* entries, built offline in about a
second: tests and CPU demos load them with `from_pretrained` exactly as they would a hub repo.

Each folder is what the family's pipeline `save_pretrained` writes, laid out as the published repos:
model_index.json, the denoiser from the catalog's tiny config, the VAE from its tiny vae_config, the
published scheduler config, and the family's text encoders and tokenizers, shrunk to the widths the
tiny denoiser expects. Each family builds its components (Family.tiny_components) from the pieces
here: tokenizers learned from a few captions (no download), and text encoder configs. Weights are
random from fixed seeds, so the same name always writes the same folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from zerotrain import families
from zerotrain.families.runtime.parts.tiny import diffusers_class, seeded
from zerotrain.models.catalog import _catalog_entry, catalog_names
from zerotrain.models.hub import pipeline_index

# The catalog's tiny models: every entry named tiny-*.
TINY_NAMES = tuple(name for name in catalog_names() if name.startswith("tiny-"))


def build_tiny_pipeline(name: str, folder: Path) -> Path:
    """Write the complete diffusers model folder of catalog entry `name` (one of TINY_NAMES) into
    `folder` and return it. The folder loads with DiffusionPipeline.from_pretrained (ModularPipeline's
    for a modular pipeline's)."""
    if name not in TINY_NAMES:
        raise ValueError(f"build_tiny_pipeline: '{name}' is not one of {', '.join(TINY_NAMES)}")
    entry = _catalog_entry(name)
    # The denoiser's config.json keeps the family's key (families.FAMILY_KEY), as from_config registers
    # private keys and save_pretrained writes them: the folder resolves to this family.
    family = families.for_config(entry["denoiser"], f"catalog entry {name}")
    with torch.random.fork_rng(devices=[]):
        pipeline_class, components = family.tiny_components(entry["denoiser"])
        if entry.get("pipeline"):  # an edit pipeline around the family's components (FluxKontextPipeline)
            pipeline_class = diffusers_class(entry["pipeline"])
        vae_config = entry["vae_config"]
        components["vae"] = seeded("vae", diffusers_class(vae_config["_class_name"]).from_config, vae_config)
    pipeline = pipeline_class(**components)
    folder = Path(folder)
    pipeline.save_pretrained(folder, safe_serialization=True)
    _name_transformers_classes(folder, pipeline)
    return folder


def _name_transformers_classes(folder: Path, pipeline: Any) -> None:
    """model_index.json naming each component of a zerotrain subclass of a transformers class (a processor
    built without torchvision: families.runtime.parts.qwen_vl.text_processor) by that transformers class, as the published repos do."""
    path = folder / "model_index.json"
    if not path.is_file():
        return
    index = json.loads(path.read_text(encoding="utf-8"))
    changed = False
    for name, value in index.items():
        if isinstance(value, list) and str(value[0]).split(".")[0] == "zerotrain":
            base = next(c for c in type(getattr(pipeline, name)).__mro__ if c.__module__.startswith("transformers."))
            index[name], changed = ["transformers", base.__name__], True
    if changed:
        path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def ensure_tiny_pipeline(name: str, root: Path) -> Path:
    """The tiny model folder under `root`, built once (atomically) and reused: what a catalog
    tiny-* name trains from, since no weights exist for it anywhere else."""
    folder = Path(root) / name
    if pipeline_index(folder) is not None:
        return folder
    tmp = Path(root) / f".{name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny_pipeline(name, tmp)
    empty = [p.name for p in tmp.iterdir() if p.is_dir() and not any(p.iterdir())]
    if empty:  # e.g. built on a rank that transformers does not let save
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"building {name} left empty component folders {empty}; build it on rank 0 first")
    try:
        os.replace(tmp, folder)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
