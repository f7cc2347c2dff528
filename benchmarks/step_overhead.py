"""Step overhead: zerotrain's training step against a raw DeepSpeed loop, side by side in one run,
on the same tiny model (tiny-flux), the same DeepSpeed JSON and the same micro-batch shape, on CPU
(DS_ACCELERATOR=cpu, gloo). Goal (issue 13): zerotrain's step at most 1.05x the raw loop's.
Prints a table and writes benchmarks/results/step_overhead.json.

    python benchmarks/step_overhead.py [--steps 40] [--warm-up 5] [--rounds 4] [--resolution 128]
                                       [--stage N] [--world 1] [--threads 1] [--no-profile]

Both sides are worker processes of this script, started as the distributed tests start ranks (one
process per rank, RANK/WORLD_SIZE/MASTER_* set), in ABBA order (zerotrain, raw, raw, zerotrain, ...)
so that drift in the shared machine's load falls on both alike:

    zerotrain  zerotrain.train.main on examples/tiny-cpu.yaml + overrides: the real loop (data
               loader over the cache, objective.prepare, the agree() all-reduce each micro-step,
               the objective's loss, engine forward/backward/step, the mean-loss all-reduce, grad
               norm, Monitor.step with metrics.jsonl and TensorBoard, memory_check, rng_state)
    raw        deepspeed.initialize with the RUN/deepspeed.json zerotrain wrote, the denoiser loaded
               and set up by the same functions (load_denoiser, apply_mode), one micro-batch
               prepared once before the loop; per micro-step only forward, MSE, backward, step

A step's time is wall clock between consecutive optimizer steps, the same point in both loops
(zerotrain's: the entry of Monitor.step, timed by wrapping it), so it includes everything a
loop iteration does; zerotrain's own step_seconds (metrics.jsonl) leaves out what follows the
optimizer step and is reported beside it. The first --warm-up steps of each run are left out. The
ratio held against the goal is that of the medians: on a shared machine a mean picks up other
work's bursts (the mean and min ratios are printed too).
Then one more run of each side has its timed steps under cProfile (--no-profile skips it), and a
second table shows where the per-step time goes: engine calls on both sides, and the work only
zerotrain's loop does (cProfile's own cost inflates these Python-heavy rows)."""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.data_throughput import cpu_name
from tests.distributed.conftest import CONFIG, run_ranks

MODEL = "tiny-flux"
IMAGES = 32  # square images of one size: every micro-batch has the raw loop's shape
# cProfile rows, per step of the profiled runs: (label, file suffix, function name, work only
# zerotrain's loop does). The zerotrain-only rows do not overlap: their sum is the extra work of
# zerotrain's step, less its mean-loss all-reduce (called by train.py's fit itself, which was
# entered before the profiler started, so cProfile cannot tell that call from the others; it is in
# the all_reduce row, with agree()'s and DeepSpeed's own).
PROFILE_ROWS = [
    ("engine forward (DeepSpeed)", "deepspeed/runtime/engine.py", "forward", False),
    ("engine backward (DeepSpeed)", "deepspeed/runtime/engine.py", "backward", False),
    ("engine step (DeepSpeed)", "deepspeed/runtime/engine.py", "step", False),
    ("torch.distributed.all_reduce (all callers)", "torch/distributed/distributed_c10d.py", "all_reduce", False),
    ("next(batch): DataLoader over the cache", "torch/utils/data/dataloader.py", "__next__", True),
    ("objective.prepare (noise, timesteps, packing)", "zerotrain/objectives.py", "prepare", True),
    ("to_device", "zerotrain/trainer.py", "to_device", True),
    ("agree(): the mean loss and the stop signal", "zerotrain/trainer.py", "agree", True),
    ("objective.loss", "zerotrain/objectives.py", "loss", True),
    ("agree() all-reduce (NaN loss, stop signal)", "zerotrain/distributed.py", "agree", True),
    ("Monitor.step (metrics.jsonl, TensorBoard, print)", "zerotrain/monitor.py", "step", True),
    ("Monitor.memory_check", "zerotrain/monitor.py", "memory_check", True),
    ("rng_state", "zerotrain/checkpoint.py", "rng_state", True),
    ("engine.get_global_grad_norm", "deepspeed/runtime/engine.py", "get_global_grad_norm", True),
]


def make_images(folder: Path, size: int) -> None:
    """IMAGES square images of size px (smooth gradients and noise) with captions."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    for i in range(IMAGES):
        base = np.stack([x * (i % 3), y * (i % 5) / 4, (x + y) / 2], axis=-1) * 200
        pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
        Image.fromarray(pixels).save(folder / f"{i:03d}.png")
        (folder / f"{i:03d}.txt").write_text(f"a picture number {i % 7}")


def overrides(work: Path, args: argparse.Namespace, run_dir: Path) -> list[str]:
    sets = [f"output_dir={run_dir}", f"data.cache_dir={work / 'cache'}", f"planner.cache_dir={work / 'cache' / 'facts'}",
            f"data.datasets=[{{path: '{work / 'images'}', repeats: 1}}]", f"data.resolution={args.resolution}",
            f"model.name_or_path={MODEL}", "training.mode=full", f"training.max_steps={args.warm_up + args.steps}",
            "training.checkpoint_every=100000", "validation.prompts=[]"]
    if args.stage is not None:
        sets.append(f"planner.stages=[{args.stage}]")
    return sets


# --- workers (one process per rank) -------------------------------------------------------------

class Clock:
    """Times zerotrain's loop from inside: the wrapped Monitor.step stamps the time as each optimizer
    step's record begins; with a profiler, the steps after the warm-up run under it (and nothing else:
    start-up, the final checkpoint and the export stay out)."""

    def __init__(self, monitor_step, profiler: cProfile.Profile | None, warm_up: int, last: int):
        self.monitor_step, self.profiler, self.warm_up, self.last = monitor_step, profiler, warm_up, last
        self.stamps: list[float] = []

    def record(self) -> None:
        self.stamps.append(time.perf_counter())
        if self.profiler is not None and len(self.stamps) == self.warm_up:
            self.profiler.enable()
        elif self.profiler is not None and len(self.stamps) == self.last:
            self.profiler.disable()


CLOCK: Clock | None = None  # set in a zerotrain worker


def timed_monitor_step(monitor, *args, **kwargs):
    CLOCK.record()
    return CLOCK.monitor_step(monitor, *args, **kwargs)


def zerotrain_worker(sets: list[str], result: Path, warm_up: int, profile: Path | None) -> int:
    global CLOCK
    from zerotrain import monitor, train
    from zerotrain.config import load_config

    max_steps = load_config(CONFIG, sets).training.max_steps
    CLOCK = Clock(monitor.Monitor.step, cProfile.Profile() if profile else None, warm_up, max_steps)
    monitor.Monitor.step = timed_monitor_step
    code = train.main(["--config", str(CONFIG), *[a for s in sets for a in ("--set", s)]])
    if os.environ["RANK"] == "0":
        if profile:
            CLOCK.profiler.dump_stats(profile)
        result.write_text(json.dumps({"stamps": CLOCK.stamps}))
    return code


def raw_worker(sets: list[str], result: Path, deepspeed_json: Path, warm_up: int, profile: Path | None) -> int:
    """A plain DeepSpeed loop: what zerotrain's step is measured against."""
    import deepspeed
    import torch
    import torch.nn.functional as F

    from zerotrain.config import load_config
    from zerotrain.data.cache import model_folder
    from zerotrain.data.prepare import make_loader, prepare
    from zerotrain.distributed import shutdown, topology
    from zerotrain.engine import apply_mode, load_denoiser
    from zerotrain.models.catalog import resolve_model
    from zerotrain.objectives import make_objective

    run = load_config(CONFIG, sets)
    ds_config = json.loads(deepspeed_json.read_text())
    layout = json.loads((deepspeed_json.parent / "plan.json").read_text())["chosen"]["layout"]
    topo = topology()
    deepspeed.init_distributed(dist_backend="gloo")
    spec = resolve_model(run.model)
    # One micro-batch, prepared before the loop as zerotrain prepares each (not timed).
    folder = model_folder(spec, run, topo, "train")
    prepared = prepare(run, spec, topo, source=folder)
    loader, _ = make_loader(prepared, run, ds_config["train_micro_batch_size_per_gpu"], topo)
    scheduler_config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    objective = make_objective(spec, scheduler_config, run.objective, run.data.resolution, model_dtype=torch.bfloat16)
    inputs = objective.prepare(next(iter(loader)), torch.Generator().manual_seed(0))
    kwargs, target = inputs.model_kwargs, inputs.target.float()

    torch.manual_seed(run.training.seed)
    model = load_denoiser(spec, folder)
    apply_mode(model, spec, run, layout["gradient_checkpointing"])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                           config=ds_config)
    profiler = cProfile.Profile() if profile else None
    stamps = []
    for _ in range(run.training.max_steps):
        for _ in range(ds_config["gradient_accumulation_steps"]):
            pred = engine(**kwargs, return_dict=False)[0]
            loss = F.mse_loss(pred.float(), target)
            engine.backward(loss)
            engine.step()
        stamps.append(time.perf_counter())
        if profiler is not None and len(stamps) == warm_up:  # the steps zerotrain's Clock profiles
            profiler.enable()
    if profiler is not None:
        profiler.disable()
    if topo.is_main:
        if profiler is not None:
            profiler.dump_stats(profile)
        result.write_text(json.dumps({"stamps": stamps, "parameters": sum(p.numel() for p in model.parameters())}))
    del engine
    shutdown(clean=True)
    return 0


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    if args.worker == "zerotrain":
        code = zerotrain_worker(args.set, args.result, args.warm_up, args.profile_out)
    else:
        code = raw_worker(args.set, args.result, args.deepspeed_json, args.warm_up, args.profile_out)
    sys.stdout.flush()
    os._exit(code)  # as the test workers leave (see zerotrain.distributed.shutdown)


# --- the driver ---------------------------------------------------------------------------------

def step_times(stamps: list[float], warm_up: int) -> list[float]:
    """Seconds of each step after the warm-up (stamp i is taken at the end of step i + 1)."""
    return [b - a for a, b in zip(stamps[warm_up - 1:], stamps[warm_up:], strict=False)]


def summary(seconds: list[float]) -> dict[str, float]:
    return {"steps": len(seconds), "mean_ms": 1000 * statistics.fmean(seconds),
            "median_ms": 1000 * statistics.median(seconds), "min_ms": 1000 * min(seconds),
            "stdev_ms": 1000 * statistics.stdev(seconds) if len(seconds) > 1 else 0.0}


def start(kind: str, name: str, args: argparse.Namespace, work: Path, extra: list[str]) -> Path:
    """One run of a worker on args.world ranks; returns its result file."""
    run_dir = work / name
    result = work / f"{name}.json"
    sets = [a for s in overrides(work, args, run_dir) for a in ("--set", s)]
    command = [sys.executable, "-u", __file__, "--worker", kind, "--result", str(result), "--threads",
               str(args.threads), "--warm-up", str(args.warm_up), *extra, *sets]
    codes, logs, seconds = run_ranks(command, work / "logs", name, world=args.world)
    if any(codes) or not result.is_file():
        tails = "\n".join(log.read_text(errors="replace")[-4000:] for log in logs)
        raise SystemExit(f"{name}: worker exited with {codes} after {seconds:.0f} s:\n{tails}")
    print(f"  {name:14s} {seconds:5.1f} s", flush=True)
    return result


def profile_rows(stats_file: Path, steps: int) -> list[dict]:
    stats = pstats.Stats(str(stats_file)).stats
    rows = []
    for label, suffix, function, extra in PROFILE_ROWS:
        seconds = calls = 0.0
        for (file, _, name), (_, ncalls, _, cumulative, _) in stats.items():
            if name == function and file.endswith(suffix):
                seconds, calls = seconds + cumulative, calls + ncalls
        rows.append({"what": label, "zerotrain_only": extra, "ms_per_step": 1000 * seconds / steps,
                     "calls_per_step": calls / steps})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (after the warm-up)")
    parser.add_argument("--warm-up", type=int, default=5, help="steps left out at the start of each run")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each side, in ABBA order")
    parser.add_argument("--resolution", type=int, default=128, help="image size (px): sets the step's cost")
    parser.add_argument("--stage", type=int, choices=[0, 1, 2, 3], default=None,
                        help="ZeRO stage for both (default: the planner's choice)")
    parser.add_argument("--world", type=int, default=1, help="ranks per run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                        help="one more run of each under cProfile, to show where the time goes")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "step_overhead.json")
    # worker mode (the driver starts these)
    parser.add_argument("--worker", choices=["zerotrain", "raw"], help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deepspeed-json", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.warm_up < 1:
        parser.error("--warm-up must be at least 1 (the first step's time has no start mark)")

    from zerotrain.models.tiny import ensure_tiny_pipeline

    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        make_images(work / "images", args.resolution)
        ensure_tiny_pipeline(MODEL, work / "cache" / "models")
        print(f"{MODEL} at {args.resolution} px, {args.world} rank(s), {args.threads} thread(s) each, "
              f"{args.warm_up}+{args.steps} steps a run, {args.rounds} round(s):", flush=True)
        times: dict[str, list[float]] = {"zerotrain": [], "raw": []}
        runs: list[dict] = []
        records: list[dict] = []
        first_run = None
        raw_info: dict = {}
        for round_index in range(args.rounds):
            for kind in ("zerotrain", "raw") if round_index % 2 == 0 else ("raw", "zerotrain"):
                name = f"{kind}-{round_index}"
                extra = ["--deepspeed-json", str(work / first_run / "deepspeed.json")] if kind == "raw" else []
                result = json.loads(start(kind, name, args, work, extra).read_text())
                seconds = step_times(result["stamps"], args.warm_up)
                times[kind] += seconds
                runs.append({"run": name, **summary(seconds)})
                if kind == "zerotrain":
                    first_run = first_run or name
                    lines = (work / name / "metrics.jsonl").read_text().splitlines()
                    records += [json.loads(line) for line in lines][args.warm_up:]
                else:
                    raw_info = result
        ds_config = json.loads((work / first_run / "deepspeed.json").read_text())
        layout = json.loads((work / first_run / "plan.json").read_text())["chosen"]["layout"]
        recorded = {key.removesuffix("_seconds"): 1000 * statistics.median(r[key] for r in records)
                    for key in ("step_seconds", "data_seconds", "forward_backward_seconds", "optimizer_seconds")}
        profiled = None
        if args.profile:
            profiled = {}
            for kind in ("zerotrain", "raw"):
                extra = ["--deepspeed-json", str(work / first_run / "deepspeed.json")] if kind == "raw" else []
                start(kind, f"{kind}-prof", args, work, [*extra, "--profile-out", str(work / f"{kind}.prof")])
                profiled[kind] = profile_rows(work / f"{kind}.prof", args.steps)

    zt, raw = summary(times["zerotrain"]), summary(times["raw"])
    ratios = {stat: zt[f"{stat}_ms"] / raw[f"{stat}_ms"] for stat in ("median", "mean", "min")}
    print(f"\nZeRO-{ds_config['zero_optimization']['stage']}, micro-batch {ds_config['train_micro_batch_size_per_gpu']} "
          f"x accumulation {ds_config['gradient_accumulation_steps']} x {args.world} rank(s), "
          f"{raw_info['parameters']:,} parameters, gradient checkpointing {layout['gradient_checkpointing']}")
    print(f"{'ms per step':14s} {'steps':>6s} {'mean':>8s} {'median':>8s} {'min':>8s} {'stdev':>8s}")
    for row in [*runs, {"run": "raw", **raw}, {"run": "zerotrain", **zt}]:
        print(f"{row['run']:14s} {row['steps']:6d} {row['mean_ms']:8.1f} {row['median_ms']:8.1f} {row['min_ms']:8.1f} "
              f"{row['stdev_ms']:8.1f}")
    verdict = "within" if ratios["median"] <= 1.05 else "OVER"
    print(f"zerotrain / raw: {ratios['median']:.3f} (median), {ratios['mean']:.3f} (mean), {ratios['min']:.3f} (min): "
          f"{verdict} the 1.05 goal (median)")
    print(f"zerotrain's own step_seconds (metrics.jsonl, median): {recorded['step']:.1f} ms = data {recorded['data']:.1f} "
          f"+ forward/backward {recorded['forward_backward']:.1f} + optimizer {recorded['optimizer']:.1f}; what follows "
          "the optimizer step (mean-loss all-reduce, Monitor.step, rng_state, get_lr) is outside it")
    if profiled:
        print(f"\nunder cProfile, ms per step (cumulative, so rows overlap) {'zerotrain':>10s} {'raw':>8s}")
        for zt_row, raw_row in zip(profiled["zerotrain"], profiled["raw"], strict=True):
            print(f"  {zt_row['what']:56s} {zt_row['ms_per_step']:8.2f} {raw_row['ms_per_step']:8.2f}")
        extra = sum(row["ms_per_step"] for row in profiled["zerotrain"] if row["zerotrain_only"])
        print(f"  {'zerotrain-only work (rows from next(batch) on; see above)':56s} {extra:8.2f}")

    document = {
        "device": f"CPU only: {cpu_name()}, {os.cpu_count()} cores (DS_ACCELERATOR=cpu, gloo)",
        "machine": f"{platform.machine()}, python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"), "goal": "zerotrain / raw <= 1.05",
        "model": MODEL, "parameters": raw_info["parameters"], "resolution": args.resolution, "world": args.world,
        "threads": args.threads, "deepspeed": ds_config, "layout": layout, "warm_up_steps": args.warm_up,
        "rounds": args.rounds, "runs": runs, "raw": raw, "zerotrain": zt, "ratio": ratios,
        "zerotrain_recorded_ms": recorded, "profile_ms_per_step": profiled,
        "seconds": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1))
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
