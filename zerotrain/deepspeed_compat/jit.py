"""DeepSpeed's ops: the report `zerotrain doctor` shows, whether an op was installed with DeepSpeed, and the
one line a run prints before an op is compiled just in time."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from zerotrain import versions

# ---- what `zerotrain doctor` reports ----

def op_report() -> dict[str, Any]:
    """What ds_report shows, as data: the accelerator, the torch/CUDA the ops were prebuilt with, and
    for each op whether it is prebuilt and whether it could be JIT-compiled here (ds_report's
    sources: git_version_info, op_builder.all_ops, op_builder.builder.probe_is_compatible)."""
    # DeepSpeed's logger binds the stdout it finds at import, and its probes print; keep both on
    # stderr so that --json prints only JSON.
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops, torch_info
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible
        from torch.utils.cpp_extension import is_ninja_available

        accelerator = get_accelerator()._name
        ops = {name: {"prebuilt": bool(installed_ops.get(name)) and accelerator_name == accelerator,
                      "compatible": bool(probe_is_compatible(builder, False))}
               for name, builder in ALL_OPS.items()}
        return {"accelerator": accelerator, "torch_info": dict(torch_info), "ops": ops,
                "ninja": is_ninja_available()}


# DeepSpeed's JIT-compiled ops that zerotrain's layouts load, by op builder class (each accelerator maps
# the class to its own builder, or to none): AdamW with the optimizer offloaded (cpu_adam) or on the
# accelerator (fused_adam), NVMe offload (async_io), and on the CPU accelerator its shared-memory
# collectives (init_distributed) and pinned host buffers (offload). Async I/O, the longest build by far
# (about 8 minutes on 2 cores), last.
TRAINING_OPS = ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "PinMemoryBuilder", "AsyncIOBuilder")
# The ops only one kind of layout loads, by op name -> that layout: `zerotrain build-ops` leaves them to the first
# run that needs them (which says so before it compiles) or to `build-ops --all` / `build-ops NAME`.
ON_REQUEST_OPS = {"async_io": "NVMe offload"}



def prebuilt(name: str) -> bool:
    """Whether op `name` was compiled when DeepSpeed was installed (git_version_info's installed_ops)."""
    from deepspeed.git_version_info import installed_ops

    return bool(installed_ops.get(name))

# ---- one line before an op is compiled just in time ----

# TRAINING_OPS by the op's name (builder.NAME: the name build-ops, doctor and torch's extension cache use).
OP_BUILDERS = dict(zip(("deepspeed_shm_comm", "cpu_adam", "fused_adam", "pin_memory", "async_io"), TRAINING_OPS,
                       strict=True))

# How long a first build takes, for the notice. `zerotrain build-ops` on the project's 2-core CPU machine
# (2026-11-28, its cores shared with other work): deepspeed_shm_comm 43 s, cpu_adam 81 s, fused_adam (the CPU
# accelerator's C++ op) 60 s, pin_memory 31 s; alone on it (2026-12-02): 27 s, 43 s, 39 s, 18 s and async_io 134 s.
# Busier, the same kind of machine took over 4 minutes for deepspeed_shm_comm (issue 38), about 5 for cpu_adam
# (zerotrain.ops.STALE_BUILD_LOCK_S) and about 8 for async_io (tests/distributed/test_nvme_offload.py). FusedAdam's CUDA op with nvcc on a 16-core GPU node: about a
# minute (issue 38).
BUILD_TIME = {"deepspeed_shm_comm": "1 to 4 minutes on 2 CPU cores", "cpu_adam": "1 to 5 minutes on 2 CPU cores",
              "fused_adam": "about a minute", "pin_memory": "about 30 s on 2 CPU cores",
              "async_io": "2 to 8 minutes on 2 CPU cores"}


def jit_builds(names: Iterable[str]) -> list[tuple[str, Path]] | None:
    """The ops among `names` (OP_BUILDERS' keys), with their build directories, that their first load() in
    this process would compile now, as DeepSpeed 0.19.8's OpBuilder.load and jit_load and torch's
    cpp_extension.load decide: not loaded in this process yet (OpBuilder._loaded_ops), not installed with
    DeepSpeed for this accelerator (git_version_info), and not built in torch's extension cache for this
    Python and torch build (_cached). An op that cannot be built here (incompatible, no ninja) is left out:
    load() raises before compiling anything. None on a DeepSpeed not tested, whose load() may decide otherwise."""
    if not versions.check("deepspeed").is_tested:
        return None
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's logger and probes print as they load
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops
        from deepspeed.ops.op_builder.builder import OpBuilder
        from torch.utils.cpp_extension import is_ninja_available

        if not is_ninja_available():  # torch's load() needs ninja even to load a built op: nothing compiles
            return []
        accelerator = get_accelerator()
        pending = []
        for name in names:
            builder = accelerator.create_op_builder(OP_BUILDERS[name])
            if builder is None or builder.name == "deepspeed_not_implemented" or builder.name in OpBuilder._loaded_ops:
                continue
            if installed_ops.get(builder.name) and accelerator_name == accelerator._name:
                continue
            directory, built = _cached(builder.name)
            if not built and builder.is_compatible(False):
                pending.append((builder.name, directory))
        return pending


def _cached(name: str) -> tuple[Path, bool]:
    """Op `name`'s build directory in torch's extension cache (TORCH_EXTENSIONS_DIR, by default one folder per
    Python and CUDA/CPU build under ~/.cache/torch_extensions), and whether it holds the op built. A fresh
    process's first load of an extension always runs ninja there (cpp_extension._jit_compile); ninja compiles
    nothing when <name>.so is there and no source or command changed since, which its dry run (-n) reports."""
    from torch.utils.cpp_extension import _get_build_directory

    directory = Path(_get_build_directory(name, False))
    built = (directory / f"{name}.so").exists() and "no work to do" in subprocess.run(
        ["ninja", "-n"], cwd=directory, capture_output=True, text=True, check=False).stdout
    if not built:
        with contextlib.suppress(OSError):  # _get_build_directory made the folder; asking leaves nothing behind
            directory.rmdir()
    return directory, built


def say_jit_builds(names: Iterable[str]) -> list[str]:
    """Before a run loads the ops `names`: one line on stderr for each that jit_builds finds would be compiled
    now, a silence of minutes otherwise. The first process on each machine says it (LOCAL_RANK 0 as the
    launchers set it, or else rank 0), since each machine compiles into its own cache. Returns the ops said."""
    import torch

    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit():
        first = int(local) == 0
    else:
        first = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if not first:
        return []
    pending = jit_builds(names) or []
    for name, directory in pending:
        print(f"zerotrain: compiling DeepSpeed's {name} op before the run goes on, once per machine (and Python and "
              f"torch build), {BUILD_TIME[name]}, into {directory}; `zerotrain build-ops` compiles the ops ahead",
              file=sys.stderr, flush=True)
    return [name for name, _ in pending]
