"""What the test workers (universal_worker.py, validation_worker.py) share: one optimizer step of
a real engine on random inputs shaped as the family's pipeline shapes them."""

from __future__ import annotations

from typing import Any

import torch


def random_step(engine: Any, spec: Any, accumulation: int, seed: int) -> None:
    """One optimizer step of `accumulation` micro-batches of one 64 px image, loss = mean(pred²)."""
    from zerotrain.families import example_inputs

    torch.manual_seed(seed)
    for _ in range(accumulation):
        inputs = example_inputs(spec, 1, 64, 64, 8, "cpu", torch.bfloat16)
        prediction = engine(**inputs, return_dict=False)[0]
        engine.backward(prediction.float().pow(2).mean())
        engine.step()
