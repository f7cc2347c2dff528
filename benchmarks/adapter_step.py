"""Step time of each adapter type (issues 25 and 41): LoRA, DoRA, LoKr and LoHa through peft, forward and
backward of a full-width, reduced-depth denoiser on this machine's CPU, fp32, and what the planner's
trace counts as their activations.

LoKr and LoHa run zerotrain's factored forward (zerotrain.adapter_forward: W1 X W2^T per token for
LoKr, the rank-r^2 Khatri-Rao factors for LoHa); the rows "lokr-peft" and "loha-peft" run peft's own
forward in the same run (the forward before issue 41), which builds every adapted layer's full delta
weight (out x in) at each forward and multiplies the tokens by it.

    python benchmarks/adapter_step.py [--model flux2-klein-4b] [--blocks 2] [--tokens 256 1024]
                                      [--rank 16] [--steps 3] [--threads 2] [--no-peft]

The models share one base's frozen weights. For each token count (image tokens; the text is 64
tokens), one warm-up round and then --steps timed rounds, each round one step of every adapter in
turn (so that a load on a shared machine reaches each alike); reported: the median step, the median
over rounds of the step's ratio to LoRA's in the same round, and the planner's saved
activations without checkpointing (its meta-device trace of the same reduced model, bf16, at that
token count). Writes benchmarks/results/adapter_step.json, naming the machine."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from zerotrain import adapter_forward, families
from zerotrain.adapters import apply_lora
from zerotrain.config import load_config
from zerotrain.models.catalog import resolve_model
from zerotrain.planner.measure import measure_model

ADAPTERS = {"lora": [], "dora": ["training.lora.use_dora=true"], "lokr": ["training.lora.type=lokr"],
            "loha": ["training.lora.type=loha"], "lokr-peft": ["training.lora.type=lokr"],
            "loha-peft": ["training.lora.type=loha"]}
TEXT_TOKENS = 64


def step_seconds(model: torch.nn.Module, inputs: dict) -> float:
    start = time.perf_counter()
    out = model(**inputs, return_dict=False)[0]
    out.float().pow(2).mean().backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


@contextlib.contextmanager
def forward_of(kind: str):
    """peft's own LoKr and LoHa forward for the "-peft" rows: the factored one not installed."""
    install = adapter_forward.install
    if kind.endswith("-peft"):
        adapter_forward.install = lambda model, version=None: 0
    try:
        yield
    finally:
        adapter_forward.install = install


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="flux2-klein-4b")
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peft", action="store_true", help="skip the rows of peft's own LoKr and LoHa forward")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    base_spec = resolve_model(load_config(None, [f"model.name_or_path={args.model}"]).model)
    family = families.of(base_spec)
    spec = base_spec.__class__(**{**base_spec.__dict__, "config": family.with_blocks(base_spec.config, args.blocks)})
    kinds = [k for k in ADAPTERS if not (args.no_peft and k.endswith("-peft"))]
    models, trainable, base = {}, {}, None
    for kind in kinds:  # one base (its frozen weights shared by every model), each adapter on it
        torch.manual_seed(0)
        run = load_config(None, [f"model.name_or_path={args.model}", "training.mode=lora",
                                 f"training.lora.rank={args.rank}", *ADAPTERS[kind]])
        model = spec.denoiser_class().from_config(spec.config)
        if base is None:
            base = model.state_dict()
        else:
            model.load_state_dict(base, assign=True)
        with forward_of(kind):
            apply_lora(model, spec, run)
        models[kind] = model
        trainable[kind] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    rows = []
    for tokens in args.tokens:
        side = math.isqrt(tokens) * family.pixel_factor(spec)
        inputs = families.example_inputs(spec, 1, side, side, TEXT_TOKENS, "cpu", torch.float32)
        times: dict[str, list[float]] = {kind: [] for kind in kinds}
        for step in range(args.steps + 1):  # round robin: a load that comes and goes reaches every adapter alike
            for kind in kinds:
                seconds = step_seconds(models[kind], inputs)
                if step:
                    times[kind].append(seconds)
        for kind in kinds:
            run = load_config(None, [f"model.name_or_path={args.model}", "training.mode=lora",
                                     f"training.lora.rank={args.rank}", f"data.resolution={side}",
                                     f"data.text_tokens={TEXT_TOKENS}", *ADAPTERS[kind]])
            with forward_of(kind):
                saved = measure_model(spec, run, cache=False).no_checkpointing.saved_bytes
            rows.append({"image_tokens": tokens, "adapter": kind, "trainable": trainable[kind],
                         "median_s": statistics.median(times[kind]), "times_s": times[kind],
                         "vs_lora": statistics.median(t / lora for t, lora in zip(times[kind], times["lora"], strict=True)),
                         "planner_saved_bytes": saved})
    for row in rows:
        print(f"{row['image_tokens']:>6} tokens  {row['adapter']:<9} {row['trainable']:>12,} trainable  "
              f"{row['median_s']:7.2f} s  x{row['vs_lora']:.2f}  planner saved {row['planner_saved_bytes'] / 2**20:8.1f} MiB")
    out = Path(__file__).with_name("results") / "adapter_step.json"
    out.write_text(json.dumps({"machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                               f"{args.threads} threads, CPU fp32", "torch": torch.__version__,
                               "model": args.model, "blocks": args.blocks, "rank": args.rank, "rows": rows},
                              indent=1) + "\n")


if __name__ == "__main__":
    main()
