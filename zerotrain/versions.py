"""The library versions zerotrain was tested with, and how an installed version compares.

zerotrain reaches into the internals of four libraries (DeepSpeed's ZeRO optimizers and checkpoint
engine, diffusers' model classes, peft's adapters, optimum-quanto's quantized tensors), so
pyproject.toml bounds each below its next minor version, and `zerotrain doctor` reports each
installed version against the one tested here. DeepSpeed's private state is reached only through
zerotrain/deepspeed_compat.py, which switches its buffer sharing off on a DeepSpeed version not
listed here.

Reads installed versions from package metadata (importlib.metadata): nothing is imported, so the
planner on a laptop pays nothing for it. Imports nothing of zerotrain."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

# The versions the whole suite (tests/) passed with, on the CPU machines and in the Docker image
# (docker/Dockerfile pins the same). Update after running the suite on a new version.
TESTED: dict[str, tuple[str, ...]] = {
    "torch": ("2.13.0",),
    "deepspeed": ("0.19.8",),
    "diffusers": ("0.42.1",),
    "peft": ("0.21.2",),
    "optimum-quanto": ("0.2.7",),
}


@dataclass(frozen=True)
class VersionCheck:
    name: str
    installed: str | None
    tested: tuple[str, ...]

    @property
    def is_tested(self) -> bool:
        return self.installed is not None and release(self.installed) in self.tested

    def describe(self) -> str:
        if self.installed is None:
            return f"{self.name} not installed"
        mark = "tested" if self.is_tested else f"untested; tested: {', '.join(self.tested)}"
        return f"{self.name} {self.installed} ({mark})"


def release(version: str) -> str:
    """The release part of a version: 2.13.0+cpu -> 2.13.0."""
    return version.split("+")[0]


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check(name: str, version: str | None = None) -> VersionCheck:
    """`name`'s installed version (or `version`) against TESTED."""
    return VersionCheck(name, installed(name) if version is None else version, TESTED[name])


def check_all() -> list[VersionCheck]:
    return [check(name) for name in TESTED]
