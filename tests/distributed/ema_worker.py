"""One rank of tests/distributed/test_ema.py: builds tiny-flux in DeepSpeed engines exactly as
zerotrain does (load_denoiser, apply_mode, deepspeed_config(Layout(...)), build_engine), keeps a
zerotrain.ema.ShardedEMA, and writes what the test compares. Started by the test with
RANK/WORLD_SIZE set:

    python ema_worker.py SPEC.json

SPEC holds model_dir, stage, offload ("none" | "cpu": the optimizer, and under ZeRO-3 the
parameters too), mode ("full" | "lora"), decay, start_step, and:

- steps (optional): two engines are built from the same seed, the trained one and a control,
  and take `steps` optimizer steps on the same batches (each rank draws its own, from
  torch.manual_seed(1 + rank)). The trained engine's EMA is updated after each step, and so is a
  reference EMA, computed with the plain formula from the full fp32 master weights that
  deepspeed.utils.safe_get_full_fp32_param gathers (ZeRO-0's optimizer holds them whole and has
  no fragment mapping for it to use: they are read from its flat fp32 groups). After step probe_at the trained engine's
  output on a fixed input is taken before, inside ema.applied() and after; the control never
  enters applied(), so the two engines' losses must stay bit-identical. Then the EMA is saved to
  `save`, loaded on the same layout by a fresh EMA of the control engine, and saved again to
  `reload`.
- loads (optional): [[src, dst], ...]: ema.load(src), then ema.save(dst): the EMA as this layout
  takes it out of a checkpoint saved by another.
- result: rank 0 writes there the losses of both engines, the three probe outputs, the reference
  EMA at probe_at and at the end, the full master weights at the end, and the probe's output from a model built without DeepSpeed
  that holds the reference EMA of probe_at.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIG = EXAMPLES / "tiny-cpu.yaml"
GLOBAL_BATCH = 2
# ZeRO-3 keeps parameters below this many elements gathered (persistent); tiny-flux has 16 to 8192,
# so both kinds are exercised (zerotrain's default, 100k, would make every one persistent).
PERSISTENCE_THRESHOLD = 1000


def full_masters(engine: Any) -> dict[str, torch.Tensor]:
    """Every trainable parameter's full fp32 master (every rank takes part; ZeRO-0 holds them whole)."""
    from deepspeed.utils import safe_get_full_fp32_param

    held = {}
    masters = None
    if engine.zero_optimization_stage() == 0:  # FP16_Optimizer: no fragment mapping, masters whole
        opt = engine.optimizer
        masters = {}
        for g, group in enumerate(opt.fp16_groups):
            flat = getattr(opt, "fp32_groups_flat", None)
            offset = 0
            for j, p in enumerate(group):
                masters[id(p)] = (flat[g].narrow(0, offset, p.numel()) if flat is not None
                                  else opt.fp32_groups[g][j]).detach().reshape(p.shape)
                offset += p.numel()
    for name, param in engine.module.named_parameters():
        if param.requires_grad:
            full = masters[id(param)] if masters is not None else safe_get_full_fp32_param(param)
            held[name] = full.detach().float().cpu().clone()
    return held


def plain_output(spec: Any, run: Any, model_dir: Path, weights: dict[str, torch.Tensor],
                 probe: dict[str, torch.Tensor]) -> torch.Tensor:
    """The probe's output from the model built without DeepSpeed, holding `weights` (bf16)."""
    from zerotrain.engine import apply_mode, load_denoiser

    torch.manual_seed(0)
    model = load_denoiser(spec, model_dir)
    apply_mode(model, spec, run, gradient_checkpointing=False)
    result = model.load_state_dict({k: v.to(torch.bfloat16) for k, v in weights.items()}, strict=False)
    assert not set(weights) & set(result.missing_keys) and not result.unexpected_keys, result
    with torch.no_grad():
        return model(**probe, return_dict=False)[0].float()


def main() -> int:
    spec_args = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(1)
    import deepspeed

    from zerotrain.config import load_config
    from zerotrain.distributed import shutdown, topology
    from zerotrain.ema import ShardedEMA
    from zerotrain.engine import apply_mode, build_engine, load_denoiser
    from zerotrain.families import example_inputs
    from zerotrain.models.catalog import resolve_model
    from zerotrain.monitor import StepTimes
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout
    from zerotrain.trainer import train_step

    deepspeed.init_distributed(dist_backend="gloo")
    topo = topology()
    model_dir, stage, offload = Path(spec_args["model_dir"]), int(spec_args["stage"]), spec_args["offload"]
    run = load_config(CONFIG, [f"output_dir={Path(sys.argv[1]).parent / 'run'}", f"training.mode={spec_args['mode']}",
                               f"training.global_batch_size={GLOBAL_BATCH}",
                               f"planner.stage3_param_persistence_threshold={PERSISTENCE_THRESHOLD}",
                               f"data.datasets=[{{path: '{EXAMPLES / 'tiny-data'}'}}]"])
    spec = resolve_model(run.model)
    layout = Layout(stage, offload_optimizer=offload, offload_param=offload if stage == 3 else "none",
                    micro_batch=1, accumulation=GLOBAL_BATCH // topo.world_size)
    steps, probe_at = int(spec_args.get("steps", 0)), spec_args.get("probe_at")
    engines = []
    for _ in range(2 if steps else 1):  # the second engine is the control: same start, same batches, no applied()
        torch.manual_seed(0)
        model = load_denoiser(spec, model_dir)
        apply_mode(model, spec, run, gradient_checkpointing=False)
        engines.append(build_engine(model, deepspeed_config(layout, run, topo.world_size), run, torch.device("cpu")))
    engine = engines[0]
    if stage == 3:  # both kinds of ZeRO-3 parameter: gathered for each forward, and persistent
        persistent = len(engine.optimizer.persistent_parameters)
        assert 0 < persistent < len(list(engine.module.parameters())), persistent
    decay, start_step = float(spec_args["decay"]), int(spec_args["start_step"])
    ema = ShardedEMA(engine, decay, start_step)
    result: dict[str, Any] = {"world_size": topo.world_size}

    if steps:
        torch.manual_seed(1234)
        probe = example_inputs(spec, 1, 64, 64, 8, "cpu", torch.bfloat16)
        torch.manual_seed(1 + topo.rank)
        reference = full_masters(engine)
        result["losses"] = [[] for _ in engines]
        for step in range(1, steps + 1):
            batch = [example_inputs(spec, 1, 64, 64, 8, "cpu", torch.bfloat16) for _ in range(layout.accumulation)]
            for held, each in zip(result["losses"], engines, strict=True):  # zerotrain's own train_step
                mean = train_step(each, lambda i, batch=batch: (batch[i], lambda out: out.float().pow(2).mean()),
                                  layout.accumulation, StepTimes())
                held.append(mean.item())
            assert engine.global_steps == step
            ema.update(step)
            masters = full_masters(engine)
            for name, master in masters.items():
                reference[name] = master if step <= start_step else decay * reference[name] + (1 - decay) * master
            if step == probe_at:
                with torch.no_grad():
                    result["before"] = engine(**probe, return_dict=False)[0].float()
                    with ema.applied():
                        result["middle"] = engine(**probe, return_dict=False)[0].float()
                    result["after"] = engine(**probe, return_dict=False)[0].float()
                result["reference_at_probe"] = {k: v.clone() for k, v in reference.items()}
        result["reference"], result["masters"] = reference, masters
        Path(spec_args["save"]).mkdir(parents=True, exist_ok=True)
        ema.save(Path(spec_args["save"]), topo.rank)
        torch.distributed.barrier()
        # Load on the same layout, into the control engine's EMA (which holds other values).
        loaded = ShardedEMA(engines[1], decay, start_step)
        loaded.load(Path(spec_args["save"]))
        Path(spec_args["reload"]).mkdir(parents=True, exist_ok=True)
        loaded.save(Path(spec_args["reload"]), topo.rank)
        result["loaded_step"] = loaded.step

    for src, dst in spec_args.get("loads", []):
        Path(dst).mkdir(parents=True, exist_ok=True)
        ema.load(Path(src))
        ema.save(Path(dst), topo.rank)
    torch.distributed.barrier()
    if topo.is_main:
        if probe_at:
            result["plain"] = plain_output(spec, run, model_dir, result["reference_at_probe"], probe)
        torch.save(result, spec_args["result"])
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
