"""Plan time per catalog model at 1024px: cold (fresh facts cache, new process, imports
included) and warm (facts cached). Prints a table and writes benchmarks/results/plan_time.json.

    python benchmarks/plan_time.py [--models flux-dev sdxl-base ...]

Target (issue 2): under 10 s cold on the 2-core CPU dev machine, instant when cached."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    "flux-dev": "8xA100-80GB", "flux-schnell": "8xA100-80GB", "sd3.5-large": "8xH100-80GB",
    "sd3.5-medium": "1xRTX4090-24GB", "sdxl-base": "1xRTX4090-24GB", "sd1.5": "1xRTX4090-24GB",
}


def timed_plan(model: str, gpus: str, cache: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "zerotrain.cli", "plan", "--model", model, "--resolution", "1024",
                    "--gpus", gpus, "--global-batch", "8", "--json"], check=True, capture_output=True,
                   env={**os.environ, "XDG_CACHE_HOME": cache})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="*", default=list(CASES))
    args = parser.parse_args()
    rows = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as cache:
            cold = timed_plan(model, CASES[model], cache)
            warm = timed_plan(model, CASES[model], cache)
        rows.append({"model": model, "gpus": CASES[model], "cold_s": round(cold, 2), "warm_s": round(warm, 2)})
        print(f"{model:14s} {CASES[model]:16s} cold {cold:5.1f} s   warm {warm:5.1f} s", flush=True)
    out = Path(__file__).parent / "results" / "plan_time.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"device": f"CPU only: {platform.processor() or platform.machine()}, "
                                         f"{os.cpu_count()} cores", "resolution": 1024, "rows": rows}, indent=2))
    print(f"written {out}")


if __name__ == "__main__":
    main()
