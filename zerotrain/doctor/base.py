"""What every check of `zerotrain doctor` shares: the verdicts (Check, Finding, Missing), the exit code, and the
Context, which measures each fact once for all the checks."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from zerotrain.config import RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import (
    Driver,
    GPUInfo,
    HardwareFacts,
    NvmlUnavailable,
    detect_nvml_gpus,
    hardware_facts,
    nvml_driver,
    visible_gpu_indices,
)
from zerotrain.units import GiB, MiB, readable

Verdict = Literal["ok", "warn", "fail", "skip"]
EXIT_CODES = {"ok": 0, "skip": 0, "warn": 1, "fail": 2}

# The oldest versions pyproject.toml accepts.
MIN_TORCH, MIN_DEEPSPEED = (2, 4), (0, 19)
# /dev/shm per DataLoader worker and rank: each worker hands its prefetched batches (prefetch_factor
# 2) to the trainer through shared memory; Docker's 64 MiB default is the usual cause of "DataLoader
# worker killed by signal: Bus error". 1 GiB is a generous margin for cached latents, not a measurement.
SHM_PER_WORKER = 1 * GiB
# NCCL's shared-memory transport between the ranks of a node; below 512 MiB DeepSpeed's own ds_report
# warns, and NCCL fails with "unhandled system error" when a segment cannot be created.
SHM_FOR_NCCL = 512 * MiB
# An EMA adds an fp32 copy of the trainable weights to each checkpoint (ema.py).
EMA_BYTES_PER_PARAM = 4
# GPU memory another process may hold before the doctor mentions it when there is no plan to compare
# with: about one CUDA context plus a little.
OTHER_PROCESS_NOTICE = 1 * GiB
# The CUDA builds PyTorch publishes wheels for (download.pytorch.org/whl/cuXYZ).
TORCH_CUDA_TAGS = ((11, 8), (12, 1), (12, 4), (12, 6), (12, 8), (12, 9), (13, 0))
TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


@dataclass
class Check:
    """One line of the report."""

    name: str
    verdict: Verdict
    detail: str
    advice: str | None = None


@dataclass(frozen=True)
class Finding:
    """What a check function returns; run_checks names it."""

    verdict: Verdict
    detail: str
    advice: str | None = None


@dataclass(frozen=True)
class Missing:
    """Why a fact is not known; `expected` when that is normal here (no NVML on a CPU machine)."""

    reason: str
    expected: bool = False


def exit_code(checks: list[Check]) -> int:
    """0: all ok or skipped; 1: warnings, no failure; 2: at least one failure."""
    return max((EXIT_CODES[c.verdict] for c in checks), default=0)


def _size(n: float) -> str:
    """A size in the largest unit it reaches, from KiB to TiB."""
    return readable(n)


def _version_tuple(text: str | None) -> tuple[int, ...] | None:
    numbers = re.findall(r"\d+", text or "")
    return tuple(int(n) for n in numbers[:2]) if len(numbers) >= 2 else None


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _torch_cuda_tag(driver_cuda: tuple[int, int] | None) -> str:
    """The newest PyTorch CUDA wheel tag a driver runs, e.g. cu124."""
    fitting = [tag for tag in TORCH_CUDA_TAGS if driver_cuda is None or tag <= driver_cuda] or [TORCH_CUDA_TAGS[0]]
    major, minor = fitting[-1]
    return f"cu{major}{minor}"


class Context:
    """The facts the checks share, each measured once and on first use. A fact that cannot be had
    is a `Missing` with the reason."""

    def __init__(self, run: RunConfig, config_path: Path | None = None, environ: Mapping[str, str] | None = None):
        self.run, self.config_path = run, config_path
        self.environ = os.environ if environ is None else environ

    @cached_property
    def nvml_gpus(self) -> list[GPUInfo] | Missing:
        """Every GPU NVML enumerates, before CUDA_VISIBLE_DEVICES."""
        try:
            return detect_nvml_gpus()
        except NvmlUnavailable as err:
            return Missing(str(err), expected=True)

    @cached_property
    def visible_gpus(self) -> list[GPUInfo] | Missing:
        """The GPUs a CUDA process here would get, in CUDA's order."""
        gpus = self.nvml_gpus
        if isinstance(gpus, Missing):
            return gpus
        try:
            return visible_gpu_indices(self.environ.get("CUDA_VISIBLE_DEVICES"), gpus)
        except ZerotrainError as err:
            return Missing(str(err))

    @cached_property
    def driver(self) -> Driver | Missing:
        try:
            return nvml_driver()
        except NvmlUnavailable as err:
            return Missing(str(err), expected=True)

    @cached_property
    def torch_gpus(self) -> int:
        """GPUs torch can use (0 for a CPU build or when CUDA cannot start)."""
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    @cached_property
    def hardware(self) -> HardwareFacts | Missing:
        """The plan's hardware, as `zerotrain plan` reads it."""
        try:
            return hardware_facts(self.run.hardware, environ=self.environ)
        except ZerotrainError as err:
            auto = self.run.hardware.gpus.strip().lower() == "auto"
            return Missing(str(err), expected=auto and isinstance(self.nvml_gpus, Missing))

    @cached_property
    def spec(self) -> Any:
        from zerotrain.models.catalog import resolve_model

        try:
            return resolve_model(self.run.model)
        except ZerotrainError as err:
            return Missing(str(err))

    @cached_property
    def facts(self) -> Any:
        from zerotrain.planner.measure import measure_model

        if isinstance(self.spec, Missing):
            return self.spec
        try:
            return measure_model(self.spec, self.run)
        except ZerotrainError as err:
            return Missing(str(err))

    def plan_for(self, hw: HardwareFacts) -> Any:
        """The plan `zerotrain plan` and train.py make for this run on `hw` (planner.entry.plan_for_run:
        the calibration applied, a given DeepSpeed config evaluated)."""
        from zerotrain.planner.entry import plan_for_run

        if isinstance(self.facts, Missing):
            return self.facts
        try:
            return plan_for_run(self.run, self.spec, hw=hw, facts=self.facts).result
        except ZerotrainError as err:
            return Missing(str(err))

    @cached_property
    def plan(self) -> Any:
        """The plan `zerotrain plan` would make here (GPU budgets capped by their free memory)."""
        return self.hardware if isinstance(self.hardware, Missing) else self.plan_for(self.hardware)

    @cached_property
    def idle_plan(self) -> Any:
        """The plan for idle GPUs: what the job gets when nothing else holds GPU memory."""
        hw = self.hardware
        return hw if isinstance(hw, Missing) else self.plan_for(dataclasses.replace(hw, gpu_free_bytes=None))

    @cached_property
    def ranks_per_node(self) -> int:
        if not isinstance(self.hardware, Missing):
            return self.hardware.gpus_per_node
        from zerotrain.distributed import local_world_size  # imports torch: only when asked

        return local_world_size(self.environ) or 1


CheckFunction = Callable[[Context], Finding]
def _no_plan(plan: Any) -> str:
    """Why a check has no plan to compare with: a Missing plan, or one where nothing fits."""
    if not isinstance(plan, Missing):
        return "no plan to compare with (nothing fits; see plan)"
    why = "no GPU visible and hardware.gpus=auto" if plan.expected else plan.reason
    return f"no plan to compare with ({why})"


def _layout_words(candidate: Any) -> str:
    from zerotrain.planner.search import describe

    return describe(candidate.layout)


def _combine(prefix: str, problems: list[Finding]) -> Finding:
    """One finding from several: the worst verdict, the details and the distinct advice joined."""
    verdict: Verdict = max((p.verdict for p in problems), key=EXIT_CODES.__getitem__)
    advice = "; ".join(dict.fromkeys(p.advice for p in problems if p.advice))
    return Finding(verdict, prefix + "; ".join(p.detail for p in problems), advice or None)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in TRUE_VALUES
