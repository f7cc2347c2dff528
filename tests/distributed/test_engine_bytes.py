"""The planner's per-rank byte formulas against what a real DeepSpeed engine holds.

Two processes (gloo on 127.0.0.1, DS_ACCELERATOR=cpu) run engine_bytes_worker.py. For ZeRO-0
(full and LoRA; offload needs ZeRO) and each of ZeRO 1/2/3 x offload_optimizer none/cpu x
full/LoRA, a worker loads tiny-flux with from_pretrained (from a save_pretrained folder), adds peft
LoRA for the LoRA cases, builds the engine from zerotrain's own DeepSpeed config
(deepspeed_config), runs one optimizer step of two micro-batches and saves a checkpoint as
zerotrain does. It reads from DeepSpeed's attributes what each rank holds (see the worker for
where and when each is measured):

    bf16 params       ZeRO-0 fp16_groups_flat + frozen params; ZeRO 1/2 bit16_groups_flat + frozen
                      params; ZeRO-3 ds_tensor partitions (lp_param_buffer) + persistent params
    fp32 master       fp32_groups_flat / single_partition_of_fp32_groups / fp32_partitioned_groups_flat
    optimizer states  exp_avg + exp_avg_sq in the basic optimizer's state
    bf16 grads        param .grad (ZeRO 0/1), grads_in_partition (ZeRO-2), grad_partitions_flat_buffer
                      (ZeRO-3), after a backward that is not an accumulation boundary
    fp32 grads        the fp32 gradient partition the basic optimizer steps on; ZeRO-0: the step's
                      allocator peak (FP16_Optimizer's fp32 copies of the gradients and their flat)

and the test compares each with the planner's term (memory.lp_params, master_weights,
optimizer_states, lp_grads, fp32_grads) on Sizes built the planner's way (facts measured on the
meta device, search.sizes_from) for 2 GPUs on one node. Without ZeRO, DeepSpeed 0.19.8 wraps
FusedAdam in FP16_Optimizer running in bf16 for the config zerotrain writes, not BF16_Optimizer.

The transient terms, compared per rank (test_buffers_and_transients_match_planner):
- reduce buckets (memory.reduce_buckets): ZeRO-0's flat all-reduce bucket (the whole gradient
  here: the tiny model is far below the engine's 5e8-element bucket), ZeRO 1/2's two ipg buffers
  and ZeRO-3's one, allocated whole even for LoRA's fewer trainable parameters. Exact.
- the all-gather after a ZeRO 1/2 step writes into the flat bf16 groups themselves
  (all_gather_into_tensor): DeepSpeed allocates no allgather bucket, and the planner has none.
- ZeRO-3's gathered parameters (memory.gathered_params), sampled before and after every module's
  forward and at every gradient: more than one layer and the prefetch (the planner's assumption
  before), since parameters reused within stage3_max_reuse_distance stay gathered, and within the
  planner's bound (reuse distance + two layers + prefetch).
- initialize's allocator peak above what it leaves (memory.init_transient), ZeRO 0-2 without
  offload: ZeRO-0's zero fp32 gradients for its first step, ZeRO 1/2's zero fp32 gradient
  partition (with two ranks the other branch, the flat copy beside the originals less the master,
  is 0).
- save_checkpoint's allocator peak (memory.save_gather): nothing at ZeRO 0-2; ZeRO-3 all-gathers
  its persistent parameters again.
These agree to TRANSIENT_SLACK (DeepSpeed's small bookkeeping tensors).

What the CPU engine cannot show, so is not asserted:
- The init transient of ZeRO-3 and of an offloaded optimizer. On a GPU machine the model zerotrain
  loads whole sits on the host while ZeRO-3 copies each partition to the GPU, and the offloaded
  master, moments and pinned buffers are host memory; on the CPU accelerator all of it is one
  allocator, so initialize's peak mixes host and device (measured 1.5-135 KB against the planner's
  GPU terms of 0-48 KB at ZeRO-3, 0 against 11-157 KB for ZeRO 1/2 offloaded).
- ZeRO-3's unreduced gradient (memory.unreduced_gradient): a layer's full bf16 gradient before it
  is copied into the bucket is an autograd output like the activation gradients around it, in the
  same allocator; no attribute holds it.
- NCCL: the in-place all_gather_into_tensor and the reduce-scatters allocate nothing in NCCL;
  under gloo, ProcessGroupGloo stages through temporaries of its own, so allocator peaks around
  collectives are gloo's. Only where DeepSpeed writes is checked.
- The engine's 5e8-element cap of ZeRO-0's bucket, which would need a model of more than 5e8
  trainable parameters.

Offload. On the CPU accelerator the "GPU" and the host are the same memory, so each buffer is
placed where DeepSpeed puts it on a GPU machine: with offload_optimizer=cpu, the fp32 master,
the moments and the fp32 gradients (and ZeRO-3's pinned grad_partitions_flat_buffer) are host
buffers. The planner's GPU terms for them are then 0, and each is compared with the planner's
host buffer of that name (memory.offload_buffers), the unpadded bytes of one rank. Offload uses
DeepSpeedCPUAdam, whose C++ op JIT-compiles on first use (about 2.5 min on the 2-core CI machine,
then cached in ~/.cache/torch_extensions); where it cannot build, the offload cases are skipped
with the compiler's message.

Tolerance ("up to padding"), in elements of the term's dtype:
- ZeRO-0's FP16_Optimizer flattens without padding: none.
- ZeRO 1/2 pad each flat group to a multiple of 2 x world (nccl_start_alignment_factor x
  world): 2 x world per group. ZeRO-2's gradient partition also holds the whole gradient of a
  parameter that straddles the partition's edges: plus 2 x the largest trainable parameter.
- ZeRO-3 pads every parameter to a multiple of world: world - 1 per parameter tensor. Its
  fp32 gradient is built per sub-group, and a sub-group closes with the parameter that crosses
  sub_group_size: plus one partition of the largest trainable parameter.
The sizes are small so the padding bounds stay far below any wrong term (e.g. a missing
division by world)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORLD = 2
# Offload does not exist without ZeRO: stage 0 runs without it.
CASES = [(0, "none", mode, "adamw") for mode in ("full", "lora")] + \
    [(stage, offload, mode, "adamw") for stage in (1, 2, 3) for offload in ("none", "cpu") for mode in ("full", "lora")]
# adamw-bf16 (DeepSpeed's bf16 master weights, gradients and moments; ZeRO 1-3): a full fine-tune
# at each stage, and offloaded at ZeRO 2 and 3 (DeepSpeedCPUAdam with bf16 moments).
CASES += [(stage, "none", "full", "adamw-bf16") for stage in (1, 2, 3)] + \
    [(stage, "cpu", "full", "adamw-bf16") for stage in (2, 3)]
# ZeRO-3 with the parameters offloaded too (ZeRO-Infinity on the host): fp32 AdamW keeps its own
# master and gradient; adamw-bf16 steps the pinned bf16 partition itself, its gradient a range of
# the bf16 gradient partition (deepspeed_compat's buffer sharing).
CASES += [(3, "cpu+param", "full", "adamw"), (3, "cpu+param", "full", "adamw-bf16")]
# The client optimizers (ZeRO 1-3, on the GPU): bitsandbytes' 8-bit AdamW on the full model's
# partitions (8-bit moments) and on LoRA's (below 4096 elements: fp32 moments), and Adafactor.
CASES += [(1, "none", "full", "adamw-8bit"), (2, "none", "lora", "adamw-8bit"), (3, "none", "full", "adamw-8bit"),
          (2, "none", "full", "adafactor"), (3, "none", "full", "adafactor")]
# Buffer sharing off (deepspeed_compat.buffer_sharing on an untested DeepSpeed version, or under
# DS_PIN_MEMORY_BACKEND=native): DeepSpeed keeps its own copies, and the planner, told by the same
# flag (Buffers.shares_copies), counts them. One case per sharing: the ZeRO 1/2 upload copy, ZeRO-3's
# master on the GPU, and ZeRO-3's master and master gradient offloaded with the parameters.
UNSHARED = [(2, "cpu", "full", "adamw-bf16"), (3, "none", "full", "adamw-bf16"), (3, "cpu+param", "full", "adamw-bf16")]
WORKER = Path(__file__).with_name("engine_bytes_worker.py")
REPO = Path(__file__).resolve().parents[2]
# First use JIT-compiles DeepSpeed's CPU ops (shm comm, fused Adam, CPU Adam): minutes once.
TIMEOUT_S = 900
ELEMENT = {"bf16 params": 2, "host bf16 params": 2, "fp32 master": 4, "optimizer states": 8, "bf16 grads": 2, "fp32 grads": 4}
# adamw-bf16's master weights, their gradients at the step and the two moments are bf16; the
# client optimizers step the same bf16 masters: 8-bit moments (padding may add an absmax block of
# 4 B to each, counted as a third byte per element) or Adafactor's one fp32 moment.
BF16_ELEMENT = {**ELEMENT, "fp32 master": 2, "optimizer states": 4, "fp32 grads": 2}
ELEMENTS = {"adamw": ELEMENT, "adamw-bf16": BF16_ELEMENT, "adamw-8bit": {**BF16_ELEMENT, "optimizer states": 3},
            "adafactor": BF16_ELEMENT}


def case_id(stage: int, offload: str, mode: str, optimizer: str = "adamw", shared: bool = True) -> str:
    return f"zero{stage}-offload_{offload}-{mode}" + ("" if optimizer == "adamw" else f"-{optimizer}") + \
        ("" if shared else "-unshared")


def run_config(cache_dir: Path, mode: str = "lora"):
    """The cases' RunConfig; LoRA options only in LoRA mode (they are an error with mode full)."""
    from zerotrain.config.sections import RunConfig

    return RunConfig.model_validate({
        "model": {"name_or_path": "tiny-flux"},
        # micro 1 x accumulation 2 x world 2: the first backward is no accumulation boundary
        "training": {"global_batch_size": 4, "micro_batch_size": 1, "gradient_checkpointing": False,
                     "mode": mode, **({"lora": {"rank": 4}} if mode == "lora" else {})},
        "data": {"resolution": 64, "text_tokens": 8},
        "hardware": {"gpus": f"{WORLD}xH100-80GB"},
        "planner": {
            # Small buckets for a 79k-parameter model, so buffers do not dominate; the reduction
            # bucket is larger than LoRA's 5.4k trainable parameters (allocated whole all the same).
            "reduce_bucket_size": 6000, "allgather_bucket_size": 5000, "stage3_prefetch_bucket_size": 5000,
            # Some parameters (biases, norms, LoRA A/B) persist under ZeRO-3, most are partitioned.
            "stage3_param_persistence_threshold": 200,
            # Below the full model's partition (39k), above LoRA's: exercises both sides of the min.
            "sub_group_size": 12000,
            # ZeRO-3 keeps parameters reused within this many elements gathered (zerotrain writes it
            # as stage3_max_reuse_distance too): less than the 77k partitioned, so the bound binds.
            "stage3_max_live_parameters": 30000,
            "cache_dir": str(cache_dir),
        },
    })


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine_bytes")


@pytest.fixture(scope="module")
def engine_bytes(workdir) -> dict[str, list[dict]]:
    """Per case id, what each rank reported (its measurement, its skip reason or its error)."""
    import torch

    from zerotrain.models.catalog import resolve_model

    run = run_config(workdir / "facts")
    spec = resolve_model(run.model)
    spec.denoiser_class().from_config(spec.config).to(torch.bfloat16).save_pretrained(workdir / "model")
    cases = [{"id": case_id(*c), "stage": c[0], "offload": c[1], "mode": c[2], "optimizer": c[3]} for c in CASES]
    cases += [{"id": case_id(*c, shared=False), "stage": c[0], "offload": c[1], "mode": c[2], "optimizer": c[3],
               "unshared": True} for c in UNSHARED]
    cases_file = workdir / "cases.json"
    cases_file.write_text(json.dumps({"model_dir": str(workdir / "model"), "run": run.model_dump(mode="json"),
                                      "cases": cases}))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    logs = [workdir / f"rank{rank}.log" for rank in range(WORLD)]
    procs = []
    for rank in range(WORLD):
        with logs[rank].open("w") as log:
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), str(cases_file), str(workdir)],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=log, stderr=subprocess.STDOUT,
            ))
    deadline = time.monotonic() + TIMEOUT_S
    # A rank that dies leaves the other waiting in a collective: stop both.
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline \
            and not any(p.poll() not in (None, 0) for p in procs):
        time.sleep(0.5)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    tails = "\n".join(f"--- rank {r} ---\n{log.read_text()[-3000:]}" for r, log in enumerate(logs))
    if any(proc.returncode != 0 for proc in procs):
        pytest.fail(f"DeepSpeed workers exited with {[p.returncode for p in procs]}:\n{tails}")
    return {c["id"]: [json.loads((workdir / f"{c['id']}.rank{r}.json").read_text()) for r in range(WORLD)]
            for c in cases}


@pytest.fixture(scope="module")
def planner(workdir):
    """Facts and Sizes per mode, the way `zerotrain plan` builds them."""
    from zerotrain.hardware import hardware_facts
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.measure import measure_model
    from zerotrain.planner.search import buffers_from, sizes_from

    out = {}
    for mode in ("full", "lora"):
        run = run_config(workdir / "facts", mode)
        facts = measure_model(resolve_model(run.model), run, cache=False)
        hw = hardware_facts(run.hardware)
        assert hw.world_size == WORLD and hw.gpus_per_node == WORLD
        out[mode] = (facts, sizes_from(facts, hw, run), buffers_from(run), run)
    return out


def measurements(engine_bytes, stage: int, offload: str, mode: str, optimizer: str, shared: bool = True) -> list[dict]:
    ranks = engine_bytes[case_id(stage, offload, mode, optimizer, shared)]
    for rank, result in enumerate(ranks):
        if result.get("skip"):
            pytest.skip(result["skip"])
        assert result["ok"], f"rank {rank} failed:\n{result['error']}"
    return [result["measured"] for result in ranks]


def layout_for(stage: int, offload: str, run, optimizer: str):
    from zerotrain.planner.memory import Layout

    micro = run.training.micro_batch_size
    return Layout(stage, offload_optimizer=offload.split("+")[0], offload_param="cpu" if "param" in offload else "none",
                  micro_batch=micro,
                  accumulation=run.training.global_batch_size // (micro * WORLD), optimizer=optimizer)


def tolerance(term: str, stage: int, m: dict, optimizer: str = "adamw") -> int:
    """Bytes by which DeepSpeed's padding may exceed or fall short of the planner's term."""
    if stage == 0:  # FP16_Optimizer flattens without padding
        return 0
    if stage < 3:
        elements = 2 * WORLD * m["param_groups"]
        if term == "bf16 grads" and stage == 2:
            elements += 2 * m["largest_trainable_param"]
    else:
        tensors = m["param_tensors"] if term == "bf16 params" else m["trainable_tensors"]
        elements = (WORLD - 1) * tensors
        if term == "fp32 grads":
            elements += math.ceil(m["largest_trainable_param"] / WORLD)
    return ELEMENTS[optimizer][term] * elements + (8 if optimizer == "adamw-8bit" else 0)


def compare(measured: dict[str, int], predicted: dict[str, int], stage: int, m: dict, rank: int,
            optimizer: str) -> list[str]:
    return [
        f"rank {rank} {term}: engine holds {measured[term]} B, planner predicts {predicted[term]} B "
        f"(padding tolerance {tolerance(term, stage, m, optimizer)} B)"
        for term in predicted if abs(measured[term] - predicted[term]) > tolerance(term, stage, m, optimizer)
    ]


@pytest.mark.parametrize(("stage", "offload", "mode", "optimizer"), CASES, ids=[case_id(*c) for c in CASES])
def test_gpu_bytes_match_planner(engine_bytes, planner, stage, offload, mode, optimizer):
    """bf16 params, fp32 master, optimizer states, bf16 and fp32 grads on each rank's GPU."""
    errors = gpu_errors(engine_bytes, planner, stage, offload, mode, optimizer)
    # every sharing the plan counts on happened (deepspeed_compat.unshared after initialize)
    errors += [f"rank {rank}: not shared: {m['unshared']}" for rank, m in
               enumerate(measurements(engine_bytes, stage, offload, mode, optimizer)) if m["unshared"]]
    assert not errors, "\n".join(errors)


def gpu_errors(engine_bytes, planner, stage, offload, mode, optimizer, shared: bool = True) -> list[str]:
    from zerotrain.planner import memory

    facts, s, b, run = planner[mode]
    b = dataclasses.replace(b, shares_copies=shared)
    layout = layout_for(stage, offload, run, optimizer)
    predicted = {
        "bf16 params": memory.lp_params(layout, s),
        "fp32 master": memory.master_weights(layout, s, b),
        "optimizer states": memory.optimizer_states(layout, s),
        "bf16 grads": memory.lp_grads(layout, s),
        "fp32 grads": memory.fp32_grads(layout, s, b),
    }
    errors = []
    for rank, m in enumerate(measurements(engine_bytes, stage, offload, mode, optimizer, shared)):
        assert (m["trainable_params"], m["total_params"]) == (facts.trainable_params, facts.total_params), \
            "the planner's facts count other parameters than the engine trains"
        if stage == 3:
            assert m["persistent_numel"] == s.persistent_params, "ZeRO-3 persists other parameters than planned"
        errors += compare(m["device"], predicted, stage, m, rank, optimizer)
    return errors


@pytest.mark.parametrize(("stage", "offload", "mode", "optimizer"), [c for c in CASES if c[1] != "none"],
                         ids=[case_id(*c) for c in CASES if c[1] != "none"])
def test_offloaded_bytes_match_planner_host_buffers(engine_bytes, planner, stage, offload, mode, optimizer):
    """Each host buffer of the offload, per rank, against the planner's (memory.offload_buffers):
    fp32 master, moments, fp32 grads, ZeRO-3's pinned bf16 grad partition, and ZeRO 1/2's pinned
    staging buffers (bf16 partition copy, largest-gradient buffer, CPU accumulators). The CPU pins
    nothing, so the sizes are compared before torch's pinned rounding (memory.pinned_bytes)."""
    errors = host_errors(engine_bytes, planner, stage, offload, mode, optimizer)
    assert not errors, "\n".join(errors)


def host_errors(engine_bytes, planner, stage, offload, mode, optimizer, shared: bool = True) -> list[str]:
    from zerotrain.planner import memory

    _, s, b, run = planner[mode]
    b = dataclasses.replace(b, shares_copies=shared)
    layout = layout_for(stage, offload, run, optimizer)
    predicted = {buf.name: sum(buf.sizes) for buf in memory.offload_buffers(layout, s, b)}
    engine_names = {"fp32 master": "fp32 master", "optimizer states": "adam moments", "fp32 grads": "fp32 grads",
                    "bf16 grads": "bf16 grad partition",
                    "host param_buffer_of_bit16_for_cpu_offload_groups": "bf16 upload copy",
                    "host temp_grad_buffer_for_cpu_offload": "grad staging",
                    "host accumulated_grads_in_cpu": "grad accumulators", "host bf16 params": "bf16 params"}
    errors = []
    for rank, m in enumerate(measurements(engine_bytes, stage, offload, mode, optimizer, shared)):
        staging = {k: v for k, v in m["staging"].items() if k.startswith("host ") and v}
        # A buffer the engine shares with another (bf16 masters at ZeRO-3) holds 0 B of its own.
        held = {engine_names[k]: v for k, v in {**m["host"], **staging}.items() if v}
        assert set(held) == set(predicted), f"rank {rank}: the engine's host buffers {sorted(held)}, " \
                                            f"the planner's {sorted(predicted)}"
        for name, value in held.items():
            term = next(k for k, v in engine_names.items() if v == name)
            slack = tolerance(term, stage, m, optimizer) if term in m["host"] else 2 * 2 * m["largest_param"]
            if abs(value - predicted[name]) > slack:
                errors.append(f"rank {rank} {name}: engine holds {value} B, planner predicts {predicted[name]} B "
                              f"(padding tolerance {slack} B)")
    return errors


@pytest.mark.parametrize(("stage", "offload", "mode", "optimizer"), UNSHARED,
                         ids=[case_id(*c, shared=False) for c in UNSHARED])
def test_unshared_buffers_match_the_planner_told_so(engine_bytes, planner, stage, offload, mode, optimizer):
    """With the sharing off, the engine keeps DeepSpeed's own copies, and the planner given
    shares_copies=False counts each of them, on the GPU and on the host. The same layout with the
    sharing on holds less: the flag changes what both sides count."""
    errors = gpu_errors(engine_bytes, planner, stage, offload, mode, optimizer, shared=False)
    if offload != "none":
        errors += host_errors(engine_bytes, planner, stage, offload, mode, optimizer, shared=False)
    assert not errors, "\n".join(errors)
    # deepspeed_compat.unshared, which initialize warns with, names each copy the plan counted as
    # shared, and the one shared case of the same layout has none.
    for m in measurements(engine_bytes, stage, offload, mode, optimizer, shared=False):
        assert m["unshared"], "the check after initialize saw no unshared buffer"
    for m in measurements(engine_bytes, stage, offload, mode, optimizer):
        assert m["unshared"] == [], m["unshared"]
    _, s, b, run = planner[mode]
    layout = layout_for(stage, offload, run, optimizer)
    from zerotrain.planner import memory

    def total(buffers):
        return memory.master_weights(layout, s, buffers) + sum(sum(x.sizes) for x in
                                                                  memory.offload_buffers(layout, s, buffers))
    assert total(dataclasses.replace(b, shares_copies=False)) > total(b)



# DeepSpeed's own bookkeeping tensors in the measured windows (80 B in a save at ZeRO 0-2; at
# ZeRO-3 up to 1,044 B over the planner's 10 KB save term, in 2 of 5 runs: 1 KB failed CI now and
# then) and ZeRO-3's partition padding (world - 1 elements per parameter). Still far below a
# missing or doubled term (10 KB and more here).
TRANSIENT_SLACK = 2048


@pytest.mark.parametrize(("stage", "offload", "mode", "optimizer"), CASES, ids=[case_id(*c) for c in CASES])
def test_buffers_and_transients_match_planner(engine_bytes, planner, stage, offload, mode, optimizer):
    """The reduction buckets, the all-gather after a ZeRO 1/2 step, ZeRO-3's gathered parameters,
    initialize's transient and the checkpoint save's, per rank, against the planner's terms."""
    from zerotrain.planner import memory

    facts, s, b, run = planner[mode]
    layout = layout_for(stage, offload, run, optimizer)
    errors = []
    for rank, m in enumerate(measurements(engine_bytes, stage, offload, mode, optimizer)):
        t = m["transients"]
        checks = {"reduce buckets": (t["reduce buckets"], memory.reduce_buckets(layout, s, b)),
                  "save": (t["save peak"], memory.save_gather(layout, s))}
        if offload == "none" and stage < 3:  # see the module docstring for ZeRO-3 and offload
            checks["init"] = (t["init peak"] - t["init end"], memory.init_transient(layout, s, b))
        errors += [f"rank {rank} {name}: engine {value} B, planner {predicted} B"
                   for name, (value, predicted) in checks.items() if abs(value - predicted) > TRANSIENT_SLACK]
        if stage in (1, 2):
            # The updated partitions are gathered into the flat bf16 groups themselves: no bucket.
            assert t["allgather into flat groups"] and all(t["allgather into flat groups"]), t
            assert t["allgather elsewhere"] == 0, t
        if stage == 3:
            # Parameters stay gathered for reuse well beyond one layer and the prefetch (what the
            # planner assumed before), and within the planner's bound.
            one_layer = memory.LP * (facts.largest_layer_params + b.stage3_prefetch_bucket_size)
            predicted = memory.gathered_params(layout, s, b)
            if not one_layer < t["gathered params"] <= predicted:
                errors.append(f"rank {rank} gathered params: engine {t['gathered params']} B, planner {predicted} B "
                              f"(one layer and the prefetch: {one_layer} B)")
    assert not errors, "\n".join(errors)
