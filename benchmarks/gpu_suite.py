"""The GPU suite: the planner's predictions against one GPU node, in one command (issue 13).

    python benchmarks/gpu_suite.py                       # one GPU node, no network: about 30 min on one H100
    python benchmarks/gpu_suite.py --only flux-dev       # one model's cases
    DS_ACCELERATOR=cpu python benchmarks/gpu_suite.py --tiny   # the whole path on CPU, on tiny-flux (the test)

Each case is one `zerotrain calibrate` process (random weights, no download; a fresh CUDA context
per case) on a reduced-depth, full-width model at 1024px:
- flux-dev and sdxl-base, full and LoRA: ZeRO 0-3 x checkpointing on/off x micro-batch 1, 2, 4;
- the newer families (qwen-image, flux2-dev, z-image, chroma), LoRA: the star around each plan;
- the memory floor on 4+4-block flux-dev, full fine-tune at ZeRO-2: 0, 2, 4 and 8 of its blocks
  checkpointed, activation offload, each optimizer (adamw-bf16, adamw-8bit, adafactor) and
  compiled blocks (the speed-up the plan does not count yet); adamw-bf16 offloaded at ZeRO-3,
  with and without the parameters;
- full-depth flux-dev LoRA, and full-depth SDXL full fine-tuning: the plan's choice.

It writes benchmarks/results/gpu-<device>-<date>.json (every case's calibration: predicted and
measured per configuration, the fitted constants) and a markdown table beside it, and prints the
worst prediction errors and the configurations that ran out of memory although predicted to fit,
or ran although predicted not to (refused wrongly). benchmarks/README.md says how to run it on a
node where the Python packages come in as wheels."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
GRID = ["--set", "planner.offload=[none]", "--set", "planner.max_micro_batch=4", "--global-batch", "4"]


def cases(tiny: bool) -> list[dict]:
    """name, calibrate arguments, and a time limit in seconds, in the order they run."""
    if tiny:  # the suite's path end to end, as briefly as it goes
        return [{"name": "tiny-flux full", "limit": 300,
                 "args": ["--model", "tiny-flux", "--resolution", "64", "--mode", "full", "--grid", "star", *GRID]}]
    out = []
    for model, blocks in (("flux-dev", 2), ("sdxl-base", 3)):
        for mode in ("full", "lora"):
            out.append({"name": f"{model} {blocks} blocks {mode}", "limit": 240,
                        "args": ["--model", model, "--blocks", str(blocks), "--mode", mode, "--grid", "full", *GRID]})
    for model in ("qwen-image", "flux2-dev", "z-image", "chroma"):
        out.append({"name": f"{model} 2 blocks lora", "limit": 150,
                    "args": ["--model", model, "--blocks", "2", "--mode", "lora", "--grid", "star", *GRID]})
    # The memory floor (issue 14) on 4+4-block Flux-dev, full fine-tune at ZeRO-2: k = 0, N/4, N/2
    # and N of its 8 blocks checkpointed, every block with activation offload, each optimizer.
    floor = ["--model", "flux-dev", "--blocks", "4", "--mode", "full", "--grid", "chosen", "--global-batch", "1",
             "--set", "planner.stages=[2]", "--set", "planner.offload=[none]"]
    for k in (0, 2, 4, 8):
        checkpointing = ["--set", "training.gradient_checkpointing=false"] if k == 0 else \
            ["--set", f"training.checkpoint_blocks={k}"]
        out.append({"name": f"flux-dev 4 blocks full, {k}/8 checkpointed", "limit": 150, "args": [*floor, *checkpointing]})
    out.append({"name": "flux-dev 4 blocks full, activation offload", "limit": 150,
                "args": [*floor, "--set", "training.activation_offload=true", "--set", "training.gradient_checkpointing=true"]})
    for optimizer in ("adamw-bf16", "adamw-8bit", "adafactor"):
        out.append({"name": f"flux-dev 4 blocks full, {optimizer}", "limit": 150,
                    "args": [*floor, "--set", f"optimizer.name={optimizer}"]})
    out.append({"name": "flux-dev 4 blocks full, compiled blocks", "limit": 240,
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
    command = [sys.executable, "-m", "zerotrain.cli", "calibrate", *case["args"], *hardware, "--steps", "2",
               "--out", str(out), "--set", f"planner.cache_dir={workdir / 'facts'}"]
    began = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=case["limit"], check=False)
        error = None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1]
    except subprocess.TimeoutExpired:
        error = f"did not finish within {case['limit']} s"
    seconds = round(time.monotonic() - began, 1)
    print(f"{case['name']:36s} {seconds:7.1f} s  {error or 'ok'}", flush=True)
    result = {"name": case["name"], "command": " ".join(command[1:]), "seconds": seconds, "error": error}
    if error is None:
        result["calibration"] = json.loads(out.read_text())
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
            if m and not row["fits"]:
                wrong.append(f"{where}: ran although the plan refused it ({row['rejected']})")
            if m and m["allocated"]:
                errors += [{"where": where, "what": key, "predicted": p[key], "measured": m[key],
                            "error": (p[key] - m[key]) / m[key]} for key in ("allocated", "reserved")]
    errors.sort(key=lambda e: -abs(e["error"]))
    return {"worst_errors": errors[:10], "wrongly_judged": wrong}


def gib(value: float | None) -> str:
    return "n/a" if not value else f"{value / 2**30:.2f}"


def markdown(results: list[dict], device: str, totals: dict) -> str:
    lines = [f"# GPU suite on {device}, {date.today().isoformat()}", "",
             ("| case | configuration | status | alloc GiB pred / meas | reserved GiB pred / meas | step s pred / meas "
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
    return "\n".join(lines + ["", *verdict(totals)]) + "\n"


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
    args = parser.parse_args()
    hardware = ["--gpus", args.gpus] + (["--gpu-memory", args.gpu_memory] if args.gpu_memory else [])
    device = device_name()
    stem = f"gpu-{re.sub(r'[^A-Za-z0-9]+', '-', device).strip('-')}-{date.today().isoformat()}"
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerotrain-gpu-suite-") as workdir:
        results = [run_case(case, Path(workdir), hardware) for case in cases(args.tiny)
                   if not args.only or args.only in case["name"]]
    totals = summary(results)
    document = {"device": device, "date": date.today().isoformat(), "seconds": round(time.monotonic() - began, 1),
                "summary": totals, "cases": results}
    (args.out / f"{stem}.json").write_text(json.dumps(document, indent=1, default=str))
    (args.out / f"{stem}.md").write_text(markdown(results, device, totals))
    print("\n".join(verdict(totals)))
    print(f"written {args.out / stem}.json and .md in {document['seconds']:.0f} s")
    return 0 if all(r["error"] is None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
