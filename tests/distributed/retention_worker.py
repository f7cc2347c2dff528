"""One rank of tests/distributed/test_zero3_retention.py: tiny-flux under LoRA at ZeRO-3 (every parameter
partitioned: stage3_param_persistence_threshold 0), with every block checkpointed or none, through zerotrain's own
engine; one optimizer step of one micro-batch. After the forward, the backward and the step, it counts the frozen
base's parameters that are still gathered on this rank (DeepSpeed's ds_status AVAILABLE, their full data present)
and their elements (and, to check the count itself, with three of them held by GatheredParameters). Since DeepSpeed 0.19.3, ZeRO-3 with activation checkpointing has been reported to leave frozen
parameters gathered after recomputation; the test pins what this version does.

    python retention_worker.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def main() -> int:
    model_dir, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    import deepspeed
    import torch.nn.functional as F
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from zerotrain.config import load_config
    from zerotrain.distributed import shutdown, topology
    from zerotrain.engine import apply_mode, build_engine, load_denoiser
    from zerotrain.families import example_inputs
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout

    deepspeed.init_distributed(dist_backend="gloo")
    topo = topology()
    run = load_config(EXAMPLES / "tiny-cpu.yaml", ["training.mode=lora", "training.lora.rank=4",
                                                   "planner.stage3_param_persistence_threshold=0",
                                                   f"training.global_batch_size={topo.world_size}",
                                                   f"data.datasets=[{{path: '{EXAMPLES / 'tiny-data'}'}}]"])
    spec = resolve_model(run.model)

    def gathered(engine: Any) -> dict[str, int]:
        frozen = [p for p in engine.module.parameters() if not p.requires_grad]
        held = [p for p in frozen if getattr(p, "ds_status", None) == ZeroParamStatus.AVAILABLE]
        return {"frozen": len(frozen), "gathered": len(held), "gathered_elements": sum(p.ds_numel for p in held),
                "frozen_elements": sum(p.ds_numel for p in frozen)}

    results = {}
    for checkpointing in (False, True):
        model = load_denoiser(spec, model_dir)
        apply_mode(model, spec, run, gradient_checkpointing=checkpointing)
        layout = Layout(3, "none", "none", gradient_checkpointing=checkpointing, micro_batch=1, accumulation=1)
        engine = build_engine(model, deepspeed_config(layout, run, topo.world_size), run, torch.device("cpu"))
        torch.manual_seed(7 + topo.rank)
        inputs = example_inputs(spec, 1, 64, 64, 8, "cpu", torch.bfloat16)
        pred = engine(**inputs, return_dict=False)[0]
        after = {"forward": gathered(engine)}
        engine.backward(F.mse_loss(pred.float(), torch.zeros_like(pred, dtype=torch.float32)))
        after["backward"] = gathered(engine)
        engine.step()
        after["step"] = gathered(engine)
        held = [p for p in engine.module.parameters() if not p.requires_grad][:3]
        with deepspeed.zero.GatheredParameters(held):  # the count's own check: three held gathered on purpose
            after["three held"] = gathered(engine)
        results["checkpointing" if checkpointing else "no checkpointing"] = after
        engine.destroy()
        del engine, model
    if topo.is_main:
        out.write_text(json.dumps(results, indent=1))
    shutdown(clean=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
