"""One rank of tests/distributed/test_oom_recovery.py's engine test: for each case (a ZeRO stage,
with offload), trains tiny-flux (the same random weights every time) through zerotrain's own
engine and train_step for STEPS optimizer steps of two micro-batches each, twice:

- as it is;
- with the backward of step FAILING's second micro-batch raising torch.OutOfMemoryError half-way
  through the model (a gradient hook on a middle block's output: the later blocks' gradients are
  computed and, with the small reduce buckets, partly reduced across the ranks; the first
  micro-batch's gradients are accumulated), then deepspeed_compat.abandon_step, and the step run
  again on the same micro-batches.

Writes both runs' per-step losses (the mean over the ranks) and the failures seen. Started with
RANK/WORLD_SIZE set:

    python abandon_worker.py MODEL_DIR OUT.json STAGE[:OFFLOAD] ...

OFFLOAD: cpu (the optimizer) or cpu+param (ZeRO-3: the optimizer and the parameters).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS, FAILING, ACCUMULATION = 4, 2, 2


def main() -> int:
    model_dir, out, cases = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    import deepspeed
    import torch.nn.functional as F

    from zerotrain.config import load_config
    from zerotrain.deepspeed_compat import abandon_step
    from zerotrain.distributed import shutdown, topology
    from zerotrain.engine import apply_mode, build_engine, load_denoiser
    from zerotrain.families import example_inputs
    from zerotrain.models.catalog import resolve_model
    from zerotrain.monitor import StepTimes
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout
    from zerotrain.recompute import checkpoint_units
    from zerotrain.trainer import StepOutOfMemory, train_step

    deepspeed.init_distributed(dist_backend="gloo")
    topo = topology()
    run = load_config(EXAMPLES / "tiny-cpu.yaml", [
        "training.mode=full", f"training.global_batch_size={ACCUMULATION * topo.world_size}", "optimizer.lr=2e-3",
        "planner.stage3_param_persistence_threshold=0", "planner.reduce_bucket_size=20000",
        f"data.datasets=[{{path: '{EXAMPLES / 'tiny-data'}'}}]"])
    spec = resolve_model(run.model)
    failure = {"armed": False}

    def fail_in_backward(_module: Any, _inputs: Any, output: Any) -> None:
        if not failure["armed"]:
            return

        def raise_once(grad: torch.Tensor) -> None:
            if failure["armed"]:
                failure["armed"] = False
                raise torch.OutOfMemoryError("CUDA out of memory (injected half-way through backward)")

        for tensor in output if isinstance(output, tuple) else (output,):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(raise_once)

    def make_engine(case: str) -> Any:
        stage, offload = (case.split(":") + ["none"])[:2]
        model = load_denoiser(spec, model_dir)
        apply_mode(model, spec, run, gradient_checkpointing=False)
        units = list(checkpoint_units(model).values())
        units[len(units) // 2].register_forward_hook(fail_in_backward)
        layout = Layout(int(stage), offload.split("+")[0], "cpu" if "param" in offload else "none", micro_batch=1,
                        accumulation=ACCUMULATION)
        return build_engine(model, deepspeed_config(layout, run, topo.world_size), run, torch.device("cpu"))

    def train(engine: Any, inject: bool) -> tuple[list[float], list[str]]:
        torch.manual_seed(100 + topo.rank)  # each rank its own micro-batches, the same for both runs
        batches = [example_inputs(spec, 1, 64, 64, 8, "cpu", torch.bfloat16) for _ in range(STEPS * ACCUMULATION)]
        targets = [torch.randn_like(b["hidden_states"], dtype=torch.float32) for b in batches]
        losses, events, step = [], [], 0
        while step < STEPS:
            def micro_batch(index: int, first: int = step * ACCUMULATION, failing: bool = step + 1 == FAILING) -> Any:
                failure["armed"] = inject and failing and index == 1 and not events
                return batches[first + index], lambda pred: F.mse_loss(pred.float(), targets[first + index])

            micro_steps = engine.micro_steps
            try:
                mean = train_step(engine, micro_batch, ACCUMULATION, StepTimes())
            except StepOutOfMemory as err:
                events.append(f"step {step + 1}: {err}")
                abandon_step(engine, micro_steps)
                continue
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / topo.world_size)
            step += 1
        return losses, events

    results = {}
    for case in cases:
        for inject in (False, True):
            engine = make_engine(case)
            losses, events = train(engine, inject)
            results[f"{case}:{'failed' if inject else 'plain'}"] = {"losses": losses, "events": events}
            engine.destroy()
            del engine
    if topo.is_main:
        out.write_text(json.dumps(results))
    shutdown(clean=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
