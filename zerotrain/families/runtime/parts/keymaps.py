"""Key-map parts: how a diffusers module's weights and LoRA factors become another layout's, where the other
layout fuses modules (Black Forest Labs' qkv, Ideogram's attention.qkv, Qwen-Image 2.1's gate_up) or orders rows
differently (BFL's final modulation). Families' ComfyUI exports use them."""

from __future__ import annotations

from typing import Any

import torch

from zerotrain.errors import ZerotrainError


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    """(shift, scale) output rows as (scale, shift): diffusers' AdaLayerNormContinuous (norm_out) and
    Black Forest Labs' final adaLN_modulation order them oppositely (swap_scale_shift in diffusers'
    converters)."""
    shift, scale = weight.chunk(2, dim=0)
    return torch.cat([scale, shift], dim=0)


def fuse_lora(
    modules: dict[str, Any], pairs: dict[str, tuple[Any, Any]], parts: tuple[str, ...], what: str
) -> tuple[Any, Any, int]:
    """One LoRA (A, B, the rank of each part) for a fused layer (`what`, for errors) made of the diffusers
    modules `parts` (in output order; `modules` maps names to modules), from those of them in `pairs`:
    their A matrices stacked (rank the sum of theirs) and their B matrices placed block-diagonally at
    their output rows, zero rows for parts without a LoRA. Exact: B @ A is the parts' B_i @ A_i stacked."""
    present = [part for part in parts if part in pairs]
    ranks = [pairs[part][0].shape[0] for part in present]
    if any(r != ranks[0] for r in ranks):
        raise ZerotrainError(f"LoRA parts of {what} have different ranks {ranks}; cannot fuse them")
    rows = [_out_features(modules[part]) for part in parts]
    down = torch.cat([pairs[part][0] for part in present], dim=0)
    up = pairs[present[0]][1].new_zeros((sum(rows), sum(ranks)))
    row, column = 0, 0
    for part, height in zip(parts, rows, strict=True):
        if part in pairs:
            up[row:row + height, column:column + ranks[0]] = pairs[part][1]
            column += ranks[0]
        row += height
    return down, up, ranks[0]


def _out_features(module: Any) -> int:
    base = getattr(module, "base_layer", module)
    return int(base.weight.shape[0])
