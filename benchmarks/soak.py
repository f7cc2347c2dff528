"""Soak: the tiny 2-rank training for 2,000 steps (checkpoints every 100), sampling every rank's
host RSS (VmRSS from /proc) twice a second against the step rank 0 has logged. A leak of a few KB a
step (a growing list of losses, a tensor kept alive per step, an open file per checkpoint) shows as
RSS that keeps rising after the warm-up. Goal: after step 200, RSS grows by less than 5%.
Writes the curve (every rank's RSS by step) to benchmarks/results/soak.json.

    python benchmarks/soak.py [--steps 2000] [--checkpoint-every 100] [--stage 2]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.distributed.conftest import CONFIG, logged_steps, start_ranks, tiny_data, train_args
from zerotrain.models.tiny import ensure_tiny_pipeline

WARM_UP = 200  # steps: allocator pools, the CPU Adam state and the first checkpoints settle by then


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def growth(samples: list[tuple[int, int]], start: int) -> float:
    """Relative RSS growth from the first sample at or after `start` to the mean of the last tenth."""
    after = [rss for step, rss in samples if step >= start]
    tail = after[-max(1, len(after) // 10):]
    return (sum(tail) / len(tail)) / after[0] - 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "soak.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ensure_tiny_pipeline("tiny-flux", work / "cache" / "models")
        out = work / "run"
        overrides = [*tiny_data(work / "cache"), f"planner.stages=[{args.stage}]", "planner.offload=[none]",
                     "training.mode=full", f"training.max_steps={args.steps}",
                     f"training.checkpoint_every={args.checkpoint_every}", "logging.every=10"]
        started = time.monotonic()
        procs, logs = start_ranks([sys.executable, "-u", *train_args(out, overrides)], work / "logs", "soak")
        samples: list[list[tuple[int, int]]] = [[] for _ in procs]
        while any(p.poll() is None for p in procs):
            step = logged_steps(out) * 10
            for rank, proc in enumerate(procs):
                rss = rss_bytes(proc.pid)
                if rss is not None and step > 0:
                    samples[rank].append((step, rss))
            time.sleep(0.5)
        codes = [p.wait() for p in procs]
        seconds = time.monotonic() - started
        if any(codes):
            print("\n".join(log.read_text()[-3000:] for log in logs))
            return 1
    result = {"config": str(CONFIG.relative_to(REPO)), "steps": args.steps, "stage": args.stage,
              "checkpoint_every": args.checkpoint_every, "seconds": round(seconds, 1), "warm_up_steps": WARM_UP,
              "machine": f"{platform.machine()}, python {platform.python_version()}, CPU (DS_ACCELERATOR=cpu, gloo)",
              "date": time.strftime("%Y-%m-%d"), "ranks": []}
    for rank, series in enumerate(samples):
        grown = growth(series, WARM_UP)
        by_step: dict[int, int] = {}
        for step, rss in series:
            by_step.setdefault(step // 20 * 20, rss)  # the curve every 20 steps
        result["ranks"].append({"rank": rank, "rss_mib_at_warm_up": round(next(r for s, r in series if s >= WARM_UP)
                                                                           / 2**20, 1),
                                "rss_mib_at_end": round(series[-1][1] / 2**20, 1), "growth_after_warm_up": grown,
                                "curve_step_rss_mib": [[s, round(r / 2**20, 1)] for s, r in sorted(by_step.items())]})
        print(f"rank {rank}: RSS {result['ranks'][-1]['rss_mib_at_warm_up']} MiB at step {WARM_UP} -> "
              f"{result['ranks'][-1]['rss_mib_at_end']} MiB at step {args.steps}: {grown:+.2%} "
              f"({'within' if grown < 0.05 else 'OVER'} the 5% goal)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{args.steps} steps in {seconds:.0f} s; written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
