"""`zerotrain calibrate`: the planner measured against the machine it runs on, in one command.

    zerotrain calibrate --model flux-dev --blocks 4 --mode lora          # this node's GPU, one rank per layout
    zerotrain calibrate --config run.yaml --ranks 2                       # two GPUs: two ranks per layout (torchrun)
    DS_ACCELERATOR=cpu zerotrain calibrate --config examples/tiny-cpu.yaml   # host RAM and time only

It takes the flags and config of `zerotrain plan`, builds the denoiser from its config with random
weights (no download; `--blocks N` keeps N blocks at full width and resolution), plans, and runs a
few real optimizer steps through zerotrain's own engine (engine.apply_mode and build_engine, the
DeepSpeed JSON the planner writes, the engine calls of train.py) for a small grid around the
planned layout: one dimension changed at a time (stage, checkpointing, micro-batch, offload), or
every combination with --grid full. For each it measures, per phase, the peak allocated and
reserved GPU memory, the host RSS, the tensor bytes after init, the forward/backward and optimizer
seconds, the steps DeepSpeed skipped, images/s and MFU, and prints them beside the planner's
predictions (a table, and JSON with --json).

Each layout runs in processes of its own (measure_apart: a fresh CUDA context and none of what
DeepSpeed leaves in a process; several ranks under torchrun), stopped after --layout-timeout. One
that crashes, hangs or runs out of memory gets a row saying so, with its last lines; this process
plans and launches only, and rewrites calibration.json after every layout, so a run cut off keeps
what finished.

Then it fits the planner's constants to the clean rows (fragmentation, CUDA context and NCCL, the
host-offload factor, achieved MFU of the family, ZeRO-3's fetch latency, CPU Adam rate from rows
without a skipped step, host<->device bandwidth) and writes calibration.json with the lane it
measured (planner.calibration.Lane: family, mode, checkpointing, resolution); later plans of the
same GPU profile use its hardware constants, and those of the same lane its workload constants
(planner.calibration). Replacing a calibration of the same GPU profile, it keeps that one's other
lanes. What this machine cannot show (no GPU: memory and MFU) stays the default, and the output
says so."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotrain import families
from zerotrain.config.flags import add_plan_flags, config_from_args
from zerotrain.config.sections import Loading, RunConfig
from zerotrain.errors import ZerotrainError, one_line
from zerotrain.planner import calibration
from zerotrain.planner.memory import Layout
from zerotrain.planner.search import Candidate, Plan, activations, describe, evaluate, uncheckpointed_bytes
from zerotrain.units import gib

if TYPE_CHECKING:  # torch loads only when calibrate runs: `zerotrain plan` imports this module's parser
    import torch

    from zerotrain.distributed import Topology



def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("calibrate", help="measure the planner's predictions on this node (random weights, "
                                              "a few real steps) and fit its constants")
    add_plan_flags(p)
    p.add_argument("--blocks", type=int, help="keep this many transformer blocks (full width and resolution)")
    p.add_argument("--steps", type=int, default=3, help="timed optimizer steps per configuration (after one warm-up)")
    p.add_argument("--grid", choices=["star", "full", "chosen"], default="star",
                   help="star: the plan's choice and one change at a time; full: every combination; chosen: "
                        "the plan's choice only")
    p.add_argument("--out", type=Path, help="calibration.json to write (default: the GPU profile's calibration in "
                                            "~/.cache/zerotrain/calibration/ on a GPU, ./calibration.json on CPU)")
    p.add_argument("--json", action="store_true", help="print the measurements as JSON")
    p.add_argument("--ranks", type=int, default=1,
                   help="processes (GPUs of this node) that measure each layout together: each layout runs in "
                        "a process group of its own, started by torchrun when more than 1")
    p.add_argument("--layout-timeout", type=float, default=900.0, metavar="SECONDS",
                   help="a layout that has not finished after this many seconds is stopped and recorded as "
                        "timed out (its start, the model's build and every step included)")
    p.add_argument("--repeat", type=int, default=1,
                   help="measure the grid this many times over, in order (each measurement a fresh process)")


# --- host memory ------------------------------------------------------------------------------------


def host_rss() -> tuple[int, int] | None:
    """This process's resident set and its peak since the last reset_peak_rss, from /proc (Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def release_host_memory() -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise), so each configuration's RSS starts
    from the same floor, and reset the RSS peak (clear_refs 5)."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


# --- one configuration ------------------------------------------------------------------------------


def build_model(spec, run: RunConfig, checkpointing: bool | list[str], layout: Layout | None = None) -> torch.nn.Module:
    """The denoiser from its config with random weights, made in bf16 (no fp32 copy on the host),
    with the run's training mode applied as train.py applies it."""
    import torch

    from zerotrain.engine import apply_mode

    torch.manual_seed(run.training.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = spec.denoiser_class().from_config(spec.config)
    finally:
        torch.set_default_dtype(default)
    # LoRA adapters come in fp32; DeepSpeed casts them, as in training. Activation offload and
    # compiled blocks as training applies them for this layout; its warnings as train.py prints them.
    lines = apply_mode(model, spec, run, checkpointing, layout is not None and layout.offload_activations,
                       layout.stage if layout is not None else None)
    if os.environ.get("RANK", "0") == "0":
        for line in lines:
            if line.startswith("warning: "):
                print(f"zerotrain: {line}", file=sys.stderr, flush=True)
    return model


class PhasePeaks:
    """Peak allocated and reserved accelerator memory of each phase (each phase's own peak)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.allocated: dict[str, int] = {}
        self.reserved: dict[str, int] = {}

    def start(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def end(self, phase: str) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.allocated[phase] = max(self.allocated.get(phase, 0), torch.cuda.max_memory_allocated(self.device))
            self.reserved[phase] = max(self.reserved.get(phase, 0), torch.cuda.max_memory_reserved(self.device))


class RandomFeed:
    """Calibration's micro-batches: the family's example inputs, with random clean latents of the
    references the planner plans for (data.references: `references`, their (width, height), appended as
    the family's pipeline appends them, their text rows too where the text keeps them), and an MSE
    against a random target (the step's cost, not what it learns)."""

    def __init__(self, family: Any, spec: Any, micro: int, side: int, tokens: int, device: torch.device,
                 references: list[tuple[int, int]] | None = None):
        self.family, self.spec, self.micro, self.side, self.tokens, self.device = family, spec, micro, side, tokens, device
        self.references = references or []

    def __call__(self, index: int) -> Any:
        import torch

        rows = self.tokens + (self.family.reference_text_rows(self.spec, self.references) if self.references else 0)
        inputs = self.family.example_inputs(self.spec, self.micro, self.side, self.side, rows, self.device,
                                            torch.bfloat16)
        if self.references:
            factor = self.spec.vae_scale_factor
            inputs = self.family.add_references(self.spec, inputs, [
                torch.randn(self.micro, self.spec.latent_channels, h // factor, w // factor, device=self.device,
                            dtype=torch.bfloat16) for w, h in self.references])
        return inputs, self.loss

    def loss(self, output: torch.Tensor) -> torch.Tensor:
        import torch

        pred = self.family.prediction(output)
        return torch.nn.functional.mse_loss(pred.float(), torch.randn_like(pred, dtype=torch.float32))


class PhaseLaps:
    """trainer.train_step's laps as calibrate measures them: each phase's allocator peak (PhasePeaks)
    and, while `recording`, its seconds; the inputs are built before the forward's clock starts."""

    def __init__(self, peaks: PhasePeaks):
        self.peaks, self.recording = peaks, False
        self.times: dict[str, list[float]] = {"forward_backward": [], "optimizer": []}
        self.began = time.perf_counter()

    def lap(self, phase: str) -> None:
        if phase != "data":
            self.peaks.end(phase)
            if self.recording:
                self.times[phase].append(time.perf_counter() - self.began)
        self.peaks.start()
        self.began = time.perf_counter()


def run_layout(layout: Layout, spec, run: RunConfig, topo: Topology, device: torch.device, steps: int,
               checkpointing: bool | list[str]) -> dict:
    """Build the engine of one layout (checkpointing every block, none or the named ones: the
    plan's Plan.checkpointed) and run 1 + `steps` optimizer steps of random inputs; what was
    measured on this rank."""
    import torch

    from zerotrain.distributed import all_ok
    from zerotrain.engine import build_engine
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.references import plan_references

    family = families.of(spec)
    config = deepspeed_config(layout, run, topo.world_size)
    peaks = PhasePeaks(device)
    release_host_memory()
    floor = host_rss()
    peaks.start()
    model = build_model(spec, run, checkpointing, layout)
    engine = build_engine(model, config, run, device)
    peaks.end("init")
    init_bytes = live_tensor_bytes()
    side, tokens = run.data.resolution, run.data.text_tokens or family.default_text_tokens
    generator_seed = run.training.seed + topo.rank
    laps = PhaseLaps(peaks)
    feed = RandomFeed(family, spec, layout.micro_batch, side, tokens, device, plan_references(spec, run))
    skipped = 0
    try:
        for step in range(steps + 1):
            torch.manual_seed(generator_seed + step)
            laps.recording = step > 0  # the first step warms up (kernels, CPU Adam's first allocation of its moments)
            failed = one_step(engine, feed, layout.accumulation, laps)  # accumulation 1: one micro-batch per step
            if not all_ok(failed is None):  # every rank learns of it, and stops measuring this layout
                raise torch.OutOfMemoryError(failed or "CUDA out of memory on another rank")
            # DeepSpeed's overflow check skipped the update (non-finite gradients): its optimizer
            # phase did no optimizer's work
            skipped += not engine.was_step_applied()
        rss = host_rss()
    except torch.OutOfMemoryError:
        raise
    except BaseException:  # noqa: BLE001 (printed before destroy(), which over a sticky CUDA error may hang)
        traceback.print_exc(file=sys.__stderr__)
        sys.__stderr__.flush()
        os._exit(1)  # this layout's own process (calibrate_layout): nothing else to keep
    finally:
        engine.destroy()
        del engine, model
        release_host_memory()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {
        "allocated": peaks.allocated, "reserved": peaks.reserved,
        "host_rss_peak": None if rss is None or floor is None else rss[1] - floor[0],
        "host_rss_floor": None if floor is None else floor[0],  # what the process held before the model
        "init_tensor_bytes": init_bytes,
        "forward_backward_s": statistics.median(laps.times["forward_backward"]),
        "optimizer_s": statistics.median(laps.times["optimizer"]),
        "skipped_steps": skipped,
    }


def live_tensor_bytes() -> int:
    """Bytes of every tensor this process holds (meta excepted), each storage counted once: after a
    layout's init, its model and engine, and anything an earlier layout left behind in the same
    process. On the CPU no allocator counts them; on a GPU it agrees with the allocator's count."""
    import torch

    gc.collect()
    seen, total = set(), 0
    for obj in gc.get_objects():
        if not isinstance(obj, torch.Tensor) or obj.device.type == "meta":
            continue
        try:
            storage = obj.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensors without a storage of their own (sparse, ...)
            continue
        key = (storage.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def one_step(engine, feed, accumulation: int, laps) -> str | None:
    """trainer.train_step; the message of an out-of-memory error in it (None: it ran)."""
    import torch

    from zerotrain.trainer import train_step

    try:
        train_step(engine, feed, accumulation, laps)
    except torch.OutOfMemoryError as err:
        return one_line(err, 200)
    return None


# --- the grid ---------------------------------------------------------------------------------------


def grid(result: Plan, kind: str) -> list[Layout]:
    """The layouts to measure, each as one micro-batch per optimizer step: the plan's choice and its
    neighbours one change away (star: another stage, checkpointing, micro-batch, offload or optimizer), every
    candidate (full), or the choice alone. When nothing fits, the candidate with the smallest GPU
    need takes the choice's place."""
    center = result.chosen or min(result.candidates, key=lambda c: c.memory.device_total)
    a = dataclasses.replace(center.layout, accumulation=1)
    every = list(dict.fromkeys(dataclasses.replace(c.layout, accumulation=1) for c in result.candidates))
    if kind == "chosen":
        return [a]
    if kind == "full":
        return [a] + [layout for layout in every if layout != a]

    def recompute(b: Layout) -> tuple:  # checkpointing: none, some blocks, all, all with activation offload
        return b.gradient_checkpointing, b.checkpointed_blocks, b.offload_activations

    def changes(b: Layout) -> int:
        return sum((b.stage != a.stage, recompute(b) != recompute(a), b.micro_batch != a.micro_batch,
                    (b.offload_optimizer, b.offload_param) != (a.offload_optimizer, a.offload_param),
                    (b.optimizer, b.zeropp) != (a.optimizer, a.zeropp)))

    star = [a] + [layout for layout in every if changes(layout) == 1]
    # Offload needs ZeRO 1+ (parameters: ZeRO-3): the offload neighbours keep the rest and take the
    # nearest stage that has them.
    # (In the candidates' order: a set's order follows each process's string hash seed, and ranks
    # measuring the layouts in different orders wait for each other in different collectives.)
    offloads = dict.fromkeys((b.offload_optimizer, b.offload_param) for b in every)
    for offload in [o for o in offloads if o != (a.offload_optimizer, a.offload_param)]:
        alike = [b for b in every if (b.offload_optimizer, b.offload_param) == offload
                 and (recompute(b), b.micro_batch, b.optimizer) == (recompute(a), a.micro_batch, a.optimizer)]
        if alike:
            star.append(min(alike, key=lambda b: abs(b.stage - a.stage)))
    return list(dict.fromkeys(star))


def measurable(candidate: Candidate, ranks: int, on_gpu: bool) -> str | None:
    """Why a candidate is not run, or None. The host is never pushed past its budget. With several
    ranks, a configuration predicted not to fit the GPU is left out: an out-of-memory error on one
    rank would leave the others waiting in a collective (measure it with one process)."""
    if candidate.rejected and "host RAM" in candidate.rejected:
        return f"skipped: {candidate.rejected}"
    if candidate.rejected and "NVMe" in candidate.rejected:
        return f"skipped: {candidate.rejected}"
    if not candidate.fits and on_gpu and ranks > 1:
        return f"skipped: predicted not to fit ({candidate.rejected}); run with one process to try it"
    return None


# --- the fit ----------------------------------------------------------------------------------------


def fit(rows: list[dict], hw, facts, family: str, planner, on_gpu: bool) -> tuple[dict[str, Any], list[str]]:
    """The planner's constants that the clean measurements determine, and the names of those they
    do not. Rows that crashed, timed out or ran out of memory measured nothing (the margin counts an
    out-of-memory row as a bound); a row with a skipped step did no optimizer's work in it."""
    ok = [r for r in rows if r["status"] == "ok"]
    context = next((r["measured"]["cuda_overheads"] for r in ok if r["measured"].get("cuda_overheads")), None)
    rates = [r["measured"]["host_to_device_bandwidth"] for r in ok if r["measured"].get("host_to_device_bandwidth")]
    bandwidth = statistics.median(rates) if rates else None
    constants: dict[str, Any] = {}
    if on_gpu and ok:
        ratios = [r["measured"]["reserved"] / r["measured"]["allocated"] - 1 for r in ok if r["measured"]["allocated"]]
        if ratios:
            constants["fragmentation"] = round(max(0.0, statistics.median(ratios)), 4)
        # ZeRO-3's forward and backward also wait on its fetches (planner.stage3_fetch_latency,
        # fitted below): the compute rate is the other stages'.
        mfu = [r["flops_per_step"] / (hw.peak_bf16_flops * r["measured"]["forward_backward_s"])
               for r in ok if r["layout"]["stage"] < 3]
        if mfu:
            constants["assumed_mfu"] = {family: round(statistics.median(mfu), 4)}
        latency = calibration.fit_fetch_latency(rows, facts, planner.stage3_param_persistence_threshold)
        if latency is not None:
            constants["stage3_fetch_latency"] = latency
    if context:
        constants["cuda_context_bytes"] = context["cuda_context_bytes"]
        constants["nccl_workspace_bytes"] = context["nccl_workspace_bytes"]
    if bandwidth:
        constants["host_to_device_bandwidth"] = bandwidth
    offloaded = [r for r in ok if r["layout"]["offload_optimizer"] == "cpu" and not r["measured"].get("skipped_steps")]
    # CPU Adam: the node's ranks step their partitions at once (search.step_time's "cpu adam" term);
    # the optimizer phase beyond the predicted host<->device transfers is its time. Parameters over
    # seconds, summed over the offloaded layouts, so a noisy short step weighs little.
    stepped = facts.trainable_params / hw.world_size * hw.gpus_per_node * len(offloaded)
    seconds = sum(r["measured"]["optimizer_s"] - (r["predicted"]["time_terms"].get("offload transfers", 0.0)
                                                   if on_gpu else 0.0) for r in offloaded)
    if offloaded and seconds > 0:
        constants["cpu_adam_params_per_second"] = round(stepped / seconds, -3)
    margin = fit_margin(rows, hw) if on_gpu else None
    if margin is not None:
        constants["activation_margin"] = margin
    factors = [r["measured"]["host_rss_peak"] / r["predicted"]["host_offload_per_rank"]
               for r in offloaded if on_gpu and r["measured"]["host_rss_peak"] and r["predicted"]["host_offload_per_rank"]]
    if factors:
        constants["host_offload_factor"] = round(statistics.median(factors), 3)
    return constants, [name for name in (*calibration.HARDWARE, *calibration.WORKLOAD) if name not in constants]


def fit_margin(rows: list[dict], hw) -> float | None:
    """planner.activation_margin from the layouts that keep blocks uncheckpointed: the share of
    their traced uncheckpointed activations by which the measured peak exceeded the prediction, at
    its largest; a layout that ran out of memory counts too, as needing at least what would have
    put its prediction past the GPU (its memory less what the plan keeps outside the allocator).
    None: no such layout was measured."""
    needs = []
    for row in rows:
        basis = row["predicted"].get("uncheckpointed_bytes") or 0
        if not basis:
            continue
        if row["status"] == "ok":
            needs.append((row["measured"]["allocated"] - row["predicted"]["allocated"]) / basis)
        elif row["status"].startswith("oom"):
            needs.append((hw.gpu_memory_bytes - row["predicted"]["device_total"]) / basis)
    if not needs:
        return None
    return round(min(max(0.0, max(needs)) + MARGIN_SLACK, 4.0), 2)


# Added to the fitted activation margin: the step-to-step variation of a measured peak.
MARGIN_SLACK = 0.02


def cuda_overheads(device: torch.device, before_group: int | None) -> dict[str, int] | None:
    """Memory outside the allocator: the CUDA context (measured before the process group) and NCCL
    plus cuBLAS workspaces (what the group and the first steps added)."""
    import torch

    if device.type != "cuda" or before_group is None:
        return None
    free, total = torch.cuda.mem_get_info(device)
    outside = total - free - torch.cuda.memory_reserved(device)
    return {"cuda_context_bytes": before_group, "nccl_workspace_bytes": max(0, outside - before_group)}


def outside_allocator(device: torch.device) -> int | None:
    import torch

    if device.type != "cuda":
        return None
    torch.zeros(1, device=device)  # creates the context
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def host_to_device_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of a pinned 256 MiB host-to-device copy, the best of five."""
    import torch

    if device.type != "cuda":
        return None
    host = torch.empty(128 * 2**20, dtype=torch.bfloat16, pin_memory=True)
    target = torch.empty_like(host, device=device)
    best = float("inf")
    for _ in range(5):
        torch.cuda.synchronize(device)
        began = time.perf_counter()
        target.copy_(host, non_blocking=True)
        torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - began)
    return round(host.numel() * host.element_size() / best, -6)


# --- the command ------------------------------------------------------------------------------------


def reduced_spec(spec, blocks: int | None):
    if not blocks:
        return spec
    if blocks < 1:
        raise ZerotrainError(f"--blocks {blocks}: give at least 1 block")
    config = families.of(spec).with_blocks(spec.config, blocks)
    return dataclasses.replace(spec, config=config, name=f"{spec.name} ({blocks} blocks)")


def prediction(candidate: Candidate, hw, on_gpu: bool, facts) -> dict[str, Any]:
    """What the planner predicts for one rank. Without a GPU the accelerator is the host itself, so
    the RSS to compare with is the device's bytes plus the offloaded ones (host_rss)."""
    memory = candidate.memory
    offload = memory.host_terms.get("offload", 0) // hw.gpus_per_node
    host = memory.host_per_node // hw.gpus_per_node
    return {"allocated": memory.allocated, "reserved": memory.reserved, "device_total": memory.device_total,
            "phases": memory.phases, "host_per_rank": host, "host_offload_per_rank": offload,
            "host_rss": host if on_gpu else memory.allocated + offload,
            "uncheckpointed_bytes": uncheckpointed_bytes(candidate.layout, facts),
            "step_seconds": candidate.step_seconds, "time_terms": candidate.time_terms}


def size(n: float | None) -> str:
    """A measured or predicted figure of the table: hundredths of a GiB, MiB below 0.1 GiB."""
    return gib(n, units=("GiB", "MiB"), switch=0.1, digits=2)


def main(args: argparse.Namespace) -> int:
    """Plan, measure each layout of the grid in processes of its own, fit, write calibration.json
    and report. This process starts no accelerator context and joins no process group: it only
    plans and launches."""
    from zerotrain.distributed import topology

    if topology().world_size > 1:
        raise ZerotrainError("zerotrain calibrate was started by a launcher (WORLD_SIZE > 1), but it starts its "
                             "own ranks, a process group for each layout: run it as one process, with "
                             "--ranks N for N GPUs")
    for flag, value in (("--ranks", args.ranks), ("--repeat", args.repeat), ("--steps", args.steps)):
        if value < 1:
            raise ZerotrainError(f"{flag} {value}: give at least 1")
    if args.layout_timeout <= 0:
        raise ZerotrainError(f"--layout-timeout {args.layout_timeout:g}: give a number of seconds above 0")
    return calibrate(args, config_from_args(args))


def calibrate(args: argparse.Namespace, run: RunConfig) -> int:
    """Plan here; each layout measured apart (measure_apart); the document rewritten after each."""
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.entry import plan_for_run
    from zerotrain.planner.measure import measure_model

    ranks = args.ranks
    spec = reduced_spec(resolve_model(run.model), args.blocks)
    # Every rank builds its own model from the config (build_model): the plans count a whole copy
    # per rank to load, as model.load: whole does.
    run = run.model_copy(update={"training": run.training.model_copy(update={
        "global_batch_size": max(run.training.global_batch_size // ranks, 1) * ranks}),
        "model": run.model.model_copy(update={"load": Loading.whole})})
    facts = measure_model(spec, run)
    planned = plan_for_run(run, spec, ranks, facts=facts, calibrated=False)
    hw, result = planned.hw, planned.result
    layouts = grid(result, args.grid) * args.repeat
    on_gpu = accelerator_type() == "cuda"
    out = args.out or (calibration.default_path(hw.gpu_name) if on_gpu else Path("calibration.json"))
    lane = calibration.Lane.of(run, families.of(spec).name)
    head = {"version": calibration.VERSION, "profile": hw.gpu_name, "date": date.today().isoformat(),
            "model": spec.name, "resolution": run.data.resolution, "mode": run.training.mode.value,
            "world_size": ranks, "lane": dataclasses.asdict(lane),
            "lanes": calibration.kept_lanes(out, lane, hw.gpu_name)}
    rows: list[dict] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        document = measure_layouts(args, run, spec, facts, result, hw, layouts, head, rows, ranks, on_gpu, out)
    except (KeyboardInterrupt, SystemExit) as stopped:  # Ctrl-C, or SIGTERM (stop_on_sigterm): the layout's
        # processes are stopped on the way out
        kept = f"the {len(rows)} layouts measured are in {partial_path(out)}" if rows else "no layout was measured"
        print(f"calibrate stopped: {kept}; {out} is unchanged", file=sys.stderr)
        return 130 if isinstance(stopped, KeyboardInterrupt) else int(stopped.code or 1)
    if args.json:
        print(json.dumps(document, indent=1, default=str))
    else:
        report(document, out)
    return 0


def partial_path(out: Path) -> Path:
    """Where a calibration in progress is written: beside `out`, so that a run cut off never replaces a
    complete calibration that plans read (the default path of the GPU profile)."""
    return out.with_name(f"{out.stem}.partial{out.suffix}")


def write_progress(out: Path, document: dict) -> None:
    """The document of the layouts measured so far: to partial_path(out) while some remain; to `out`, the
    partial file removed, once complete."""
    from zerotrain.monitor import write_json

    if document["complete"]:
        write_json(out, document)
        partial_path(out).unlink(missing_ok=True)
    else:
        write_json(partial_path(out), document)


def measure_layouts(args, run, spec, facts, result, hw, layouts, head, rows, ranks, on_gpu, out) -> dict:
    """Each layout measured in processes of its own, its row appended to `rows`, the document written after
    every layout (write_progress); returns the complete document."""
    from zerotrain.engine import cpu_adam_unavailable

    # Built here, once, before the layouts' ranks would each build it at once on a fresh machine.
    no_cpu_adam = cpu_adam_unavailable() if any(layout.offload_optimizer == "cpu" for layout in layouts) else None
    document: dict = {}
    with tempfile.TemporaryDirectory(prefix="zerotrain-calibrate-") as work, stop_on_sigterm():
        for index, layout in enumerate(layouts):
            trial = run.model_copy(update={"training": run.training.model_copy(
                update={"global_batch_size": layout.micro_batch * ranks})})
            candidate = evaluate(layout, facts, hw, trial)
            row = {"config": describe(layout), "layout": dataclasses.asdict(layout),
                   "predicted": prediction(candidate, hw, on_gpu, facts),
                   "flops_per_step": activations(layout, facts).flops * layout.micro_batch,
                   "fits": candidate.fits, "rejected": candidate.rejected,
                   "status": measurable(candidate, ranks, on_gpu) or "ok"}
            if row["status"] == "ok" and layout.offload_optimizer == "cpu" and no_cpu_adam:
                row["status"] = f"skipped: {no_cpu_adam}"
            if row["status"] == "ok":
                print(f"calibrate: [{index + 1}/{len(layouts)}] {row['config']} ...", file=sys.stderr, flush=True)
                job = {"run": trial.model_dump(mode="json"), "blocks": args.blocks, "layout": row["layout"],
                       "steps": args.steps, "checkpointing": result.checkpointed(layout), "debug": bool(args.debug)}
                row.update(measure_apart(job, ranks, args.layout_timeout, Path(work) / f"layout-{index}"))
            rows.append(row)
            # after every layout: a run cut off keeps what finished
            document = finish(head, rows, hw, facts, spec, run.planner, on_gpu, complete=index + 1 == len(layouts))
            write_progress(out, document)
    return document


def finish(head: dict, rows: list[dict], hw, facts, spec, planner, on_gpu: bool, complete: bool) -> dict:
    """The calibration document of the rows measured so far: their derived figures, and the
    constants fitted to the clean ones."""
    for row in rows:
        m = row.get("measured")
        if row["status"] == "ok" and m and "images_per_second" not in m:
            step = m["forward_backward_s"] + m["optimizer_s"]
            m["images_per_second"] = row["layout"]["micro_batch"] * head["world_size"] / step
            m["mfu"] = row["flops_per_step"] / (hw.peak_bf16_flops * step) if on_gpu else None
    devices = [row["measured"]["device"] for row in rows if row.get("measured")]
    device = devices[0] if devices else (f"cpu ({os.cpu_count()} cores)" if not on_gpu else hw.gpu_name)
    constants, defaults = fit(rows, hw, facts, families.of(spec).name, planner, on_gpu)
    return {**head, "device": device, "complete": complete, "constants": constants, "defaults": defaults,
            "measurements": rows}


def accelerator_type() -> str:
    """The device type the layouts' processes will use (DeepSpeed's accelerator choice, DS_ACCELERATOR
    included), found without creating a CUDA context here."""
    from zerotrain.distributed import accelerator

    return accelerator()[0]


@contextlib.contextmanager
def stop_on_sigterm():
    """SIGTERM (a scheduler's, `timeout`'s) unwinds like Ctrl-C, so that the running layout's
    processes are stopped with it instead of living on, holding the GPU."""
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# --- one layout in processes of its own -------------------------------------------------------------


def measure_apart(job: dict, ranks: int, timeout: float, folder: Path) -> dict:
    """Run one layout in fresh processes (a fresh CUDA context, none of DeepSpeed's process-wide
    state from earlier layouts: ZeRO-3 keeps the module and replaces F.linear for the rest of a
    process), one per rank: `python -m zerotrain.calibrate_layout JOB` alone, under torchrun for several
    ranks, the way DeepSpeed's autotuner launches each experiment as a job of its own. torchrun
    stops the other ranks when one fails. Returns the row's status, measurement and, when it
    failed, the last lines it printed."""
    folder.mkdir(parents=True)
    (folder / "job.json").write_text(json.dumps(job))
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    command = [sys.executable, *launcher, "-m", "zerotrain.calibrate_layout", str(folder / "job.json")]
    log = folder / "output.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            stop_tree(proc)
    results = [read_result(folder / f"rank{rank}.json") for rank in range(ranks)]
    oom = next((r["oom"] for r in results if r and "oom" in r), None)
    if oom is not None:  # measured: this layout does not fit
        return {"status": f"oom: {oom[:120]}", "measured": None}
    if code == 0 and all(results):
        return {"status": "ok", "measured": merge(results)}
    tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
    if code is None:
        status = f"timeout: not finished after {timeout:g} s (--layout-timeout)"
    elif code < 0:
        status = f"crashed: killed by {signal.Signals(-code).name}"
    else:
        status = f"crashed: exit code {code}"
    print(f"calibrate: {status}; its last lines:", *tail, sep="\n", file=sys.stderr, flush=True)
    return {"status": status, "measured": None, "error": tail}


# The last lines of a failed layout's output kept in its row (its exception, printed before any barrier).
TAIL_LINES = 25


def stop_tree(proc: subprocess.Popen) -> None:
    """End a layout's process and everything it started (torchrun's ranks), if still running."""
    import psutil

    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    if proc.poll() is None:
        proc.kill()
    for child in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    proc.wait()


def read_result(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # never written: the rank died first
        return None


def worker(job_file: Path) -> int:
    """One rank of one layout's processes: measure, write this rank's result beside the job, leave.
    An error prints its real exception at once and ends the process without a barrier: a collective
    over a sticky CUDA error fails, and the NCCL watchdog then aborts the process before the
    original exception is printed."""
    import torch

    from zerotrain.deepspeed_compat import init_distributed
    from zerotrain.distributed import accelerator, shutdown, standalone_rendezvous, topology, use_device
    from zerotrain.models.catalog import resolve_model
    from zerotrain.monitor import write_json
    from zerotrain.quiet import quiet_libraries
    from zerotrain.trainer import allocator_settings

    job = json.loads(job_file.read_text())
    run = RunConfig.model_validate(job["run"])
    topo = topology()
    allocator_settings(run)
    if topo.world_size == 1:
        standalone_rendezvous()
    device = use_device(topo)
    before_group = outside_allocator(device)
    result_file = job_file.parent / f"rank{topo.rank}.json"
    with quiet_libraries(job["debug"] or run.logging.verbose, topo.rank):
        init_distributed(accelerator()[1])
        try:
            spec = reduced_spec(resolve_model(run.model), job["blocks"])
            result = run_layout(Layout(**job["layout"]), spec, run, topo, device, job["steps"], job["checkpointing"])
            result["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else \
                f"cpu ({os.cpu_count()} cores)"
            result["cuda_overheads"] = cuda_overheads(device, before_group)
            result["host_to_device_bandwidth"] = host_to_device_bandwidth(device)
        except torch.OutOfMemoryError as err:
            # Written before leaving: the exit code makes torchrun stop any rank still waiting.
            write_json(result_file, {"oom": one_line(err, 200)})
            os._exit(OOM_EXIT)
        except BaseException:  # noqa: BLE001 (anything, SystemExit included: printed, then the process ends)
            traceback.print_exc(file=sys.__stderr__)
            sys.__stderr__.flush()
            os._exit(1)
        write_json(result_file, result)
        shutdown(clean=True)
    return 0


OOM_EXIT = 3


def merge(ranks: list[dict]) -> dict:
    """One row from every rank's measurement: the largest memory of any rank, the slowest time."""
    phases = list(ranks[0]["allocated"])  # empty without a GPU
    rss = [r["host_rss_peak"] for r in ranks if r["host_rss_peak"] is not None]
    floors = [r["host_rss_floor"] for r in ranks if r["host_rss_floor"] is not None]
    return {
        "device": ranks[0]["device"],
        "allocated": max((r["allocated"][p] for r in ranks for p in phases), default=0),
        "reserved": max((r["reserved"][p] for r in ranks for p in phases), default=0),
        "phases": {p: max(r["allocated"][p] for r in ranks) for p in phases},
        "host_rss_peak": max(rss, default=None),
        "host_rss_floor": max(floors, default=None),
        "init_tensor_bytes": max(r["init_tensor_bytes"] for r in ranks),
        "forward_backward_s": max(r["forward_backward_s"] for r in ranks),
        "optimizer_s": max(r["optimizer_s"] for r in ranks),
        "skipped_steps": max(r["skipped_steps"] for r in ranks),
        "cuda_overheads": ranks[0]["cuda_overheads"],
        "host_to_device_bandwidth": ranks[0]["host_to_device_bandwidth"],
    }


def report(document: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=170)
    table = Table(title=f"zerotrain calibrate: {document['model']} at {document['resolution']}px, "
                        f"{document['mode']}, {document['world_size']} rank(s) on {document['device']}")
    for column in ("configuration", "status", "GPU alloc pred / meas", "reserved pred / meas", "host RSS pred / meas",
                   "fwd+bwd s", "opt s", "step s pred / meas", "img/s", "MFU"):
        table.add_column(column, overflow="fold")
    for row in document["measurements"]:
        p, m = row["predicted"], row.get("measured")
        if not m:
            table.add_row(row["config"], row["status"], size(p["allocated"]), size(p["reserved"]), size(p["host_rss"]),
                          "", "", f"{p['step_seconds']:.3g}", "", "")
            continue
        gpu = bool(m["allocated"])
        skipped = f" ({m['skipped_steps']} steps skipped: non-finite gradients)" if m.get("skipped_steps") else ""
        table.add_row(
            row["config"], row["status"] + skipped,
            f"{size(p['allocated'])} / {size(m['allocated']) if gpu else 'n/a'}",
            f"{size(p['reserved'])} / {size(m['reserved']) if gpu else 'n/a'}",
            f"{size(p['host_rss'])} / {size(m['host_rss_peak'])}",
            f"{m['forward_backward_s']:.3g}", f"{m['optimizer_s']:.3g}",
            f"{p['step_seconds']:.3g} / {m['forward_backward_s'] + m['optimizer_s']:.3g}",
            f"{m['images_per_second']:.3g}", f"{m['mfu']:.1%}" if m["mfu"] is not None else "n/a")
    console.print(table)
    if document["device"].startswith("cpu"):
        console.print("No GPU: the CPU is the accelerator, so GPU memory and MFU are not measured, and the host "
                      "RSS to expect is the planner's device bytes plus its offloaded host bytes.")
    fitted = ", ".join(f"{k}={v}" for k, v in document["constants"].items()) or "nothing"
    console.print(f"Fitted: {fitted}")
    console.print(f"Defaults kept (not measurable in this run): {', '.join(document['defaults']) or 'none'}")
    lane = calibration.Lane.from_json(document["lane"])
    kept = f"; kept from the calibration it replaced: {len(document['lanes'])} other lanes" if document["lanes"] else ""
    console.print(f"Lane: {lane.describe() if lane else 'none'}: plans of this lane use every fitted constant, other "
                  f"plans on {document['profile']} only {', '.join(calibration.HARDWARE)}{kept}")
    console.print(f"Written to {out}; plans use it with planner.calibration: {out}")

