"""`zerotrain doctor`'s software checks: the run config, the versions of torch, CUDA, the driver and
DeepSpeed, the libraries a run imports, and DeepSpeed's ops for the plan."""

from __future__ import annotations

import platform
from typing import Any

from zerotrain.doctor.base import (
    MIN_DEEPSPEED,
    MIN_TORCH,
    Context,
    Finding,
    Missing,
    _combine,
    _dist_version,
    _torch_cuda_tag,
    _version_tuple,
)
from zerotrain.hardware import (
    Driver,
)


def check_config(ctx: Context) -> Finding:
    run = ctx.run
    source = str(ctx.config_path) if ctx.config_path else "defaults and command-line flags"
    return Finding("ok", f"{source}: model {run.model.name_or_path}, {run.data.resolution}px, "
                         f"{run.training.mode.value}, global batch {run.training.global_batch_size}, "
                         f"hardware.gpus={run.hardware.gpus} x {run.hardware.nodes} node(s), output {run.output_dir}")


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
