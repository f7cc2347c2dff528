"""Checkpoints: the guarded checkpoint writer, universal checkpoints, and CPU Adam's bias-correction replay
after a resume."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zerotrain import versions
from zerotrain.deepspeed_compat.fragments import _require
from zerotrain.errors import ZerotrainError

# ---- checkpoints ----

@contextlib.contextmanager
def guarded_writes(engine: Any, wrap: Any) -> Iterator[Any]:
    """engine.save_checkpoint writes through wrap(the engine's checkpoint engine) inside; yields the
    wrapper. No public extension point exists (see the module docstring): the engine attribute
    (runtime/engine.py _configure_checkpointing) is swapped for the one save."""
    _require(engine, ("checkpoint_engine",), "checkpoint.save")
    inner = engine.checkpoint_engine
    guard = wrap(inner)
    engine.checkpoint_engine = guard
    try:
        yield guard
    finally:
        engine.checkpoint_engine = inner


def to_universal(checkpoint: Path, out: Path) -> None:
    """DeepSpeed's documented ds_to_universal command line (deepspeed/checkpoint/ds_to_universal.py),
    in a process of its own: `checkpoint` converted into `out`. Raises ZerotrainError with the
    end of its output when it fails."""
    command = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(checkpoint),
               "--output_folder", str(out), "--num_extract_workers", "1", "--num_merge_workers", "1",
               "--inject_missing_state"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        raise ZerotrainError(" ".join(" ".join(lines[-3:]).split())[:300] or f"exit code {done.returncode}")


def replay_adam_steps(basic: Any, steps: int) -> bool:
    """Replay CPU Adam's bias-correction product through steps 1..`steps` on empty tensors (see
    checkpoint.replay_cpu_adam_steps). DeepSpeedCPUAdam's op: ds_opt_adam.adam_update
    (csrc/adam/cpu_adam.cpp, positional: id, step, lr, beta1, beta2, eps, weight decay, bias
    correction, params, grads, exp_avg, exp_avg_sq); FusedAdam on the CPU accelerator:
    multi_tensor_adam (ops/adam/fused_adam.py step). Returns False, doing nothing, on an untested
    DeepSpeed version."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    if not versions.check("deepspeed").is_tested:
        return False
    empty = torch.zeros(0, dtype=torch.float32)
    for step in range(1, steps + 1):
        for group in basic.param_groups:
            beta1, beta2 = group["betas"]
            common = (group["lr"], beta1, beta2, group["eps"])
            if isinstance(basic, DeepSpeedCPUAdam):
                basic.ds_opt_adam.adam_update(basic.opt_id, step, *common, group["weight_decay"],
                                              group["bias_correction"], empty, empty, empty, empty)
            else:
                basic.multi_tensor_adam(2048 * 32, basic._dummy_overflow_buf, [[empty]] * 4, *common, step,
                                        basic.adam_w_mode, int(group["bias_correction"]), group["weight_decay"])
    return True
