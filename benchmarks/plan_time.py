"""Plan time at 1024px, each plan in a new process (imports included) with an empty user facts cache:

- cold: a catalog model's first plan, from the facts shipped with zerotrain (zerotrain/planner/shipped_facts/);
- write-config: the same plan with --write-config, DeepSpeed validating the JSON it writes;
- fine-tune: a bare transformer/config.json of a catalog architecture, with the private keys diffusers
  writes (_diffusers_version, _name_or_path), as a user's fine-tune has it: planned from the catalog
  model's shipped facts since they are keyed by architecture;
- traced: --no-cache, the model built and traced on the meta device, as for an architecture outside the
  catalog; one row per family.

    python benchmarks/plan_time.py [--runs 3]

Prints a table and writes benchmarks/results/plan_time.json (each case's median of --runs, and every run).
Goals (issue 41): cold under 0.5 s, the Qwen-Image fine-tune's config.json under 3 s, write-config under 5 s."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# (case, model, extra flags, hardware (profile, host RAM per node)). Every case fits: one that does not also
# plans its suggestions, which is a different measurement.
A100, H100, RTX4090 = ("8xA100-80GB", "1TiB"), ("1xH100-80GB", "256GiB"), ("1xRTX4090-24GB", "128GiB")
COLD = [("cold", "flux-dev", [], A100), ("write-config", "flux-dev", ["--write-config", "{tmp}/ds.json"], A100),
        ("fine-tune", "qwen-image", ["--mode", "lora", "--from-config"], H100)]
# One catalog model per family, traced again (--no-cache).
TRACED = ["chroma", "flux-dev", "flux2-klein-4b", "flux3-klein", "ideogram-4", "krea-2-raw", "qwen-image",
          "qwen-image-2.1", "sd3.5-medium", "sdxl-base", "z-image"]


def fine_tune_config(model: str, folder: Path) -> Path:
    """The catalog model's transformer config as a fine-tune's folder holds it."""
    from zerotrain.config import ModelConfig
    from zerotrain.models.catalog import resolve_model

    config = {**resolve_model(ModelConfig(name_or_path=model)).config, "_diffusers_version": "0.42.1",
              "_name_or_path": f"someone/{model}-fine-tune"}
    path = folder / "transformer" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    return path


def timed_plan(model: str, flags: list[str], hardware: tuple[str, str]) -> tuple[float, str]:
    """Seconds of one `zerotrain plan` in a new process with an empty facts cache, and its facts_source."""
    gpus, host = hardware
    with tempfile.TemporaryDirectory() as tmp:
        if "--from-config" in flags:
            flags = [f for f in flags if f != "--from-config"]
            model = str(fine_tune_config(model, Path(tmp) / "fine-tune"))
        flags = [f.replace("{tmp}", tmp) for f in flags]
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "zerotrain.cli", "plan", "--model", model, "--resolution", "1024",
                               "--gpus", gpus, "--host-memory", host, "--global-batch", "8", "--json", *flags],
                              check=False, capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": tmp})
        seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):  # 1: planned, nothing fits
        raise SystemExit(f"{model}: zerotrain plan failed: {done.stderr.strip()}")
    return seconds, json.loads(done.stdout)["model"]["facts_source"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--traced", nargs="*", default=TRACED, help="models to trace (one per family)")
    args = parser.parse_args()
    cases = [*COLD, *(("traced", model, ["--no-cache"], H100) for model in args.traced)]
    rows = []
    for case, model, flags, hardware in cases:
        runs = [timed_plan(model, flags, hardware) for _ in range(args.runs)]
        seconds = [round(s, 2) for s, _ in runs]
        rows.append({"case": case, "model": model, "flags": [f for f in flags if "{tmp}" not in f],
                     "gpus": hardware[0], "facts_source": runs[0][1], "median_s": statistics.median(seconds),
                     "runs_s": seconds})
        print(f"{case:12s} {model:16s} {runs[0][1]:8s} {statistics.median(seconds):6.2f} s  {seconds}", flush=True)
    out = Path(__file__).parent / "results" / "plan_time.json"
    out.write_text(json.dumps({"device": f"CPU only: {platform.processor() or platform.machine()}, "
                                         f"{os.cpu_count()} cores", "resolution": 1024,
                               "note": "new process, empty facts cache, median of the runs",
                               "rows": rows}, indent=1) + "\n")
    print(f"written {out}")


if __name__ == "__main__":
    main()
