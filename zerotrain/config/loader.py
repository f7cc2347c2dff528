"""Load a RunConfig with precedence CLI overrides > file > defaults.

Files may be YAML, JSON or TOML. Overrides are dotted `key=value` pairs whose value is parsed
as YAML (so `training.lora.rank=32`, `planner.stages=[2,3]`, `model.name_or_path=sdxl-base`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from zerotrain.config.sections import RunConfig
from zerotrain.errors import ZerotrainError

try:  # Python 3.11+
    import tomllib
except ModuleNotFoundError:  # Python 3.10: TOML configs need the tomli backport
    tomllib = None


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a run config file into a plain dict; malformed files give one line naming the file."""
    if not path.is_file():
        raise ZerotrainError(f"{path}: config file not found")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            data = json.loads(text)
        elif path.suffix == ".toml":
            if tomllib is None:
                raise ZerotrainError(f"{path}: TOML configs need Python 3.11+; use YAML or JSON")
            data = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError, ValueError) as err:  # TOMLDecodeError is a ValueError
        detail = " ".join(str(err).split()).replace('"<unicode string>", ', "")
        kind = {".json": "JSON", ".toml": "TOML"}.get(path.suffix, "YAML")
        raise ZerotrainError(f"{path}: not valid {kind}: {detail}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ZerotrainError(f"{path}: the top level must be a mapping of sections (model:, training:, ...)")
    return data


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set one dotted `a.b.c=value` into nested dicts, in place."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ZerotrainError(f"override '{override}': write it as section.field=value, e.g. training.lora.rank=32")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    node = data
    parts = key.strip().split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ZerotrainError(f"override '{override}': '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def format_validation_error(err: ValidationError, source: str) -> str:
    """The first problem, as `source: field.path: message (got value)`."""
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "(top level)"
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        message = "unknown field; check the spelling against the configuration reference, docs/configuration.md"
    got = first.get("input")
    shown = "" if isinstance(got, dict) or got is None else f" (got {got!r})"
    more = f" [+{len(err.errors()) - 1} more]" if len(err.errors()) > 1 else ""
    return f"{source}: {where}: {message}{shown}{more}"


def load_config(path: Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Defaults, then the file, then each override in order."""
    data = read_config_file(path) if path is not None else {}
    for override in overrides:
        apply_override(data, override)
    source = str(path) if path is not None else "command line"
    if path is not None and overrides:
        source = f"{path} (with command-line overrides)"
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise ZerotrainError(format_validation_error(err, source)) from err
