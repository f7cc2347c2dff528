"""One rank of tests/distributed/test_train_optimizers.py: for each (stage, optimizer) given, trains
tiny-flux (the same random weights every time) for STEPS optimizer steps on one fixed batch with
zerotrain's own DeepSpeed config and engine, and writes the losses. Started by the test with
RANK/WORLD_SIZE set:

    python optimizer_worker.py MODEL_DIR OUT.json STAGE:OPTIMIZER[:OFFLOAD[:deepspeed]] ...

OFFLOAD: cpu (the optimizer) or cpu+param (ZeRO-3: the optimizer and the parameters; two
micro-batches of the batch per step, so that the offloaded gradients accumulate). A trailing
:deepspeed builds the engine with DeepSpeed's own ZeRO-3 buffers, without zerotrain's sharing
(deepspeed_compat's buffer sharing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 10
LR = 2e-3


def finish(engine: Any) -> None:
    """engine.destroy(), and what ZeRO-3 leaves in a process released (F.linear restored, its module
    off DeepSpeed's stack), so that the next case's engine starts as in a fresh process."""
    from zerotrain.deepspeed_compat import release_process_state

    module = engine.module
    engine.destroy()
    release_process_state(module)


def main() -> int:
    model_dir, out, cases = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    import deepspeed
    import torch.nn.functional as F

    from zerotrain.checkpoint import replay_cpu_adam_steps
    from zerotrain.config import load_config
    from zerotrain.deepspeed_compat import Sharing
    from zerotrain.distributed import shutdown, topology
    from zerotrain.engine import apply_mode, build_engine, cpu_adam_unavailable, load_denoiser
    from zerotrain.families import example_inputs
    from zerotrain.models.catalog import resolve_model
    from zerotrain.monitor import StepTimes
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout
    from zerotrain.trainer import train_step

    deepspeed.init_distributed(dist_backend="gloo")
    topo = topology()
    run = load_config(EXAMPLES / "tiny-cpu.yaml", [
        "training.mode=full", f"training.global_batch_size={topo.world_size}", f"optimizer.lr={LR}",
        "optimizer.weight_decay=0", "planner.stage3_param_persistence_threshold=0",
        f"data.datasets=[{{path: '{EXAMPLES / 'tiny-data'}'}}]"])
    spec = resolve_model(run.model)
    if any(":cpu" in case for case in cases):  # built one rank at a time, as train.py does
        unavailable = cpu_adam_unavailable()
        if unavailable:
            raise SystemExit(unavailable)
    losses = {}
    def make_engine(case: str) -> tuple[Any, int]:
        stage, optimizer, offload, own = (case.split(":") + ["none", ""])[:4]
        model = load_denoiser(spec, model_dir)
        apply_mode(model, spec, run, gradient_checkpointing=False)
        accumulation = 2 if "param" in offload else 1
        layout = Layout(int(stage), offload.split("+")[0], "cpu" if "param" in offload else "none", micro_batch=1,
                        accumulation=accumulation, optimizer=optimizer)
        batch = run.model_copy(update={"training": run.training.model_copy(
            update={"global_batch_size": accumulation * topo.world_size})})
        own_buffers = Sharing(False, "DeepSpeed's own buffers, to compare with") if own == "deepspeed" else None
        return build_engine(model, deepspeed_config(layout, batch, topo.world_size), batch, torch.device("cpu"),
                            sharing=own_buffers), accumulation

    def train(engine: Any, accumulation: int, steps: int, save: Path | None = None) -> list[float]:
        """`steps` optimizer steps through zerotrain's own train_step, on one fixed batch."""
        torch.manual_seed(100 + topo.rank)  # each rank its own sample, the same for every case
        inputs = example_inputs(spec, 1, 64, 64, 8, "cpu", torch.bfloat16)
        target = torch.randn_like(inputs["hidden_states"], dtype=torch.float32)
        out = []
        for _ in range(steps):
            mean = train_step(engine, lambda _: (inputs, lambda pred: F.mse_loss(pred.float(), target)),
                              accumulation, StepTimes())
            torch.distributed.all_reduce(mean)
            out.append(mean.item() / topo.world_size)
            if save is not None and len(out) == STEPS // 2:
                engine.save_checkpoint(str(save), tag="half")
        return out

    for case in cases:
        engine, accumulation = make_engine(case)
        # Offloaded ZeRO-3 also saves half-way; a new engine loads that and trains the second half.
        resumes = "param" in case and "deepspeed" not in case
        save = out.parent / ("checkpoint-" + case.replace(":", "_")) if resumes else None
        losses[case] = train(engine, accumulation, STEPS, save)
        finish(engine)
        if save is not None:
            engine, accumulation = make_engine(case)
            engine.load_checkpoint(str(save), tag="half")
            replay_cpu_adam_steps(engine)  # as zerotrain's checkpoint.load does
            losses[f"{case}:resumed"] = train(engine, accumulation, STEPS - STEPS // 2)
            finish(engine)
    if topo.is_main:
        out.write_text(json.dumps(losses))
    shutdown(clean=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
