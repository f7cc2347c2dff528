"""LoKr and LoHa on linear layers without their full delta weight (issue 41): the one place zerotrain
reaches into peft's adapter layers.

peft's LoKr and LoHa layers build each adapted layer's full delta weight (out x in) at every forward
and multiply the tokens by it (`_get_delta_activations`: get_delta_weight, then F.linear): a second
matmul as large as the base layer's, in forward and in backward, and a delta kept for backward. The
same product, factored:

- LoKr, delta = kron(W1, W2) x scale, W1 (a1 x a2) = lokr_w1 or lokr_w1_a @ lokr_w1_b, W2 (b1 x b2)
  likewise: for a token x reshaped to X (a2 x b2), kron(W1, W2) x = W1 X W2^T (a1 x b1), read row
  by row. tokens x (in x b1 + a2 x out) multiplies (or tokens x (in x a1 + b2 x out), whichever is
  fewer) instead of tokens x in x out. An autograd function keeps for backward only the input (as
  LoRA does) and W1, W2, and recomputes the one intermediate product, which at many tokens would
  outgrow the delta (tokens x in against out x in); under autocast plain autograd keeps it.
- LoHa, delta = (w1_a w1_b) * (w2_a w2_b) x scale (elementwise): the Hadamard product of two rank-r
  products is the rank-r^2 product U V, U[:, p r + q] = w1_a[:, p] w2_a[:, q] and V[p r + q, :] =
  w1_b[p, :] w2_b[q, :] (Khatri-Rao), applied as LoRA applies B A: tokens x r^2 x (in + out)
  multiplies, plus r^2 x (in + out) to build U and V, against peft's tokens x in x out plus
  2 r x in x out to build the delta; a layer takes whichever is fewer (at r = 16 and 3072 wide,
  the factored one, about 6 times fewer at 1024 tokens; at r = 64 peft's). Backward keeps U, V and
  V x (r^2 values per token): at r = 16 and 3072 wide, U and V are a sixth of the delta.

The layers' classes, parameters and names stay peft's (so state dicts, the exports, init_from and
ZeRO-3's partitioning and gathering are untouched): install() sets, on each peft LoKr or LoHa Linear
layer, an instance attribute `_get_delta_activations` (peft's per-adapter hook that its forward calls
after the base layer, under its own disable_adapters, merged, module_dropout, multiple-adapter and
dtype logic) which computes the factored product, and calls peft's own method where it does not
apply: rank_dropout while training (a random row mask of the delta), LoKr's lokr_t2 and LoHa's
hada_t1 (their conv-only Tucker factors) and an input whose width is not the layer's.

Checked against peft's source in zerotrain.versions.TESTED["peft"] (tuners/lokr/layer.py and
tuners/loha/layer.py: get_delta_weight, make_kron, HadaWeight, _get_delta_activations,
LycorisLayer._cast_input_dtype, the scaling and rank_dropout dicts). Guard: on another peft version,
or a layer without the attributes read here, peft's forward stays, with one warning naming why.
"""

from __future__ import annotations

import functools
import sys
import types
from typing import TYPE_CHECKING, Any

from zerotrain import versions

if TYPE_CHECKING:
    import torch

# What the factored forwards read of a peft layer, beyond its adapter parameters.
ATTRIBUTES = ("scaling", "rank_dropout", "_cast_input_dtype", "_get_delta_activations", "training")


@functools.cache
def gate(version: str | None = None) -> str:
    """Why the factored forwards stay off ("" where they apply): `version` is peft's (default: the
    installed one)."""
    peft = versions.check("peft", version)
    if not peft.is_tested:
        return (f"peft {peft.installed} is not a version zerotrain's factored LoKr and LoHa forward was checked "
                f"against ({', '.join(peft.tested)})")
    return ""


@functools.cache
def _warn(why: str) -> None:
    print(f"zerotrain: warning: LoKr and LoHa keep peft's forward ({why}): each adapted layer builds its full "
          "delta weight at every step, about twice LoRA's step time", file=sys.stderr, flush=True)


def install(model: torch.nn.Module, version: str | None = None) -> int:
    """The factored forward on every peft LoKr and LoHa Linear layer of `model`; returns how many."""
    from peft.tuners.loha.layer import Linear as LoHaLinear
    from peft.tuners.lokr.layer import Linear as LoKrLinear

    layers = [(m, kind) for m in model.modules()
              for kind, cls in (("lokr", LoKrLinear), ("loha", LoHaLinear)) if isinstance(m, cls)]
    if not layers:
        return 0
    why = gate(version)
    missing = next((f"{type(m).__module__}.{type(m).__name__} has no {a}" for m, _ in layers for a in ATTRIBUTES
                    if not hasattr(m, a)), "")
    if why or missing:
        _warn(why or missing)
        return 0
    for module, kind in layers:
        module._get_delta_activations = types.MethodType(_lokr_delta if kind == "lokr" else _loha_delta, module)
    return len(layers)


def _peft(module: Any, adapter: str, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """peft's own _get_delta_activations (the class's, beneath the instance attribute)."""
    return type(module)._get_delta_activations(module, adapter, x, *args, **kwargs)


def _lokr_delta(self: Any, adapter: str, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """kron(W1, W2) x scale applied to x as W1 X W2^T, X the token reshaped to (a2, b2)."""
    import torch

    if (self.training and self.rank_dropout[adapter]) or adapter in self.lokr_t2:
        return _peft(self, adapter, x, *args, **kwargs)
    w1 = self.lokr_w1[adapter] if adapter in self.lokr_w1 else self.lokr_w1_a[adapter] @ self.lokr_w1_b[adapter]
    w2 = self.lokr_w2[adapter] if adapter in self.lokr_w2 else self.lokr_w2_a[adapter] @ self.lokr_w2_b[adapter]
    if w1.dim() != 2 or w2.dim() != 2 or w1.dtype != w2.dtype or x.shape[-1] != w1.shape[1] * w2.shape[1]:
        return _peft(self, adapter, x, *args, **kwargs)
    x = self._cast_input_dtype(x, w1.dtype)
    w1 = w1 * self.scaling[adapter]
    try:
        autocast = torch.is_autocast_enabled(x.device.type)
    except RuntimeError:  # a device type without autocast (meta)
        autocast = False
    return _kron(x, w1, w2) if autocast else _kron_function().apply(x, w1, w2)


def _kron(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """kron(w1, w2) applied to the rows of x: W1 X W2^T per row, in the order of fewer multiplies."""
    import torch

    (a1, a2), (b1, b2) = w1.shape, w2.shape
    tokens = x.reshape(-1, a2, b2)
    if a1 * a2 * b2 + a1 * b2 * b1 < a2 * b2 * b1 + a1 * a2 * b1:  # multiplies per row, W1 first or W2 first
        y = torch.matmul(w1, tokens) @ w2.T  # (n, a1, b2) then (n, a1, b1)
    else:
        y = ((tokens @ w2.T).transpose(1, 2) @ w1.T).transpose(1, 2)  # (n, a2, b1), (n, b1, a1), (n, a1, b1)
    return y.reshape(*x.shape[:-1], a1 * b1)


@functools.cache
def _kron_function() -> Any:
    """The autograd Function, made at first use (this module imports no torch: the planner reads gate())."""
    import torch

    class Kron(torch.autograd.Function):
        """_kron keeping for backward only its inputs (x is the base layer's, kept anyway), not its
        intermediate product, which at many tokens outgrows the delta (tokens x in against out x in):
        backward recomputes it (one small product)."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x, w1, w2)
            return _kron(x, w1, w2)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            x, w1, w2 = ctx.saved_tensors
            (a1, a2), (b1, b2) = w1.shape, w2.shape
            grad = grad.to(x.dtype)
            grad_x = _kron(grad, w1.T, w2.T) if ctx.needs_input_grad[0] else None  # kron(W1, W2)^T = kron(W1^T, W2^T)
            g = grad.reshape(-1, a1, b1)
            tokens = x.reshape(-1, a2, b2)
            grad_w1 = torch.einsum("nik,njk->ij", g, tokens @ w2.T) if ctx.needs_input_grad[1] else None
            grad_w2 = (g.reshape(-1, b1).T @ torch.matmul(w1, tokens).reshape(-1, b2)) if ctx.needs_input_grad[2] else None
            return grad_x, grad_w1, grad_w2

    return Kron


def _loha_delta(self: Any, adapter: str, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """((w1_a w1_b) * (w2_a w2_b)) x scale applied to x as U (V x), the rank-r^2 factors (Khatri-Rao),
    where that multiplies less than building the delta."""
    import torch.nn.functional as F

    if (self.training and self.rank_dropout[adapter]) or adapter in self.hada_t1:
        return _peft(self, adapter, x, *args, **kwargs)
    w1a, w1b, w2a, w2b = (self.hada_w1_a[adapter], self.hada_w1_b[adapter], self.hada_w2_a[adapter],
                          self.hada_w2_b[adapter])
    if w1a.dim() != 2 or w1b.dim() != 2 or len({w1a.dtype, w1b.dtype, w2a.dtype, w2b.dtype}) > 1 \
            or x.shape[-1] != w1b.shape[1]:
        return _peft(self, adapter, x, *args, **kwargs)
    out, r1 = w1a.shape
    r2, width = w2b.shape
    tokens = x.numel() // width
    rank = r1 * r2
    if rank * (width + out) * (tokens + 1) >= width * out * (tokens + r1 + r2):
        return _peft(self, adapter, x, *args, **kwargs)
    x = self._cast_input_dtype(x, w1a.dtype)
    up = (w1a[:, :, None] * w2a[:, None, :]).reshape(out, rank) * self.scaling[adapter]
    down = (w1b[:, None, :] * w2b[None, :, :]).reshape(rank, width)
    return F.linear(F.linear(x, down), up)
