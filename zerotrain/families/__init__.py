"""Model families as plug-ins: one module per family, each defining `FAMILY`, which implements
`zerotrain.protocols.Family` (most subclass `zerotrain.families.base.BaseFamily`). Adding a family is
adding a module here (plus its catalog configs and tests); every module of this package that defines
FAMILY is found at import.

The rest of zerotrain asks `of(spec)` for the family of a resolved model and never tests a family's
name. A model resolves to its family by its denoiser config (for_config): the family its private key
"_zerotrain_family" names, or else the one family that trains its class by default (by_class), so that two
families may train one diffusers class."""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
from functools import cache
from typing import Any

from zerotrain.errors import ZerotrainError
from zerotrain.protocols import Family, LatentCodec, ModelSpec, protocol_members

__all__ = [
    "FAMILY_KEY",
    "all_families",
    "by_class",
    "by_name",
    "check_family",
    "check_resolution",
    "example_inputs",
    "for_config",
    "of",
]

# The denoiser config's private key that names its family, beside diffusers' own _class_name and
# _diffusers_version: from_config ignores it, save_pretrained keeps it.
FAMILY_KEY = "_zerotrain_family"


@cache
def all_families() -> tuple[Family, ...]:
    """Every family, in module name order."""
    found = []
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module.name.startswith("_") or module.name == "base" or module.ispkg:
            continue
        family = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILY", None)
        if family is None:
            continue
        check_family(family, f"{__name__}.{module.name}.FAMILY")
        found.append(family)
    _check_defaults(found)
    return tuple(found)


def _check_defaults(found: list[Family]) -> None:
    """One line unless every denoiser class has exactly one family that trains it by default."""
    for class_name in dict.fromkeys(c for family in found for c in family.denoiser_classes):
        trains = [family for family in found if class_name in family.denoiser_classes]
        defaults = [family.name for family in trains if family.default_for_class]
        if len(defaults) != 1:
            raise TypeError(
                f"{class_name} is trained by {', '.join(f.name for f in trains)}, of which "
                f"{', '.join(defaults) or 'none'} by default (default_for_class); exactly one must be, and "
                f"the others' configs name them with \"{FAMILY_KEY}\"")


def check_family(family: object, where: str) -> None:
    """One line when `family` lacks a member of the whole contract (zerotrain.protocols.Family, its parts'
    protocols included: what export and validation ask too, and its codec's LatentCodec) where it must hold it
    without torch: the declarations hold every member not marked torch_side, and name a torch side
    (runtime_class) that exists. The torch side's own members are checked when it loads
    (zerotrain.families.parts.declared), which imports torch."""
    missing = [member for member in _DECLARED if not hasattr(type(family), member)]
    codec = getattr(type(family), "codec", None)
    missing += [f"codec.{member}" for member in _CODEC_DECLARED if not hasattr(type(codec), member)]
    missing += [f"{prefix}runtime_class" for prefix, declared in (("", family), ("codec.", codec))
                if not _finds_runtime(declared)]
    if missing:
        raise TypeError(f"{where} lacks {', '.join(missing)} of zerotrain.protocols.Family")


def _finds_runtime(declared: object) -> bool:
    """Whether the declarations name a torch side whose module exists (found, not imported)."""
    module, _, name = str(getattr(type(declared), "runtime_class", "")).partition(":")
    try:
        return bool(name) and importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# What a FAMILY (and its codec) must hold without torch: the protocols' members not marked torch_side.
_DECLARED = protocol_members(Family, "declared")
_CODEC_DECLARED = protocol_members(LatentCodec, "declared")


def by_class(class_name: str) -> Family | None:
    """The family that trains this diffusers denoiser class by default (default_for_class), if any."""
    return next((f for f in all_families() if class_name in f.denoiser_classes and f.default_for_class), None)


def for_config(config: dict[str, Any], where: str) -> Family:
    """The family of a denoiser config (a catalog entry's "denoiser", a config.json), whose _class_name zerotrain
    trains: the one its FAMILY_KEY names, else its class's default. `where` (the field and file) starts the one
    line that refuses a name that is no family, or a family that does not train the class."""
    class_name = config["_class_name"]
    named = config.get(FAMILY_KEY)
    if named is None:
        family = by_class(class_name)
        if family is None:
            raise ZerotrainError(f"{where}: zerotrain trains no {class_name}")
        return family
    family = next((f for f in all_families() if f.name == named), None)
    if family is None:
        known = ", ".join(f.name for f in all_families())
        raise ZerotrainError(f"{where}: \"{FAMILY_KEY}\": {json.dumps(named)} names no model family (zerotrain "
                             f"knows {known}); name one of them, or remove the key to train {class_name}'s default")
    if class_name not in family.denoiser_classes:
        others = ", ".join(f.name for f in all_families() if class_name in f.denoiser_classes)
        raise ZerotrainError(f"{where}: \"{FAMILY_KEY}\": \"{named}\" trains {', '.join(family.denoiser_classes)}, "
                             f"not {class_name}; name a family of {class_name} ({others}), or remove the key")
    return family


def by_name(name: str) -> Family:
    family = next((f for f in all_families() if f.name == name), None)
    if family is None:
        known = ", ".join(f.name for f in all_families())
        raise ZerotrainError(f"no model family '{name}'; zerotrain knows {known}")
    return family


def of(spec: ModelSpec) -> Family:
    """The family of a resolved model."""
    try:
        return by_name(spec.family)
    except ZerotrainError as err:
        raise ZerotrainError(f"model.name_or_path='{spec.name}': {err}") from None


def check_resolution(spec: ModelSpec, resolution: int) -> None:
    """One line when data.resolution is not a multiple of the model's pixel factor."""
    factor = of(spec).pixel_factor(spec)
    if resolution % factor:
        lower, upper = resolution // factor * factor, (resolution // factor + 1) * factor
        raise ZerotrainError(
            f"data.resolution={resolution} is not a multiple of {factor} for {spec.name} "
            f"(VAE x{spec.vae_scale_factor} times the denoiser's patching); use {lower or upper} or {upper}"
        )


def example_inputs(spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int, device, dtype) -> dict:
    """The denoiser's forward arguments for one training step on random inputs (Family.example_inputs)."""
    return of(spec).example_inputs(spec, batch, height, width, text_tokens, device, dtype)
