"""Which denoiser a run trains: catalog names, local diffusers folders, bare config.json files and hub
ids all resolve to one `ModelSpec` (class, config and the VAE facts that shape the latents).

The catalog (``catalog/*.json``) holds the published diffusers configs of each architecture and no
weights, so the planner can build any of them on the meta device offline.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

from zerotrain import families
from zerotrain.config.sections import ModelConfig
from zerotrain.errors import ZerotrainError, one_line
from zerotrain.models.denoiser import PICKLES, SINGLE_FILES, over_base
from zerotrain.models.hub import hub_file, hub_index, pipeline_index
from zerotrain.protocols import ModelSpec

_CATALOG_DIR = Path(__file__).with_name("catalog")
_FIELD = "model.name_or_path"
# owner/name as the hub spells repo ids: one slash, no leading dot or dash.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


@cache
def denoiser_families() -> dict[str, str]:
    """Denoiser class -> the name of the family that trains it by default (a config names any other, see
    families.for_config), for every family in zerotrain/families/ (asked when first needed, so importing the
    catalog imports no family)."""
    return {class_name: family.name for family in families.all_families() for class_name in family.denoiser_classes
            if family.default_for_class}


def _supported() -> str:
    return ", ".join(denoiser_families())


def _denoiser_subfolders() -> tuple[str, ...]:
    """Where a diffusers pipeline folder keeps its denoiser, in order of preference."""
    return tuple(dict.fromkeys(family.denoiser_folder for family in families.all_families()))


def is_plan_only(spec: ModelSpec) -> bool:
    """The planner measures and plans it, but zerotrain cannot cache or train it (an SD 1.x/2.x UNet:
    zerotrain encodes captions for the families' own pipelines only)."""
    return families.of(spec).plan_only(spec) is not None


def check_trainable(spec: ModelSpec) -> None:
    """Raise one line for a plan-only model (Family.plan_only). prepare() calls it on every rank (for
    `zerotrain cache` and training) before anything is fetched or encoded."""
    kind = families.of(spec).plan_only(spec)
    if kind is not None:
        trainable = ", ".join(dict.fromkeys(family.title for family in families.all_families()))
        raise ZerotrainError(
            f"{_FIELD}='{spec.name}' is plan-only: zerotrain plans {kind} but cannot cache or train them (it "
            f"encodes captions for {trainable} models); "
            "use it with zerotrain plan, or train one of those"
        )


def catalog_names() -> list[str]:
    """Names accepted as model.name_or_path without any file or network access."""
    return sorted(path.stem for path in _CATALOG_DIR.glob("*.json"))


def catalog_listing() -> str:
    """The catalog names for people to read, each plan-only one marked so."""
    return ", ".join(f"{name} (plan only)" if is_plan_only(_from_catalog(name)) else name for name in catalog_names())


def resolve_model(config: ModelConfig) -> ModelSpec:
    """Resolve model.name_or_path (a catalog name, a diffusers config.json, a local diffusers model folder,
    or a hub id: owner/name), with model.denoiser's fine-tune in place of its denoiser where set. Raises
    ZerotrainError with one line on any bad input."""
    base = _resolve_base(config)
    return over_base(base, config) if config.denoiser is not None else base


def _resolve_base(config: ModelConfig) -> ModelSpec:
    name = config.name_or_path
    if name in catalog_names():
        return _from_catalog(name)
    path = Path(name).expanduser()
    if path.is_file() and path.name.endswith(SINGLE_FILES + PICKLES):
        raise ZerotrainError(
            f"{_FIELD}='{name}' is a single weights file, not a pipeline; set model.denoiser to it and "
            f"{_FIELD} to the pipeline it was fine-tuned from (a catalog name such as flux-dev, a hub id or a "
            "diffusers folder), whose VAE, text encoders and scheduler it trains with"
        )
    if path.is_file():
        return _from_config_file(name, path)
    if path.is_dir():
        return _from_folder(name, path, config.subfolder)
    if HUB_ID.match(name) and not name.endswith(".json"):
        return _from_hub(name, config.subfolder, config.revision)
    raise ZerotrainError(
        f"{_FIELD}='{name}': no catalog entry, file or folder of that name; use one of "
        f"{catalog_listing()}, a diffusers config.json, a local diffusers model folder, "
        "or a hub id like black-forest-labs/FLUX.1-dev"
    )


@cache
def _catalog_entry(name: str) -> dict[str, Any]:
    return json.loads((_CATALOG_DIR / f"{name}.json").read_text(encoding="utf-8"))


def catalog_class(name: str) -> str:
    """The denoiser class of a catalog model."""
    return _catalog_entry(name)["denoiser"]["_class_name"]


def _from_catalog(name: str) -> ModelSpec:
    entry = _catalog_entry(name)
    denoiser = json.loads(json.dumps(entry["denoiser"]))  # a private copy: callers may edit it
    vae = entry["vae"]
    return ModelSpec(
        name=name,
        family=families.for_config(denoiser, f"{_FIELD}='{name}': {_CATALOG_DIR / name}.json's denoiser").name,
        class_name=denoiser["_class_name"],
        config=denoiser,
        vae_scale_factor=vae["scale_factor"],
        latent_channels=vae["latent_channels"],
        vae_scaling_factor=vae["scaling_factor"],
        vae_shift_factor=vae["shift_factor"],
        source="catalog",
        pretrained=entry["hub_id"],
        subfolder=entry["subfolder"],
        pipeline_class=entry.get("pipeline"),
    )


def _from_config_file(name: str, path: Path) -> ModelSpec:
    """A bare denoiser config.json; a sibling ../vae/config.json supplies the VAE facts if present."""
    vae_path = path.parent.parent / "vae" / "config.json"
    return _spec(
        name,
        denoiser_path=path,
        vae_path=vae_path if vae_path.is_file() else None,
        source=f"config.json {path}",
        pretrained=None,
        subfolder=None,
    )


def _from_folder(name: str, folder: Path, subfolder: str | None) -> ModelSpec:
    """A diffusers pipeline folder (model_index.json or modular_model_index.json), or a folder that holds
    a denoiser config.json."""
    index_path = pipeline_index(folder)
    index = _read_json(index_path) if index_path is not None else {}
    if subfolder is None and index:
        subfolder = _denoiser_component(index, index_path)
    if subfolder is not None:
        denoiser_path = folder / subfolder / "config.json"
        if not denoiser_path.is_file():
            raise ZerotrainError(
                f"{_FIELD}='{name}': {denoiser_path} not found; set model.subfolder to the folder that "
                "holds the denoiser (transformer or unet)"
            )
        vae_path = folder / "vae" / "config.json"
        pretrained, sub = folder, subfolder
    elif (folder / "config.json").is_file():
        denoiser_path = folder / "config.json"
        vae_path = folder.parent / "vae" / "config.json"
        pretrained, sub = folder, None
    else:
        raise ZerotrainError(
            f"{_FIELD}='{name}': {folder} holds no model_index.json, modular_model_index.json or config.json; point to a "
            "diffusers model folder (as written by save_pretrained) or to its denoiser's config.json"
        )
    return _spec(
        name,
        denoiser_path=denoiser_path,
        vae_path=vae_path if vae_path.is_file() else None,
        source=f"folder {folder}",
        pretrained=str(pretrained),
        subfolder=sub,
        pipeline_class=index.get("_class_name"),
    )


def _from_hub(repo_id: str, subfolder: str | None, revision: str | None) -> ModelSpec:
    """Fetch only the small JSON files (model_index, denoiser and VAE configs), never weights."""
    index_name, index = hub_index(repo_id, revision, required=subfolder is None)
    if subfolder is None and index:
        subfolder = _denoiser_component(index, f"{repo_id}/{index_name}")
    denoiser_file = f"{subfolder}/config.json" if subfolder else "config.json"
    denoiser_path = hub_file(repo_id, denoiser_file, revision)
    if denoiser_path is None:
        raise ZerotrainError(
            f"{_FIELD}='{repo_id}': the hub repo has no {denoiser_file}; set model.subfolder to the "
            "folder that holds the denoiser, or pass a local folder or config.json instead"
        )
    vae_path = hub_file(repo_id, "vae/config.json", revision) if subfolder else None
    return _spec(
        repo_id,
        denoiser_path=denoiser_path,
        vae_path=vae_path,
        source=f"hub {repo_id}" + (f"@{revision}" if revision else ""),
        pretrained=repo_id,
        subfolder=subfolder,
        pipeline_class=index.get("_class_name"),
    )


def _denoiser_component(index: dict[str, Any], where: Path | str) -> str:
    """The pipeline index's component that holds a supported denoiser: [library, class] entries, and a
    modular index's [library, class, loading spec]."""
    components = {
        key: value[1]
        for key, value in index.items()
        if not key.startswith("_") and isinstance(value, list) and len(value) in (2, 3)
    }
    found = [key for key, class_name in components.items() if class_name in denoiser_families()]
    for key in _denoiser_subfolders():
        if key in found:
            return key
    if len(found) == 1:
        return found[0]
    listed = ", ".join(f"{key} ({cls})" for key, cls in components.items()) or "none"
    if found:
        raise ZerotrainError(
            f"{_FIELD}: {where} lists several denoisers ({', '.join(found)}); set model.subfolder to one"
        )
    raise ZerotrainError(
        f"{_FIELD}: {where} has no denoiser zerotrain supports among its components ({listed}); "
        f"supported: {_supported()}, or set model.subfolder"
    )


def _spec(
    name: str,
    *,
    denoiser_path: Path,
    vae_path: Path | None,
    source: str,
    pretrained: str | None,
    subfolder: str | None,
    pipeline_class: str | None = None,
) -> ModelSpec:
    config = _read_json(denoiser_path)
    class_name = config.get("_class_name")
    if class_name is None:
        raise ZerotrainError(
            f"{_FIELD}: {denoiser_path} has no _class_name; it must be a diffusers model config.json, "
            "such as transformer/config.json or unet/config.json of a diffusers model folder"
        )
    if class_name not in denoiser_families():
        raise ZerotrainError(
            f"{_FIELD}: {denoiser_path} has _class_name '{class_name}', which zerotrain does not "
            f"support; supported: {_supported()}"
        )
    family = families.for_config(config, f"{_FIELD}: {denoiser_path}")
    latent_channels = family.latent_channels(config, denoiser_path)
    if vae_path is None:
        vae = family.published_vae(config)
    else:
        vae = family.codec.vae_facts(_read_json(vae_path))
        if vae.latent_channels != latent_channels:
            raise ZerotrainError(
                f"{_FIELD}: {vae_path} has latent_channels {vae.latent_channels} but the denoiser "
                f"{denoiser_path} expects {latent_channels}; the folder mixes models of different families"
            )
    return ModelSpec(
        name=name,
        family=family.name,
        class_name=class_name,
        config=config,
        vae_scale_factor=vae.scale_factor,
        latent_channels=latent_channels,
        vae_scaling_factor=vae.scaling_factor,
        vae_shift_factor=vae.shift_factor,
        source=source,
        pretrained=pretrained,
        subfolder=subfolder,
        pipeline_class=pipeline_class if isinstance(pipeline_class, str) else None,
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ZerotrainError(f"{_FIELD}: {path} is not valid JSON ({err}); fix or replace the file") from err
    except (OSError, UnicodeDecodeError) as err:
        raise ZerotrainError(f"{_FIELD}: cannot read {path} ({one_line(err)})") from err
    if not isinstance(data, dict):
        raise ZerotrainError(f"{_FIELD}: {path} must hold a JSON object, found {type(data).__name__}")
    return data
