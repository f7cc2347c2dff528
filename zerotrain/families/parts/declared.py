"""A family (or a latent codec) in two halves. Its declarations live in a module that imports no torch, diffusers
or transformers: the classes, token counts, patch sizes, shift defaults and every other member the planner reads
(zerotrain.protocols' members not marked torch_side). Its torch side is a subclass of the declarations in
zerotrain/families/runtime/ (the same path below runtime/), which imports what it needs at module level and
implements the torch_side members: encode_prompt, flow_inputs, example_inputs, the key maps, the tiny model.

The declarations name their torch side (`runtime_class`, "module:Class") and reach it on first use: a member
they lack is looked up on one instance of it, so callers ask the family and never the half. A plan that reads
only declarations imports no torch (tests/unit/test_shipped_facts.py)."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from zerotrain.protocols import protocol_members

# One instance of each torch side, by runtime_class.
_LOADED: dict[str, Any] = {}


class Declared:
    """The declarations half: members it lacks come from its torch side (runtime_class), loaded on first use."""

    runtime_class: ClassVar[str]
    """"module:Class" of the torch side: a subclass of this class under zerotrain/families/runtime/."""
    runtime_protocol: ClassVar[type | None] = None
    """The zerotrain.protocols protocol whose torch_side members the torch side must hold, checked on load."""

    def runtime(self) -> Any:
        """The torch side: one instance of runtime_class, imported and checked on first use."""
        path = type(self).runtime_class
        if path not in _LOADED:
            _LOADED[path] = load(path, type(self), self.runtime_protocol)
        return _LOADED[path]

    def __getattr__(self, name: str) -> Any:
        # Only for names the class lacks; the torch side itself (a subclass) has all it will ever have.
        if name.startswith("__") or is_runtime(self):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.runtime(), name)


def is_runtime(obj: object) -> bool:
    """Whether obj is a torch side (an instance of its own runtime_class)."""
    path = getattr(type(obj), "runtime_class", None)
    return path is not None and f"{type(obj).__module__}:{type(obj).__qualname__}" == path


def load(path: str, declared: type, protocol: type | None = None) -> Any:
    """An instance of the torch side at "module:Class", which must subclass the declarations `declared`, be its
    own runtime_class and hold every torch_side member of `protocol`; one line otherwise."""
    module, _, name = path.partition(":")
    cls = getattr(importlib.import_module(module), name, None)
    if not isinstance(cls, type) or not issubclass(cls, declared) or cls.runtime_class != path:
        raise TypeError(f"{declared.__module__}.{declared.__qualname__}.runtime_class = {path!r} names no subclass "
                        f"of {declared.__qualname__} whose runtime_class is that path")
    missing = [member for member in protocol_members(protocol, "torch") if not hasattr(cls, member)] if protocol else []
    if missing:
        raise TypeError(f"{path} lacks {', '.join(missing)} of zerotrain.protocols.{protocol.__name__}")
    return cls()
