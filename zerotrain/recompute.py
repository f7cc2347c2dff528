"""Activation checkpointing of some of a denoiser's blocks (partial checkpointing).

A checkpoint unit is what diffusers checkpoints as one piece: each block of a DiT's top-level
block lists (Flux's 19 double and 38 single blocks, SD3's 24-38 joint blocks), and each down, mid
and up block of a UNet (its resnets and attentions run under checkpointing inside it). The planner
(facts.CheckpointUnit) measures what each unit frees and what its recomputation costs, and picks
the units to checkpoint; the engine applies exactly those here, through diffusers' own
enable_gradient_checkpointing with a function that checkpoints only calls inside them."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Collection
from typing import Any

import torch
import torch.utils.checkpoint


def block_lists(model: torch.nn.Module) -> dict[str, torch.nn.ModuleList]:
    """The model's lists of blocks by name, in model order: its top-level ModuleLists, and the ModuleLists of
    its top-level ModuleDicts by dotted name (FLUX.3's per-mode blocks: "mode_blocks.image")."""
    lists: dict[str, torch.nn.ModuleList] = {}
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList):
            lists[name] = child
        elif isinstance(child, torch.nn.ModuleDict):
            lists.update({f"{name}.{key}": value for key, value in child.items() if isinstance(value, torch.nn.ModuleList)})
    return lists


def set_block_list(model: torch.nn.Module, name: str, blocks: torch.nn.ModuleList) -> None:
    """Replace the block list `name` (block_lists' naming) of the model."""
    parent, _, key = name.rpartition(".")
    if parent:
        getattr(model, parent)[key] = blocks
    else:
        setattr(model, name, blocks)


def checkpoint_units(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's checkpoint units by name ("transformer_blocks.3", "mode_blocks.image.0", "down_blocks.1",
    "mid_block"), in model order: items of its block lists (block_lists) that are transformer blocks or
    checkpoint themselves (a UNet's blocks carry gradient_checkpointing), and other top-level children that do."""
    units: dict[str, torch.nn.Module] = {}
    lists = block_lists(model)
    for name, child in model.named_children():
        for prefix, blocks in lists.items():
            if prefix == name or prefix.startswith(f"{name}."):
                for index, block in enumerate(blocks):
                    if type(block).__name__.endswith("TransformerBlock") or hasattr(block, "gradient_checkpointing"):
                        units[f"{prefix}.{index}"] = block
        if not isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)) and hasattr(child, "gradient_checkpointing"):
            units[name] = child
    return units


def default_checkpoint(function: Callable, *args: Any) -> Any:
    """diffusers' default: non-reentrant torch.utils.checkpoint."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


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


def checkpointed(model: torch.nn.Module) -> int:
    """How many of the model's checkpoint units run under checkpointing now: read from the function
    diffusers calls (the _gradient_checkpointing_func its enable_gradient_checkpointing sets on each
    module that checkpoints), not from what was asked."""
    functions = [getattr(m, "_gradient_checkpointing_func", None) for m in model.modules()
                 if getattr(m, "gradient_checkpointing", False)]
    if not functions:
        return 0
    units = checkpoint_units(model)
    inside = getattr(functions[0], "keywords", {}).get("inside")
    return len(units) if inside is None else sum(id(unit) in inside for unit in units.values())


def _checkpointed(module: Any, *args: Any, checkpoint_fn: Callable) -> Any:
    return checkpoint_fn(module.__call__, *args)


def _some(module: Any, *args: Any, inside: frozenset[int], checkpoint_fn: Callable) -> Any:
    if id(module) in inside:
        return checkpoint_fn(module.__call__, *args)
    return module(*args)


# Checkpointed block inputs of at least this many bytes move to host memory (activation offload);
# smaller ones (a timestep embedding, a mask) are not worth a transfer.
OFFLOAD_MIN_BYTES = 1 << 20


def offloaded(tensor: Any) -> bool:
    """Whether activation offload moves this checkpoint input to the host: a floating-point tensor
    of at least OFFLOAD_MIN_BYTES on the accelerator."""
    return (isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.device.type != "cpu"
            and tensor.numel() * tensor.element_size() >= OFFLOAD_MIN_BYTES)


class OffloadingCheckpoint:
    """A checkpointing function (for recompute.enable) that keeps each checkpointed block's large
    inputs in pinned host memory instead of on the GPU: activation offload, the tier after
    checkpointing every block, whose saved activations are then mostly these inputs.

    The block's forward runs on the GPU tensors it is given; non-reentrant torch.utils.checkpoint
    keeps, for the recomputation, the host copies made here (asynchronous device-to-host copies
    into pinned memory), so a GPU input is freed as soon as the model drops it. In backward, the
    recomputation copies them back (host-to-device) while the original is gone, marked as requiring
    gradients as the original was, so that the recomputed graph saves what the forward did. The
    gradients flow through the forward's own graph: they are exactly plain checkpointing's.

    A tensor handed to several blocks (a shared embedding) is copied once per forward: copies are
    looked up by the GPU tensor while it lives. `moves` decides which inputs move (`offloaded`;
    tests pass their own on the CPU), `host` where they go."""

    def __init__(self, moves: Callable[[Any], bool] = offloaded, host: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.moves = moves
        self.host = host or _to_pinned_host
        self._copies: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self.moved_bytes = 0
        """Bytes copied to the host since construction (each shared tensor once)."""

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        entry = self._copies.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        self._copies = {k: v for k, v in self._copies.items() if v[0]() is not None}
        copy = self.host(tensor.detach())
        self._copies[id(tensor)] = (weakref.ref(tensor), copy)
        self.moved_bytes += copy.numel() * copy.element_size()
        return copy

    def __call__(self, function: Callable, *args: Any) -> Any:
        moved = {i: (weakref.ref(a), a.device, a.requires_grad) for i, a in enumerate(args) if self.moves(a)}
        host_args = [self._host_copy(a) if i in moved else a for i, a in enumerate(args)]

        def run(*inputs: Any) -> Any:
            real = list(inputs)
            for i, (ref, device, requires_grad) in moved.items():
                original = ref()
                real[i] = original if original is not None else \
                    inputs[i].to(device, non_blocking=True).requires_grad_(requires_grad)
            return function(*real)

        return torch.utils.checkpoint.checkpoint(run, *host_args, use_reentrant=False)


def _to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    return host.copy_(tensor, non_blocking=True)
