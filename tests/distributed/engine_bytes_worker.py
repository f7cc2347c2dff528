"""One rank of tests/distributed/test_engine_bytes.py: trains a tiny diffusers denoiser under
real DeepSpeed on CPU for each case it is given and writes, per case, the bytes the engine
holds on this rank, read from DeepSpeed's own attributes.

Started twice by the test (RANK 0 and 1, gloo on 127.0.0.1, DS_ACCELERATOR=cpu):

    python engine_bytes_worker.py CASES.json OUT_DIR

CASES.json holds {"model_dir", "run", "cases": [{"id", "stage", "offload", "mode"}]}; "run" is a
RunConfig dump. OUT_DIR/<id>.rank<R>.json receives the measurement of each case, or its error.

Each case runs one optimizer step of two micro-batches (gradient_accumulation_steps=2):
- bf16 gradients are measured after the first backward, which is no accumulation boundary: what
  a rank holds between micro-batches, the state the planner's lp_grads describes.
- fp32 gradients are measured inside the basic optimizer's step, the only time they exist (ZeRO
  1/2 build single_partition_of_fp32_groups[i].grad at the step, ZeRO-3 builds
  fp32_partitioned_groups_flat[i].grad one sub-group at a time; offloaded, they are persistent
  pinned host buffers).
- bf16 parameters, the fp32 master partition and the Adam moments are measured after the step.
Bytes are counted per distinct storage, so views into DeepSpeed's flat buffers count once."""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def flat(items) -> list[torch.Tensor]:
    """Tensors of a nested list/tuple/dict of tensors."""
    if isinstance(items, torch.Tensor):
        return [items]
    if isinstance(items, dict):
        items = items.values()
    if isinstance(items, (list, tuple)) or hasattr(items, "__iter__"):
        return [t for item in items if item is not None for t in flat(item)]
    return []


def zero_grad_tensors(zero, params: list[torch.nn.Parameter], stage: int) -> list[torch.Tensor]:
    """bf16 gradient storage a ZeRO optimizer holds between micro-batches. ZeRO 1/2: the
    parameters' .grad (ZeRO-1 accumulates full gradients until the boundary) and the partition
    buffer (grads_in_partition, kept alive through averaged_gradients / all_grad_tensors after
    _release_ipg_buffers drops the attribute). ZeRO-3: grad_partitions_flat_buffer."""
    tensors = [p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params]
    if stage == 3:
        tensors.append(zero.grad_partitions_flat_buffer)
    else:
        tensors += [getattr(zero, "grads_in_partition", None)]
        tensors += flat(zero.averaged_gradients) + flat(zero.all_grad_tensors)
    return [t for t in tensors if t is not None and t.dtype == torch.bfloat16]


def params_bytes(zero, model: torch.nn.Module, stage: int) -> dict[str, int]:
    """bf16 parameters this rank holds. ZeRO 1/2: bit16_groups_flat (the trainable parameters,
    flattened and padded to 2 x world elements; the module's parameters are views into it) plus
    the frozen parameters, which DeepSpeed leaves whole on every rank. ZeRO-3: every parameter's
    partition (ds_tensor; the trainable ones are views into lp_param_buffer /
    fp16_partitioned_groups_flat) plus the full data of parameters that stay gathered
    (ds_persist, below stage3_param_persistence_threshold)."""
    params = list(model.parameters())
    if stage < 3:
        frozen = [p for p in params if not p.requires_grad]
        return {
            "bf16_flat": storage_bytes(zero.bit16_groups_flat),
            "frozen": storage_bytes(frozen),
            "total": storage_bytes(list(zero.bit16_groups_flat) + frozen),
        }
    partitions = [p.ds_tensor for p in params]
    persistent = [p.data for p in params if getattr(p, "ds_persist", False)]
    gathered_other = [p.data for p in params if not getattr(p, "ds_persist", False) and p.data.numel() > 0]
    return {
        "bf16_flat": storage_bytes(zero.fp16_partitioned_groups_flat),
        "partitions": storage_bytes(partitions),
        "persistent": storage_bytes(persistent),
        "persistent_numel": sum(p.ds_numel for p in params if getattr(p, "ds_persist", False)),
        "still_gathered": storage_bytes(gathered_other),
        "total": storage_bytes(partitions + persistent + gathered_other),
    }


def master_tensors(zero, stage: int) -> list[torch.Tensor]:
    return list(zero.fp32_partitioned_groups_flat if stage == 3 else zero.single_partition_of_fp32_groups)


def optimizer_state_tensors(basic: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Adam's moments (exp_avg, exp_avg_sq). The 0-dim step counter is not a moment."""
    return [t for state in basic.state.values() for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0]


def reachable_tensors(obj, depth: int = 0) -> list[torch.Tensor]:
    """Tensors (and their .grad) inside nested lists, tuples and dicts, a few levels deep."""
    if isinstance(obj, torch.Tensor):
        return [obj] + ([obj.grad] if obj.grad is not None else [])
    if depth > 3:
        return []
    if isinstance(obj, dict):
        return [t for key, value in obj.items() for t in reachable_tensors(key, depth + 1) + reachable_tensors(value, depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in reachable_tensors(item, depth + 1)]
    return []


def inventory(zero) -> dict[str, int]:
    """Every tensor storage the ZeRO optimizer object reaches through its attributes, by
    attribute (each storage counted once, under the first attribute in sorted order)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    holders = {f"zero.{k}": v for k, v in vars(zero).items()}
    holders["zero.optimizer.state"] = zero.optimizer.state
    for name in sorted(holders):
        total = 0
        for tensor in reachable_tensors(holders[name]):
            if tensor.device.type == "meta" or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        if total:
            out[name] = total
    return out


def host_offload_buffers(zero, stage: int) -> dict[str, int]:
    """Buffers ZeRO keeps in (pinned) host memory for an offloaded optimizer beyond the fp32
    master, moments and fp32 gradients."""
    out = {}
    if stage < 3:
        out["bf16_param_buffer"] = storage_bytes(getattr(zero, "param_buffer_of_bit16_for_cpu_offload_groups", []))
    return out


def run_case(case: dict, model_dir: str, run_json: dict, world: int) -> dict:
    import deepspeed
    from diffusers.utils import logging as diffusers_logging

    from zerotrain.config.sections import RunConfig
    from zerotrain.models.catalog import resolve_model
    from zerotrain.models.families import example_inputs
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout
    from zerotrain.planner.trace import apply_lora

    run = RunConfig.model_validate({**run_json, "training": {**run_json["training"], "mode": case["mode"]}})
    spec = resolve_model(run.model)
    diffusers_logging.set_verbosity_error()
    model = spec.denoiser_class().from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    if case["mode"] == "lora":
        apply_lora(model, spec, run)
    model.to(torch.bfloat16)  # peft creates the adapters in fp32; the engine trains in bf16
    micro = run.training.micro_batch_size
    accumulation = run.training.global_batch_size // (micro * world)
    layout = Layout(case["stage"], offload_optimizer=case["offload"], micro_batch=micro, accumulation=accumulation)
    config = deepspeed_config(layout, run, world_size=world)
    trainable = [p for p in model.parameters() if p.requires_grad]
    counts = {"trainable_params": sum(p.numel() for p in trainable),
              "total_params": sum(p.numel() for p in model.parameters()),
              "param_count": len(trainable)}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    zero = engine.optimizer
    basic = zero.optimizer
    stage = case["stage"]

    fp32_grad_peak = [0]
    inner_step = basic.step

    def recording_step(*args, **kwargs):
        grads = [p.grad for group in basic.param_groups for p in group["params"]]
        fp32_grad_peak[0] = max(fp32_grad_peak[0], storage_bytes(grads))
        return inner_step(*args, **kwargs)

    basic.step = recording_step

    side = run.data.resolution
    measured: dict = {"optimizer_class": type(basic).__name__, "zero_class": type(zero).__name__, **counts}
    torch.manual_seed(case["stage"])
    for index in range(accumulation):
        inputs = example_inputs(spec, micro, side, side, run.data.text_tokens, "cpu", torch.bfloat16)
        out = engine(**inputs, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(out.float(), torch.randn_like(out, dtype=torch.float32))
        engine.backward(loss)
        del out, loss, inputs
        if index == 0:
            grads = zero_grad_tensors(zero, list(model.parameters()), stage)
            measured["bf16_grads"] = storage_bytes(grads)
            if stage < 3:
                in_partition = [p for group in zero.params_in_partition for p in group]
                measured["params_in_partition_numel"] = sum(p.numel() for p in in_partition)
                measured["partition_numel"] = sum(zero.partition_size)
        engine.step()
    basic.step = inner_step

    assert engine.global_steps == 1, f"expected one optimizer step, engine reports {engine.global_steps}"
    measured["bf16_params"] = params_bytes(zero, model, stage)
    measured["fp32_master"] = storage_bytes(master_tensors(zero, stage))
    measured["optimizer_states"] = storage_bytes(optimizer_state_tensors(basic))
    measured["fp32_grads"] = fp32_grad_peak[0]
    measured["host_extra"] = host_offload_buffers(zero, stage) if case["offload"] != "none" else {}
    measured["inventory"] = inventory(zero)
    engine.destroy()
    return measured


def main() -> int:
    cases_file, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    import deepspeed

    spec = json.loads(cases_file.read_text())
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for case in spec["cases"]:
        try:
            result = {"ok": True, "measured": run_case(case, spec["model_dir"], spec["run"], world)}
        except Exception:  # recorded per case; the test shows the traceback
            result = {"ok": False, "error": traceback.format_exc()}
        (out_dir / f"{case['id']}.rank{rank}.json").write_text(json.dumps(result, indent=1))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
