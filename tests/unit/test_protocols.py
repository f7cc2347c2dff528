"""The Family protocol is the whole contract: what the rest of zerotrain asks of a family is in it (export's
needs included), and discovery refuses a family that lacks any of it, its VAE part's members too."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerotrain import families
from zerotrain.families.base import BaseFamily
from zerotrain.protocols import Family, LatentCodec, protocol_members

PACKAGE = Path(__file__).resolve().parents[2] / "zerotrain"
# A family object as the code outside families/ names it: family.X, self.family.X, families.of(spec).X,
# families.by_name(...).X, FAMILY.X.
ASKED = re.compile(r"(?:\bfamily|\bFAMILY|(?:\bfamilies\.|\b)of\([\w.]*\)|\bfamilies\.by_(?:name|class)\([^)]*\))\.([a-z_]+)\b")


def asked_of_families() -> set[str]:
    names = set()
    for path in PACKAGE.rglob("*.py"):
        if "families" not in path.relative_to(PACKAGE).parts:
            names |= set(ASKED.findall(path.read_text(encoding="utf-8")))
    return names


def test_what_zerotrain_asks_of_a_family_is_in_the_protocol():
    asked = asked_of_families()
    assert {"comfyui_adapter_name", "diffusers_lokr", "codec", "encode_prompt", "flow_inputs"} <= asked
    assert asked - set(protocol_members(Family)) == set()


def test_the_protocol_is_its_parts():
    parts = [base for base in Family.__mro__[1:] if base.__module__ == Family.__module__]
    assert [p.__name__ for p in parts] == ["DenoiserModel", "TextConditioning", "Objective", "References",
                                           "Validation", "KeyMaps"]
    members = [m for p in parts for m in protocol_members(p)]
    assert sorted(members) == sorted(protocol_members(Family)) and len(set(members)) == len(members)
    assert max(len(protocol_members(p)) for p in (*parts, LatentCodec)) <= 21


class _NoExport(BaseFamily):
    """A family written against an older protocol: BaseFamily's defaults, without the export names."""

    name = "test_no_export"


def test_discovery_refuses_a_family_that_lacks_part_of_the_contract(monkeypatch):
    for family in families.all_families():
        families.check_family(family, type(family).__module__)
    incomplete = _NoExport()
    with pytest.raises(TypeError, match=r"tests\.FAMILY lacks .*\btitle\b.*of zerotrain.protocols.Family"):
        families.check_family(incomplete, "tests.FAMILY")
    monkeypatch.delattr(BaseFamily, "comfyui_adapter_name")
    with pytest.raises(TypeError, match=r"lacks .*comfyui_adapter_name"):
        families.check_family(families.by_name("ideogram4"), "ideogram4.FAMILY")
    monkeypatch.setattr(type(families.by_name("sd3")), "codec", object(), raising=False)
    with pytest.raises(TypeError, match=r"lacks .*codec\.posterior"):
        families.check_family(families.by_name("sd3"), "sd3.FAMILY")
