"""Activation offload's own code (zerotrain/recompute.py) on the CPU: the predicate that picks the
inputs to move (recompute.offloaded) and OffloadingCheckpoint with its default host copy
(_to_pinned_host), installed by engine.apply_mode as train.py calls it.

On the CPU accelerator the predicate moves nothing (host and device are one memory), so the tests
let CPU tensors stand for the accelerator's: CpuAsAccelerator asks recompute.offloaded about each
input's meta twin (same shape and dtype, a device that is not the host), and keeps everything else
as the product has it: the size threshold, the host copy, the recomputation from that copy. What
the CPU cannot show is a real device-to-host transfer and pinning (pinned only with CUDA).

tests/unit/test_memory_floor.py checks the bytes against the planner's trace with a predicate and
host of its own; tests/distributed/test_train_activation_offload.py trains with CpuAsAccelerator
through train.py."""

from __future__ import annotations

import weakref
from typing import ClassVar

import torch

from tests.unit.test_facts import cpu_inputs, real_model, spec_of
from zerotrain import recompute
from zerotrain.config import load_config
from zerotrain.engine import apply_mode
from zerotrain.families import of

# The tiny model's block inputs (a few KiB) are far below the 1 MiB of a real one.
TINY_MIN_BYTES = 1024


class CpuAsAccelerator(recompute.OffloadingCheckpoint):
    """recompute.OffloadingCheckpoint with the product's predicate and host copy, where a CPU
    tensor counts as an accelerator tensor; it records each moved input (a weak reference, and
    whether its host copy is a separate buffer with the same values) and the host copies."""

    made: ClassVar[list[CpuAsAccelerator]] = []

    def __init__(self) -> None:
        super().__init__(moves=self.as_accelerator)
        self.originals: list[weakref.ref] = []
        self.copies: list[torch.Tensor] = []
        self.separate: list[bool] = []
        CpuAsAccelerator.made.append(self)

    @staticmethod
    def as_accelerator(value: object) -> bool:
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            value = torch.empty_like(value, device="meta")
        return recompute.offloaded(value)

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        copy = super()._host_copy(tensor)
        if not any(c is copy for c in self.copies):
            self.originals.append(weakref.ref(tensor))
            self.copies.append(copy)
            self.separate.append(copy.data_ptr() != tensor.data_ptr() and torch.equal(copy, tensor.detach()))
        return copy

    @classmethod
    def install(cls) -> None:
        """For a process that trains (tests/distributed/patched.py): the engine's offload uses
        this class, with the tiny models' threshold; rank 0's planner measures with it too."""
        recompute.OFFLOAD_MIN_BYTES = TINY_MIN_BYTES
        recompute.OffloadingCheckpoint = cls


def test_the_predicate_moves_large_floating_accelerator_tensors_only():
    large = 1 << 20  # recompute.OFFLOAD_MIN_BYTES
    assert recompute.OFFLOAD_MIN_BYTES == large
    assert recompute.offloaded(torch.empty(large // 2, dtype=torch.bfloat16, device="meta"))
    assert recompute.offloaded(torch.empty(large // 4, dtype=torch.float32, device="meta"))
    assert not recompute.offloaded(torch.empty(large // 2 - 1, dtype=torch.bfloat16, device="meta"))  # too small
    assert not recompute.offloaded(torch.empty(large, dtype=torch.int8, device="meta"))  # not floating point
    assert not recompute.offloaded(torch.empty(large // 2, dtype=torch.bfloat16))  # already in host memory
    assert not recompute.offloaded((torch.empty(large, device="meta"),)) and not recompute.offloaded(None)


def test_apply_mode_offload_keeps_host_copies_of_block_inputs_and_plain_checkpointing_gradients(monkeypatch):
    """engine.apply_mode(..., offload_activations=True), as train.py calls it, on tiny-flux with
    every block checkpointed: each large block input is copied once into a separate host buffer,
    the checkpoint keeps only that copy (every original is freed as soon as the model drops it,
    while the graph is still alive), and the gradients are plain checkpointing's, bit for bit."""
    monkeypatch.setattr(recompute, "OFFLOAD_MIN_BYTES", TINY_MIN_BYTES)
    monkeypatch.setattr(recompute, "OffloadingCheckpoint", CpuAsAccelerator)
    monkeypatch.setattr(CpuAsAccelerator, "made", [])
    spec = spec_of("tiny-flux", num_layers=2, num_single_layers=3)
    family = of(spec)
    run = load_config(None, ["model.name_or_path=tiny-flux", "training.mode=full"])

    def forward(offload: bool) -> tuple[torch.nn.Module, torch.Tensor]:
        model = real_model(spec)
        apply_mode(model, spec, run, True, offload_activations=offload)
        out = family.prediction(model(**cpu_inputs(spec), return_dict=False)[0])
        return model, out.float().square().mean()

    plain, plain_loss = forward(False)
    assert CpuAsAccelerator.made == []
    offloaded, loss = forward(True)
    (offloader,) = CpuAsAccelerator.made
    # hidden and text states into each double block, hidden states into each single block (and
    # the text states the last double block hands on): every one moved, each once
    assert len(offloader.copies) >= 2 * 2 + 3, len(offloader.copies)
    assert offloader.moved_bytes == sum(c.numel() * c.element_size() for c in offloader.copies) > 0
    assert all(offloader.separate), offloader.separate
    assert all(c.device.type == "cpu" and c.is_pinned() == torch.cuda.is_available() for c in offloader.copies)
    alive = [i for i, ref in enumerate(offloader.originals) if ref() is not None]
    assert alive == [], f"block inputs {alive} of {len(offloader.originals)} are still held after the forward"
    assert loss.grad_fn is not None and torch.equal(loss, plain_loss)

    plain_loss.backward()
    loss.backward()
    for (name, a), b in zip(plain.named_parameters(), offloaded.parameters(), strict=True):
        assert a.grad is not None and torch.equal(a.grad, b.grad), name
