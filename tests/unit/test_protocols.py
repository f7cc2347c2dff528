"""The Family protocol is the whole contract: what the rest of zerotrain asks of a family is in it (export's
needs included), and discovery refuses a family whose declarations lack any of it, its VAE part's members too;
a family's torch side is refused on load when it lacks a torch_side member, and the two sides agree on every
member both have (zerotrain.families.parts.declared)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zerotrain import families
from zerotrain.families.base import BaseFamily
from zerotrain.families.parts import declared
from zerotrain.families.runtime.base import BaseRuntime
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
    sd3 = type(families.by_name("sd3"))
    monkeypatch.setattr(sd3, "runtime_class", "zerotrain.families.runtime.no_such_module:SD3Runtime")
    with pytest.raises(TypeError, match=r"lacks runtime_class of"):
        families.check_family(families.by_name("sd3"), "sd3.FAMILY")
    monkeypatch.setattr(sd3, "codec", object(), raising=False)
    with pytest.raises(TypeError, match=r"lacks .*codec\.vae_facts.*codec\.runtime_class"):
        families.check_family(families.by_name("sd3"), "sd3.FAMILY")


def test_the_declarations_hold_no_torch_side_member_and_the_torch_side_holds_them_all():
    torch_side = set(protocol_members(Family, "torch"))
    assert {"encode_prompt", "flow_inputs", "example_inputs", "comfyui_lora", "tiny_components"} <= torch_side
    assert {"patch", "image_tokens", "default_text_tokens", "shift_defaults", "max_references"} <= set(
        protocol_members(Family, "declared"))
    assert torch_side & {name for name in vars(BaseFamily) if not name.startswith("_")} == set()
    for family in families.all_families():
        runtime = family.runtime()
        assert declared.is_runtime(runtime) and not declared.is_runtime(family)
        assert all(hasattr(runtime, member) for member in protocol_members(Family))
        assert all(hasattr(runtime.codec.runtime(), member) for member in protocol_members(LatentCodec))


def disagreements(declarations: type, torch_side: type) -> list[str]:
    """Members the declarations and their torch side both have but resolve differently: a torch side overriding
    a declaration (which a caller of the declarations never sees), or a declarations default that the torch side
    overrides (which shadows the override for the declarations' callers)."""
    return [name for name in dir(torch_side) if not name.startswith("_") and hasattr(declarations, name)
            and getattr(declarations, name) is not getattr(torch_side, name)]


def test_a_familys_two_sides_agree_on_every_member_both_have():
    for family in families.all_families():
        for half in (family, family.codec):
            assert disagreements(type(half), type(half.runtime())) == [], type(half).__name__


class _Half(BaseFamily):
    runtime_class = f"{__name__}:_HalfRuntime"
    name = "test_half"

    def prediction(self, output):
        return output


class _HalfRuntime(_Half, BaseRuntime):
    def patch(self, spec):
        return 4

    def prediction(self, output):
        return -output


class _Stranger(BaseFamily):
    runtime_class = f"{__name__}:_HalfRuntime"


def test_a_torch_side_is_checked_on_load_and_the_agreement_finder_sees_both_ways():
    with pytest.raises(TypeError, match=r"_HalfRuntime lacks .*encode_prompt.*of zerotrain.protocols.Family"):
        declared.load(_Half.runtime_class, _Half, Family)
    with pytest.raises(TypeError, match=r"names no subclass of _Stranger"):
        declared.load(_Stranger.runtime_class, _Stranger, Family)
    assert declared.load(_Half.runtime_class, _Half) is not None
    assert disagreements(_Half, _HalfRuntime) == ["patch", "prediction"]
