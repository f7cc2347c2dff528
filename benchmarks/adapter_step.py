"""Step time of each adapter type (issue 25): LoRA, DoRA, LoKr and LoHa through peft, forward and backward
of a full-width, reduced-depth denoiser on this machine's CPU, fp32. peft's LoKr and LoHa build every
adapted layer's full delta weight (out x in) at each forward and multiply by it; LoRA multiplies by
its two thin factors. So LoKr's extra cost is per layer, whatever the token count, and its share of
a step shrinks as the tokens grow.

    python benchmarks/adapter_step.py [--model flux2-klein-4b] [--blocks 2] [--tokens 256 1024]
                                      [--rank 16] [--steps 3] [--threads 2]

For each token count (image tokens; the text is 64 tokens) and adapter, one warm-up step and then
--steps timed steps; the median is reported, with its ratio to LoRA's. Writes
benchmarks/results/adapter_step.json, naming the machine."""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from zerotrain import families
from zerotrain.adapters import apply_lora
from zerotrain.config import load_config
from zerotrain.models.catalog import resolve_model

ADAPTERS = {"lora": [], "dora": ["training.lora.use_dora=true"], "lokr": ["training.lora.type=lokr"],
            "loha": ["training.lora.type=loha"]}
TEXT_TOKENS = 64


def step_seconds(model: torch.nn.Module, inputs: dict, steps: int) -> list[float]:
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        out = model(**inputs, return_dict=False)[0]
        out.float().pow(2).mean().backward()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="flux2-klein-4b")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base_spec = resolve_model(load_config(None, [f"model.name_or_path={args.model}"]).model)
    family = families.of(base_spec)
    spec = base_spec.__class__(**{**base_spec.__dict__, "config": family.with_blocks(base_spec.config, args.blocks)})
    rows = []
    for tokens in args.tokens:
        side = math.isqrt(tokens) * family.pixel_factor(spec)
        inputs = families.example_inputs(spec, 1, side, side, TEXT_TOKENS, "cpu", torch.float32)
        for kind, extra in ADAPTERS.items():
            torch.manual_seed(0)
            run = load_config(None, [f"model.name_or_path={args.model}", "training.mode=lora",
                                     f"training.lora.rank={args.rank}", *extra])
            model = spec.denoiser_class().from_config(spec.config)
            apply_lora(model, spec, run)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            times = step_seconds(model, inputs, args.steps)
            rows.append({"image_tokens": tokens, "adapter": kind, "trainable": trainable,
                         "median_s": statistics.median(times), "times_s": times})
            del model
    for row in rows:
        lora = next(r for r in rows if r["image_tokens"] == row["image_tokens"] and r["adapter"] == "lora")
        row["vs_lora"] = row["median_s"] / lora["median_s"]
        print(f"{row['image_tokens']:>6} tokens  {row['adapter']:<5} {row['trainable']:>12,} trainable  "
              f"{row['median_s']:7.2f} s  x{row['vs_lora']:.2f}")
    out = Path(__file__).with_name("results") / "adapter_step.json"
    out.write_text(json.dumps({"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                               f"{args.threads} threads, CPU fp32", "torch": torch.__version__,
                               "model": args.model, "blocks": args.blocks, "rank": args.rank, "rows": rows},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
