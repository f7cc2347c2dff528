"""Model families as plug-ins: one module per family, each defining `FAMILY`, which implements
`zerotrain.protocols.Family` (most subclass `zerotrain.families.base.BaseFamily`). Adding a family is
adding a module here (plus its catalog configs and tests); every module of this package that defines
FAMILY is found at import.

The rest of zerotrain asks `of(spec)` for the family of a resolved model and never tests a family's
name."""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from zerotrain.errors import ZerotrainError
from zerotrain.protocols import Family, LatentCodec, ModelSpec, protocol_members

__all__ = [
    "all_families",
    "by_class",
    "by_name",
    "check_family",
    "check_resolution",
    "example_inputs",
    "of",
]


@cache
def all_families() -> tuple[Family, ...]:
    """Every family, in module name order."""
    found = []
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module.name.startswith("_") or module.name == "base":
            continue
        family = getattr(importlib.import_module(f"{__name__}.{module.name}"), "FAMILY", None)
        if family is None:
            continue
        check_family(family, f"{__name__}.{module.name}.FAMILY")
        found.append(family)
    return tuple(found)


def check_family(family: object, where: str) -> None:
    """One line when `family` lacks a member of the whole contract: zerotrain.protocols.Family, its parts'
    protocols included (what export and validation ask too), and its codec's LatentCodec."""
    missing = [member for member in _MEMBERS if not hasattr(family, member)]
    missing += [f"codec.{member}" for member in _CODEC_MEMBERS if not hasattr(getattr(family, "codec", None), member)]
    if missing:
        raise TypeError(f"{where} lacks {', '.join(missing)} of zerotrain.protocols.Family")


# What a FAMILY must have: the protocol's attributes and methods.
_MEMBERS = protocol_members(Family)
_CODEC_MEMBERS = protocol_members(LatentCodec)


def by_class(class_name: str) -> Family | None:
    """The family that trains this diffusers denoiser class, if any."""
    return next((f for f in all_families() if class_name in f.denoiser_classes), None)


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
