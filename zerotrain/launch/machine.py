"""Checks against this machine, for the commands that start here: the GPUs NVML shows, the
CUDA_VISIBLE_DEVICES the DeepSpeed launcher would ignore, and where the launcher executables are."""

from __future__ import annotations

import re
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from zerotrain.errors import ZerotrainError


def local_gpus(environ: Mapping[str, str], nvml: Any = None, apply_mask: bool = True) -> int | None:
    """GPUs a process started here would see through NVML (honouring CUDA_VISIBLE_DEVICES when
    apply_mask), or None when NVML cannot be used (no GPU, no driver)."""
    from zerotrain.hardware import NvmlUnavailable, detect_nvml_gpus, visible_gpu_indices

    try:
        detected = detect_nvml_gpus(nvml)
    except NvmlUnavailable:
        return None
    if not apply_mask:
        return len(detected)
    return len(visible_gpu_indices(environ.get("CUDA_VISIBLE_DEVICES"), detected))


def check_local_gpus(wanted: int, environ: Mapping[str, str], nvml: Any, *, what: str, apply_mask: bool,
                     will_run: bool, highest_index: int | None = None) -> str | None:
    """Refuse to start more ranks here than there are GPUs. CPU ranks (DS_ACCELERATOR=cpu) are
    not limited. Without any GPU visible, --run is refused, and a printed command gets a note."""
    if environ.get("DS_ACCELERATOR") == "cpu":
        return None
    count = local_gpus(environ, nvml, apply_mask)
    if count is None or count == 0:
        if will_run:
            raise ZerotrainError(f"{what}: no GPU is visible here (NVML cannot be used); for CPU ranks (tests, "
                                 "a laptop) set DS_ACCELERATOR=cpu")
        return f"not checked against this machine's GPUs (none visible): {what}"
    mask = environ.get("CUDA_VISIBLE_DEVICES")
    seen = f"{count} GPU(s) visible" + (f" with CUDA_VISIBLE_DEVICES={mask}" if apply_mask and mask is not None else "")
    if wanted > count:
        raise ZerotrainError(f"{what}: {wanted} processes per node but {seen}; one process per GPU, so use "
                             f"--gpus {count} or fewer")
    if highest_index is not None and highest_index >= count:
        raise ZerotrainError(f"{what}: GPU {highest_index} does not exist here ({seen}, indices 0-{count - 1})")
    return None


def refuse_cuda_visible_devices(environ: Mapping[str, str], selection: str) -> None:
    mask = environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return
    raise ZerotrainError(
        f"CUDA_VISIBLE_DEVICES={mask} is set, and the DeepSpeed launcher {selection}: it ignores the variable and "
        "sets its own for every rank, so the ranks would not run on the GPUs you masked (\"invalid device "
        "ordinal\" or the wrong cards). Unset CUDA_VISIBLE_DEVICES and choose GPUs with --include localhost:"
        f"{mask if re.fullmatch(r'[0-9,]+', mask) else '0,1'} (physical indices, as nvidia-smi lists them)")


def executable(name: str) -> str:
    """A launcher from this Python environment (next to sys.executable), else from PATH."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file():
        return str(beside)
    return shutil.which(name) or name
