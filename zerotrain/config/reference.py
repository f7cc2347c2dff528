"""The configuration reference, generated from the pydantic models' field docstrings:
`python -m zerotrain.config.reference` prints the Markdown that docs/configuration.md embeds
between its markers, and `--write` writes it there (in a checkout; tests/unit/test_readme.py keeps
the two in sync)."""

from __future__ import annotations

import argparse
import json
import typing
from enum import Enum
from pathlib import Path

from pydantic import BaseModel

from zerotrain.config.sections import RunConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN, END = "<!-- configuration reference -->", "<!-- end configuration reference -->"


def _default(field) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        return "" if isinstance(value, BaseModel) else f"`{json.dumps(value)}`"
    value = field.default
    if isinstance(value, Enum):
        value = value.value
    return f"`{json.dumps(value, default=str)}`"


def _in_reference(field) -> bool:
    """Whether a section belongs in the user's reference (the tests' fault injection does not)."""
    return (field.json_schema_extra or {}).get("reference", True)


def reference() -> str:
    lines = []
    top = RunConfig.model_fields
    lines += ["| field | default | meaning |", "| --- | --- | --- |"]
    for name, field in top.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            continue
        lines.append(f"| `{name}` | {_default(field)} | {' '.join((field.description or '').split())} |")
    for section, field in top.items():
        model = field.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or not _in_reference(field):
            continue
        lines += ["", f"**`{section}:`** {' '.join((field.description or '').split())}", "",
                  "| field | default | meaning |", "| --- | --- | --- |"]
        for name, sub in model.model_fields.items():
            nested = sub.annotation
            items = typing.get_args(nested)[0] if typing.get_origin(nested) is list else None
            optional = [a for a in typing.get_args(nested) if isinstance(a, type) and issubclass(a, BaseModel)]
            if optional and typing.get_origin(nested) is not list:  # a section that may be left out
                lines.append(f"| `{section}.{name}` | {_default(sub)} | {' '.join((sub.description or '').split())} |")
                rows = [(f"{section}.{name}.{leaf}", leaf_field) for leaf, leaf_field in optional[0].model_fields.items()]
            elif isinstance(nested, type) and issubclass(nested, BaseModel):
                rows = [(f"{section}.{name}.{leaf}", leaf_field) for leaf, leaf_field in nested.model_fields.items()]
            elif isinstance(items, type) and issubclass(items, BaseModel):  # each entry of a list
                lines.append(f"| `{section}.{name}` | {_default(sub)} | {' '.join((sub.description or '').split())} |")
                rows = [(f"{section}.{name}[].{leaf}", leaf_field) for leaf, leaf_field in items.model_fields.items()]
            else:
                rows = [(f"{section}.{name}", sub)]
            lines += [f"| `{key}` | {_default(row)} | {' '.join((row.description or '').split())} |" for key, row in rows]
    return "\n".join(lines)


def _between_markers(page: str) -> tuple[int, int]:
    return page.index(BEGIN) + len(BEGIN), page.index(END)


def embedded(page: str) -> str:
    """The reference as `page` (docs/configuration.md's text) embeds it, between the markers."""
    start, end = _between_markers(page)
    return page[start:end].strip("\n")


def write(path: Path = PAGE) -> None:
    """Replace the reference between the markers of `path` with the generated one."""
    page = path.read_text()
    start, end = _between_markers(page)
    path.write_text(page[:start] + "\n" + reference() + "\n" + page[end:])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m zerotrain.config.reference",
                                     description="print the configuration reference (Markdown)")
    parser.add_argument("--write", action="store_true",
                        help="write it into docs/configuration.md, between its markers, instead")
    if parser.parse_args().write:
        write()
    else:
        print(reference())
