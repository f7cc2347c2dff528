"""The DataLoader workers' host RAM against the plan (issue 48 §6): a 2-rank CPU run of the tiny example with
data.num_workers 0 and then 2 (the default), each rank's process and its children (the workers) sampled ten
times a second from /proc: their proportional set size (PSS, which splits the pages a forked worker still shares
with its rank) summed over the node, and each worker's own pages (USS: Private_Clean + Private_Dirty). The
highest node PSS of the run with workers less that of the run without, over the training steps (the first one
settled, the last one excluded), divided by the node's workers, is what one worker costs; the plan counts
planner.loader_worker_bytes for each (memory.loader_bytes). Goal: the measured cost within the planned one.
A worker's pages are the rank's Python heap that it touches after the fork (the garbage collector walks every
object, so a worker copies the pages of the rank's imports and module objects), its own allocator's arenas, and
data.prefetch batches: they do not grow with the model's weights, which live in tensor storage a worker never
touches. Writes benchmarks/results/loader_workers_ram.json.

    python benchmarks/loader_workers_ram.py [--steps 300]
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

from benchmarks.ema_host_ram import sampled
from tests.distributed.conftest import WORLD, logged_steps, tiny_data, train_args


def smaps(pid: int) -> dict[str, int]:
    """A process's smaps_rollup in bytes (Pss, Private_Clean, ...); {} once it is gone."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]
    except OSError:
        return {}
    return {parts[0].rstrip(":"): int(parts[1]) * 1024 for parts in (line.split() for line in lines) if len(parts) >= 2}


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def sample_run(args: list[str], log_dir: Path, name: str, out: Path) -> list[dict]:
    """Run the ranks; every tenth of a second, the logged step count, the node's PSS (ranks and their children)
    and each child's USS."""

    def probe(procs: list) -> dict:
        pss, workers = 0, []
        for proc in procs:
            pss += smaps(proc.pid).get("Pss", 0)
            for child in children(proc.pid):
                found = smaps(child)
                pss += found.get("Pss", 0)
                workers.append(found.get("Private_Clean", 0) + found.get("Private_Dirty", 0))
        return {"step": logged_steps(out), "node_pss": pss, "worker_uss": workers}

    return sampled(args, log_dir, name, probe)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "loader_workers_ram.json")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        base = [*tiny_data(work / "cache"), "planner.stages=[2]", "planner.offload=[none]", "training.mode=full",
                f"training.max_steps={args.steps}", "training.checkpoint_every=1000"]
        for workers in (0, 2):
            out = work / f"workers-{workers}"
            samples = sample_run([sys.executable, "-u", *train_args(out, [*base, f"data.num_workers={workers}"])],
                                 work / "logs", out.name, out)
            training = [s for s in samples if 2 <= s["step"] < args.steps]
            plan = json.loads((out / "plan.json").read_text())
            rows[workers] = {"peak_node_pss_bytes": max(s["node_pss"] for s in training),
                             "peak_worker_uss_bytes": max(max(s["worker_uss"], default=0) for s in training),
                             "samples": len(training), "planned_host_terms": plan["chosen"]["memory"]["host_terms"]}
            print(f"data.num_workers={workers}: {rows[workers]}", flush=True)
    workers = 2 * WORLD
    measured = (rows[2]["peak_node_pss_bytes"] - rows[0]["peak_node_pss_bytes"]) / workers
    terms = rows[2]["planned_host_terms"]
    planned = (terms["training"] - terms["offload"]) // workers  # no EMA: the workers alone
    print(f"one worker: {measured / 2**20:.0f} MiB of the node's PSS (its own pages at most "
          f"{rows[2]['peak_worker_uss_bytes'] / 2**20:.0f} MiB); planned {planned / 2**20:.0f} MiB", flush=True)
    summary = {"what": __doc__.splitlines()[0], "world": WORLD, "workers_per_rank": 2, "steps": args.steps,
               "machine": f"{platform.machine()}, python {platform.python_version()}, CPU accelerator",
               "date": time.strftime("%Y-%m-%d"), "measured_bytes_per_worker": int(measured),
               "planned_bytes_per_worker": planned, "ratio": round(measured / planned, 3),
               "runs": {f"num_workers={k}": v for k, v in rows.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if measured <= planned else 1


if __name__ == "__main__":
    sys.exit(main())
