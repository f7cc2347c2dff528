"""Surviving what stops long runs: preemption signals, non-finite steps, out-of-memory errors.

- SIGTERM and SIGUSR1 (Slurm preemption with --signal, a scheduler's or the user's stop) only set
  a flag. The loop reads it, with every rank agreeing, at the end of each optimizer step (in the
  step's one collective, with the mean loss): the step in progress is finished, every rank writes
  a checkpoint of it, and the run exits 0, saying how to resume. A watchdog started by the signal
  ends the process if all that takes longer than faults.grace_seconds, leaving the previous
  complete checkpoint as the latest.
- A non-finite loss on any rank makes the reduced gradients of every rank non-finite, so
  DeepSpeed's bf16 overflow check (check_grad_overflow, on by default and required by zerotrain)
  skips the optimizer step on all ranks together; non-finite gradients with a finite loss are
  caught by the same check. The loss is reported as it was, never replaced; skipped steps are
  counted, and faults.max_bad_steps consecutive ones stop the run with a checkpoint.
- A CUDA out-of-memory error is turned into one message: the planner's prediction, what was
  measured, and the next configuration the planner would choose with less memory.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopSignal:
    """Turns SIGTERM/SIGUSR1 into a flag, with a watchdog that enforces the grace period."""

    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._watchdog: threading.Timer | None = None
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is not None:
            return
        self.received = signal.Signals(signum).name
        self._watchdog = threading.Timer(self.grace_seconds, self._expire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self) -> None:
        print(f"zerotrain: error: no checkpoint within the {self.grace_seconds:.0f} s grace period after "
              f"{self.received}; exiting; the previous complete checkpoint stays the latest", file=sys.stderr,
              flush=True)
        os._exit(1)

    def restore(self) -> None:
        """Put the previous handlers back and stop the watchdog: the run is over (its checkpoint is
        written), and a process that goes on (zerotrain train called in-process) must not be ended."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def oom_advice(plan: Any, used: Any, headroom: float) -> str:
    """What to do after an out-of-memory error with the Candidate `used`: plan with a budget just
    below its prediction, i.e. a larger planner.headroom, and name what the planner then chooses."""
    from zerotrain.planner.search import describe, gib

    gpu_bytes = plan.gpu_budget_bytes / (1 - headroom)
    new_headroom = math.ceil((1 - (used.memory.device_total - 1) / gpu_bytes) * 10_000) / 10_000
    if new_headroom >= 0.9:
        return "no configuration with less memory is left: use more GPUs, LoRA, or a quantized base"
    budget = gpu_bytes * (1 - new_headroom)
    fitting = [c for c in plan.candidates if c.memory.device_total <= budget and
               (c.rejected is None or "per GPU" in c.rejected)]
    if not fitting:
        return "no configuration with less memory is left: use more GPUs, LoRA, or a quantized base"
    best = max(fitting, key=lambda c: (c.images_per_second, -c.memory.device_total))
    return (f"--set planner.headroom={new_headroom:.4f} makes the planner choose {describe(best.layout)} "
            f"(predicted {gib(best.memory.device_total)} per GPU)")
