"""The GPU check: what one short GPU window (about 10 minutes, one node, no network) should measure
first, case by case, each result kept as soon as it is in (issue 38).

    python benchmarks/gpu_check.py --out $OUT                   # on the GPU node: 480 s of cases
    python benchmarks/gpu_check.py --out $OUT --sanitizer --budget 560   # the crash under compute-sanitizer
    python benchmarks/gpu_check.py --only crash,pytest --out DIR   # the cases whose name contains either
    DS_ACCELERATOR=cpu python benchmarks/gpu_check.py --tiny --out DIR  # the same path on CPU (the test)

benchmarks/README.md says how to carry the packages the node lacks (benchmarks/build_gpu_wheels.sh).

The cases, in the order they run (most valuable first), with their time limits in seconds on a GPU
(and with --tiny on a CPU):

| # | case | what | limit (tiny) |
|---|---|---|---|
| 1 | prepare | builds the model folder the train.py cases load: flux-dev cut to 2 blocks at full width, random weights, saved with save_pretrained, with narrow text encoders and VAE whose output widths are the transformer's; and generated captioned images (4 square at 1024 px, 3 of three aspects) | 120 (90) |
| 2 | build-fused-adam | DeepSpeed's FusedAdam op, built once for this node (nvcc, about a minute) | 180 (120) |
| 3 | crash-fused-adam | the crash of the first H200 run through train.py, not calibrate: full fine-tune, ZeRO-1, every block checkpointed, 1024 px, micro-batch 1, 3 steps, the real FusedAdam, CUDA_LAUNCH_BLOCKING=1 | 150 (120) |
| 4 | crash-torch-adam | the same with optimizer.torch_adam (DeepSpeed's "torch_adam": true, "fused": true), as the H200 run had it | 150 (120) |
| 5 | lora-compile-buckets | LoRA through train.py with training.compile=true at ZeRO-0 over three aspect buckets (three batch shapes), 6 steps | 200 (600) |
| 6 | calibrate-flux-dev-lora | `zerotrain calibrate` flux-dev, 2 blocks, LoRA, the star grid (gpu_suite's arguments) | 180 (300) |
| 7 | calibrate-flux-dev-full | the same, full fine-tune | 180 (300) |
| 8 | calibrate-flux-dev-full-no-overlap | the same at ZeRO-1 and 2 with planner.overlap_comm=false, uncheckpointed: whether the first GPU run's skipped steps (non-finite gradients at ZeRO-1/2 only) go with the overlapped reduction streams (each row's skipped_steps) | 120 (300) |
| 9 | calibrate-qwen-image-lora | qwen-image, 2 blocks, LoRA, the star grid | 240 (300) |
| 10 | calibrate-qwen-image-edit-2511-lora-1ref | Qwen-Image-Edit-2511, 2 blocks, LoRA at 1024 px with one reference, the plan's layout (issue 39: its peak against the plan) | 150 (300) |
| 11 | pytest-gpu | tests/distributed/test_gpu.py (out-of-memory recovery, the CUDA load); a gpu-only session builds no CPU op | 300 (120) |
| 12-15 | calibrate-FAMILY-lora | krea-2-raw, ideogram-4, flux3-klein-base, qwen-image-2.1 at 2 blocks, LoRA, the star grid | 150 each (300) |

The GPU limits are estimates, not yet measured on a node: about twice what each case should take on
one H100 (a train.py case: imports, the planner's trace, the cache, three steps, and a full
fine-tune's final checkpoint of about 7 GB); the seconds each case took are recorded, to tighten them.

With --sanitizer, cases 3 and 4 run under `compute-sanitizer --tool memcheck` with
PYTORCH_NO_CUDA_MEMORY_CACHING=1 and expandable segments off (otherwise a use after free inside
torch's caching allocator stays invisible), limit 360 s each. With --tiny, the model is tiny-flux
at 64 px, built the same way, and calibrate runs the tiny models.

Each case is one process in a session of its own, stopped whole at its limit (gpu_suite.run_limited).
A case whose limit exceeds what is left of --budget (default 480 s: a 10-minute command less the
wheels' install and the node's start) is not started, nor is any case after it; each is recorded as
not started. A case whose prerequisite failed is recorded as not run. After every case, the results
are written to --out as three files (the node returns at most 8):
- gpu-check.json: every case's status, seconds, limit, command, log tail, what its log shows
  (skipped steps, illegal memory accesses, sanitizer errors), a train case's losses, peaks and
  DeepSpeed optimizer, a calibrate case's calibration document; device and versions;
- gpu-check.md: the same as tables (the calibrations as gpu_suite prints them);
- gpu-check-logs.tar.gz: every case's full log, and a train case's plan.json, deepspeed.json,
  metrics.jsonl and memory.json.
A run cut off from outside keeps every finished case, and shows the case it was in as running.

Every `zerotrain calibrate` invocation is built by gpu_suite.calibrate_command, with its arguments
from gpu_suite.reduced_args (GPU) or gpu_suite.tiny_args (--tiny)."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from datetime import date
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the repository's packages, gpu_suite among them
    sys.path.insert(0, str(REPO))

from benchmarks import gpu_suite

RESULT_JSON, RESULT_MD, RESULT_LOGS = "gpu-check.json", "gpu-check.md", "gpu-check-logs.tar.gz"
DEFAULT_BUDGET_S = 480
SANITIZER_LIMIT_S = 360
# The crash-hunting settings (issue 38): errors where they happen; under the sanitizer, every
# allocation a real cudaMalloc, so that it sees each buffer's own bounds and lifetime.
CRASH_ENV = {"CUDA_LAUNCH_BLOCKING": "1"}
SANITIZER_ENV = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
# What a case's log tells beyond its exit code.
SIGNS = {"skipped_steps": re.compile(r"OVERFLOW! Skipping step"),
         "illegal_memory_access": re.compile(r"illegal memory access"),
         "sanitizer_errors": re.compile(r"ERROR SUMMARY: ([1-9]\d*) error")}
# A train case's run files that are kept (the checkpoints and the export are deleted).
RUN_FILES = ("plan.json", "deepspeed.json", "metrics.jsonl", "memory.json")
PACKAGES = ("torch", "deepspeed", "diffusers", "transformers", "peft", "pydantic")
# The calibrated models, as the tiny catalog model of the same family for --tiny.
TINY_MODEL = {"flux-dev": "tiny-flux", "qwen-image": "tiny-qwen-image", "krea-2-raw": "tiny-krea2",
              "ideogram-4": "tiny-ideogram4", "flux3-klein-base": "tiny-flux3", "qwen-image-2.1": "tiny-qwen-image21",
              "qwen-image-edit-2511": "tiny-qwen-image-edit-2511"}
# Issue 39's GPU step: Qwen-Image-Edit-2511, 2 blocks at full width, LoRA at 1024 px with one reference (the
# planner's 1024^2 reference and its 196 text rows), the plan's own layout: its peak against the plan.
EDIT_STEP = ("--set", "data.references=1", "--grid", "chosen")


@dataclasses.dataclass(frozen=True)
class Setting:
    """What differs between the GPU node and --tiny (a CPU)."""

    tiny: bool
    model: str  # the catalog model the train.py cases' folder is built from
    blocks: int | None
    resolution: int
    bucket_step: int
    hardware: dict[str, Any]  # the run config's hardware section
    calibrate_hardware: list[str]


GPU = Setting(False, "flux-dev", 2, 1024, 64, {}, ["--gpus", "auto"])
TINY = Setting(True, "tiny-flux", None, 64, 16, {"gpus": "1", "gpu_memory": "8GiB"},
               ["--gpus", "1", "--gpu-memory", "8GiB"])


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    what: str
    command: list[str]
    limit: float
    kind: str = "command"  # train (output: its run folder), calibrate (output: its calibration JSON), command
    output: Path | None = None
    needs: tuple[str, ...] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)


def limit(gpu: float, tiny: float, setting: Setting) -> float:
    return tiny if setting.tiny else gpu


def cases(setting: Setting, workdir: Path, sanitizer: bool = False) -> list[Case]:
    """Every case in the order it runs (the module docstring's table)."""
    me = [sys.executable, "-u", str(Path(__file__).resolve())]
    out = [Case("prepare", f"{setting.model} model folder ({setting.blocks or 'all'} blocks, full width, random "
                           "weights) and generated images", [*me, "--step", "prepare", "--workdir", str(workdir)]
                + (["--tiny"] if setting.tiny else []), limit(120, 90, setting)),
           Case("build-fused-adam", "DeepSpeed's FusedAdam op built for this node",
                [*me, "--step", "build-fused-adam"], limit(180, 120, setting))]
    out += crash_cases(setting, workdir, sanitizer)
    out.append(train_case("lora-compile-buckets", "LoRA, training.compile=true, ZeRO-0, three aspect buckets",
                          workdir, limit(200, 600, setting), [
                              "training.mode=lora", "training.compile=true", "training.gradient_checkpointing=false",
                              "planner.stages=[0]", "training.max_steps=6",
                              f"data.datasets=[{{path: '{workdir / 'images' / 'buckets'}'}}]"]))
    for model, mode, gpu_limit in (("flux-dev", "lora", 180), ("flux-dev", "full", 180), ("qwen-image", "lora", 240)):
        out.append(calibrate_case(model, mode, limit(gpu_limit, 300, setting), setting, workdir))
        if mode == "full":  # the skipped steps of ZeRO-1/2 (rows' skipped_steps) without overlap_comm's streams
            out.append(calibrate_case(model, mode, limit(120, 300, setting), setting, workdir, "-no-overlap",
                                      ("--set", "planner.overlap_comm=false", "--set", "planner.stages=[1,2]", "--set", "optimizer.name=adamw",
                                       "--set", "training.gradient_checkpointing=false", "--grid", "full")))
    out.append(calibrate_case("qwen-image-edit-2511", "lora", limit(150, 300, setting), setting, workdir, "-1ref",
                              (*EDIT_STEP, *(("--set", "data.control_resolution=64") if setting.tiny else ()))))
    out.append(Case("pytest-gpu", "tests/distributed/test_gpu.py (the gpu-marked tests)",
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                     str(REPO / "tests" / "distributed" / "test_gpu.py")], limit(300, 120, setting)))
    out += [calibrate_case(model, "lora", limit(150, 300, setting), setting, workdir)
            for model in gpu_suite.FAMILIES_2026]
    return out


def crash_cases(setting: Setting, workdir: Path, sanitizer: bool) -> list[Case]:
    """The first H200 run's crash through train.py: FusedAdam, then torch's AdamW as that run had it."""
    crash = ["training.mode=full", "planner.stages=[1]", "training.gradient_checkpointing=true",
             "training.compile=false", "training.max_steps=3"]
    prefix, env = [], dict(CRASH_ENV)
    if sanitizer:
        prefix = [sanitizer_path(), "--tool", "memcheck", "--target-processes", "all", "--error-exitcode", "99"]
        env.update(SANITIZER_ENV)
    at = SANITIZER_LIMIT_S if sanitizer else limit(150, 120, setting)
    under = ", under compute-sanitizer memcheck" if sanitizer else ""
    layout = "full fine-tune, ZeRO-1, every block checkpointed, micro-batch 1, 3 steps"
    return [train_case("crash-fused-adam", f"{layout}, DeepSpeed's FusedAdam{under}", workdir, at, crash,
                       prefix, env, needs=("prepare", "build-fused-adam")),
            train_case("crash-torch-adam", f"{layout}, torch's fused AdamW (optimizer.torch_adam){under}", workdir,
                       at, [*crash, "optimizer.torch_adam=true"], prefix, env)]


def train_case(name: str, what: str, workdir: Path, seconds: float, overrides: list[str],
               prefix: list[str] | None = None, env: dict[str, str] | None = None,
               needs: tuple[str, ...] = ("prepare",)) -> Case:
    """One process of zerotrain/train.py on the prepared run config (run.json) with `overrides`."""
    run = workdir / "runs" / name
    command = [*(prefix or []), sys.executable, "-u", str(REPO / "zerotrain" / "train.py"),
               "--config", str(workdir / "run.json"), "--set", f"output_dir={run}"]
    for override in overrides:
        command += ["--set", override]
    return Case(name, what, command, seconds, "train", run, needs, env or {})


def calibrate_case(model: str, mode: str, seconds: float, setting: Setting, workdir: Path,
                   variant: str = "", extra: tuple[str, ...] = ()) -> Case:
    name = f"calibrate-{model}-{mode}{variant}"
    out = workdir / "calibrations" / f"{name}.json"
    args = [*(gpu_suite.tiny_args(TINY_MODEL[model], mode) if setting.tiny else
              gpu_suite.reduced_args(model, 2, mode, "star")), *extra]
    return Case(name, f"zerotrain calibrate {' '.join(args)}",
                gpu_suite.calibrate_command(args, setting.calibrate_hardware, out, workdir), seconds, "calibrate", out)


def sanitizer_path() -> str:
    """compute-sanitizer from PATH or the CUDA toolkit; one line if neither has it."""
    toolkit = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "compute-sanitizer"
    found = shutil.which("compute-sanitizer") or (str(toolkit) if toolkit.is_file() else None)
    if found is None:
        raise SystemExit("gpu_check: --sanitizer needs compute-sanitizer (CUDA toolkit), found neither on PATH nor "
                         "in $CUDA_HOME/bin (default /usr/local/cuda): install the toolkit, or drop --sanitizer")
    return found


def run_config(setting: Setting, workdir: Path) -> dict[str, Any]:
    """The train.py cases' run config (JSON, which train.py reads as it reads YAML): one image per
    step on one process, the square images, caches and facts under the workdir."""
    return {
        "model": {"name_or_path": str(workdir / "model")},
        "training": {"mode": "full", "global_batch_size": 1, "micro_batch_size": 1, "max_steps": 3,
                     "checkpoint_every": 1000, "seed": 0},
        "data": {"resolution": setting.resolution, "bucket_step": setting.bucket_step,
                 "min_image_size": setting.resolution // 2,
                 "datasets": [{"path": str(workdir / "images" / "square")}],
                 "cache_dir": str(workdir / "cache"), "num_workers": 0},
        "planner": {"offload": ["none"], "cache_dir": str(workdir / "facts")},
        "hardware": setting.hardware,
        "output_dir": str(workdir / "runs" / "default"),
    }


# --- the steps that run in a case's own process ------------------------------------------------------


def narrow_vae_config(spec) -> dict[str, Any]:
    """A narrow diffusers AutoencoderKL with the model's latent channels, pixels per latent cell and
    latent scaling: what the denoiser sees is shaped as the real VAE's, at a fraction of its cost.
    (For the models whose VAE is an AutoencoderKL: FLUX.1, Chroma, SD3, SDXL.)"""
    levels = spec.vae_scale_factor.bit_length()  # each level after the first halves the image
    return {"_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [32] * levels,
            "down_block_types": ["DownEncoderBlock2D"] * levels, "up_block_types": ["UpDecoderBlock2D"] * levels,
            "in_channels": 3, "out_channels": 3, "latent_channels": spec.latent_channels, "layers_per_block": 1,
            "norm_num_groups": 8, "sample_size": 64, "scaling_factor": spec.vae_scaling_factor or 1.0,
            "shift_factor": spec.vae_shift_factor, "use_quant_conv": False, "use_post_quant_conv": False}


def build_model_folder(name: str, blocks: int | None, folder: Path) -> Path:
    """The diffusers folder of catalog model `name` cut to `blocks` blocks at full width, with random
    weights (no download): the denoiser from its catalog config, the family's narrow text encoders
    whose outputs are as wide as the denoiser expects (Family.tiny_components, which builds the
    tiny-* folders too), and narrow_vae_config's VAE; written with save_pretrained, as train.py and
    the cache load any model folder."""
    import torch

    from zerotrain import families
    from zerotrain.config.sections import ModelConfig
    from zerotrain.families.runtime.parts.tiny import diffusers_class, seeded
    from zerotrain.models.catalog import resolve_model

    spec = resolve_model(ModelConfig(name_or_path=name))
    family = families.of(spec)
    denoiser = family.with_blocks(spec.config, blocks) if blocks else spec.config
    with torch.random.fork_rng(devices=[]):
        pipeline_class, components = family.tiny_components(denoiser)
        components["vae"] = seeded("vae", diffusers_class("AutoencoderKL").from_config, narrow_vae_config(spec))
    pipeline_class(**components).save_pretrained(folder, safe_serialization=True)
    return folder


# Three aspects (width, height as multiples of the resolution): three buckets, three batch shapes.
ASPECTS = ((1.0, 1.0), (1.5, 1.0), (1.0, 1.5))
CAPTIONS = ("a red square on a white wall", "a green circle in the grass", "a blue triangle over the sea",
            "a yellow star in the night sky")


def write_images(folder: Path, sizes: list[tuple[int, int]]) -> None:
    """Captioned PNGs of the given sizes: a shape of its own colour over a gradient, from fixed seeds."""
    import numpy as np
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    for index, (width, height) in enumerate(sizes):
        rng = np.random.default_rng(index)
        ramp = np.linspace(0, 255, width, dtype=np.float32)[None, :, None] * rng.uniform(0.2, 1.0, (1, 1, 3))
        image = Image.fromarray(np.broadcast_to(ramp, (height, width, 3)).astype(np.uint8))
        box = [int(v) for v in rng.uniform(0.1, 0.4, 2) * (width, height)]
        ImageDraw.Draw(image).ellipse([*box, width - box[0], height - box[1]],
                                      fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        image.save(folder / f"{index:02d}.png")
        (folder / f"{index:02d}.txt").write_text(CAPTIONS[index % len(CAPTIONS)])


def prepare(setting: Setting, workdir: Path) -> int:
    began = time.monotonic()
    build_model_folder(setting.model, setting.blocks, workdir / "model")
    print(f"model folder {workdir / 'model'} in {time.monotonic() - began:.0f} s", flush=True)
    r = setting.resolution
    write_images(workdir / "images" / "square", [(r, r)] * 4)
    write_images(workdir / "images" / "buckets", [(int(w * r), int(h * r)) for w, h in ASPECTS])
    print(f"images under {workdir / 'images'}; done in {time.monotonic() - began:.0f} s", flush=True)
    return 0


def build_fused_adam() -> int:
    """DeepSpeed's FusedAdam for this node, as `zerotrain build-ops` builds it (the other ops are not
    needed here and would cost minutes)."""
    from zerotrain.ops import build_ops

    [op] = build_ops(("FusedAdamBuilder",))
    print(f"{op.name}: {op.status} ({op.detail})", flush=True)
    return 1 if op.status == "failed" else 0


# --- running the cases ------------------------------------------------------------------------------


def with_prerequisites(selected: list[Case], every: list[Case]) -> list[Case]:
    """The selected cases and those they need, in the check's order."""
    by_name = {case.name: case for case in every}
    wanted = {case.name for case in selected}
    pending = list(wanted)
    while pending:
        for need in by_name[pending.pop()].needs:
            if need not in wanted:
                wanted.add(need)
                pending.append(need)
    return [case for case in every if case.name in wanted]


def run_cases(selected: list[Case], budget: float, document: dict[str, Any], out: Path, workdir: Path) -> None:
    """Each case in its own process, in order, while its limit fits in what is left of the budget;
    the results saved before and after each one."""
    began = time.monotonic()
    records = document["cases"] = [{"name": c.name, "what": c.what, "limit": c.limit, "status": "pending"}
                                   for c in selected]
    status = {case.name: "pending" for case in selected}
    cut = None
    for case, record in zip(selected, records):
        left = budget - (time.monotonic() - began)
        if cut is None and case.limit > left:
            cut = f"the budget: {case.name} needs up to {case.limit:.0f} s, {left:.0f} s of {budget:.0f} s were left"
        missing = [need for need in case.needs if status.get(need) != "ok"]
        if cut or missing:
            record.update(status="not started" if cut else "not run",
                          reason=cut or f"needs {', '.join(missing)}, which did not succeed")
        else:
            record.update(status="running", command=" ".join(case.command), env=case.env)
            save(document, out, workdir, time.monotonic() - began)
            env = {**os.environ, **case.env,
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
            log = workdir / "logs" / f"{case.name}.log"
            done = gpu_suite.run_limited(case.command, case.limit, log, env, REPO)
            record.update(outcome(case, done, log, workdir))
        status[case.name] = record["status"]
        save(document, out, workdir, time.monotonic() - began)
        detail = record.get("seconds", "")
        print(f"{case.name:30s} {record['status']:12s} {detail!s:>7} {record.get('error') or record.get('reason') or ''}",
              flush=True)


def outcome(case: Case, done: gpu_suite.Finished, log: Path, workdir: Path) -> dict[str, Any]:
    """A finished case's record: status, seconds, what its log shows, and its own results."""
    record: dict[str, Any] = {"seconds": done.seconds, "returncode": done.returncode}
    if done.timed_out:
        record.update(status="timed out", error=f"stopped at its limit of {case.limit:.0f} s")
    elif done.returncode != 0:
        record.update(status="failed", error=gpu_suite.last_line(log))
    else:
        record["status"] = "ok"
    text = log.read_text(errors="replace")
    if record["status"] != "ok":
        record["tail"] = text.splitlines()[-40:]
    signs = {}
    for key, pattern in SIGNS.items():
        found = pattern.findall(text)
        if found:
            signs[key] = int(found[-1]) if key == "sanitizer_errors" else len(found)
    record["signs"] = signs
    if case.kind == "train":
        record["run"] = keep_run(case.output, workdir / "logs" / case.name)
    elif case.kind == "calibrate" and case.output.is_file():
        record["calibration"] = json.loads(case.output.read_text())
    return record


def keep_run(run: Path, keep: Path) -> dict[str, Any]:
    """A train case's small files copied beside its log, what they say in brief, and the run folder
    (checkpoints and export: gigabytes on the GPU node) removed."""
    keep.mkdir(parents=True, exist_ok=True)
    for name in RUN_FILES:
        if (run / name).is_file():
            shutil.copy2(run / name, keep / name)
    summary: dict[str, Any] = {}
    if (run / "metrics.jsonl").is_file():
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        peaks = [r["peak_allocated_bytes"] for r in records if r.get("peak_allocated_bytes") is not None]
        summary.update(steps=len(records), losses=[r["loss"] for r in records],
                       peak_allocated_bytes=max(peaks) if peaks else None)
    if (run / "deepspeed.json").is_file():
        config = json.loads((run / "deepspeed.json").read_text())
        summary.update(optimizer=config.get("optimizer"), zero_stage=(config.get("zero_optimization") or {}).get("stage"))
    if (run / "plan.json").is_file():
        chosen = json.loads((run / "plan.json").read_text()).get("chosen") or {}
        summary["layout"] = chosen.get("layout")
    shutil.rmtree(run, ignore_errors=True)
    return summary


def save(document: dict[str, Any], out: Path, workdir: Path, seconds: float) -> None:
    """The three result files, each replaced whole (a reader, or a cut-off, never sees half of one)."""
    document["seconds"] = round(seconds, 1)
    calibrations = [{"name": r["name"], "error": r.get("error"), "calibration": r["calibration"]}
                    for r in document["cases"] if r.get("calibration")]
    document["summary"] = gpu_suite.summary(calibrations)
    replace(out / RESULT_JSON, json.dumps(document, indent=1, default=str).encode())
    replace(out / RESULT_MD, markdown(document, calibrations).encode())
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w:gz") as tar:
        if (workdir / "logs").is_dir():
            tar.add(workdir / "logs", arcname="logs")
    replace(out / RESULT_LOGS, packed.getvalue())


def replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def markdown(document: dict[str, Any], calibrations: list[dict]) -> str:
    lines = [f"# GPU check on {document['device']}, {document['date']}", "",
             f"Commit {document['commit']}, budget {document['budget_s']} s, {document['seconds']} s so far. "
             + ", ".join(f"{k} {v}" for k, v in document["versions"].items()), "",
             "| case | status | seconds / limit | notes |", "| --- | --- | --- | --- |"]
    for r in document["cases"]:
        notes = [r.get("error") or r.get("reason") or ""]
        notes += [f"{k}: {v}" for k, v in (r.get("signs") or {}).items()]
        run = r.get("run") or {}
        if run.get("steps") is not None:
            notes.append(f"{run['steps']} steps, losses {', '.join(f'{x:.4g}' for x in run['losses'])}, peak "
                         f"{gpu_suite.gib(run['peak_allocated_bytes'])} GiB")
        seconds = f"{r['seconds']} / {r['limit']:.0f}" if "seconds" in r else f"- / {r['limit']:.0f}"
        lines.append(f"| {r['name']} | {r['status']} | {seconds} | {'; '.join(n for n in notes if n)} |")
    if calibrations:
        lines += ["", "## Calibrations", "", *gpu_suite.calibration_table(calibrations), "",
                  *gpu_suite.verdict(document["summary"])]
    return "\n".join(lines) + "\n"


def versions() -> dict[str, str | None]:
    """The versions the cases import (package metadata: nothing is imported here)."""
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def commit() -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False, timeout=10)
    except OSError:  # no git on the node
        return None
    return done.stdout.strip() or None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for the three result files (default: "
                                                 "benchmarks/results/gpu-check-<date>)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S,
                        help="seconds for all the cases; a case whose limit exceeds what is left is not started "
                             f"(default {DEFAULT_BUDGET_S})")
    parser.add_argument("--tiny", action="store_true", help="tiny-flux at 64 px and the tiny models (the CPU test)")
    parser.add_argument("--sanitizer", action="store_true",
                        help=f"run the crash cases under compute-sanitizer memcheck ({SANITIZER_LIMIT_S} s each)")
    parser.add_argument("--only", help="the cases whose name contains this, or one of these (comma-separated), and "
                                       "those they need")
    parser.add_argument("--workdir", type=Path, help="where the model, images, caches and logs go (kept; default: a "
                                                     "temporary folder, removed at the end)")
    parser.add_argument("--step", choices=["prepare", "build-fused-adam"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    setting = TINY if args.tiny else GPU
    if args.step == "prepare":
        return prepare(setting, args.workdir)
    if args.step == "build-fused-adam":
        return build_fused_adam()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="zerotrain-gpu-check-"))
    try:
        return check(args, setting, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


def check(args: argparse.Namespace, setting: Setting, workdir: Path) -> int:
    # Stopped from outside (a scheduler's SIGTERM): stop the running case's process group too
    # (run_limited), keeping the results saved so far, where that case shows as running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    every = cases(setting, workdir, args.sanitizer)
    wanted = [part for part in (args.only or "").split(",") if part]
    selected = with_prerequisites([c for c in every if not wanted or any(w in c.name for w in wanted)], every)
    if not selected:
        raise SystemExit(f"gpu_check: --only {args.only} names no case; the cases are {', '.join(c.name for c in every)}")
    out = args.out or gpu_suite.RESULTS / f"gpu-check-{date.today().isoformat()}"
    out.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "run.json").write_text(json.dumps(run_config(setting, workdir), indent=1))
    document = {"device": gpu_suite.device_name(), "date": date.today().isoformat(), "commit": commit(),
                "argv": sys.argv[1:], "budget_s": args.budget, "versions": versions(), "cases": []}
    run_cases(selected, args.budget, document, out, workdir)
    print(f"written {out / RESULT_JSON}, {RESULT_MD} and {RESULT_LOGS} in {document['seconds']:.0f} s", flush=True)
    return 0 if all(r["status"] in ("ok", "not started") for r in document["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
