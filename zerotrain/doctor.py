"""`zerotrain doctor`: one command to run before a long job. Each check prints a verdict (ok, warn,
fail, skip) and, for anything but ok, what to do: versions of torch, CUDA, the driver and DeepSpeed
and its ops; the GPUs NVML, CUDA_VISIBLE_DEVICES and torch see; NCCL peer-to-peer; free GPU memory,
host RAM and NVMe space against the plan; /dev/shm; the output folder; and whether the model's
weights can be had.

Exit codes: 0 when every check is ok or skipped, 1 when some warn and none fail, 2 when any fails.
On a machine without GPUs or NVML the GPU checks are skipped with the reason, and the plan uses the
profile hardware.gpus names (or is skipped with gpus=auto).

Every check is a small function of a `Context`, which measures each fact once. No check raises: an
unexpected exception becomes a warning that carries its text.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from zerotrain.config import RunConfig
from zerotrain.config.flags import add_plan_flags, config_from_args
from zerotrain.errors import ZerotrainError, one_line
from zerotrain.hardware import (
    Driver,
    GPUInfo,
    HardwareFacts,
    NvmlUnavailable,
    detect_nvml_gpus,
    hardware_facts,
    host_memory_bytes,
    nvml_driver,
    parse_gpu_spec,
    visible_gpu_indices,
)
from zerotrain.units import GiB, MiB, gib

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
    return gib(n, units=("TiB", "GiB", "MiB", "KiB"))


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
CHECKS: list[tuple[str, CheckFunction]] = []


def check(name: str) -> Callable[[CheckFunction], CheckFunction]:
    """Register a check under `name`; checks run in the order they are defined."""
    def register(function: CheckFunction) -> CheckFunction:
        CHECKS.append((name, function))
        return function
    return register


def _no_plan(plan: Any) -> str:
    """Why a check has no plan to compare with: a Missing plan, or one where nothing fits."""
    if not isinstance(plan, Missing):
        return "no plan to compare with (nothing fits; see plan)"
    why = "no GPU visible and hardware.gpus=auto" if plan.expected else plan.reason
    return f"no plan to compare with ({why})"


def _layout_words(candidate: Any) -> str:
    from zerotrain.planner.search import describe

    return describe(candidate.layout)


@check("config")
def check_config(ctx: Context) -> Finding:
    run = ctx.run
    source = str(ctx.config_path) if ctx.config_path else "defaults and command-line flags"
    return Finding("ok", f"{source}: model {run.model.name_or_path}, {run.data.resolution}px, "
                         f"{run.training.mode.value}, global batch {run.training.global_batch_size}, "
                         f"hardware.gpus={run.hardware.gpus} x {run.hardware.nodes} node(s), output {run.output_dir}")


@check("versions")
def check_versions(ctx: Context) -> Finding:
    import torch

    cuda, hip = torch.version.cuda, getattr(torch.version, "hip", None)
    build = f"CUDA {cuda}" if cuda else f"ROCm {hip}" if hip else "CPU build"
    deepspeed = _dist_version("deepspeed")
    gpus, driver = ctx.nvml_gpus, ctx.driver
    driver_text = (f"driver {driver.version} (CUDA up to {driver.cuda[0]}.{driver.cuda[1]})"
                   if isinstance(driver, Driver) else f"no NVIDIA driver ({driver.reason})")
    detail = (f"python {platform.python_version()}, torch {torch.__version__} ({build}), {driver_text}, "
              f"DeepSpeed {deepspeed or 'not installed'}")
    torch_plain = torch.__version__.split("+")[0]
    if (_version_tuple(torch.__version__) or (0, 0)) < MIN_TORCH:
        return Finding("fail", f"{detail}: zerotrain needs torch >= {'.'.join(map(str, MIN_TORCH))}",
                       "install a newer torch build for your driver (see the README), then pip install -e .")
    if deepspeed is None or (_version_tuple(deepspeed) or (0, 0)) < MIN_DEEPSPEED:
        return Finding("fail", f"{detail}: zerotrain needs DeepSpeed >= {'.'.join(map(str, MIN_DEEPSPEED))}",
                       "pip install -e . (pyproject.toml pins the DeepSpeed versions zerotrain supports)")
    has_gpus = isinstance(gpus, list) and len(gpus) > 0
    driver_cuda = driver.cuda if isinstance(driver, Driver) else None
    if has_gpus and not cuda and not hip:
        return Finding(
            "fail", f"{detail}: torch is a CPU build but NVML sees {len(gpus)} NVIDIA GPU(s); training would "
                    "not use them",
            f"pip install --force-reinstall torch=={torch_plain} --index-url "
            f"https://download.pytorch.org/whl/{_torch_cuda_tag(driver_cuda)} (a CUDA build your driver runs)")
    runtime = _version_tuple(cuda)
    if has_gpus and runtime and driver_cuda:
        if runtime[0] > driver_cuda[0]:
            return Finding(
                "fail", f"{detail}: torch's CUDA {cuda} needs a newer driver than this one, which runs CUDA up "
                        f"to {driver_cuda[0]}.{driver_cuda[1]}",
                f"upgrade the NVIDIA driver, or install torch built for it: pip install --force-reinstall "
                f"torch=={torch_plain} --index-url https://download.pytorch.org/whl/{_torch_cuda_tag(driver_cuda)}")
        if runtime > driver_cuda:
            return Finding(
                "warn", f"{detail}: torch's CUDA {cuda} is newer than the driver's CUDA "
                        f"{driver_cuda[0]}.{driver_cuda[1]}; it runs through CUDA minor-version compatibility, but "
                        "kernels JIT-compiled from PTX can fail",
                "upgrade the NVIDIA driver, or install torch built for "
                f"{_torch_cuda_tag(driver_cuda)} (--index-url https://download.pytorch.org/whl/"
                f"{_torch_cuda_tag(driver_cuda)})")
    if has_gpus and isinstance(ctx.visible_gpus, list) and ctx.visible_gpus and not torch.cuda.is_available():
        return Finding("fail", f"{detail}: NVML sees the GPUs but torch cannot start CUDA",
                       "check that the driver and torch's CUDA build match (nvidia-smi, python -c 'import torch; "
                       "torch.cuda.init()') and that the container was started with --gpus all")
    if not has_gpus:
        detail += "; CPU-only here: plans work, training runs with DS_ACCELERATOR=cpu"
    return Finding("ok", detail)


@check("libraries")
def check_libraries(ctx: Context) -> Finding:
    """The libraries whose internals zerotrain uses, against the versions it was tested with."""
    from zerotrain import versions
    from zerotrain.deepspeed_compat import PIN_BACKEND, buffer_sharing

    found = versions.check_all()
    detail = ", ".join(v.describe() for v in found)
    missing = [v.name for v in found if v.installed is None]
    if missing:
        return Finding("fail", detail, f"pip install -e . (installs {', '.join(missing)})")
    untested = [v for v in found if not v.is_tested]
    sharing = buffer_sharing(environ=ctx.environ)
    if not sharing.enabled:
        detail += f"; buffer sharing is off ({sharing.why}), and plans count DeepSpeed's own copies"
    if not untested and sharing.enabled:
        return Finding("ok", detail)
    advice = [("install the tested versions: pip install "
               + " ".join(f"'{v.name}=={v.tested[-1]}'" for v in untested))] if untested else []
    if buffer_sharing(environ={}).enabled and not sharing.enabled:
        advice.append(f"unset {PIN_BACKEND}")
    return Finding("warn", detail, "; ".join(advice))


def _needed_ops(layout: Any) -> dict[str, str]:
    """The ops the planned DeepSpeed config loads, and why: DeepSpeed's AdamW is FusedAdam on the
    accelerator and DeepSpeedCPUAdam when the optimizer is offloaded (engine.get_optimizer_configuration);
    NVMe offload swaps through async_io. A client optimizer (adamw-8bit, adafactor) needs none:
    bitsandbytes and transformers bring their own."""
    from zerotrain import optimizers

    if optimizers.get(layout.optimizer).client:
        needed = {}
    elif layout.offload_optimizer == "none":
        needed = {"fused_adam": "AdamW on the accelerator"}
    else:
        needed = {"cpu_adam": f"AdamW on the CPU (optimizer offloaded to {layout.offload_optimizer})"}
    if "nvme" in (layout.offload_optimizer, layout.offload_param):
        needed["async_io"] = "NVMe offload"
    return needed


def _jit_note(name: str, why: str, unbuilt: list[tuple[str, Any]] | None) -> str:
    """Whether the plan's op `name`, compiled just in time, is built on this machine already (unbuilt:
    deepspeed_compat.jit_builds, None where DeepSpeed is not a tested version and it cannot tell)."""
    from zerotrain.deepspeed_compat import BUILD_TIME

    if unbuilt is not None and name not in {op for op, _ in unbuilt}:
        return f"the plan's {name} ({why}) is built in torch's extension cache"
    when = ("is JIT-compiled on first use unless built already" if unbuilt is None
            else "is not built on this machine: the first run compiles it")
    return f"the plan's {name} ({why}) {when} ({BUILD_TIME[name]}, once; `zerotrain build-ops` compiles it now)"


OP_ADVICE = {
    "async_io": "install libaio (apt install libaio-dev) and reinstall DeepSpeed, or keep the plan off NVMe "
                "(--set planner.offload=[none,cpu])",
    "fused_adam": "install the CUDA toolkit matching torch's CUDA (nvcc, CUDA_HOME), or a DeepSpeed built with "
                  "DS_BUILD_FUSED_ADAM=1",
    "cpu_adam": "install a C++ compiler (apt install build-essential), or a DeepSpeed built with DS_BUILD_CPU_ADAM=1",
}


@check("deepspeed ops")
def check_deepspeed(ctx: Context) -> Finding:
    import torch

    from zerotrain.deepspeed_compat import jit_builds, op_report

    ds = op_report()
    ops, info = ds["ops"], ds["torch_info"]
    plan = ctx.plan
    needed = _needed_ops(plan.chosen.layout) if not isinstance(plan, Missing) and plan.chosen else {}
    prebuilt = [name for name, op in ops.items() if op["prebuilt"]]
    incompatible = [name for name, op in ops.items() if not op["compatible"]]
    notes = [f"accelerator {ds['accelerator']}", f"prebuilt ops: {', '.join(prebuilt) or 'none'}",
             f"not compatible here: {', '.join(incompatible) or 'none'}", f"ninja {'found' if ds['ninja'] else 'missing'}"]
    problems: list[Finding] = []
    unbuilt = jit_builds([name for name in needed if name in ops])
    for name, why in needed.items():
        op = ops.get(name)
        if op is None:
            problems.append(Finding("warn", f"the plan needs {name} ({why}), which this DeepSpeed lacks",
                                    "pip install -U deepspeed"))
        elif op["prebuilt"]:
            notes.append(f"the plan's {name} ({why}) is prebuilt")
        elif not op["compatible"]:
            problems.append(Finding("fail", f"the plan needs {name} ({why}), which cannot be built here",
                                    OP_ADVICE.get(name, f"see ds_report for what {name} lacks")))
        elif not ds["ninja"]:
            problems.append(Finding("fail", f"the plan needs {name} ({why}): not prebuilt, and compiling it "
                                            "needs ninja", "pip install ninja"))
        else:
            notes.append(_jit_note(name, why, unbuilt))
    if not needed:
        notes.append("no plan here, so no op is required yet" if isinstance(plan, Missing)
                     else "nothing fits, so no op is required yet")
    reinstall = "reinstall DeepSpeed for this torch: pip install --force-reinstall --no-cache-dir deepspeed"
    if info.get("version", "0.0") != "0.0" and _version_tuple(info["version"]) != _version_tuple(torch.__version__):
        problems.append(Finding("warn", f"DeepSpeed's prebuilt ops were compiled against torch {info['version']}, "
                                        f"running {torch.__version__}: they may fail to load", reinstall))
    built_cuda = info.get("cuda_version", "0.0")
    if built_cuda != "0.0" and torch.version.cuda and _version_tuple(built_cuda) != _version_tuple(torch.version.cuda):
        problems.append(Finding("warn", f"DeepSpeed's ops were compiled with CUDA {built_cuda}, torch runs CUDA "
                                        f"{torch.version.cuda}", reinstall))
    gpus = ctx.visible_gpus
    if ds["accelerator"] == "cpu" and isinstance(gpus, list) and gpus and ctx.torch_gpus:
        problems.append(Finding("warn", f"DeepSpeed chose the cpu accelerator (DS_ACCELERATOR="
                                        f"{ctx.environ.get('DS_ACCELERATOR')}) on a node with GPUs",
                                "unset DS_ACCELERATOR so that DeepSpeed trains on the GPUs"))
    if not problems:
        return Finding("ok", "; ".join(notes))
    return _combine("; ".join(notes) + "; ", problems)


def _gpu_list(gpus: list[GPUInfo]) -> str:
    return ", ".join(f"{g.index}: {g.name} ({_size(g.total_bytes)})" for g in gpus)


@check("gpus")
def check_gpus(ctx: Context) -> Finding:
    import torch

    gpus, mask, torch_count = ctx.nvml_gpus, ctx.environ.get("CUDA_VISIBLE_DEVICES"), ctx.torch_gpus
    if isinstance(gpus, Missing):
        if torch_count == 0:
            return Finding("skip", f"no GPU visible (NVML absent: {gpus.reason}); torch sees none either")
        return Finding("warn", f"torch sees {torch_count} GPU(s) but NVML is unavailable ({gpus.reason}), so "
                               "hardware.gpus=auto and these checks cannot read them",
                       "pip install nvidia-ml-py, and in a container make libnvidia-ml visible (docker run --gpus "
                       "all); or name the GPUs: --gpus 8xA100-80GB")
    visible = ctx.visible_gpus
    if isinstance(visible, Missing):
        return Finding("warn", visible.reason, "name the GPUs with --gpus N --gpu-memory SIZE")
    n = len(gpus)
    ids = ",".join(str(i) for i in range(n))
    include = f"deepspeed --include localhost:{ids}"
    shown = f"CUDA_VISIBLE_DEVICES={mask}" if mask is not None else "CUDA_VISIBLE_DEVICES unset"
    detail = f"NVML: {n} GPU(s) ({_gpu_list(gpus)}); {shown}; torch sees {torch_count}"
    entries = [e.strip() for e in mask.split(",")] if mask is not None and mask.strip() else []
    if n and mask is not None and not visible:
        why = "lists a GPU twice, which makes CUDA hide every GPU" if len(set(entries)) < len(entries) \
            else f"hides all {n} GPUs"
        return Finding("fail", f"{detail}: CUDA_VISIBLE_DEVICES {why}",
                       f"unset CUDA_VISIBLE_DEVICES or list distinct GPUs (0 to {n - 1}); with the DeepSpeed "
                       f"launcher choose them with `{include}` instead")
    if len(visible) < len(entries):
        bad = entries[len(visible)]
        return Finding(
            "fail", f"{detail}: CUDA_VISIBLE_DEVICES lists {len(entries)} GPUs but this node has {n} (NVML "
                    f"0-{n - 1}); CUDA stops at '{bad}', so processes see only {len(visible)}, and a rank that "
                    f"asks for cuda:{len(visible)} fails with 'invalid device ordinal'",
            f"list only GPUs 0 to {n - 1} (e.g. CUDA_VISIBLE_DEVICES={ids}) or unset it; the DeepSpeed launcher "
            f"rewrites CUDA_VISIBLE_DEVICES, so choose GPUs with `{include}` instead")
    problems: list[Finding] = []
    if torch.cuda.is_available() and torch_count != len(visible):
        problems.append(Finding("fail", f"torch sees {torch_count} GPU(s) where NVML and CUDA_VISIBLE_DEVICES give "
                                        f"{len(visible)}",
                                "check CUDA_VISIBLE_DEVICES and that torch and NVML talk to the same driver "
                                "(nvidia-smi)"))
    from zerotrain.distributed import local_world_size

    local = local_world_size(ctx.environ)
    if local and local > len(visible):
        problems.append(Finding("fail", f"the launcher starts {local} processes on this node but {len(visible)} "
                                        "GPU(s) are visible; the extra ranks fail with 'invalid device ordinal'",
                                f"start one process per visible GPU (torchrun --nproc_per_node {len(visible)}, "
                                f"or `{include}`)"))
    spec = ctx.run.hardware.gpus.strip()
    if spec.lower() != "auto":
        with contextlib.suppress(ZerotrainError):
            planned = parse_gpu_spec(spec, ctx.run.hardware.gpu_memory)[0]
            if planned != len(visible):
                problems.append(Finding("warn", f"the config plans for {planned} GPU(s) per node "
                                                f"(hardware.gpus={spec}) but {len(visible)} are visible here",
                                        "on the training node use hardware.gpus=auto (--gpus auto), or fix the "
                                        "count"))
    if len({g.name for g in visible}) > 1 and ctx.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        problems.append(Finding("warn", "the GPUs differ, and CUDA numbers them fastest first while NVML and "
                                        "nvidia-smi number them by PCI bus, so cuda:N need not be NVML's N",
                                "export CUDA_DEVICE_ORDER=PCI_BUS_ID"))
    if not problems:
        note = f" (the DeepSpeed launcher rewrites CUDA_VISIBLE_DEVICES: use `{include}`)" if mask is not None else ""
        return Finding("ok", f"{detail}; {len(visible)} visible{note}")
    return _combine(f"{detail}: ", problems)


def _combine(prefix: str, problems: list[Finding]) -> Finding:
    """One finding from several: the worst verdict, the details and the distinct advice joined."""
    verdict: Verdict = max((p.verdict for p in problems), key=EXIT_CODES.__getitem__)
    advice = "; ".join(dict.fromkeys(p.advice for p in problems if p.advice))
    return Finding(verdict, prefix + "; ".join(p.detail for p in problems), advice or None)


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in TRUE_VALUES


@check("nccl p2p")
def check_p2p(ctx: Context) -> Finding:
    import torch

    count = ctx.torch_gpus
    if count == 0:
        return Finding("skip", "no GPU visible to torch: no peer-to-peer traffic to check")
    if count == 1:
        return Finding("skip", "one GPU: no peer-to-peer traffic within the node")
    missing = [(i, j) for i in range(count) for j in range(count)
               if i != j and not torch.cuda.can_device_access_peer(i, j)]
    disabled = _truthy(ctx.environ.get("NCCL_P2P_DISABLE"))
    pairs = ", ".join(f"{i}->{j}" for i, j in missing[:8]) + (" ..." if len(missing) > 8 else "")
    if missing and disabled:
        return Finding("ok", f"no peer access for {pairs}, and NCCL_P2P_DISABLE=1 is set, so NCCL goes through "
                             "host shared memory")
    if missing:
        return Finding(
            "warn", f"{len(missing)} of {count * (count - 1)} GPU pairs have no peer-to-peer access ({pairs}): "
                    "NCCL falls back to host shared memory, and on some systems (consumer cards, VMs with "
                    "IOMMU/ACS) hangs or errors when it tries P2P",
            "if collectives hang or fail at start, export NCCL_P2P_DISABLE=1; NCCL_P2P_LEVEL (LOC, NVL, PIX, PXB, "
            "PHB, SYS) limits which paths NCCL uses for P2P")
    if disabled:
        return Finding("warn", f"all {count} GPUs reach each other directly, but NCCL_P2P_DISABLE=1 makes NCCL "
                               "copy through host memory (slower)", "unset NCCL_P2P_DISABLE")
    return Finding("ok", f"all {count * (count - 1)} GPU pairs have peer-to-peer access (NVLink or PCIe)")


def _hub_cache_dir(environ: Mapping[str, str]) -> Path:
    """The hub cache a new process would use (huggingface_hub.constants, read from the environment now,
    since the library reads it once at import)."""
    explicit = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(os.path.expanduser(explicit)))
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def _hub_offline(environ: Mapping[str, str]) -> bool:
    return _truthy(environ.get("HF_HUB_OFFLINE") or environ.get("TRANSFORMERS_OFFLINE"))


def _has_weights(folder: Path) -> bool:
    """A denoiser/VAE folder whose weights are all there: an index's every shard, or a single file."""
    for index in folder.glob("*.index.json"):
        with contextlib.suppress(OSError, ValueError):
            shards = set(json.loads(index.read_text())["weight_map"].values())
            return bool(shards) and all((folder / shard).is_file() for shard in shards)
    return any(p.is_file() for pattern in ("*.safetensors", "*.bin") for p in folder.glob(pattern))


def _hub_finding(ctx: Context, repo: str, subfolder: str | None,
                 size_hint: Callable[[], str] = lambda: "") -> Finding:
    """Whether a hub repo's weights are in the local hub cache, without the network. size_hint is
    called only when the download is still to come."""
    from huggingface_hub import try_to_load_from_cache

    from zerotrain.models.catalog import PIPELINE_INDEXES, pipeline_index

    cache, offline, revision = _hub_cache_dir(ctx.environ), _hub_offline(ctx.environ), ctx.run.model.revision
    where = f"hub repo {repo}" + (f"@{revision}" if revision else "")
    snapshot = None
    for name in (*PIPELINE_INDEXES, "config.json"):
        found = try_to_load_from_cache(repo, name, cache_dir=cache, revision=revision)
        if isinstance(found, str):
            snapshot = Path(found).parent
            break
    folders = [f for f in (subfolder, "vae") if f] if snapshot and pipeline_index(snapshot) else [""]
    complete = snapshot is not None and all(_has_weights(snapshot / f) for f in folders)
    if complete:
        return Finding("ok", f"{where}: weights ({', '.join(f or 'denoiser' for f in folders)}) in the local hub "
                             f"cache {snapshot}")
    state = "partly in" if snapshot else "not in"
    fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    if offline:
        return Finding("fail", f"{where} is {state} the hub cache {cache}, and HF_HUB_OFFLINE is set: loading fails",
                       f"where there is network run `{fetch}` (with this HF_HOME / HF_HUB_CACHE), or download it to "
                       "a folder and set model.name_or_path to it; or unset HF_HUB_OFFLINE")
    return Finding("warn", f"{where} is {state} the hub cache {cache}: the first run downloads it"
                           f"{size_hint()}",
                   f"download it before the job: `{fetch}` (gated repos: accept the license on huggingface.co and "
                   "`hf auth login` first)")


def _denoiser_size(ctx: Context) -> str:
    facts = ctx.facts
    return "" if isinstance(facts, Missing) else f" (the denoiser alone is {_size(2 * facts.total_params)} in bf16)"


@check("model")
def check_model(ctx: Context) -> Finding:
    from zerotrain.models.catalog import HUB_ID, catalog_names, resolve_model

    model = ctx.run.model
    name = model.name_or_path
    if name in catalog_names():
        spec = resolve_model(model)  # a catalog entry resolves offline
        if spec.pretrained is None:
            return Finding("ok", f"{name} is built locally on first use (random weights, for tests and CPU demos)")
        # A catalog architecture is measured offline, so its size can be told; a bare hub id's config
        # would need the network.
        return _hub_finding(ctx, spec.pretrained, model.subfolder or spec.subfolder, lambda: _denoiser_size(ctx))
    path = Path(name).expanduser()
    if path.exists():
        spec = ctx.spec
        if isinstance(spec, Missing):
            return Finding("fail", spec.reason, "point model.name_or_path at a diffusers model folder")
        if path.is_file():
            return Finding("warn", f"{path} is a bare config.json: it plans, but caching and training need the "
                                   "weights", "point model.name_or_path at the diffusers model folder or hub id")
        denoiser = Path(spec.pretrained) / (spec.subfolder or "")
        if not _has_weights(denoiser):
            return Finding("fail", f"{denoiser} holds no complete weights (*.safetensors, *.bin)",
                           "finish the download or save_pretrained into the folder")
        return Finding("ok", f"local folder {path}: {spec.class_name} weights in {denoiser}")
    if HUB_ID.match(name) and not name.endswith(".json"):
        return _hub_finding(ctx, name, model.subfolder)
    return Finding("fail", f"model.name_or_path={name}: no such folder or file, and not a catalog name or hub id",
                   f"fix the path, or use a catalog name ({', '.join(catalog_names())}) or a hub id (owner/name)")


@check("plan")
def check_plan(ctx: Context) -> Finding:

    plan = ctx.plan
    if isinstance(plan, Missing):
        if plan.expected:
            return Finding("skip", "no GPU visible (NVML absent) and hardware.gpus=auto: nothing to plan for "
                                   "here; name the GPUs (--gpus 8xA100-80GB) to check a plan")
        return Finding("fail", plan.reason, "fix the config; `zerotrain plan` shows the same with more detail")
    if plan.chosen is None:
        return Finding("fail", f"nothing fits {plan.hardware}",
                       "run `zerotrain plan` with the same config: it lists what would fit")
    memory = plan.chosen.memory
    return Finding("ok", f"{_layout_words(plan.chosen)}: {gib(memory.device_total)} per GPU of a "
                         f"{gib(plan.gpu_budget_bytes)} budget, {plan.chosen.images_per_second:.2f} images/s predicted "
                         f"on {plan.hardware}")


def _free_memory(ctx: Context) -> list[GPUInfo] | Missing:
    """Total and free memory of each visible GPU: NVML's, or torch's when NVML is absent."""
    import torch

    visible = ctx.visible_gpus
    if isinstance(visible, list) or ctx.torch_gpus == 0:
        return visible
    gpus = []
    for i in range(ctx.torch_gpus):
        free, total = torch.cuda.mem_get_info(i)
        gpus.append(GPUInfo(i, torch.cuda.get_device_name(i), "", int(total), int(free)))
    return gpus


@check("gpu memory")
def check_gpu_memory(ctx: Context) -> Finding:
    gpus = _free_memory(ctx)
    if isinstance(gpus, Missing):
        absent = "NVML absent" if gpus.expected else "NVML unusable"
        return Finding("skip", f"no GPU visible ({absent}: {gpus.reason})")
    if not gpus:
        return Finding("skip", "no GPU visible (CUDA_VISIBLE_DEVICES hides them; see gpus)")
    held = {g.index: g.total_bytes - g.free_bytes for g in gpus}
    usage = ", ".join(f"GPU {g.index}: {_size(g.free_bytes)} free of {_size(g.total_bytes)}" for g in gpus)
    idle = ctx.idle_plan
    if isinstance(idle, Missing) or idle.chosen is None:
        busy = [i for i, n in held.items() if n > OTHER_PROCESS_NOTICE]
        if busy:
            return Finding("warn", f"{usage}; other processes hold memory on GPU {', '.join(map(str, busy))}; "
                                   f"{_no_plan(idle)}",
                           "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv shows who")
        return Finding("ok", f"{usage}; {_no_plan(idle)}")
    need = idle.chosen.memory.device_total
    headroom = ctx.run.planner.headroom
    short = [g for g in gpus if need > int(min(g.total_bytes, g.free_bytes) * (1 - headroom))]
    planned = f"the plan ({_layout_words(idle.chosen)}) needs {_size(need)} per GPU plus {headroom:.0%} headroom"
    if not short:
        return Finding("ok", f"{usage}; {planned}")
    worst = min(short, key=lambda g: g.free_bytes)
    shortfall = (f"GPU {worst.index} ({worst.name}) has {_size(worst.free_bytes)} free of {_size(worst.total_bytes)} "
                 f"({_size(held[worst.index])} in use), but {planned}")
    who = "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv shows which processes hold it"
    hw = ctx.hardware
    fallback = None if isinstance(hw, Missing) else ctx.plan_for(
        dataclasses.replace(hw, gpu_free_bytes=min(g.free_bytes for g in gpus)))
    if fallback is not None and not isinstance(fallback, Missing) and fallback.chosen is not None:
        return Finding("warn", f"{shortfall}; with what is free the planner falls back to "
                               f"{_layout_words(fallback.chosen)} ({fallback.chosen.images_per_second:.2f} vs "
                               f"{idle.chosen.images_per_second:.2f} images/s)",
                       f"free the GPUs before a long job ({who}), or accept the slower plan")
    return Finding("fail", f"{shortfall}; nothing fits in the free memory",
                   f"stop the processes holding GPU memory ({who}), or choose idle GPUs (deepspeed --include "
                   "localhost:...)")


def available_host_memory(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """RAM that can be allocated now: MemAvailable, capped by what the container's cgroup leaves."""
    available = None
    with contextlib.suppress(OSError, AttributeError):
        match = re.search(r"MemAvailable:\s*(\d+)\s*kB", Path("/proc/meminfo").read_text())
        available = int(match.group(1)) * 1024
    with contextlib.suppress(OSError, ValueError):
        limit = (cgroup_root / "memory.max").read_text().strip()
        if limit.isdigit():
            left = int(limit) - int((cgroup_root / "memory.current").read_text())
            available = left if available is None else min(available, left)
    return available


@check("host ram")
def check_host_ram(ctx: Context) -> Finding:
    total, available = host_memory_bytes(), available_host_memory()
    have = f"{_size(total)} RAM here" + (f" ({_size(available)} available)" if available is not None else "")
    plan = ctx.plan
    if isinstance(plan, Missing) or plan.chosen is None:
        return Finding("skip", f"{have}; {_no_plan(plan)}")
    memory = plan.chosen.memory
    terms = ", ".join(f"{k} {_size(v)}" for k, v in memory.host_terms.items() if v)
    need = f"the plan ({_layout_words(plan.chosen)}) needs {_size(memory.host_per_node)} per node ({terms})"
    if memory.host_per_node > total:
        return Finding("fail", f"{have}, but {need}",
                       "plan with this node's RAM (hardware.gpus=auto measures it, or set hardware.host_memory), "
                       "offload to NVMe (hardware.nvme_path), or train LoRA / on more nodes")
    if available is not None and memory.host_per_node > available:
        return Finding("warn", f"{have}, but {need}: other processes hold the rest",
                       "stop what holds host memory (top, sorted by RES) before the job")
    return Finding("ok", f"{have}; {need}")


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def _probe_write(folder: Path) -> str | None:
    """None when a file can be written in `folder`, else why not."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".zerotrain-doctor-"):
            pass
    except OSError as err:
        return one_line(err)
    return None


@check("nvme")
def check_nvme(ctx: Context) -> Finding:
    config = ctx.run.hardware
    if config.nvme_path is None:
        return Finding("skip", "no NVMe offload (hardware.nvme_path unset)")
    folder = _existing_ancestor(config.nvme_path)
    if not folder.is_dir():
        return Finding("fail", f"hardware.nvme_path={config.nvme_path}: {folder} is a file",
                       "point hardware.nvme_path at a folder on a local NVMe drive")
    error = _probe_write(folder)
    if error:
        return Finding("fail", f"hardware.nvme_path={config.nvme_path}: cannot write in {folder} ({error})",
                       "choose a writable folder on a local NVMe drive, or fix its permissions")
    free = shutil.disk_usage(folder).free
    have = f"{_size(free)} free at {folder}"
    plan = ctx.plan
    if isinstance(plan, Missing) or plan.chosen is None:
        return Finding("ok", f"{have}; {_no_plan(plan)}")
    need = plan.chosen.memory.nvme_per_node
    if not need:
        return Finding("ok", f"{have}; the plan ({_layout_words(plan.chosen)}) does not offload to NVMe")
    planned = f"the plan ({_layout_words(plan.chosen)}) swaps {_size(need)} per node"
    if need > free:
        return Finding("fail", f"{have}, but {planned}" + (
            f" (hardware.nvme_space={config.nvme_space} was planned for)" if config.nvme_space else ""),
                       "free space on the drive, point hardware.nvme_path at a larger one, or plan without NVMe "
                       "(--set planner.offload=[none,cpu])")
    return Finding("ok", f"{have}; {planned}")


@check("shm")
def check_shm(ctx: Context) -> Finding:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return Finding("skip", "no /dev/shm on this system")
    usage = shutil.disk_usage(shm)
    workers, ranks = ctx.run.data.num_workers, ctx.ranks_per_node
    need = max(workers * ranks * SHM_PER_WORKER, SHM_FOR_NCCL if ranks > 1 else 0)
    have = f"/dev/shm: {_size(usage.free)} free of {_size(usage.total)}"
    uses = (f"{workers} DataLoader worker(s) x {ranks} rank(s) per node at {_size(SHM_PER_WORKER)} each"
            if workers else f"data.num_workers=0 (no DataLoader workers), {ranks} rank(s) per node")
    if usage.free < need:
        return Finding("warn", f"{have}; {uses} want about {_size(need)}: workers die with 'Bus error' and NCCL "
                               "with 'unhandled system error' when it runs out",
                       "in Docker: docker run --ipc=host (or --shm-size=16g); on Kubernetes mount an emptyDir "
                       "with medium: Memory at /dev/shm; or lower data.num_workers")
    return Finding("ok", f"{have}; {uses}")


def _checkpoint_bytes(ctx: Context) -> int | None:
    facts = ctx.facts
    if isinstance(facts, Missing):
        return None
    # the bf16 weights, the master and the optimizer's state of the optimizer the plan trains with;
    # frozen weights are not saved (exclude_frozen_parameters)
    from zerotrain import optimizers

    plan = ctx.plan
    name = plan.chosen.layout.optimizer if not isinstance(plan, Missing) and plan.chosen else \
        ctx.run.optimizer.name if ctx.run.optimizer.name != "auto" else ctx.run.planner.optimizers[0]
    per_param = optimizers.get(name).checkpoint_bytes_per_param() + (EMA_BYTES_PER_PARAM if ctx.run.ema.enabled else 0)
    return int(per_param * facts.trainable_params)


@check("output")
def check_output(ctx: Context) -> Finding:
    out = ctx.run.output_dir
    if out.exists() and not out.is_dir():
        return Finding("fail", f"output_dir={out} is a file", "set output_dir to a folder (--set output_dir=PATH)")
    folder = _existing_ancestor(out)
    if not folder.is_dir():
        return Finding("fail", f"output_dir={out} cannot be created: {folder} is a file",
                       "set output_dir to a folder path (--set output_dir=PATH)")
    error = _probe_write(folder)
    if error:
        return Finding("fail", f"output_dir={out}: cannot write in {folder} ({error})",
                       "set output_dir to a writable folder (--set output_dir=PATH), or fix its permissions")
    free = shutil.disk_usage(folder).free
    where = f"output_dir={out}" + ("" if folder == out.absolute() else f" (to be created in {folder})")
    checkpoint = _checkpoint_bytes(ctx)
    if checkpoint is None:
        return Finding("ok", f"{where}: writable, {_size(free)} free; checkpoint size unknown ({ctx.facts.reason})")
    keep = ctx.run.training.keep_checkpoints
    # A new checkpoint is written before the oldest is removed.
    need = (keep + 1) * checkpoint
    sizes = (f"{_size(free)} free; a checkpoint is about {_size(checkpoint)}, {keep} kept + 1 being written = "
             f"{_size(need)}")
    if free < checkpoint:
        return Finding("fail", f"{where}: {sizes}: not even one checkpoint fits",
                       "free space, or set output_dir on a larger drive")
    if free < need:
        return Finding("warn", f"{where}: {sizes}: the disk fills before training.keep_checkpoints is reached",
                       "free space, lower training.keep_checkpoints, or use a larger drive")
    return Finding("ok", f"{where}: writable; {sizes}")


def run_checks(run: RunConfig, *, config_path: Path | None = None, debug: bool = False) -> list[Check]:
    """Every check, in order. An exception inside a check becomes a warning with its text (debug
    lets it through, for the traceback)."""
    ctx = Context(run, config_path)
    checks = []
    for name, function in CHECKS:
        try:
            finding = function(ctx)
        except Exception as err:  # a check must never stop the others
            if debug:
                raise
            finding = Finding("warn", f"the check itself failed: {type(err).__name__}: {one_line(err, 300)}",
                              "run `zerotrain --debug doctor ...` for the traceback, and report it")
        checks.append(Check(name, finding.verdict, finding.detail, finding.advice))
    return checks


def add_parser(commands: Any) -> None:
    """Register `doctor` on an argparse subparsers object, with `zerotrain plan`'s shorthand flags
    (config.flags.config_from_args maps them to config fields through PLAN_FLAGS)."""
    d = commands.add_parser("doctor", help="check this machine before a long job: versions, GPUs, NCCL, memory, "
                                           "disk, model (exit 0 ok, 1 warnings, 2 failures)")
    add_plan_flags(d)
    d.add_argument("--json", action="store_true", help="print the checks as JSON")


def to_json(checks: list[Check]) -> dict[str, Any]:
    counts = {verdict: sum(c.verdict == verdict for c in checks) for verdict in EXIT_CODES}
    return {"checks": [dataclasses.asdict(c) for c in checks], "summary": {**counts, "exit_code": exit_code(checks)}}


STYLES = {"ok": "bold green", "warn": "bold yellow", "fail": "bold red", "skip": "dim"}


def print_checks(checks: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)
    table = Table(title="zerotrain doctor", title_justify="left", show_lines=True)
    table.add_column("check", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    table.add_column("detail", ratio=3)
    table.add_column("what to do", ratio=2)
    for c in checks:
        # Text, not markup: details hold square brackets ("[nvml]") that rich would take for tags.
        table.add_row(c.name, Text(c.verdict, style=STYLES[c.verdict]), Text(c.detail), Text(c.advice or ""))
    console.print(table)
    summary = to_json(checks)["summary"]
    console.print(f"{summary['ok']} ok, {summary['warn']} warning(s), {summary['fail']} failure(s), "
                  f"{summary['skip']} skipped: exit {summary['exit_code']}")


def main(args: argparse.Namespace) -> int:
    """Run the checks, print them (a table, or JSON with --json) and return exit_code."""
    try:
        run = config_from_args(args)
    except ZerotrainError as err:
        checks = [Check("config", "fail", str(err), "fix the config file or the --set / flag values")]
    else:
        with contextlib.redirect_stdout(sys.stderr):  # library chatter must not mix into the report
            checks = run_checks(run, config_path=args.config, debug=getattr(args, "debug", False))
    if args.json:
        print(json.dumps(to_json(checks), indent=2))
    else:
        print_checks(checks)
    return exit_code(checks)
