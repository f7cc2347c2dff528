"""Measuring model facts on the meta device, with no weights and no GPU.

The real diffusers model is built on meta. Parameters are counted by name (DeepSpeed's
model_to_params de-duplicates by data_ptr, which is 0 for every meta tensor). One forward and
backward is traced under a dispatch mode that tracks live tensor storages (de-duplicated by
storage, freed through weak references), so saved activations, the forward peak and the
backward transient are measured rather than guessed. Attention is accounted as a flash kernel
holds it (q, k, v, out, logsumexp saved; dq, dk, dv and FlashAttention-2's fp32 workspace in
backward), because meta and CPU would fall back to math attention and save the full T x T score
matrix (about 4x too much per block, FIELD_NOTES). FLOPs come from torch's own flop formulas, plus
attention's matmuls."""

from __future__ import annotations

import contextlib
import functools
import math
import time
import weakref
from collections.abc import Collection, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import flop_registry

from zerotrain import families, recompute
from zerotrain.adapters import apply_lora, is_adapter
from zerotrain.config.sections import Mode, Quantization, RunConfig
from zerotrain.models.meta import build_meta_model
from zerotrain.planner.facts import ActivationFacts, CheckpointUnit, ModelFacts
from zerotrain.planner.references import plan_references
from zerotrain.protocols import ModelSpec

BF16 = 2  # bytes per bf16 element

# optimum-quanto's weight formats: bytes per weight element, and how scales are laid out.
# qint8/qfloat8 keep one scale per output channel (axis 0) in the weight's dtype; qint4 packs two
# weights per byte with a bf16 scale and shift per group along the input dimension. Checked
# against quanto on tiny models in tests/unit/test_facts.py.
QUANTO_BYTES = {Quantization.qint8: 1.0, Quantization.qfloat8: 1.0, Quantization.qint4: 0.5}
QUANTO_INT4_GROUPS = (128, 96, 64, 32)


def quanto_int4_group(in_features: int) -> int:
    """optimum-quanto 0.2.7's int4 group size (nn/qmodule.py, QModuleMixin.__init__): 128, else
    the first of 96/64/32 dividing in_features when in_features > 128; otherwise one group per
    output row."""
    if in_features > 128:
        for size in QUANTO_INT4_GROUPS:
            if in_features % size == 0:
                return size
    return in_features


class _Accountant:
    """Collects what the patched attention reports while a trace runs."""

    def __init__(self) -> None:
        self.flops = 0.0


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def flash_backward_workspace(query: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of the buffers FlashAttention-2's backward allocates besides dq, dk and dv
    (flash_api.cpp mha_bwd, which torch vendors for CUDA SDPA): softmax_d, fp32 B x H x Lq, and the
    fp32 dq accumulator dq_accum, B x Lq x H x D, with Lq rounded up to 128 and D to 32 (256 above
    192); given here with batch and heads leading. Both live alongside dq, dk and dv until the
    kernel returns."""
    *batch_heads, queries, head_dim = query.shape
    rows = _round_up(queries, 128)
    dim = _round_up(head_dim, 32) if head_dim <= 192 else 256
    return [((*batch_heads, rows), torch.float32), ((*batch_heads, rows, dim), torch.float32)]


def _flash_layout_empty(query: torch.Tensor, value_dim: int) -> torch.Tensor:
    """The attention output (B, H, Lq, Dv) as flash and memory-efficient kernels lay it out: stored
    (B, Lq, H, Dv) and returned transposed (torch's _scaled_dot_product_flash_attention and its CPU
    counterpart), so that the usual transpose(1, 2).reshape(B, Lq, H * Dv) after attention is a view,
    not a copy."""
    if query.dim() != 4:
        return query.new_empty((*query.shape[:-1], value_dim))
    batch, heads, queries, _ = query.shape
    return query.new_empty((batch, queries, heads, value_dim)).transpose(1, 2)


class FlashAccountedAttention(torch.autograd.Function):
    """Scaled dot-product attention whose memory is that of a flash kernel: forward saves q, k, v,
    out and the fp32 logsumexp (B, H, Lq); backward allocates dq, dk, dv and FlashAttention-2's
    workspace (flash_backward_workspace) on top. On meta it only produces shapes; on real CPU
    tensors it runs torch's CPU flash kernels, which save and return the same tensors (their
    per-thread scratch is freed inside the kernel)."""

    @staticmethod
    def forward(ctx, query, key, value, attn_mask, scale, accountant):
        batch_heads = math.prod(query.shape[:-2])
        accountant.flops += 4.0 * batch_heads * query.shape[-2] * key.shape[-2] * query.shape[-1]
        if query.device.type == "meta":
            out = _flash_layout_empty(query, value.shape[-1])
            lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        else:
            if attn_mask is not None and attn_mask.dtype == torch.bool:
                # The CPU flash kernel takes additive masks only.
                attn_mask = torch.zeros_like(attn_mask, dtype=query.dtype).masked_fill_(~attn_mask, float("-inf"))
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                query, key, value, attn_mask=attn_mask, scale=scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.attn_mask, ctx.scale, ctx.accountant = attn_mask, scale, accountant
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        batch_heads = math.prod(query.shape[:-2])
        ctx.accountant.flops += 8.0 * batch_heads * query.shape[-2] * key.shape[-2] * query.shape[-1]
        if query.device.type != "meta":
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out, query, key, value, out, lse, 0.0, False, attn_mask=ctx.attn_mask, scale=ctx.scale)
            return (*grads, None, None, None)
        grads = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        workspace = [torch.empty(shape, dtype=dtype, device=query.device)
                     for shape, dtype in flash_backward_workspace(query)]
        del workspace
        return (*grads, None, None, None)


_ORIGINAL_SDPA = F.scaled_dot_product_attention


class _FlashSDPA:
    """Drop-in for F.scaled_dot_product_attention that routes through FlashAccountedAttention."""

    def __init__(self, accountant: _Accountant) -> None:
        self.accountant = accountant

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                 enable_gqa=False):
        if dropout_p or is_causal or enable_gqa:
            return _ORIGINAL_SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                  is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        return FlashAccountedAttention.apply(query, key, value, attn_mask, scale, self.accountant)


@contextlib.contextmanager
def flash_attention_accounting(accountant: _Accountant) -> Iterator[None]:
    """Route every F.scaled_dot_product_attention call (diffusers' native attention backend and
    AttnProcessor2_0 both call it) through FlashAccountedAttention while the trace runs."""
    F.scaled_dot_product_attention = _FlashSDPA(accountant)
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _ORIGINAL_SDPA


class LiveBytesMode(TorchDispatchMode):
    """Tracks bytes of tensor storages created while active, until they are freed.

    Storages are keyed by their StorageImpl (views share one), freed through a weak reference,
    and storages that existed before (parameters, buffers, inputs) are ignored. Also counts
    FLOPs with torch.utils.flop_counter's formulas (FlopCounterMode itself keeps tensors alive,
    which would distort the peak)."""

    def __init__(self, ignore: set[int]) -> None:
        super().__init__()
        self.ignore = ignore
        self.sizes: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self.flops = 0.0

    def _free(self, key: int) -> None:
        self.live -= self.sizes.pop(key)

    def reset_peak(self) -> None:
        self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        counter = flop_registry.get(func._overloadpacket)
        if counter is not None:
            self.flops += counter(*args, **kwargs, out_val=out)
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in self.ignore or key in self.sizes:
                    continue
                self.sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
                weakref.finalize(storage, self._free, key)
        self.peak = max(self.peak, self.live)
        return out


@contextlib.contextmanager
def meta_autocast() -> Iterator[None]:
    """torch.autocast on the meta device as a null context while tracing. torch has no autocast for meta
    and refuses to open one, even disabled, so a model that switches autocast off by its inputs' device
    (Ideogram 4's rotary embedding: torch.autocast(device_type=position_ids.device.type, enabled=False))
    could not trace; on meta there is no autocast to switch. Every other device type gets torch's own."""
    real = torch.autocast

    def autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        if device_type == "meta":
            return contextlib.nullcontext()
        return real(device_type, *args, **kwargs)

    torch.autocast = autocast  # type: ignore[assignment,misc]
    try:
        yield
    finally:
        torch.autocast = real  # type: ignore[misc]


# The indexing ops whose boolean index tensors HostMetadataMode makes integer on the host.
_INDEXING = frozenset({torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
                       torch.ops.aten._index_put_impl_.default})


class HostMetadataMode(TorchDispatchMode):
    """Lets a meta trace use the small host tensors a model builds from its inputs' metadata (Qwen-Image 2.1
    derives its token masks and position ids on the host from img_mask, with nonzero and tolist, which a meta
    tensor cannot answer): an op that mixes meta and host tensors gets the host ones on meta, boolean indices
    first made integer on the host (a meta tensor's nonzero has no size)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        if any(_on(t, "meta") for t in leaves) and any(_on(t, "cpu") for t in leaves):
            if func in _INDEXING:
                indices: list[Any] = []
                for index in args[1]:
                    indices.extend(index.nonzero(as_tuple=True) if _on(index, "cpu") and index.dtype == torch.bool
                                   else [index])
                args = (args[0], indices, *args[2:])
            args, kwargs = tree_map(lambda t: t.to("meta") if _on(t, "cpu") else t, (args, kwargs))
        return func(*args, **kwargs)


def host_metadata(inputs: dict[str, Any]) -> Any:
    """HostMetadataMode where the inputs hold host tensors beside meta ones, a null context otherwise."""
    leaves = tree_leaves(inputs)
    if any(_on(t, "cpu") for t in leaves) and any(_on(t, "meta") for t in leaves):
        return HostMetadataMode()
    return contextlib.nullcontext()


def _on(tensor: Any, device_type: str) -> bool:
    """A tensor of at least one dimension on that device type (a 0-dim host scalar mixes with any device)."""
    return isinstance(tensor, torch.Tensor) and tensor.device.type == device_type and tensor.dim() > 0


def _storage_keys(tensors: Iterator[torch.Tensor]) -> set[int]:
    return {t.untyped_storage()._cdata for t in tensors}


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def trace_activations(
    model: torch.nn.Module, inputs: dict[str, Any], gradient_checkpointing: bool | Collection[str] | None,
    saved_inputs_of: tuple[type, ...] = (), prediction: Any = None,
) -> ActivationFacts:
    """One forward and backward of `model` on `inputs` under LiveBytesMode and flash accounting,
    with every block checkpointed (True), none (False), the named checkpoint units
    (zerotrain.recompute), or (None) as the model is set up already.

    Parameter gradients are dropped as soon as they are accumulated, as ZeRO's reduce hooks
    move them out of the autograd graph. `saved_inputs_of` lists module types whose forward
    inputs stay saved for backward even when their weight is frozen (quanto's
    QuantizedLinearFunction saves its input whenever autograd records it). `prediction` turns the
    forward's first output into one tensor (Family.prediction; the output itself by default)."""
    if gradient_checkpointing is False:
        model.disable_gradient_checkpointing()
    elif gradient_checkpointing is not None:
        # Non-reentrant checkpointing as diffusers uses it; RNG state is not needed for a trace.
        recompute.enable(model, None if gradient_checkpointing is True else gradient_checkpointing,
                         functools.partial(checkpoint, use_reentrant=False, preserve_rng_state=False))
    params = [p for p in model.parameters() if p.requires_grad]
    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in params]
    tensors = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    ignore = _storage_keys(model.parameters()) | _storage_keys(model.buffers()) | _storage_keys(iter(tensors))
    save_hooks = [
        module.register_forward_pre_hook(_save_input_for_backward)
        for module in model.modules() if saved_inputs_of and isinstance(module, saved_inputs_of)
    ]
    accountant = _Accountant()
    mode = LiveBytesMode(ignore)
    try:
        with flash_attention_accounting(accountant), mode, host_metadata(inputs):
            out = model(**inputs, return_dict=False)[0]
            out = prediction(out) if prediction is not None else out
            loss = F.mse_loss(out.float(), torch.zeros_like(out, dtype=torch.float32))
            forward_peak, saved = mode.peak, mode.live
            mode.reset_peak()
            loss.backward()
            del out, loss
            backward_peak = mode.peak
    finally:
        for hook in hooks + save_hooks:
            hook.remove()
    return ActivationFacts(
        saved_bytes=int(saved), forward_peak_bytes=int(forward_peak), backward_peak_bytes=int(backward_peak),
        flops=float(mode.flops + accountant.flops),
    )


def repeated_block_groups(model: torch.nn.Module) -> dict[str, list[list[int]]]:
    """For each block list (recompute.block_lists) of 3+ DiT transformer blocks: its block indices grouped by
    structure (class and parameter shapes). Blocks of one group cost the same activations and
    FLOPs. Only *TransformerBlock lists qualify: a DiT block maps tokens to tokens of the same
    shape, so dropping some leaves a valid model, whereas UNet down/up blocks change resolution
    and feed skip connections."""
    groups: dict[str, list[list[int]]] = {}
    for name, child in recompute.block_lists(model).items():
        if len(child) < 3:
            continue
        if not all(type(block).__name__.endswith("TransformerBlock") for block in child):
            continue
        by_signature: dict[tuple, list[int]] = {}
        for index, block in enumerate(child):
            signature = (type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters()))
            by_signature.setdefault(signature, []).append(index)
        groups[name] = sorted(by_signature.values())
    return groups


@contextlib.contextmanager
def keep_blocks(model: torch.nn.Module, keep: dict[str, list[int]]) -> Iterator[None]:
    """Temporarily shorten block lists (recompute.block_lists) to the given block indices (in order)."""
    lists = recompute.block_lists(model)
    originals = {name: lists[name] for name in keep}
    try:
        for name, indices in keep.items():
            recompute.set_block_list(model, name, torch.nn.ModuleList([originals[name][i] for i in sorted(indices)]))
        yield
    finally:
        for name, blocks in originals.items():
            recompute.set_block_list(model, name, blocks)


def _extrapolate(base: ActivationFacts, slopes: list[tuple[ActivationFacts, int]]) -> ActivationFacts:
    """Saved bytes and FLOPs grow linearly with block count: base + sum(extra * increment).
    A peak is the saved bytes plus the largest transient on top of them (one block's
    recomputation, activation gradients); where it happens shifts with depth, so the transient
    is the largest seen in any of the reduced traces, added to the extrapolated saved bytes."""
    traces = [base, *(more for more, _ in slopes)]
    saved = base.saved_bytes + sum(n * (more.saved_bytes - base.saved_bytes) for more, n in slopes)
    return ActivationFacts(
        saved_bytes=int(saved),
        forward_peak_bytes=int(saved + max(t.forward_peak_bytes - t.saved_bytes for t in traces)),
        backward_peak_bytes=int(saved + max(t.backward_peak_bytes - t.saved_bytes for t in traces)),
        flops=float(base.flops + sum(n * (more.flops - base.flops) for more, n in slopes)),
    )


def trace_by_blocks(
    model: torch.nn.Module, inputs: dict[str, Any], gradient_checkpointing: bool,
    saved_inputs_of: tuple[type, ...] = (), prediction: Any = None,
) -> tuple[ActivationFacts, dict[tuple[str, ...], tuple[int, float]]]:
    """trace_activations on a reduced-depth model, extrapolated to the full depth.

    Repeated blocks of a DiT (Flux's 19 + 38, SD3's 38) cost the same per block, so the model
    is traced with one block of each structural group, and once more with one extra block of
    each group that repeats; the full model is the base plus (count - 1) times each group's
    increment. Exact for saved bytes and FLOPs as long as blocks of a group are alike, and an upper
    bound for the peaks (see _extrapolate); tests/unit checks both against a full trace. Models without repeated top-level blocks
    (UNets) are traced whole. Also returns each repeating group's increment (one more block's
    saved bytes and FLOPs), by the names of its blocks."""
    groups = repeated_block_groups(model)
    if not groups:
        return trace_activations(model, inputs, gradient_checkpointing, saved_inputs_of, prediction), {}
    base_keep = {name: [g[0] for g in lists] for name, lists in groups.items()}
    with keep_blocks(model, base_keep):
        base = trace_activations(model, inputs, gradient_checkpointing, saved_inputs_of, prediction)
    slopes = []
    increments = {}
    for name, lists in groups.items():
        for group in lists:
            if len(group) < 2:
                continue
            keep = {n: list(v) for n, v in base_keep.items()}
            keep[name].append(group[1])
            with keep_blocks(model, keep):
                more = trace_activations(model, inputs, gradient_checkpointing, saved_inputs_of, prediction)
            slopes.append((more, len(group) - 1))
            increments[tuple(f"{name}.{i}" for i in group)] = (more.saved_bytes - base.saved_bytes,
                                                                more.flops - base.flops)
    return _extrapolate(base, slopes), increments


def checkpoint_costs(
    model: torch.nn.Module, inputs: dict[str, Any], none: ActivationFacts,
    plain: dict[tuple[str, ...], tuple[int, float]], checkpointed: dict[tuple[str, ...], tuple[int, float]],
    saved_inputs_of: tuple[type, ...] = (), prediction: Any = None,
) -> list[CheckpointUnit]:
    """What checkpointing each block frees and costs, best first (most bytes freed per FLOP
    recomputed); blocks whose checkpointing frees nothing are left out. Repeated DiT blocks: a
    group's increment without checkpointing less its increment with (plain and checkpointed, from
    trace_by_blocks). Otherwise (UNet blocks, short block lists): the model traced with that one
    unit checkpointed, against `none`. Partial checkpointing needs at least two blocks to choose from."""
    units = []
    if plain:
        for names, (saved, flops) in plain.items():
            units.append(CheckpointUnit(list(names), saved - checkpointed[names][0], checkpointed[names][1] - flops))
    else:
        for name in recompute.checkpoint_units(model):
            alone = trace_activations(model, inputs, [name], saved_inputs_of, prediction)
            units.append(CheckpointUnit([name], none.saved_bytes - alone.saved_bytes, alone.flops - none.flops))
    units = [u for u in units if u.freed_bytes > 0]
    units.sort(key=lambda u: (-u.freed_bytes / max(u.recompute_flops, 1.0), u.names[0]))
    return units if sum(len(u.names) for u in units) >= 2 else []


class _SaveInput(torch.autograd.Function):
    """Identity that keeps its input for backward, as quanto's QuantizedLinearFunction does for
    every quantized layer even with a frozen weight. Under checkpointing, autograd's own rules
    apply to it (dropped in forward, kept during recomputation)."""

    @staticmethod
    def forward(ctx, tensor):
        ctx.save_for_backward(tensor)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _save_input_for_backward(module: torch.nn.Module, args: tuple) -> tuple:
    return tuple(_SaveInput.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)


def frozen_storage_bytes(model: torch.nn.Module, quantize: Quantization) -> int:
    """Bytes of the frozen parameters as they will be stored."""
    total = 0
    quantized: set[int] = set()
    if quantize is not Quantization.none:
        for name, module in model.named_modules():
            if is_adapter(name) or not isinstance(module, (torch.nn.Linear, torch.nn.Conv2d)):
                continue
            weight = module.weight
            out_features, in_features = weight.shape[0], weight[0].numel()
            if quantize is Quantization.qint4:
                groups = out_features * (in_features // quanto_int4_group(in_features))
                scales = 2 * groups * BF16  # scale and shift per group
            else:
                scales = out_features * BF16  # one scale per output channel
            total += int(weight.numel() * QUANTO_BYTES[quantize]) + scales
            quantized.add(id(weight))
    for param in model.parameters():
        if not param.requires_grad and id(param) not in quantized:
            total += param.numel() * param.element_size()
    return total


def block_params(model: torch.nn.Module) -> dict[str, int]:
    """Parameters per top-level block: items of block lists (recompute.block_lists), and other top-level
    children whole (a ModuleDict less its block lists)."""
    lists = recompute.block_lists(model)
    blocks: dict[str, int] = {}
    for name, child in model.named_children():
        inner = {prefix: items for prefix, items in lists.items() if prefix == name or prefix.startswith(f"{name}.")}
        for prefix, items in inner.items():
            for index, module in enumerate(items):
                count = sum(p.numel() for p in module.parameters())
                if count:
                    blocks[f"{prefix}.{index}"] = count
        if isinstance(child, torch.nn.ModuleList):
            continue
        listed = {id(p) for items in inner.values() for p in items.parameters()}
        count = sum(p.numel() for p in child.parameters() if id(p) not in listed)
        if count:
            blocks[name] = count
    return blocks


def module_largest_params(model: torch.nn.Module) -> list[int]:
    """ModelFacts.module_largest_params: the elements of the largest parameter each module holds itself."""
    return sorted(max(p.numel() for p in own) for own in (list(m.parameters(recurse=False)) for m in model.modules())
                  if own)


def offload_inputs(model: torch.nn.Module, inputs: dict[str, Any], family: Any) -> tuple[list[int], int]:
    """What activation offload would move with every block checkpointed: one forward (no backward:
    only the checkpoint inputs matter) through the family's own checkpointing, recording the inputs
    zerotrain.recompute.offloaded selects, each tensor once. Returns their bytes, and the most bytes
    of one block's."""
    seen: dict[int, torch.Tensor] = {}  # kept alive for the pass, so that ids stay unique
    largest = 0

    def record(function: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal largest
        moved = [a for a in args if recompute.offloaded(a)]
        largest = max(largest, sum(a.numel() * a.element_size() for a in moved))
        seen.update((id(a), a) for a in moved)
        return function(*args, **kwargs)

    family.enable_checkpointing(model, None, record)
    with torch.enable_grad(), host_metadata(inputs):
        model(**inputs, return_dict=False)
    model.disable_gradient_checkpointing()
    return [t.numel() * t.element_size() for t in seen.values()], largest


def measure(spec: ModelSpec, run: RunConfig, text_tokens: int) -> ModelFacts:
    """Build, count and trace the model for this run's mode and resolution."""
    start = time.perf_counter()
    model = build_meta_model(spec)
    if run.training.mode is Mode.lora:
        apply_lora(model, spec, run)
    params = list(model.parameters())
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    resolution = run.data.resolution
    family = families.of(spec)
    references = plan_references(spec, run)
    # A text encoder that keeps the references' rows (Qwen-Image-Edit) gives the transformer those beside the caption.
    text_rows = text_tokens + family.reference_text_rows(spec, references)
    inputs = family.example_inputs(spec, 1, resolution, resolution, text_rows, "meta", torch.bfloat16)
    if references:  # edit training: the references' clean tokens, appended as the family's pipeline does
        factor = spec.vae_scale_factor
        inputs = family.add_references(spec, inputs, [
            torch.empty(1, spec.latent_channels, height // factor, width // factor, device="meta")
            for width, height in references])
    reference_tokens = sum(family.latent_tokens(spec, h // spec.vae_scale_factor, w // spec.vae_scale_factor)
                           for w, h in references)
    input_bytes = sum(t.numel() * t.element_size() for t in tree_leaves(inputs) if isinstance(t, torch.Tensor))
    quantize = run.training.quantize_base
    saved_inputs_of = (torch.nn.Linear, torch.nn.Conv2d) if quantize is not Quantization.none else ()
    with meta_autocast():
        no_gc, plain = trace_by_blocks(model, inputs, False, saved_inputs_of, family.prediction)
        gc, checkpointed = trace_by_blocks(model, inputs, True, saved_inputs_of, family.prediction)
        units = checkpoint_costs(model, inputs, no_gc, plain, checkpointed, saved_inputs_of, family.prediction)
        moved, largest_call = offload_inputs(model, inputs, family)
    facts = ModelFacts(
        model=spec.name, class_name=spec.class_name, family=spec.family, resolution=resolution,
        mode=run.training.mode.value, quantize=quantize.value,
        lora_rank=run.training.lora.rank if run.training.mode is Mode.lora else None,
        total_params=total, trainable_params=trainable, frozen_params=total - trainable,
        frozen_bytes=frozen_storage_bytes(model, quantize),
        buffer_bytes=sum(b.numel() * b.element_size() for b in model.buffers()),
        largest_layer_params=largest, block_params=block_params(model),
        param_numels=sorted(p.numel() for p in params), module_largest_params=module_largest_params(model),
        largest_trainable_param=max((p.numel() for p in params if p.requires_grad), default=0),
        image_tokens=family.image_tokens(spec, resolution), text_tokens=text_rows, input_bytes=input_bytes,
        no_checkpointing=no_gc, checkpointing=gc, checkpoint_units=units, offload_input_bytes=moved,
        offload_largest_call=largest_call, reference_tokens=reference_tokens,
        trace_seconds=round(time.perf_counter() - start, 3),
    )
    return facts
