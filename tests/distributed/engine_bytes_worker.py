"""One rank of tests/distributed/test_engine_bytes.py: trains a tiny diffusers denoiser under
real DeepSpeed on CPU for each case it is given, and writes, per case, the bytes the engine
holds on this rank, read from DeepSpeed's own attributes (deepspeed/runtime/engine.py,
fp16/fused_optimizer.py, zero/stage_1_and_2.py and zero/stage3.py, 0.19.8), and the transient
bytes of its phases, read from torch.profiler's allocator events (allocator_window).

Started twice by the test (RANK 0 and 1, gloo on 127.0.0.1, DS_ACCELERATOR=cpu):

    python engine_bytes_worker.py CASES.json OUT_DIR

CASES.json holds {"model_dir", "run", "cases": [{"id", "stage", "offload", "mode"}]}; "run" is a
RunConfig dump. OUT_DIR/<id>.rank<R>.json receives the measurement of each case, or its error.

Each case runs one optimizer step of two micro-batches (gradient_accumulation_steps=2), then
saves a checkpoint as zerotrain does:
- bf16 gradients are measured after the first backward, which is no accumulation boundary:
  what a rank holds between micro-batches, the state the planner's lp_grads describes.
- fp32 gradients are measured inside the basic optimizer's step, the only time they exist
  without offload (ZeRO 1/2 build single_partition_of_fp32_groups[i].grad for the step;
  ZeRO-3 builds fp32_partitioned_groups_flat[i].grad one sub-group at a time, so the largest
  sub-group counts). Offloaded, they are persistent pinned host buffers, all of them counted.
  ZeRO-0's FP16_Optimizer holds its fp32 copies of the gradients and their flat copy only while
  it flattens, before the basic optimizer runs: there they are the step's allocator peak.
- bf16 parameters, the fp32 master partition and the Adam moments are measured after the step.
- Transients: deepspeed.initialize's allocator peak above what it leaves; the reduction buckets
  (ZeRO-0: the flat bucket engine.allreduce_bucket returns; ZeRO 1-3: ipg_buckets, sampled
  through the backward); where the all-gather after a ZeRO 1/2 step writes; ZeRO-3's gathered
  parameters, sampled through forward and backward; save_checkpoint's allocator peak.

Bytes are counted per distinct storage, so views into DeepSpeed's flat buffers count once. On
the CPU accelerator "device" and host are the same memory, so each buffer is placed where
DeepSpeed puts it on a GPU machine: the accelerator, or (offload_optimizer=cpu) the host."""

from __future__ import annotations

import gc
import json
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None or tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def nested_tensors(obj: object, depth: int = 0) -> list[torch.Tensor]:
    """Tensors (and their .grad) inside nested lists, tuples and dicts (keys included)."""
    if isinstance(obj, torch.Tensor):
        return [obj] + ([obj.grad] if obj.grad is not None else [])
    if depth > 3:
        return []
    if isinstance(obj, dict):
        return [t for k, v in obj.items() for t in nested_tensors(k, depth + 1) + nested_tensors(v, depth + 1)]
    if isinstance(obj, (list, tuple)):
        return [t for item in obj for t in nested_tensors(item, depth + 1)]
    return []


def bf16_grad_tensors(zero, params: list[torch.nn.Parameter], stage: int) -> list[torch.Tensor]:
    """bf16 gradient storage a ZeRO optimizer holds between micro-batches. ZeRO-0: the parameters'
    .grad, accumulated by autograd until the boundary. ZeRO 1/2: the parameters' .grad (ZeRO-1
    accumulates whole gradients until the boundary) and the partition buffer grads_in_partition
    (still alive through averaged_gradients / all_grad_tensors after _release_ipg_buffers drops the
    attribute). ZeRO-3: grad_partitions_flat_buffer."""
    tensors = [p.grad for p in params] + [getattr(p, "grad_accum", None) for p in params]
    if stage == 3:
        tensors.append(zero.grad_partitions_flat_buffer)
    elif stage > 0:
        tensors.append(getattr(zero, "grads_in_partition", None))
        tensors += nested_tensors(zero.averaged_gradients) + nested_tensors(zero.all_grad_tensors)
    return [t for t in tensors if t is not None and t.dtype == torch.bfloat16]


def bf16_param_tensors(zero, model: torch.nn.Module, stage: int) -> list[torch.Tensor]:
    """bf16 parameters a rank holds. ZeRO-0: fp16_groups_flat (FP16_Optimizer flattens the
    trainable parameters without padding; the module's parameters are views into it) and the
    frozen parameters. ZeRO 1/2: bit16_groups_flat (the trainable parameters, flattened and padded
    to a multiple of 2 x world elements; the module's parameters are views into it) and the frozen
    parameters, which DeepSpeed leaves whole on every rank. ZeRO-3: every parameter's partition
    (ds_tensor; the trainable ones are views into lp_param_buffer / fp16_partitioned_groups_flat)
    and the full data of every parameter still gathered after the step, i.e. those below
    stage3_param_persistence_threshold (ds_persist)."""
    params = list(model.parameters())
    frozen = [p for p in params if not p.requires_grad]
    if stage == 0:
        return list(zero.fp16_groups_flat) + frozen
    if stage < 3:
        return list(zero.bit16_groups_flat) + frozen
    return [p.ds_tensor for p in params] + [p.data for p in params]


def master_tensors(zero, stage: int) -> list[torch.Tensor]:
    """fp32 master weights: FP16_Optimizer's fp32_groups_flat (ZeRO-0), the fp32 partition
    (ZeRO 1/2: single_partition_of_fp32_groups; ZeRO-3: fp32_partitioned_groups_flat)."""
    if stage == 0:
        return list(zero.fp32_groups_flat)
    return list(zero.fp32_partitioned_groups_flat if stage == 3 else zero.single_partition_of_fp32_groups)


def adam_moment_tensors(basic: torch.optim.Optimizer) -> list[torch.Tensor]:
    """exp_avg and exp_avg_sq of the basic optimizer (the 0-dim step counter is no moment)."""
    return [t for state in basic.state.values() for t in state.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0]


def offload_staging(zero) -> dict[str, int]:
    """Buffers ZeRO 1/2 allocate only for an offloaded optimizer (stage_1_and_2.py), besides the
    fp32 master, the moments and the fp32 gradient partition."""
    return {
        # pinned host: bf16 copy of the updated partition, for the copy back to the GPU
        # (with bf16 masters the master itself: deepspeed_compat's buffer sharing; no second buffer)
        "host param_buffer_of_bit16_for_cpu_offload_groups": storage_bytes(
            b for b, m in zip(zero.param_buffer_of_bit16_for_cpu_offload_groups, zero.single_partition_of_fp32_groups)
            if b.untyped_storage().data_ptr() != m.untyped_storage().data_ptr()),
        # pinned host: one bf16 gradient of the largest parameter
        "host temp_grad_buffer_for_cpu_offload": storage_bytes([zero.temp_grad_buffer_for_cpu_offload]),
        # pinned host: bf16 gradients accumulated across micro-batches (whole parameters of the partition)
        "host accumulated_grads_in_cpu": storage_bytes(zero.accumulated_grads_in_cpu.values()),
        # GPU: one bf16 gradient of the largest parameter
        "device temp_grad_buffer_for_gpu_offload": storage_bytes([zero.temp_grad_buffer_for_gpu_offload]),
    }


def inventory(zero) -> dict[str, int]:
    """Every tensor storage the ZeRO optimizer reaches through its attributes, by attribute
    (each storage counted once, under the first attribute in sorted order): a record of what
    the engine holds, for the report."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    holders = {k: v for k, v in vars(zero).items() if k != "param_names"}
    holders["optimizer.state"] = zero.optimizer.state
    for name in sorted(holders):
        total = 0
        for tensor in nested_tensors(holders[name]):
            if tensor.device.type == "meta" or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        if total:
            out[name] = total
    return out


def allocator_window(fn: Callable[[], Any]) -> tuple[Any, int, int]:
    """fn() under torch.profiler's allocator events: its result, the highest bytes allocated inside the
    window and still live, and those still live when it returned. A free of a block allocated before the
    window does not count: torch reports one only for a block allocated under an earlier profiler window
    (an earlier case's engine, freed whenever a later case's init happens to release it: 2-6 KB in 1 run
    of several, which CI once took for this case's transient), never for one allocated outside."""
    from torch._C._profiler import _EventType

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            events.append((event.start_time_ns, event.extra_fields.ptr, event.extra_fields.alloc_size))
    live_blocks: dict[int, int] = {}
    live = peak = 0
    for _, ptr, change in sorted(events, key=lambda e: e[0]):
        if change > 0:
            live_blocks[ptr] = live_blocks.get(ptr, 0) + change
        elif ptr in live_blocks:
            live_blocks[ptr] += change
            if live_blocks[ptr] <= 0:
                del live_blocks[ptr]
        else:
            continue  # allocated before the window
        live += change
        peak = max(peak, live)
    return result, peak, live


def reduce_bucket_tensors(zero, stage: int) -> list[torch.Tensor]:
    """The ZeRO optimizer's gradient reduction buckets (ipg_buckets): ZeRO 1/2 hold a list of one
    buffer, two with overlap_comm (setup_buckets, allocated for each backward, released at the
    step); ZeRO-3 one buffer, allocated at init."""
    if stage == 3:
        return [bucket.buffer for bucket in zero.ipg_buckets.values() if bucket.buffer is not None]
    return [t for bucket in zero.ipg_buckets.values() for t in bucket.buffer]


class PeakSampler:
    """The highest value of `measure()` over a forward and backward, sampled before and after every
    module's forward and whenever a trainable parameter's gradient is computed (under ZeRO-3 its
    module's parameters are gathered then, and ZeRO 1/2 fill their reduction buckets)."""

    def __init__(self, model: torch.nn.Module, measure: Callable[[], int]) -> None:
        self.measure = measure
        self.peak = 0
        self.hooks = [h for module in model.modules()
                      for h in (module.register_forward_pre_hook(self.sample), module.register_forward_hook(self.sample))]
        self.hooks += [p.register_hook(self.sample_grad) for p in model.parameters() if p.requires_grad]

    def sample(self, *_: Any) -> None:
        self.peak = max(self.peak, self.measure())

    def sample_grad(self, grad: torch.Tensor) -> torch.Tensor:
        self.sample()
        return grad

    def remove(self) -> int:
        for hook in self.hooks:
            hook.remove()
        return self.peak


def gathered_bytes(params: list[torch.nn.Parameter]) -> int:
    """ZeRO-3: bytes of the full (gathered) data of these parameters; a partitioned parameter's
    .data is an empty tensor."""
    return storage_bytes(p.data for p in params)


def build_model(spec, run, model_dir: str, mode: str) -> torch.nn.Module:
    """The denoiser as training loads it (from_pretrained of a save_pretrained folder), with
    peft LoRA adapters and a frozen base in LoRA mode."""
    from diffusers.utils import logging as diffusers_logging

    from zerotrain.planner.trace import apply_lora

    diffusers_logging.set_verbosity_error()
    model = spec.denoiser_class().from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    if mode == "lora":
        apply_lora(model, spec, run)
    return model.to(torch.bfloat16)  # peft creates adapters in fp32; the engine trains in bf16


def run_case(case: dict, model_dir: str, run_json: dict, world: int, out_dir: Path) -> dict:
    import deepspeed
    import deepspeed.comm

    from zerotrain.config.sections import RunConfig
    from zerotrain.deepspeed_compat import Sharing, release_process_state, unshared
    from zerotrain.engine import initialize
    from zerotrain.families import example_inputs
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout

    stage, offload = case["stage"], case["offload"]
    training = {**run_json["training"], "mode": case["mode"]}
    if case["mode"] == "full":  # LoRA options are an error with mode full
        training.pop("lora", None)
    run = RunConfig.model_validate({**run_json, "training": training})
    spec = resolve_model(run.model)
    model = build_model(spec, run, model_dir, case["mode"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    counts = {
        "trainable_params": sum(p.numel() for p in trainable),
        "total_params": sum(p.numel() for p in model.parameters()),
        "trainable_tensors": len(trainable),
        "param_tensors": len(list(model.parameters())),
        "largest_param": max(p.numel() for p in model.parameters()),
        "largest_trainable_param": max(p.numel() for p in trainable),
    }
    micro = run.training.micro_batch_size
    accumulation = run.training.global_batch_size // (micro * world)
    # offload: none, cpu (the optimizer) or cpu+param (ZeRO-3: the optimizer and the parameters)
    layout = Layout(stage, offload_optimizer=offload.split("+")[0], offload_param="cpu" if "param" in offload else "none",
                    micro_batch=micro, accumulation=accumulation, optimizer=case.get("optimizer", "adamw"))
    config = deepspeed_config(layout, run, world_size=world)
    own_buffers = Sharing(False, "the engine-bytes test's unshared case")

    gc.collect()  # what earlier cases left for the collector is not freed inside the window
    (engine, _, _, _), init_peak, init_end = allocator_window(
        lambda: initialize(model, trainable, config, own_buffers if case.get("unshared") else None))
    zero = engine.optimizer
    basic = zero.optimizer
    # What deepspeed_compat.initialize checks after initialize: each sharing the plan counts on
    # that did not happen, with its bytes.
    missed = unshared(zero)

    fp32_grad_bytes, shared_grad_bytes = [0], [0]
    inner_step = basic.step

    def recording_step(*args, **kwargs):
        # The parameters this call steps on, and every master tensor's gradient: offloaded
        # ZeRO-3 keeps a pinned fp32 gradient per sub-group while it steps on one at a time.
        grads = [p.grad for group in basic.param_groups for p in group["params"]]
        grads += [t.grad for t in master_tensors(zero, stage)]
        fp32_grad_bytes[0] = max(fp32_grad_bytes[0], storage_bytes(grads))
        if stage == 3 and offload != "none":
            flat = zero.grad_partitions_flat_buffer.untyped_storage().data_ptr()
            shared_grad_bytes[0] = storage_bytes(g for g in grads if g is not None
                                                 and g.untyped_storage().data_ptr() == flat)
        return inner_step(*args, **kwargs)

    basic.step = recording_step
    # ZeRO-0 reduces at the boundary through the engine itself, flattening the gradients of one
    # bucket at a time (engine.allreduce_bucket returns the flat bucket).
    allreduce_bytes = [0]
    inner_allreduce = engine.allreduce_bucket

    def recording_allreduce(bucket, *args, **kwargs):
        flat = inner_allreduce(bucket, *args, **kwargs)
        allreduce_bytes[0] = max(allreduce_bytes[0], storage_bytes([flat]))
        return flat

    engine.allreduce_bucket = recording_allreduce
    # The all-gather of the updated bf16 partitions after a ZeRO 1/2 step: where it writes.
    gather_outputs: list[torch.Tensor] = []
    inner_gather = deepspeed.comm.all_gather_into_tensor

    def recording_gather(output_tensor, tensor, *args, **kwargs):
        gather_outputs.append(output_tensor)
        return inner_gather(output_tensor, tensor, *args, **kwargs)

    buckets = PeakSampler(model, lambda: storage_bytes(reduce_bucket_tensors(zero, stage))) if stage > 0 else None
    partitioned = [p for p in model.parameters() if not getattr(p, "ds_persist", True)]
    gathered = PeakSampler(model, lambda: gathered_bytes(partitioned)) if stage == 3 else None
    side = run.data.resolution
    torch.manual_seed(stage)
    bf16_grads = step_peak = 0
    for index in range(accumulation):
        inputs = example_inputs(spec, micro, side, side, run.data.text_tokens, "cpu", torch.bfloat16)
        out = engine(**inputs, return_dict=False)[0]
        loss = torch.nn.functional.mse_loss(out.float(), torch.randn_like(out, dtype=torch.float32))
        engine.backward(loss)
        del out, loss, inputs
        if index == 0:
            bf16_grads = storage_bytes(bf16_grad_tensors(zero, list(model.parameters()), stage))
        if engine.is_gradient_accumulation_boundary():
            deepspeed.comm.all_gather_into_tensor = recording_gather
            try:
                _, step_peak, _ = allocator_window(engine.step)
            finally:
                deepspeed.comm.all_gather_into_tensor = inner_gather
        else:
            engine.step()
    basic.step = inner_step
    engine.allreduce_bucket = inner_allreduce
    assert engine.global_steps == 1, f"expected one optimizer step, the engine reports {engine.global_steps}"
    bucket_bytes = buckets.remove() if buckets is not None else allreduce_bytes[0]
    gathered_peak = gathered.remove() if gathered is not None else 0
    # zerotrain's checkpoint.save: every rank, frozen parameters left out.
    _, save_peak, _ = allocator_window(lambda: engine.save_checkpoint(
        str(out_dir / f"{case['id']}.checkpoint"), tag="step1", save_latest=False, exclude_frozen_parameters=True))

    param_tensors = bf16_param_tensors(zero, model, stage)
    param_storages = {t.untyped_storage().data_ptr() for t in param_tensors if t is not None and t.numel()}
    held = {
        "bf16 params": storage_bytes(param_tensors),
        # A master that is the bf16 partition itself (ZeRO-3 with adamw-bf16) is no second copy.
        "fp32 master": storage_bytes(t for t in master_tensors(zero, stage)
                                     if t.untyped_storage().data_ptr() not in param_storages),
        "optimizer states": storage_bytes(adam_moment_tensors(basic)),
        "bf16 grads": bf16_grads,
        # ZeRO-0's fp32 gradients are transient: FP16_Optimizer.step makes an fp32 copy of each
        # gradient and flattens them, all before the basic optimizer sees the flat one. Offloaded
        # ZeRO-3 gradients that are ranges of the gradient partition itself (adamw-bf16) are no
        # second buffer.
        "fp32 grads": step_peak if stage == 0 else fp32_grad_bytes[0] - shared_grad_bytes[0],
    }
    if "param" in offload:
        # The parameters offloaded: the trainable partitions are one pinned host buffer
        # (param_groups_fp16_flat_cpu_memory); what the GPU keeps is the persistent parameters.
        held["bf16 params"] = storage_bytes(p.data for p in model.parameters() if p.ds_persist)
        held["host bf16 params"] = storage_bytes(zero.fp16_partitioned_groups_flat)
    # Where DeepSpeed puts each on a GPU machine. Offloaded, ZeRO 1/2 keep the fp32 master, its
    # .grad and the moments on self.device='cpu'; ZeRO-3 keeps fp32_partitioned_groups_flat
    # (and .grad), the moments and the pinned grad_partitions_flat_buffer there.
    on_host = set()
    if offload != "none":
        on_host = {"fp32 master", "optimizer states", "fp32 grads"} | ({"bf16 grads"} if stage == 3 else set())
    on_host |= {"host bf16 params"} & set(held)
    flats = {t.untyped_storage().data_ptr() for t in getattr(zero, "bit16_groups_flat", [])}
    measured = {
        "optimizer_class": type(basic).__name__,
        "zero_class": type(zero).__name__,
        **counts,
        "param_groups": len(zero.fp16_groups) if stage in (0, 3) else len(basic.param_groups),
        "device": {k: (0 if k in on_host else v) for k, v in held.items() if k != "host bf16 params"},
        "host": {k: v for k, v in held.items() if k in on_host},
        "staging": offload_staging(zero) if stage in (1, 2) and offload != "none" else {},
        "transients": {
            "init peak": init_peak, "init end": init_end, "step peak": step_peak, "save peak": save_peak,
            "reduce buckets": bucket_bytes,
            "allgather into flat groups": [t.untyped_storage().data_ptr() in flats for t in gather_outputs],
            "allgather elsewhere": storage_bytes(t for t in gather_outputs if t.untyped_storage().data_ptr() not in flats),
            "gathered params": gathered_peak,
        },
        "inventory": inventory(zero),
        "unshared": missed,
    }
    if stage in (1, 2):
        measured["partition_numel"] = sum(zero.partition_size)
        measured["params_in_partition_numel"] = sum(p.numel() for group in zero.params_in_partition for p in group)
    if stage == 3:
        params = list(model.parameters())
        measured["persistent_numel"] = sum(p.ds_numel for p in params if p.ds_persist)
        measured["sub_groups"] = len(zero.fp16_groups)
        measured["sub_group_partition_numels"] = list(zero.fp16_partitioned_groups_flat_numel)
    engine.destroy()
    release_process_state(model)  # the next case's engine starts as in a fresh process (F.linear restored)
    return measured


def main() -> int:
    cases_file, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    import deepspeed

    from zerotrain.engine import cpu_adam_unavailable

    spec = json.loads(cases_file.read_text())
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    no_offload = cpu_adam_unavailable() if any(c["offload"] != "none" for c in spec["cases"]) else None
    for case in spec["cases"]:
        if case["offload"] != "none" and no_offload:
            result = {"ok": False, "skip": no_offload}
        else:
            try:
                result = {"ok": True, "measured": run_case(case, spec["model_dir"], spec["run"], world, out_dir)}
            except Exception:  # noqa: BLE001 - any failure is this case's result; the next cases still run
                result = {"ok": False, "error": traceback.format_exc()}
        (out_dir / f"{case['id']}.rank{rank}.json").write_text(json.dumps(result, indent=1))
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
