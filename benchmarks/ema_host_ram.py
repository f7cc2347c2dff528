"""The EMA's host RAM against the plan (issue 48 §6): a 2-rank CPU run of a FLUX.1-architecture model large
enough for the EMA to stand out (tiny-flux's encoders and VAE, a transformer of about 144M parameters), once
without the EMA and once with ema.enabled and validation.use_ema, validation rendered after the last step.
Every rank's host RSS (VmRSS; the DataLoader's workers off) is sampled ten times a second, summed over the node
and tagged with the phase rank 0's files show. In each phase, the highest node RSS of the run with the EMA less
that of the run without is what the EMA costs there, compared with what the plan adds for it: training (steps
2 on, before the last: "training" less "offload", memory.ema_bytes, with no DataLoader workers) and validation (from the last
step's record until rank 0 says where the images went: the trained masters beside the EMA, twice that). Goal:
within 10% in both. On the CPU accelerator the device is the host, so only the difference of the two runs is
the EMA's. Writes benchmarks/results/ema_host_ram.json.

    python benchmarks/ema_host_ram.py [--stage 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.soak import rss_bytes
from tests.distributed.conftest import WORLD, logged_steps, start_ranks, tiny_data, train_args
from zerotrain.models.tiny import ensure_tiny_pipeline

T = TypeVar("T")
# Rank 0's line once its validation images of a step are written (Trainer.validate; step 0's come first).
VALIDATED = "validation images of step {}:"
# A FLUX.1 transformer about 2000 times tiny-flux's, with its in/out and text widths (the encoders' and VAE's).
WIDER = {"num_layers": 2, "num_single_layers": 4, "attention_head_dim": 64, "num_attention_heads": 16,
         "axes_dims_rope": [16, 24, 24]}  # rope axes sum to the head width


def model_folder(work: Path) -> tuple[Path, int]:
    """tiny-flux's pipeline with a wider, deeper transformer (random weights); its parameter count."""
    import torch
    from diffusers import FluxTransformer2DModel

    tiny = ensure_tiny_pipeline("tiny-flux", work / "cache" / "models")
    folder = shutil.copytree(tiny, work / "wide-flux")
    config = json.loads((folder / "transformer" / "config.json").read_text())
    shutil.rmtree(folder / "transformer")
    model = FluxTransformer2DModel.from_config({**config, **WIDER}).to(torch.bfloat16)
    model.save_pretrained(folder / "transformer")
    return folder, sum(p.numel() for p in model.parameters())


def sampled(args: list[str], log_dir: Path, name: str, probe: Callable[[list[Any]], T]) -> list[T]:
    """Run the ranks of `args`; probe(their processes) ten times a second until they end (also for
    loader_workers_ram.py). An exit code other than 0 ends the benchmark with the ranks' logs."""
    procs, logs = start_ranks(args, log_dir, name)
    samples: list[T] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(probe(procs))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    codes = [p.wait(timeout=1800) for p in procs]
    done.set()
    sampler.join()
    if any(codes):
        raise SystemExit(f"{name}: exit codes {codes}\n" + "\n".join(log.read_text()[-3000:] for log in logs))
    return samples


def node_rss(args: list[str], log_dir: Path, name: str, out: Path, last: int) -> list[tuple[str, int]]:
    """Run the ranks; (the phase, the sum of their RSS) ten times a second: "step N" while N steps are logged,
    "validation" from the last step's record until rank 0 says where its validation images went, "after" then."""
    log0 = log_dir / f"{name}.rank0.log"

    def phase() -> str:
        if log0.exists() and VALIDATED.format(last) in log0.read_text(errors="replace"):
            return "after"
        return f"step {logged_steps(out)}"

    return sampled(args, log_dir, name, lambda procs: (phase(), sum(rss_bytes(p.pid) or 0 for p in procs)))


def highest(samples: list[tuple[str, int]], phases: list[str]) -> int:
    return max(rss for phase, rss in samples if phase in phases)


def planned(run_dir: Path) -> dict[str, int]:
    return json.loads((run_dir / "plan.json").read_text())["chosen"]["memory"]["host_terms"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ema_host_ram.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder, params = model_folder(work)
        base = [*tiny_data(work / "cache"), f"model.name_or_path={folder}", f"planner.stages=[{args.stage}]",
                "planner.offload=[none]", "training.mode=full", f"training.max_steps={args.steps}",
                "training.checkpoint_every=1000", "data.num_workers=0", "hardware.host_memory=512GiB",
                "hardware.gpu_memory=64GiB", "validation.prompts=[a red square]", f"validation.every={args.steps}",
                "validation.steps=2"]
        cases = {"without EMA": [], "with EMA": ["ema.enabled=true", "validation.use_ema=true"]}
        rows = {}
        for name, extra in cases.items():
            out = work / name.replace(" ", "-")
            samples = node_rss([sys.executable, "-u", *train_args(out, [*base, *extra])], work / "logs", out.name, out,
                               args.steps)
            training = [f"step {n}" for n in range(2, args.steps)]  # the first step's allocations settled
            rows[name] = {"training_peak_node_rss_bytes": highest(samples, training),
                          "validation_peak_node_rss_bytes": highest(samples, [f"step {args.steps}"]),
                          "planned_host_terms": planned(out)}
            print(f"{name}: {rows[name]}", flush=True)
    terms = rows["with EMA"]["planned_host_terms"]
    planned_bytes = {"training": terms["training"] - terms["offload"],
                     "validation": terms["validation"] - terms["offload"]}
    comparison = {}
    for phase, predicted in planned_bytes.items():
        key = f"{phase}_peak_node_rss_bytes"
        measured = rows["with EMA"][key] - rows["without EMA"][key]
        comparison[phase] = {"measured_ema_bytes": measured, "planned_ema_bytes": predicted,
                             "ratio": round(measured / predicted, 3)}
        print(f"{phase}: the EMA added {measured / 2**20:.0f} MiB to the node's highest RSS; the plan "
              f"{predicted / 2**20:.0f} MiB (ratio {measured / predicted:.3f})", flush=True)
    summary = {"what": __doc__.splitlines()[0], "parameters": params, "world": WORLD, "stage": args.stage,
               "steps": args.steps, "machine": f"{platform.machine()}, python {platform.python_version()}, CPU accelerator",
               "date": time.strftime("%Y-%m-%d"), "comparison": comparison, "runs": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if all(0.9 <= c["ratio"] <= 1.1 for c in comparison.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
