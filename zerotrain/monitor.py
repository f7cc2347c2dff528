"""What a run reports while it trains: progress on rank 0, metrics (JSONL and TensorBoard), and
the planner's predicted peak memory against the measured one.

Every rank creates a Monitor; only rank 0 writes or prints. `memory_check` is the one collective
(every rank's measured peak is gathered), called by every rank at the same step.

- Progress: a rich progress bar when stdout is a terminal (logging.progress_bar: auto), plain
  lines otherwise, so Slurm log files stay readable: global step, epoch, images/s, smoothed loss,
  learning rate, peak GPU memory against the prediction, and the ETA.
- Metrics: RUN/metrics.jsonl (one JSON object per logged step) and, with logging.tensorboard,
  RUN/tensorboard/ event files, with the same scalars: loss, learning rate, gradient norm,
  images/s, step time split into data wait, forward/backward and optimizer, skipped (NaN/inf)
  steps, peak allocated and reserved memory, and MFU where a GPU is present (the planner's model
  FLOPs per image x images/s / (world x the GPU's dense bf16 peak)).
- RUN/memory.json keeps the prediction (per-phase and per-term bytes) and every rank's measured
  peaks after `logging.memory_check_step` steps, so plans can be calibrated against real runs.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerotrain.distributed import Topology, gather_objects
from zerotrain.units import GiB, gib

SMOOTHING = 0.9  # weight of the old value in the smoothed loss and speed
# A measured peak above the prediction by more than this share (or the plan's activation margin,
# where larger) is worth a warning: the plan's headroom is all that is left.
MEMORY_WARN_SHARE = 0.05


@dataclass
class StepTimes:
    """Seconds of one optimizer step, by phase (GPU work is synchronised at each boundary)."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    data: float = 0.0
    forward_backward: float = 0.0
    optimizer: float = 0.0
    _mark: float = field(default_factory=time.perf_counter)

    def lap(self, phase: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        setattr(self, phase, getattr(self, phase) + now - self._mark)
        self._mark = now

    @property
    def total(self) -> float:
        return self.data + self.forward_backward + self.optimizer


def measured_peaks(device: torch.device) -> dict[str, Any]:
    """This process's peak GPU memory since it started (None without a GPU)."""
    if device.type != "cuda":
        return {"device": device.type, "max_allocated": None, "max_reserved": None}
    return {"device": torch.cuda.get_device_name(device),
            "max_allocated": torch.cuda.max_memory_allocated(device),
            "max_reserved": torch.cuda.max_memory_reserved(device)}


def _gib(n: float | None) -> str:
    """A memory figure of the run's lines: MiB below 0.1 GiB (a CPU run's few MiB stay readable)."""
    return gib(n, units=("GiB", "MiB"), switch=0.1)


def write_json(path: Path, document: dict[str, Any]) -> None:
    """Write a JSON document through a temporary file, so a reader never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(document, indent=1, default=str))
    tmp.replace(path)


def _eta(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _truncate_metrics(path: Path, start_step: int) -> None:
    """Drop the records of steps after `start_step` (the checkpoint a run resumes from): a run
    killed between checkpoints logged steps that are now trained again, and TensorBoard's
    purge_step drops them there too. A torn last line (the kill came mid-write) goes as well."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and int(record.get("step", 0)) <= start_step:
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)


class Monitor:
    """Progress, metrics and the memory comparison of one run (see the module docstring)."""

    def __init__(self, run_dir: Path, topo: Topology, device: torch.device, *, max_steps: int, start_step: int,
                 images_per_step: int, predicted: Any, layout_text: str, flops_per_image: float,
                 peak_flops_per_gpu: float | None, every: int = 1, tensorboard: bool = True,
                 progress_bar: str = "auto", memory_check_step: int = 3, margin_bytes: int = 0,
                 print_fn: Callable[[str], None] | None = None, wandb: tuple[Any, ...] | None = None):
        self.run_dir, self.topo, self.device = run_dir, topo, device
        self.max_steps, self.start_step, self.images_per_step = max_steps, start_step, images_per_step
        self.predicted, self.layout_text = predicted, layout_text
        self.flops_per_image, self.peak_flops = flops_per_image, peak_flops_per_gpu
        self.every, self.memory_check_step = every, memory_check_step
        self.smoothed_loss: float | None = None
        self.smoothed_speed: float | None = None
        self.skipped = 0
        self.memory_checked = False
        self.check_at = start_step + memory_check_step
        self.margin_bytes = margin_bytes
        self.adjustments: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self.print = print_fn or (lambda line: print(line, flush=True))
        self.metrics = self.writer = self.bar = None
        if not topo.is_main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        _truncate_metrics(run_dir / "metrics.jsonl", start_step)
        self.metrics = (run_dir / "metrics.jsonl").open("a")
        writers = []
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # Its thread writes the events every 10 s and at close(): a flush per step waited for it and
            # cost about 0.4 ms a step (benchmarks/step_overhead.py); metrics.jsonl is flushed every step.
            writers.append(SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1, flush_secs=10))
        if wandb is not None:  # (logging.wandb, the resolved config, the plan's summary)
            from zerotrain.tracking import WandbWriter

            writers.append(WandbWriter(wandb[0], run_dir, *wandb[1:]))
        if writers:
            from zerotrain.tracking import Writers

            self.writer = writers[0] if len(writers) == 1 else Writers(writers)
        if progress_bar == "always" or (progress_bar == "auto" and sys.stdout.isatty()):
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                TextColumn("{task.fields[status]}"), TimeRemainingColumn())
            self.task = self.bar.add_task("train", total=max_steps, completed=start_step, status="")
            self.bar.start()

    # --- per step ------------------------------------------------------------------------------

    def step(self, step: int, epoch: int, loss: float, lr: float, grad_norm: float | None, times: StepTimes,
             skipped: bool) -> dict[str, Any]:
        """Record one optimizer step (every rank calls it; rank 0 writes). Returns the record."""
        self.skipped += skipped
        speed = self.images_per_step / times.total if times.total > 0 else 0.0
        finite = math.isfinite(loss)
        if finite:
            self.smoothed_loss = loss if self.smoothed_loss is None else \
                SMOOTHING * self.smoothed_loss + (1 - SMOOTHING) * loss
        self.smoothed_speed = speed if self.smoothed_speed is None else \
            SMOOTHING * self.smoothed_speed + (1 - SMOOTHING) * speed
        peaks = measured_peaks(self.device)
        record = {
            "step": step, "epoch": epoch, "images": step * self.images_per_step, "loss": loss,
            "loss_smoothed": self.smoothed_loss, "lr": lr, "grad_norm": grad_norm, "skipped": skipped,
            "skipped_total": self.skipped, "images_per_second": speed, "step_seconds": times.total,
            "data_seconds": times.data, "forward_backward_seconds": times.forward_backward,
            "optimizer_seconds": times.optimizer, "peak_allocated_bytes": peaks["max_allocated"],
            "peak_reserved_bytes": peaks["max_reserved"], "mfu": self.mfu(speed),
        }
        if self.topo.is_main and (step % self.every == 0 or step == self.max_steps or skipped):
            self._write(record)
            self._show(record)
        return record

    def mfu(self, images_per_second: float) -> float | None:
        """Model FLOPs utilisation, where a GPU is present."""
        if self.device.type != "cuda" or not self.peak_flops or not self.flops_per_image:
            return None
        return self.flops_per_image * images_per_second / (self.topo.world_size * self.peak_flops)

    def _write(self, record: dict[str, Any]) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        if self.writer is None:
            return
        step = record["step"]
        scalars = {
            "train/loss": record["loss"], "train/loss_smoothed": record["loss_smoothed"], "train/lr": record["lr"],
            "train/grad_norm": record["grad_norm"], "train/skipped_steps": record["skipped_total"],
            "train/epoch": record["epoch"], "perf/images_per_second": record["images_per_second"],
            "perf/step_seconds": record["step_seconds"], "perf/data_seconds": record["data_seconds"],
            "perf/forward_backward_seconds": record["forward_backward_seconds"],
            "perf/optimizer_seconds": record["optimizer_seconds"], "perf/mfu": record["mfu"],
            "memory/peak_allocated_gib": None if record["peak_allocated_bytes"] is None
            else record["peak_allocated_bytes"] / GiB,
            "memory/peak_reserved_gib": None if record["peak_reserved_bytes"] is None
            else record["peak_reserved_bytes"] / GiB,
        }
        for name, value in scalars.items():
            if value is not None:
                self.writer.add_scalar(name, value, step)

    def status(self, record: dict[str, Any]) -> str:
        """The progress line's content (without the step counter)."""
        remaining = (self.max_steps - record["step"]) * self.images_per_step / self.smoothed_speed \
            if self.smoothed_speed else 0.0
        parts = [f"epoch {record['epoch']}",
                 f"loss {record['loss']:.5f}" + (f" (avg {self.smoothed_loss:.4f})" if self.smoothed_loss else ""),
                 f"lr {record['lr']:.2e}", f"{record['images_per_second']:.2f} img/s"]
        if record["peak_allocated_bytes"] is not None:
            parts.append(f"mem {_gib(record['peak_allocated_bytes'])} / {_gib(self.predicted.allocated)} planned")
        if record["mfu"] is not None:
            parts.append(f"MFU {record['mfu']:.0%}")
        if record["skipped"]:
            parts.append(f"SKIPPED (non-finite loss or gradients; {self.skipped} so far)")
        parts.append(f"eta {_eta(remaining)}")
        return "  ".join(parts)

    def _show(self, record: dict[str, Any]) -> None:
        status = self.status(record)
        if self.bar is not None:
            self.bar.update(self.task, completed=record["step"], status=status)
        else:
            self.print(f"step {record['step']}/{self.max_steps}  {status}")

    # --- memory -----------------------------------------------------------------------------------

    def memory_check(self, step: int) -> str | None:
        """Every rank calls this at the same step: once, after logging.memory_check_step steps
        (or at the last step of a shorter run). Rank 0 prints one line comparing the planner's
        prediction with the measured peaks and writes RUN/memory.json; returns the line."""
        due = step == self.check_at or step == self.max_steps
        if self.memory_checked or not due:
            return None
        self.memory_checked = True
        ranks = gather_objects(measured_peaks(self.device))
        if not self.topo.is_main:
            return None
        allocated = [r["max_allocated"] for r in ranks if r["max_allocated"] is not None]
        reserved = [r["max_reserved"] for r in ranks if r["max_reserved"] is not None]
        predicted = self.predicted
        if allocated:
            worst_alloc, worst_reserved = max(allocated), max(reserved)
            line = (f"memory after step {step}: planner predicted {_gib(predicted.allocated)} allocated, "
                    f"{_gib(predicted.reserved)} reserved per GPU ({self.layout_text}); measured peak "
                    f"{_gib(worst_alloc)} allocated ({(worst_alloc / predicted.allocated - 1):+.1%}), "
                    f"{_gib(worst_reserved)} reserved ({(worst_reserved / predicted.reserved - 1):+.1%}) "
                    f"on the fullest of {len(allocated)} GPU(s)")
            allowed = max(self.margin_bytes, MEMORY_WARN_SHARE * predicted.allocated)
            if worst_alloc > predicted.allocated + allowed:
                line += (f"; warning: more than the {_gib(allowed)} margin above the prediction: the planner's "
                         "estimate is low on this GPU, and a larger run may run out of memory; run zerotrain "
                         "calibrate to measure it (planner.calibration)")
        else:
            line = (f"memory after step {step}: planner predicted {_gib(predicted.allocated)} allocated, "
                    f"{_gib(predicted.reserved)} reserved per GPU ({self.layout_text}); no GPU here, so no "
                    "measurement to compare")
        document = {"step": step, "layout": self.layout_text, "predicted": {
            "allocated": predicted.allocated, "reserved": predicted.reserved, "device_total": predicted.device_total,
            "peak_phase": predicted.peak_phase, "phases": predicted.phases, "terms": predicted.terms},
            "measured": [{"rank": rank, **peaks} for rank, peaks in enumerate(ranks)],
            "margin_bytes": self.margin_bytes, "adjusted": self.adjustments}
        write_json(self.run_dir / "memory.json", document)
        self.print(line)
        return line

    def adjust(self, step: int, predicted: Any, layout_text: str, margin_bytes: int,
               adjustments: list[dict[str, Any]]) -> None:
        """The run moved to another layout after `step` (faults.OomRecovery): the memory check
        compares its prediction, logging.memory_check_step steps on, and memory.json lists the moves."""
        self.predicted, self.layout_text, self.margin_bytes = predicted, layout_text, margin_bytes
        self.adjustments = list(adjustments)
        self.check_at, self.memory_checked = step + self.memory_check_step, False
        if self.topo.is_main:
            write_json(self.run_dir / "memory.json", {"step": step, "layout": layout_text, "adjusted": self.adjustments})

    def log(self, line: str) -> None:
        """A line on rank 0 that does not break the progress bar."""
        if not self.topo.is_main:
            return
        if self.bar is not None:
            self.bar.console.print(line)
        else:
            self.print(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.writer is not None:
            self.writer.close()
        if self.metrics is not None:
            self.metrics.close()
