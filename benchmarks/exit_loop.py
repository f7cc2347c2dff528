"""Every rank leaves cleanly: the tiny 2-rank training, run N times in a row (default 50), counting
the runs in which any rank exits non-zero, and the aborts among them (exit -6, SIGABRT, with
"terminate called without an active exception": gloo's worker threads released during interpreter
finalization, the defect zerotrain's orderly shutdown removes). Writes
benchmarks/results/exit_loop.json.

    python benchmarks/exit_loop.py [--runs 50] [--steps 5]

Each run is the configuration of the test where the abort was seen (ZeRO-2, full fine-tune, a NaN
loss injected at step 3), started the way the distributed tests start ranks (one process per
rank, RANK/WORLD_SIZE/MASTER_* set, DS_ACCELERATOR=cpu, gloo)."""

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

from tests.distributed.conftest import run_train, tiny_data
from zerotrain.models.tiny import ensure_tiny_pipeline


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "exit_loop.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ensure_tiny_pipeline("tiny-flux", work / "cache" / "models")
        base = [*tiny_data(work / "cache"), "planner.stages=[2]", "planner.offload=[none]", "training.mode=full",
                f"training.max_steps={args.steps}", "training.checkpoint_every=1000", "testing.nan_at=[3]"]
        runs = []
        for i in range(args.runs):
            result = run_train(work / f"run{i}", base, work / "logs", f"run{i}")
            aborted = any(rc == -6 for rc in result.returncodes)
            runs.append({"returncodes": result.returncodes, "seconds": round(result.seconds, 1), "aborted": aborted})
            print(f"run {i + 1}/{args.runs}: exit codes {result.returncodes} in {result.seconds:.1f} s"
                  + ("  ABORT" if aborted else ""), flush=True)
            if not result.ok:
                print(result.tails(1500), flush=True)
    failed = sum(1 for r in runs if any(rc != 0 for rc in r["returncodes"]))
    aborts = sum(1 for r in runs if r["aborted"])
    summary = {"runs": len(runs), "failed": failed, "aborted": aborts, "steps_per_run": args.steps,
               "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}",
               "date": time.strftime("%Y-%m-%d"), "per_run": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"{len(runs)} runs: {failed} with a non-zero exit, {aborts} aborted; written to {args.out}")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
