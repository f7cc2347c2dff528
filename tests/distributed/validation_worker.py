"""One rank of tests/distributed/test_validation.py: builds a real DeepSpeed engine the way
zerotrain/train.py does (load_denoiser, apply_mode, build_engine with the planner's DeepSpeed JSON),
renders the validation images before training (step 0, as validation.at_start does), takes one
optimizer step, and renders again (step 1). Started by the test with RANK/WORLD_SIZE set:

    python validation_worker.py MODEL_DIR OUT_DIR STAGE OVERRIDE...

OVERRIDE are --set style key=value overrides of examples/tiny-cpu.yaml (model, mode, validation.*).
Rank 0 leaves the images under OUT_DIR/validation/step-0000000{0,1}/ and prints the paths."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIG = EXAMPLES / "tiny-cpu.yaml"
GLOBAL_BATCH = 2


def main() -> int:
    model_dir, out_dir, stage = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    overrides = sys.argv[4:]
    torch.set_num_threads(1)
    import deepspeed

    from tests.distributed.worker_steps import random_step
    from zerotrain.config import load_config
    from zerotrain.distributed import shutdown, topology
    from zerotrain.engine import apply_mode, build_engine, denoiser, load_denoiser
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout
    from zerotrain.sampling import Validator

    deepspeed.init_distributed(dist_backend="gloo")
    topo = topology()
    device = torch.device("cpu")
    run = load_config(CONFIG, [f"output_dir={out_dir}", f"training.global_batch_size={GLOBAL_BATCH}",
                               f"data.datasets=[{{path: '{EXAMPLES / 'tiny-data'}'}}]", *overrides])
    spec = resolve_model(run.model)
    validator = Validator(spec, model_dir, run, topo, device)  # before the model, as train.py would

    torch.manual_seed(run.training.seed)
    model = load_denoiser(spec, model_dir)
    apply_mode(model, spec, run, gradient_checkpointing=True)
    layout = Layout(stage, micro_batch=1, accumulation=GLOBAL_BATCH // topo.world_size)
    engine = build_engine(model, deepspeed_config(layout, run, topo.world_size), run, device)

    if stage == 3:  # the test's point: every parameter partitioned, gathered inside each forward
        persistent = [name for name, p in engine.module.named_parameters() if p.ds_persist]
        assert not persistent, f"ZeRO-3 keeps {len(persistent)} parameters whole, e.g. {persistent[:3]}"

    paths = []
    assert validator.due(0, 1, resumed=False)
    paths += validator.render(denoiser(engine), 0, out_dir)
    assert engine.module.training, "render must leave the model in training mode"

    random_step(engine, spec, layout.accumulation, seed=1 + topo.rank)
    assert validator.due(1, 1, resumed=False)
    paths += validator.render(denoiser(engine), 1, out_dir)

    assert bool(paths) == topo.is_main, f"rank {topo.rank} returned {paths}"
    for path in paths:
        print(f"wrote {path}")
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
