"""Surviving what stops long runs: preemption signals, non-finite steps, out-of-memory errors.

- SIGTERM, SIGUSR1 and SIGINT (Slurm preemption with --signal, a scheduler's or the user's stop,
  Ctrl-C) only set a flag. The loop reads it, with every rank agreeing, at the end of each optimizer step (in the
  step's one collective, with the mean loss): the step in progress is finished, every rank writes
  a checkpoint of it, and the run exits 0, saying how to resume. A watchdog started by the signal
  ends the process if all that takes longer than faults.grace_seconds, leaving the previous
  complete checkpoint as the latest. Launchers signal every process of the job: Slurm the whole
  job step, torchrun and a terminal's Ctrl-C the process group, so the DataLoader workers get the
  signal too. They ignore it (ignore_stop_signals, each worker's init): a worker that died of it
  would fail the rank's step before its checkpoint; the rank ends them when it exits. A signal
  after the first (torchrun passes on the one its agent got) changes nothing.
- A non-finite loss on any rank makes the reduced gradients of every rank non-finite, so
  DeepSpeed's bf16 overflow check (check_grad_overflow, on by default and required by zerotrain)
  skips the optimizer step on all ranks together; non-finite gradients with a finite loss are
  caught by the same check. The loss is reported as it was, never replaced; skipped steps are
  counted, and faults.max_bad_steps consecutive ones stop the run with a checkpoint.
- A CUDA out-of-memory error in the forward or backward of a run's first steps, on every rank, is
  recovered in place (OomRecovery: the step dropped on every rank and run again with more
  recomputation); otherwise it is turned into one message: the planner's prediction, what was
  measured, and the next configuration the planner would choose with less memory. On one rank
  alone (Trainer.recoverable) the others wait inside the step's collectives, which it cannot join:
  it posts its line (distributed.Heartbeat.post), and every rank stops with it.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
from typing import Any

from zerotrain.units import gib

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def ignore_stop_signals(_worker_id: int = 0) -> None:
    """A DataLoader worker's init (worker_init_fn): the stop signals, which a launcher sends to every process of
    the job, are the rank's to act on; the worker goes on serving batches until the rank shuts it down."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class StopSignal:
    """Turns SIGTERM/SIGUSR1/SIGINT into a flag, with a watchdog that enforces the grace period."""

    def __init__(self, grace_seconds: float):
        self.grace_seconds = grace_seconds
        self.received: str | None = None
        self._previous: dict[int, Any] = {}
        self._watchdog: threading.Timer | None = None
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is not None:  # a launcher passes on what the job got already (torchrun: its SIGINT)
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
    from zerotrain.planner.search import describe

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


class OomRecovery:
    """Out-of-memory recovery in the first faults.oom_recovery_steps steps of a run or a resume
    (planner/ladder.py says where a run can go): every rank drops the failed step (no optimizer
    update, nothing counted; deepspeed_compat.abandon_step), memory is freed, and the step runs
    again, on the same micro-batches and noise, with the next rung's recomputation applied to the
    model in place. The move is printed in one line with the measured peak, appended to plan.json
    ("adjusted", which a resume keeps) and to memory.json, and the memory check measures the new
    layout. After faults.max_oom_retries moves, past the window, or with no rung left, the error
    stands (trainer.run_loop turns it into one line naming the layout that needs a new engine)."""

    def __init__(self, planned: Any, model: Any, start_step: int, device: Any, is_main: bool):
        from zerotrain.planner.ladder import rungs

        self.planned, self.model, self.device, self.is_main = planned, model, device, is_main
        faults = planned.run.faults
        self.until = start_step + faults.oom_recovery_steps
        self.retries_left = faults.max_oom_retries
        self.current = planned.used
        self.adjusted: list[dict[str, Any]] = list(planned.adjusted)
        more, self.offload = planned.recoverable
        self.next = rungs(self.current.layout, planned.facts, planned.hw, planned.run, self.offload) if more else []

    def allowed(self, step: int) -> bool:
        """Whether an out-of-memory error in `step` is recovered."""
        return step <= self.until and self.retries_left > 0 and bool(self.next)

    def recover(self, step: int, error: str, peak: int | None, monitor: Any) -> None:
        """Move the model to the next rung (the failed step was dropped and its memory freed)."""
        from zerotrain import families, recompute
        from zerotrain.distributed import gather_objects
        from zerotrain.planner.ladder import checkpointed_count, config_fields, rungs, set_lines
        from zerotrain.planner.search import describe

        planned, before, rung = self.planned, self.current, self.next[0]
        checkpointing = planned.result.checkpointed(rung.layout)
        families.of(planned.spec).enable_checkpointing(
            self.model, None if checkpointing is True else checkpointing,
            recompute.OffloadingCheckpoint() if rung.layout.offload_activations else None)
        ranks = gather_objects(recompute.checkpointed(self.model))  # what each rank's model does now
        self.current, self.retries_left = rung, self.retries_left - 1
        self.next = rungs(rung.layout, planned.facts, planned.hw, planned.run, self.offload)
        fields = config_fields(rung.layout, planned.facts)
        measured = "no GPU to measure" if peak is None else f"{gib(peak)} allocated when it failed"
        where = applied(ranks, checkpointed_count(rung.layout, planned.facts))
        line = (f"step {step} ran out of memory with {describe(before.layout)} (predicted "
                f"{gib(before.memory.device_total)} per GPU; {measured}): dropped on every rank, and run again with "
                f"{describe(rung.layout)} (predicted {gib(rung.memory.device_total)}) {where}; a resume keeps it; to "
                f"start with it: {set_lines(fields)}")
        self.adjusted.append({"step": step, "from": describe(before.layout), "to": describe(rung.layout),
                              "training": fields, "predicted_before": before.memory.device_total,
                              "predicted_after": rung.memory.device_total, "measured_peak": peak,
                              "error": error})
        monitor.adjust(step - 1, rung.memory, describe(rung.layout), rung.margin_bytes, self.adjusted)
        if self.is_main:
            self._write_plan()
        monitor.log(f"zerotrain: warning: {line}")

    def _write_plan(self) -> None:
        import json

        from zerotrain.monitor import write_json

        path = self.planned.run.output_dir / "plan.json"
        document = json.loads(path.read_text())
        write_json(path, {**document, "adjusted": self.adjusted, "trained": self.current.to_json()})


def applied(blocks_per_rank: list[int], expected: int) -> str:
    """Whether every rank's model checkpoints the blocks the move asked for, in words."""
    if all(n == expected for n in blocks_per_rank):
        return f"on each of {len(blocks_per_rank)} rank{'s' if len(blocks_per_rank) > 1 else ''}"
    return "but the ranks' models checkpoint " + ", ".join(f"{n} blocks on rank {r}" for r, n in enumerate(blocks_per_rank))
