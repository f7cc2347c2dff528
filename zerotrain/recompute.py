"""Activation checkpointing of some of a denoiser's blocks (partial checkpointing).

A checkpoint unit is what diffusers checkpoints as one piece: each block of a DiT's top-level
block lists (Flux's 19 double and 38 single blocks, SD3's 24-38 joint blocks), and each down, mid
and up block of a UNet (its resnets and attentions run under checkpointing inside it). The planner
(facts.CheckpointUnit) measures what each unit frees and what its recomputation costs, and picks
the units to checkpoint; the engine applies exactly those here, through diffusers' own
enable_gradient_checkpointing with a function that checkpoints only calls inside them."""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint


def checkpoint_units(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's checkpoint units by name ("transformer_blocks.3", "down_blocks.1", "mid_block"),
    in model order: items of top-level ModuleLists that are transformer blocks or checkpoint
    themselves (a UNet's blocks carry gradient_checkpointing), and other top-level children that do."""
    units: dict[str, torch.nn.Module] = {}
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            for index, block in enumerate(child):
                if type(block).__name__.endswith("TransformerBlock") or hasattr(block, "gradient_checkpointing"):
                    units[f"{name}.{index}"] = block
        elif hasattr(child, "gradient_checkpointing"):
            units[name] = child
    return units


def default_checkpoint(function: Callable, *args: Any) -> Any:
    """diffusers' default: non-reentrant torch.utils.checkpoint."""
    return checkpoint(function, *args, use_reentrant=False)


def enable(model: torch.nn.Module, names: Collection[str] | None = None,
           checkpoint_fn: Callable = default_checkpoint) -> None:
    """Gradient checkpointing of the named units (None: every block, as diffusers'
    enable_gradient_checkpointing does it). diffusers calls the checkpointing function with each
    block (DiT) or each resnet and attention inside a block (UNet); calls inside a named unit run
    under checkpoint_fn, the others plainly."""
    if names is None:
        model.enable_gradient_checkpointing(functools.partial(_checkpointed, checkpoint_fn=checkpoint_fn))
        return
    units = checkpoint_units(model)
    unknown = sorted(set(names) - set(units))
    if unknown:
        raise ValueError(f"no checkpoint unit named {unknown[0]} in {type(model).__name__} "
                         f"(its units: {', '.join(list(units)[:4])}, ...)")
    inside = frozenset(id(m) for name in names for m in units[name].modules())
    model.enable_gradient_checkpointing(functools.partial(_some, inside=inside, checkpoint_fn=checkpoint_fn))


def _checkpointed(module: Any, *args: Any, checkpoint_fn: Callable) -> Any:
    return checkpoint_fn(module.__call__, *args)


def _some(module: Any, *args: Any, inside: frozenset[int], checkpoint_fn: Callable) -> Any:
    if id(module) in inside:
        return checkpoint_fn(module.__call__, *args)
    return module(*args)
