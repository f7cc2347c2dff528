"""One rank of tests/distributed/test_train_optimizers.py: for each (stage, optimizer) given, trains
tiny-flux (the same random weights every time) for STEPS optimizer steps on one fixed batch with
zerotrain's own DeepSpeed config and engine, and writes the losses. Started by the test with
RANK/WORLD_SIZE set:

    python optimizer_worker.py MODEL_DIR OUT.json STAGE:OPTIMIZER[:cpu] ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 10
LR = 2e-3


def main() -> int:
    model_dir, out, cases = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
    torch.set_num_threads(1)
    import deepspeed
    import torch.nn.functional as F

    from zerotrain.config import load_config
    from zerotrain.distributed import shutdown, topology
    from zerotrain.engine import apply_mode, build_engine, cpu_adam_unavailable, load_denoiser
    from zerotrain.families import example_inputs
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout

    deepspeed.init_distributed(dist_backend="gloo")
    topo = topology()
    run = load_config(EXAMPLES / "tiny-cpu.yaml", [
        "training.mode=full", f"training.global_batch_size={topo.world_size}", f"optimizer.lr={LR}",
        "optimizer.weight_decay=0", "planner.stage3_param_persistence_threshold=0",
        f"data.datasets=[{{path: '{EXAMPLES / 'tiny-data'}'}}]"])
    spec = resolve_model(run.model)
    if any(case.endswith(":cpu") for case in cases):  # built one rank at a time, as train.py does
        unavailable = cpu_adam_unavailable()
        if unavailable:
            raise SystemExit(unavailable)
    losses = {}
    for case in cases:
        stage, optimizer, *offload = case.split(":")  # STAGE:OPTIMIZER[:cpu]
        model = load_denoiser(spec, model_dir)
        apply_mode(model, spec, run, gradient_checkpointing=False)
        layout = Layout(int(stage), offload[0] if offload else "none", micro_batch=1, accumulation=1,
                        optimizer=optimizer)
        engine = build_engine(model, deepspeed_config(layout, run, topo.world_size), run, torch.device("cpu"))
        torch.manual_seed(100 + topo.rank)  # each rank its own sample, the same for every case
        inputs = example_inputs(spec, 1, 64, 64, 8, "cpu", torch.bfloat16)
        target = torch.randn_like(inputs["hidden_states"], dtype=torch.float32)
        losses[case] = []
        for _ in range(STEPS):
            prediction = engine(**inputs, return_dict=False)[0]
            loss = F.mse_loss(prediction.float(), target)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses[case].append(mean.item() / topo.world_size)
        engine.destroy()
        del engine, model
    if topo.is_main:
        out.write_text(json.dumps(losses))
    shutdown(clean=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
