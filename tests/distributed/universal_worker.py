"""One rank of tests/distributed/test_train_universal.py: trains tiny-flux for one optimizer step
and checkpoints it (save), or resumes from that checkpoint (load), with zerotrain's own engine and
checkpoint functions, then writes what the engine holds for every trainable parameter: the full
fp32 master weight and Adam moments as DeepSpeed's safe_get_full_* APIs gather them (every rank
takes part), plus the step counters. Started by the test with RANK/WORLD_SIZE set:

    python universal_worker.py save|load RUN_DIR MODEL_DIR STAGE OUT.pt|-

("-": write nothing; DeepSpeed 0.19's safe_get_full_optimizer_state cannot read the Adam moments
of a ZeRO-1/2 engine resumed the ordinary way until its next step.) load converts the checkpoint to a universal one when it was saved by another world size or
stage, as train.py does."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIG = EXAMPLES / "tiny-cpu.yaml"
GLOBAL_BATCH = 2


def main() -> int:
    mode, run_dir, model_dir, stage, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), \
        Path(sys.argv[5])
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    from tests.distributed.worker_steps import random_step
    from zerotrain.checkpoint import find, load, make_universal, needs_universal, save
    from zerotrain.config import load_config
    from zerotrain.distributed import shutdown, topology
    from zerotrain.engine import apply_mode, build_engine, load_denoiser
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout

    deepspeed.init_distributed(dist_backend="gloo")
    topo = topology()
    run = load_config(CONFIG, [f"output_dir={run_dir}", "training.mode=full",
                               f"training.global_batch_size={GLOBAL_BATCH}",
                               "planner.stage3_param_persistence_threshold=0",
                               f"data.datasets=[{{path: '{EXAMPLES / 'tiny-data'}'}}]"])
    spec = resolve_model(run.model)
    torch.manual_seed(0)
    model = load_denoiser(spec, model_dir)
    apply_mode(model, spec, run, gradient_checkpointing=False)
    layout = Layout(stage, micro_batch=1, accumulation=GLOBAL_BATCH // topo.world_size)
    ds_config = deepspeed_config(layout, run, topo.world_size)
    checkpoint, universal = find(run_dir, "auto"), None
    if mode == "load" and needs_universal(checkpoint, topo.world_size, stage):
        universal = make_universal(checkpoint, topo)
        ds_config["checkpoint"] = {"load_universal": True}
    engine = build_engine(model, ds_config, run, torch.device("cpu"))

    if mode == "save":
        random_step(engine, spec, layout.accumulation, seed=1 + topo.rank)
        save(engine, run_dir, 1, topo, {"step": 1}, {}, keep=3)
    else:
        load(engine, checkpoint, topo, {}, universal)

    if str(out) == "-":
        return 0
    held = {"global_steps": engine.global_steps, "scheduler_steps": engine.lr_scheduler.last_epoch,
            "params": {}}
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            held["params"][name] = {"fp32": safe_get_full_fp32_param(param),
                                    **{key: safe_get_full_optimizer_state(param, key)
                                       for key in ("exp_avg", "exp_avg_sq")}}
    if topo.is_main:
        torch.save(held, out)
    # Leave the process group as train.py does, or gloo may abort the exiting process (exit -6).
    shutdown(clean=True)
    return 0


if __name__ == "__main__":
    code = main()
    # The results are written. This worker built several engines; skipping interpreter finalization
    # keeps gloo's threads from aborting it there (pytorch#190489), which still happened about once in
    # a few CI runs after the shutdown. train.py's own exit path is what the train.py-based tests and
    # benchmarks/exit_loop.py check.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
