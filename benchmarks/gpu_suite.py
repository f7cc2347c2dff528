"""The GPU suite: the planner's predictions against one GPU node, in one command (issue 13).

    python benchmarks/gpu_suite.py                       # one GPU node, no network: about 30 min on one H100
    python benchmarks/gpu_suite.py --only flux-dev       # one model's cases
    python benchmarks/gpu_suite.py --plan-only --gpus 1xH100-80GB   # what each case would run, planned here (any machine)
    DS_ACCELERATOR=cpu python benchmarks/gpu_suite.py --tiny   # the whole path on CPU, on tiny-flux (the test)

Each case is one `zerotrain calibrate` process (random weights, no download; a fresh CUDA context
per case) on a reduced-depth, full-width model at 1024px:
- flux-dev and sdxl-base, full and LoRA: ZeRO 0-3 x checkpointing on/off x micro-batch 1, 2, 4;
- the newer families (qwen-image, flux2-dev, z-image, chroma, krea-2-raw, ideogram-4, flux3-klein-base, qwen-image-2.1), LoRA: the star around each plan;
- the memory floor on 8-block flux-dev (3 double- and 5 single-stream blocks), full fine-tune at
  ZeRO-2: 0, 2, 4 and 8 of its blocks checkpointed, activation offload, each optimizer
  (adamw-bf16, adamw-8bit, adafactor) and compiled blocks (the speed-up the plan does not count
  yet); adamw-bf16 offloaded at ZeRO-3 on 4-block flux-dev, with and without the parameters;
- full-depth flux-dev LoRA, and full-depth SDXL full fine-tuning: the plan's choice.

It writes benchmarks/results/gpu-<device>-<date>.json (every case's calibration: predicted and
measured per configuration, the fitted constants) and a markdown table beside it, and prints the
worst prediction errors and the configurations that ran out of memory although predicted to fit,
or ran although predicted not to (refused wrongly). benchmarks/README.md says how to run it on a
node where the Python packages come in as wheels.

--plan-only runs nothing: it plans every case here as calibrate would (the model's facts, the plan,
calibrate's grid around it, the planner's prediction for each layout) and writes
plan-<date>.json, so that a case that cannot run (a setting its model refuses) shows before the
GPU time is spent. tests/distributed/test_gpu_suite.py checks it on CPU."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
GRID = ["--set", "planner.offload=[none]", "--set", "planner.max_micro_batch=4", "--global-batch", "4"]
# The families released in 2026 (benchmarks/gpu_check.py runs them last).
FAMILIES_2026 = ("krea-2-raw", "ideogram-4", "flux3-klein-base", "qwen-image-2.1")
# SIGTERM first, so that a case may write what it has; SIGKILL this many seconds later.
KILL_GRACE_S = 10


def reduced_args(model: str, blocks: int, mode: str, grid: str) -> list[str]:
    """calibrate's arguments for a reduced-depth, full-width model at 1024 px over the grid's layouts
    (GRID: no offload, micro-batch up to 4)."""
    return ["--model", model, "--blocks", str(blocks), "--mode", mode, "--grid", grid, *GRID]


def tiny_args(model: str, mode: str) -> list[str]:
    """calibrate's arguments for a tiny catalog model at 64 px over the star grid, at ZeRO-0 and 3 only
    (each layout is a process of its own: on 2 CPU cores, about 10 s each)."""
    return ["--model", model, "--resolution", "64", "--mode", mode, "--grid", "star", *GRID,
            "--set", "planner.stages=[0,3]"]


def calibrate_command(args: list[str], hardware: list[str], out: Path, workdir: Path) -> list[str]:
    """The one `zerotrain calibrate` invocation this suite and gpu_check.py run: two steps per layout,
    a layout that hangs stopped after LAYOUT_TIMEOUT_S (the case goes on with the next), the
    calibration document written to `out` after every layout, the model's facts cached under `workdir`."""
    return [sys.executable, "-m", "zerotrain.cli", "calibrate", *args, *hardware, "--steps", "2",
            "--layout-timeout", str(LAYOUT_TIMEOUT_S), "--out", str(out), "--set", f"planner.cache_dir={workdir / 'facts'}"]


# A layout's process: imports, the model's build, three steps of a 2-block model (about 20 s on a GPU
# node, 10-25 s for tiny-flux on 2 CPU cores); a hang is stopped well within a case's limit.
LAYOUT_TIMEOUT_S = 90


@dataclasses.dataclass(frozen=True)
class Finished:
    returncode: int | None  # None: killed at its time limit
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_limited(command: list[str], limit: float, log: Path, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> Finished:
    """Run `command` in a session of its own (its own process group), its stdout and stderr into
    `log`. At `limit` seconds the whole group is stopped (SIGTERM, then SIGKILL KILL_GRACE_S later):
    a calibrate or train process leaves compile workers and DeepSpeed helpers behind, which a kill of
    the direct child alone would leave holding the GPU. Whatever of the group outlives a normal exit
    is killed too, and so is the group when this process is interrupted while it waits."""
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    returncode: int | None = None
    with log.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True)
        try:
            returncode = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        finally:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    return Finished(returncode, round(time.monotonic() - began, 1))


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:  # the group has ended
        pass


def last_line(log: Path) -> str:
    """The last non-empty line of a log: where zerotrain prints its one-line error."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip() if lines else "?"


def cases(tiny: bool) -> list[dict]:
    """name, calibrate arguments, and a time limit in seconds, in the order they run."""
    if tiny:  # the suite's path end to end, as briefly as it goes
        return [{"name": "tiny-flux full", "limit": 300, "args": tiny_args("tiny-flux", "full")}]
    out = []
    for model, blocks in (("flux-dev", 2), ("sdxl-base", 3)):
        for mode in ("full", "lora"):
            out.append({"name": f"{model} {blocks} blocks {mode}", "limit": 240,
                        "args": reduced_args(model, blocks, mode, "full")})
    for model in ("qwen-image", "flux2-dev", "z-image", "chroma", *FAMILIES_2026):
        out.append({"name": f"{model} 2 blocks lora", "limit": 150, "args": reduced_args(model, 2, "lora", "star")})
    # The memory floor (issue 14) on 8-block Flux-dev (--blocks 8 shares them 3 double + 5 single),
    # full fine-tune at ZeRO-2: k = 0, N/4, N/2 and N of its 8 blocks checkpointed, every block with
    # activation offload, each optimizer. (--blocks 4 keeps 1 + 3 blocks, of which 3 checkpointable:
    # 4/8 and 8/8 were refused there.)
    floor = ["--model", "flux-dev", "--blocks", "8", "--mode", "full", "--grid", "chosen", "--global-batch", "1",
             "--set", "planner.stages=[2]", "--set", "planner.offload=[none]"]
    for k in (0, 2, 4, 8):
        checkpointing = ["--set", "training.gradient_checkpointing=false"] if k == 0 else \
            ["--set", f"training.checkpoint_blocks={k}"]
        out.append({"name": f"flux-dev 8 blocks full, {k}/8 checkpointed", "limit": 150, "args": [*floor, *checkpointing]})
    out.append({"name": "flux-dev 8 blocks full, activation offload", "limit": 150,
                "args": [*floor, "--set", "training.activation_offload=true", "--set", "training.gradient_checkpointing=true"]})
    for optimizer in ("adamw-bf16", "adamw-8bit", "adafactor"):
        out.append({"name": f"flux-dev 8 blocks full, {optimizer}", "limit": 150,
                    "args": [*floor, "--set", f"optimizer.name={optimizer}"]})
    out.append({"name": "flux-dev 8 blocks full, compiled blocks", "limit": 240,
                "args": [*floor, "--set", "training.compile=true"]})
    # adamw-bf16 offloaded at ZeRO-3, with and without the parameters: the host RAM of the shared
    # buffers (deepspeed_compat._zero3_shares_bf16_masters) and the PCIe and CPU-Adam time the plan predicts.
    out.append({"name": "flux-dev 4 blocks full, adamw-bf16 at ZeRO-3 offloaded", "limit": 300,
                "args": ["--model", "flux-dev", "--blocks", "4", "--mode", "full", "--grid", "full",
                         "--global-batch", "1", "--set", "planner.stages=[3]", "--set", "planner.offload=[cpu]",
                         "--set", "optimizer.name=adamw-bf16", "--set", "training.gradient_checkpointing=true"]})
    out.append({"name": "flux-dev lora (full depth)", "limit": 300,
                "args": ["--model", "flux-dev", "--mode", "lora", "--grid", "chosen", "--global-batch", "1"]})
    out.append({"name": "sdxl-base full (full depth)", "limit": 240,
                "args": ["--model", "sdxl-base", "--mode", "full", "--grid", "chosen", "--global-batch", "4"]})
    return out


def device_name() -> str:
    """The GPU's name (nvidia-smi's), or the CPU's."""
    try:
        import pynvml

        pynvml.nvmlInit()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        return name.decode() if isinstance(name, bytes) else name
    except Exception:  # noqa: BLE001 - no NVML: a CPU run
        return f"cpu-{platform.machine()}-{os.cpu_count()}cores"


def run_case(case: dict, workdir: Path, hardware: list[str]) -> dict:
    out = workdir / (re.sub(r"[^\w.-]+", "-", case["name"]) + ".json")
    command = calibrate_command(case["args"], hardware, out, workdir)
    done = run_limited(command, case["limit"], out.with_suffix(".log"))
    error = None
    if done.timed_out:
        error = f"did not finish within {case['limit']} s"
    elif done.returncode != 0:
        error = last_line(out.with_suffix(".log"))
    print(f"{case['name']:36s} {done.seconds:7.1f} s  {error or 'ok'}", flush=True)
    result = {"name": case["name"], "command": " ".join(command[1:]), "seconds": done.seconds, "error": error}
    if error is None:
        result["calibration"] = json.loads(out.read_text())
    return result


def plan_case(case: dict, hardware: list[str], workdir: Path) -> dict:
    """What the case would measure, planned in this process without running it: calibrate's
    arguments, the model's facts (reduced to --blocks), the plan, calibrate's grid around it, and
    for each layout the planner's GPU prediction as calibrate records it (one process)."""
    from zerotrain import calibrate
    from zerotrain.config.flags import config_from_args
    from zerotrain.hardware import hardware_facts
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.measure import measure_model
    from zerotrain.planner.search import describe, evaluate, plan

    parser = argparse.ArgumentParser(prog="zerotrain")
    calibrate.add_parser(parser.add_subparsers(dest="command"))
    command = ["calibrate", *case["args"], *hardware, "--set", f"planner.cache_dir={workdir / 'facts'}"]
    began = time.monotonic()
    result = {"name": case["name"], "command": " ".join(command), "error": None, "chosen": None, "planned": []}
    try:
        args = parser.parse_args(command)
        run = config_from_args(args)
        spec = calibrate.reduced_spec(resolve_model(run.model), args.blocks)
        facts = measure_model(spec, run)
        hw = hardware_facts(run.hardware)
        planned = plan(facts, hw, run)
        result["chosen"] = describe(planned.chosen.layout) if planned.chosen else None
        for layout in calibrate.grid(planned, args.grid):
            trial = run.model_copy(update={"training": run.training.model_copy(
                update={"global_batch_size": layout.micro_batch})})
            candidate = evaluate(layout, facts, hw, trial)
            checkpointed = planned.checkpointed(layout)
            result["planned"].append({
                "config": describe(layout), "layout": dataclasses.asdict(layout),
                "checkpointed": checkpointed if isinstance(checkpointed, bool) else list(checkpointed),
                "predicted": calibrate.prediction(candidate, hw, True, facts), "fits": candidate.fits,
                "rejected": candidate.rejected})
    except SystemExit as err:  # argparse refused the arguments (its message is on stderr)
        result["error"] = f"calibrate's arguments refused (exit {err.code})"
    except Exception as err:  # noqa: BLE001 - a case that cannot be planned is what --plan-only reports
        result["error"] = f"{type(err).__name__}: {err}"
    result["seconds"] = round(time.monotonic() - began, 1)
    outcome = result["error"] or f"{len(result['planned'])} layouts, chosen: {result['chosen']}"
    print(f"{case['name']:52s} {result['seconds']:5.1f} s  {outcome}", flush=True)
    return result


def summary(results: list[dict]) -> dict:
    """Worst relative errors of the memory predictions, and the configurations the plan judged wrongly."""
    errors, wrong = [], []
    for result in results:
        for row in (result.get("calibration") or {}).get("measurements", []):
            p, m = row["predicted"], row.get("measured")
            where = f"{result['name']}: {row['config']}"
            if row["status"].startswith("oom") and row["fits"]:
                wrong.append(f"{where}: out of memory although predicted to fit ({gib(p['device_total'])} GiB)")
            # Refused for memory (not, on one GPU, as ZeRO-3 that saves nothing there: that one runs, slowly).
            if m and not row["fits"] and not (row["rejected"] or "").startswith("one GPU:"):
                wrong.append(f"{where}: ran although the plan refused it ({row['rejected']})")
            if m and m["allocated"]:
                errors += [{"where": where, "what": key, "predicted": p[key], "measured": m[key],
                            "error": (p[key] - m[key]) / m[key]} for key in ("allocated", "reserved")]
    errors.sort(key=lambda e: -abs(e["error"]))
    return {"worst_errors": errors[:10], "wrongly_judged": wrong}


def gib(value: float | None) -> str:
    return "n/a" if not value else f"{value / 2**30:.2f}"


def markdown(results: list[dict], device: str, totals: dict) -> str:
    lines = [f"# GPU suite on {device}, {date.today().isoformat()}", "", *calibration_table(results)]
    return "\n".join(lines + ["", *verdict(totals)]) + "\n"


def calibration_table(results: list[dict]) -> list[str]:
    """Each case's layouts, predicted against measured, as markdown table lines."""
    lines = [("| case | configuration | status | alloc GiB pred / meas | reserved GiB pred / meas | step s pred / meas "
              "| img/s | MFU |"), "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for result in results:
        if result["error"]:
            lines.append(f"| {result['name']} | | {result['error']} | | | | | |")
            continue
        for row in result["calibration"]["measurements"]:
            p, m = row["predicted"], row.get("measured") or {}
            step = f"{m['forward_backward_s'] + m['optimizer_s']:.3g}" if m else "n/a"
            speed = f"{m['images_per_second']:.3g}" if m else "n/a"
            mfu = f"{m['mfu']:.1%}" if m.get("mfu") is not None else "n/a"
            lines.append(f"| {result['name']} | {row['config']} | {row['status']} | {gib(p['allocated'])} / "
                         f"{gib(m.get('allocated'))} | {gib(p['reserved'])} / {gib(m.get('reserved'))} | "
                         f"{p['step_seconds']:.3g} / {step} | {speed} | {mfu} |")
    return lines


def verdict(totals: dict) -> list[str]:
    lines = ["Worst memory prediction errors ((predicted - measured) / measured):", ""]
    lines += [f"- {e['where']} {e['what']}: {e['error']:+.1%}" for e in totals["worst_errors"]] or ["- none measured"]
    lines += ["", "Judged wrongly (out of memory although predicted to fit, or refused although it runs):", ""]
    return lines + ([f"- {w}" for w in totals["wrongly_judged"]] or ["- none"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny-flux at 64px on whatever device (the CPU test)")
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and markdown results")
    parser.add_argument("--gpus", default="auto", help="hardware.gpus for every case (default: NVML's)")
    parser.add_argument("--gpu-memory", help="hardware.gpu_memory, with a bare --gpus count")
    parser.add_argument("--host-memory", help="hardware.host_memory for every case (default: this node's)")
    parser.add_argument("--plan-only", action="store_true",
                        help="run nothing: plan each case here (give --gpus a profile off the GPU node) and write "
                             "plan-<date>.json")
    args = parser.parse_args()
    hardware = ["--gpus", args.gpus] + (["--gpu-memory", args.gpu_memory] if args.gpu_memory else []) + (
        ["--host-memory", args.host_memory] if args.host_memory else [])
    selected = [case for case in cases(args.tiny) if not args.only or args.only in case["name"]]
    if args.plan_only:
        return plan_only(selected, hardware, args.out)
    device = device_name()
    stem = f"gpu-{re.sub(r'[^A-Za-z0-9]+', '-', device).strip('-')}-{date.today().isoformat()}"
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerotrain-gpu-suite-") as workdir:
        results = [run_case(case, Path(workdir), hardware) for case in selected]
    totals = summary(results)
    document = {"device": device, "date": date.today().isoformat(), "seconds": round(time.monotonic() - began, 1),
                "summary": totals, "cases": results}
    (args.out / f"{stem}.json").write_text(json.dumps(document, indent=1, default=str))
    (args.out / f"{stem}.md").write_text(markdown(results, device, totals))
    print("\n".join(verdict(totals)))
    print(f"written {args.out / stem}.json and .md in {document['seconds']:.0f} s")
    return 0 if all(r["error"] is None for r in results) else 1


def plan_only(selected: list[dict], hardware: list[str], out: Path) -> int:
    """--plan-only: every case planned here (plan_case), written to plan-<date>.json; 1 if any case
    cannot be planned."""
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerotrain-gpu-suite-plan-") as workdir:
        results = [plan_case(case, hardware, Path(workdir)) for case in selected]
    document = {"plan_only": True, "hardware": " ".join(hardware), "date": date.today().isoformat(),
                "seconds": round(time.monotonic() - began, 1), "cases": results}
    path = out / f"plan-{date.today().isoformat()}.json"
    path.write_text(json.dumps(document, indent=1, default=str))
    failed = [r["name"] for r in results if r["error"]]
    print(f"written {path}: {len(results)} cases planned" + (f", {len(failed)} cannot run: {', '.join(failed)}"
                                                              if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
