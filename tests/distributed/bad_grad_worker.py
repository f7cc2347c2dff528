"""One rank of tests/distributed/test_bad_gradients.py: a finite loss whose gradients are not
finite on one rank only, as a bf16 overflow in one rank's backward gives. For each ZeRO stage,
an engine built as zerotrain builds it (build_engine, the planner's DeepSpeed JSON, the LR
schedule) takes a good step, a bad one (rank 0's output gradient is made inf by a hook; every
loss stays finite) and a good one. Started by the test with RANK/WORLD_SIZE set:

    python bad_grad_worker.py OUT.json

Rank 0 writes, per case, what every rank saw: whether each step was applied, the weights'
state after each step (changed, finite), the gradient norm DeepSpeed reports and the LR
scheduler's step count. The last case is ZeRO-2 with bf16.check_grad_overflow: false, the
setting zerotrain refuses in a given DeepSpeed JSON: there the bad step is applied."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIG = EXAMPLES / "tiny-cpu.yaml"
CASES = [("zero0", 0, True), ("zero1", 1, True), ("zero2", 2, True), ("zero3", 3, True),
         ("zero2-no-overflow-check", 2, False)]


def weights(engine) -> list[torch.Tensor]:
    """The full bf16 weights the module holds (gathered under ZeRO-3)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().float().clone() for p in params]


def run_case(stage: int, overflow_check: bool, run, topo) -> dict:
    from zerotrain.engine import build_engine
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    config = deepspeed_config(Layout(stage, micro_batch=1, accumulation=1), run, topo.world_size)
    if not overflow_check:
        config["bf16"] = {**config["bf16"], "check_grad_overflow": False}
    engine = build_engine(model, config, run, torch.device("cpu"))
    seen = {"applied": [], "loss_finite": [], "changed": [], "weights_finite": [], "grad_norm": [],
            "scheduler_steps": []}
    before = weights(engine)
    for bad in (False, True, False):
        torch.manual_seed(100 + topo.rank)
        out = engine(torch.randn(4, 32, dtype=torch.bfloat16))
        if bad and topo.rank == 0:
            out.register_hook(lambda grad: torch.full_like(grad, float("inf")))
        loss = out.float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        after = weights(engine)
        norm = engine.get_global_grad_norm()
        seen["applied"].append(bool(engine.was_step_applied()))
        seen["loss_finite"].append(bool(torch.isfinite(loss).item()))
        seen["changed"].append(any(not torch.equal(a, b) for a, b in zip(before, after)))
        seen["weights_finite"].append(all(bool(torch.isfinite(a).all()) for a in after))
        seen["grad_norm"].append(None if norm is None else float(norm) if math.isfinite(float(norm)) else "nonfinite")
        seen["scheduler_steps"].append(engine.lr_scheduler.last_epoch)
        before = after
    engine.destroy()
    return seen


def main() -> int:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    import deepspeed

    from zerotrain.config import load_config
    from zerotrain.distributed import gather_objects, shutdown, topology

    deepspeed.init_distributed(dist_backend="gloo")
    topo = topology()
    # lr 1e-2: one applied Adam step moves every bf16 weight visibly; ZeRO-3 partitions everything.
    run = load_config(CONFIG, ["training.global_batch_size=2", "optimizer.lr=1e-2",
                               "planner.stage3_param_persistence_threshold=0",
                               f"data.datasets=[{{path: '{EXAMPLES / 'tiny-data'}'}}]"])
    results = {name: gather_objects(run_case(stage, check, run, topo)) for name, stage, check in CASES}
    if topo.is_main:
        out.write_text(json.dumps(results, indent=1))
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
