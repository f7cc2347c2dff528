"""The memory floor (issue 14), without an engine.

Partial checkpointing: the planner's prediction for k of N checkpointed blocks against a real CPU
forward and backward with exactly those blocks checkpointed by the engine's code
(Family.enable_checkpointing, zerotrain.recompute), measured with the tracer's own LiveBytesMode;
and the search choosing the fewest blocks that fit. The optimizer dimension: the planner takes
another optimizer only where fp32 AdamW does not fit, and Adafactor's step transient. ZeRO++ on several nodes: its memory term and
the intra/inter-node split of the traffic. (The engine's real bytes under adamw-bf16:
tests/distributed/test_engine_bytes.py; its training: test_train_optimizers.py.)"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from tests.unit.test_facts import TEXT_TOKENS, cpu_inputs, meta_inputs, real_model, run_config, spec_of
from zerotrain import recompute
from zerotrain.config import load_config
from zerotrain.errors import ZerotrainError
from zerotrain.families import of
from zerotrain.hardware import hardware_facts
from zerotrain.planner import trace
from zerotrain.planner.facts import ActivationFacts, CheckpointUnit, ModelFacts
from zerotrain.planner.search import describe, evaluate, plan

MODELS = [
    # Repeated DiT blocks: each group's cost comes from trace_by_blocks' increments.
    ("tiny-flux", {"num_layers": 3, "num_single_layers": 4}),
    # A UNet: each down, mid and up block traced with it alone checkpointed.
    ("tiny-sdxl", {}),
]


@pytest.mark.parametrize(("name", "depth"), MODELS, ids=[name for name, _ in MODELS])
def test_saved_bytes_and_flops_of_k_checkpointed_blocks_match_a_real_backward(name, depth):
    spec = spec_of(name, **depth)
    facts = trace.measure(spec, run_config(name), TEXT_TOKENS)
    n = facts.checkpoint_blocks
    order = facts.checkpoint_order()
    assert n == len(order) >= 3 and set(order) <= set(recompute.checkpoint_units(trace.build_meta_model(spec)))
    family = of(spec)
    real = {}
    for k in (0, n // 2, n):
        model = real_model(spec)
        if k:
            family.enable_checkpointing(model, order[:k])  # as engine.apply_mode does for the plan
        real[k] = trace.trace_activations(model, cpu_inputs(spec), None, prediction=family.prediction)
        assert real[k].flops == pytest.approx(facts.activations(k > 0, k).flops, rel=1e-9), k
    # What checkpointing k blocks frees. The CPU kernels keep a few bytes per block that the
    # planner's CUDA-like meta trace does not (layer-norm statistics in bf16 rather than fp32, CPU
    # flash attention's logsumexp: under 0.4% of what is freed here, per-token scalars at full size).
    none = facts.activations(False)
    for k in (n // 2, n):
        freed = none.saved_bytes - facts.activations(True, k).saved_bytes
        assert real[0].saved_bytes - real[k].saved_bytes == pytest.approx(freed, rel=0.01), k
    assert real[0].saved_bytes == pytest.approx(none.saved_bytes, rel=0.005)
    # And with the engine's checkpointing on the meta model, the prediction is exact.
    meta = trace.build_meta_model(spec)
    family.enable_checkpointing(meta, order[:n // 2])
    half = trace.trace_activations(meta, meta_inputs(spec), None, prediction=family.prediction)
    assert half.saved_bytes == facts.activations(True, n // 2).saved_bytes
    # Between the extremes, both move monotonically with k.
    curve = [facts.activations(True, k) for k in range(n + 1)]
    assert all(a.saved_bytes >= b.saved_bytes and a.flops <= b.flops for a, b in itertools.pairwise(curve))
    assert curve[0] == facts.no_checkpointing and curve[-1] == facts.checkpointing


def test_activation_offload_moves_the_block_inputs_off_the_device_with_the_same_gradients(monkeypatch):
    """Activation offload (recompute.OffloadingCheckpoint, as engine.apply_mode installs it) on a
    real CPU forward and backward of tiny-flux with every block checkpointed: the device's saved
    activations fall by exactly the bytes the planner's meta trace says it moves
    (ModelFacts.offload_input_bytes), and the gradients are plain checkpointing's, bit for bit.
    On the CPU there is no second memory, so the test's host copies are made outside the tracker,
    and every input of 1 KiB or more moves (the tiny model's are below the 1 MiB of a real one)."""
    from torch.utils._python_dispatch import _disable_current_modes

    monkeypatch.setattr(recompute, "OFFLOAD_MIN_BYTES", 1024)
    spec = spec_of("tiny-flux", num_layers=3, num_single_layers=4)
    facts = trace.measure(spec, run_config("tiny-flux"), TEXT_TOKENS)
    assert len(facts.offload_input_bytes) == 3 * 2 + 4 * 2  # hidden and text states of every block
    moved = sum(facts.offload_input_bytes)
    assert 0 < facts.offload_largest_call < moved
    family = of(spec)

    def outside_tracker(tensor: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():
            return tensor.clone()

    def moves(tensor: object) -> bool:
        return isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and \
            tensor.numel() * tensor.element_size() >= recompute.OFFLOAD_MIN_BYTES

    def checkpointed(offload: bool) -> tuple[torch.nn.Module, recompute.OffloadingCheckpoint | None]:
        model = real_model(spec)
        offloader = recompute.OffloadingCheckpoint(moves, outside_tracker) if offload else None
        family.enable_checkpointing(model, None, offloader)
        return model, offloader

    plain, _ = checkpointed(False)
    offloaded, offloader = checkpointed(True)
    kept = trace.trace_activations(plain, cpu_inputs(spec), None, prediction=family.prediction)
    on_host = trace.trace_activations(offloaded, cpu_inputs(spec), None, prediction=family.prediction)
    assert offloader.moved_bytes == moved
    assert kept.saved_bytes - on_host.saved_bytes == moved
    assert facts.activations(True, None, offload=True).saved_bytes == facts.checkpointing.saved_bytes - moved
    assert on_host.flops == kept.flops

    def gradients(model: torch.nn.Module) -> list[torch.Tensor]:
        out = family.prediction(model(**cpu_inputs(spec), return_dict=False)[0])
        out.float().square().mean().backward()
        return [p.grad for p in model.parameters()]

    plain, _ = checkpointed(False)
    offloaded, _ = checkpointed(True)
    for a, b in zip(gradients(plain), gradients(offloaded), strict=True):
        assert torch.equal(a, b)


def test_the_plan_offloads_activations_only_past_checkpointing_every_block():
    """Activation offload is the tier after checkpointing every block: chosen where that alone
    does not fit, with its host bytes (pinned, per tensor) and transfer time accounted; and a
    training.activation_offload=true the model cannot honour is one line."""
    facts = dataclasses.replace(facts_with_units(), offload_input_bytes=[24 * 2**20] * 60,
                                offload_largest_call=48 * 2**20)
    every = facts.activations(True)
    run = load_config(None, ["hardware.gpus=1", "hardware.gpu_memory=24GiB", "training.global_batch_size=1",
                             "planner.stages=[3]"])
    hw = hardware_facts(run.hardware)
    roomy = plan(facts, hw, run)
    assert not roomy.chosen.layout.offload_activations
    # A budget just below what checkpointing every block needs at its smallest.
    smallest = min(c.memory.device_total for c in roomy.candidates
                   if c.layout.gradient_checkpointing and not c.layout.offload_activations)
    gpu = (smallest - 2**30 // 2) / (1 - run.planner.headroom) / 2**30
    tight = load_config(None, ["hardware.gpus=1", f"hardware.gpu_memory={gpu:.3f}GiB", "training.global_batch_size=1",
                               "planner.stages=[3]"])
    result = plan(facts, hardware_facts(tight.hardware), tight)
    chosen = result.chosen
    assert chosen.layout.offload_activations and chosen.layout.gradient_checkpointing, describe(chosen.layout)
    assert chosen.layout.checkpointed_blocks is None
    moved = 60 * 24 * 2**20
    assert activations_of(chosen, facts).saved_bytes == every.saved_bytes - moved
    assert chosen.time_terms["activation transfers"] == pytest.approx(2 * moved / hw.host_to_device_bandwidth)
    assert chosen.memory.host_terms["offload"] >= moved  # each 24 MiB tensor pinned on its own: 32 MiB
    assert any(line.startswith("Activation offload: the inputs of every checkpointed block (60 tensors")
               for line in result.reasons), result.reasons
    with pytest.raises(ZerotrainError, match="activation_offload=true offloads the inputs of every checkpointed"):
        plan(facts, hw, load_config(None, ["hardware.gpus=1xH100-80GB", "training.global_batch_size=1",
                                           "training.activation_offload=true", "training.checkpoint_blocks=3"]))
    with pytest.raises(ZerotrainError, match="take no input large enough to offload"):
        plan(facts_with_units(), hw, load_config(None, ["hardware.gpus=1xH100-80GB", "training.global_batch_size=1",
                                                        "training.activation_offload=true"]))


def activations_of(c, facts):
    from zerotrain.planner.search import activations

    return activations(c.layout, facts)


def test_checkpointing_unknown_blocks_is_refused():
    model = real_model(spec_of("tiny-flux"))
    with pytest.raises(ValueError, match="no checkpoint unit named transformer_blocks.99"):
        recompute.enable(model, ["transformer_blocks.99"])


def facts_with_units() -> ModelFacts:
    """A 1B-parameter DiT: 10 GiB saved without checkpointing, 1 GiB with every one of its 30
    blocks checkpointed (20 frees 0.4 GiB each, 10 frees 0.1 GiB each for the same recomputation)."""
    gib = 2**30
    none = ActivationFacts(saved_bytes=10 * gib, forward_peak_bytes=11 * gib, backward_peak_bytes=12 * gib, flops=6e13)
    every = ActivationFacts(saved_bytes=1 * gib, forward_peak_bytes=2 * gib, backward_peak_bytes=3 * gib, flops=8e13)
    units = [CheckpointUnit([f"single.{i}" for i in range(10)], gib // 10, 2e13 / 30),
             CheckpointUnit([f"double.{i}" for i in range(20)], 4 * gib // 10, 2e13 / 30)]
    units.sort(key=lambda u: -u.freed_bytes)
    return ModelFacts(model="m", class_name="FluxTransformer2DModel", family="flux", resolution=1024, mode="full",
                      quantize="none", lora_rank=None, total_params=10**9, trainable_params=10**9, frozen_params=0,
                      frozen_bytes=0, buffer_bytes=0, largest_layer_params=10**7, block_params={},
                      param_numels=[10**7] * 100, largest_trainable_param=10**7, image_tokens=4096, text_tokens=512,
                      input_bytes=10**6, no_checkpointing=none, checkpointing=every, checkpoint_units=units)


def test_the_plan_checkpoints_the_fewest_blocks_that_fit():
    facts = facts_with_units()
    run = load_config(None, ["hardware.gpus=1", "hardware.gpu_memory=26GiB", "training.global_batch_size=1",
                             "planner.stages=[2]", "planner.offload=[none]"])
    hw = hardware_facts(run.hardware)
    result = plan(facts, hw, run)
    chosen = result.chosen
    k = chosen.layout.checkpointed_blocks
    assert chosen.layout.gradient_checkpointing and 0 < k < facts.checkpoint_blocks, describe(chosen.layout)
    assert result.checkpointed(chosen.layout) == facts.checkpoint_order()[:k]
    assert result.checkpointed(chosen.layout)[0].startswith("double.")  # most bytes per FLOP first
    fewer = evaluate(dataclasses.replace(chosen.layout, checkpointed_blocks=k - 1), facts, hw, run)
    assert not fewer.fits  # the fewest that fit
    none = evaluate(dataclasses.replace(chosen.layout, gradient_checkpointing=False, checkpointed_blocks=None),
                    facts, hw, run)
    every = evaluate(dataclasses.replace(chosen.layout, checkpointed_blocks=None), facts, hw, run)
    assert not none.fits and every.fits
    assert none.step_seconds < chosen.step_seconds < every.step_seconds
    [line] = [r for r in result.reasons if r.startswith(f"Checkpointing {k} of 30 blocks")]
    assert "between" in line and "without checkpointing" in line


def test_checkpoint_blocks_is_checked_against_the_model():
    facts = facts_with_units()
    run = load_config(None, ["hardware.gpus=1xH100-80GB", "training.global_batch_size=1", "training.checkpoint_blocks=40"])
    with pytest.raises(ZerotrainError, match="training.checkpoint_blocks=40: m has 30 blocks"):
        plan(facts, hardware_facts(run.hardware), run)
    run = load_config(None, ["hardware.gpus=1xH100-80GB", "training.global_batch_size=1",
                             "training.checkpoint_blocks=5", "training.gradient_checkpointing=false"])
    with pytest.raises(ZerotrainError, match="training.gradient_checkpointing is false"):
        plan(facts, hardware_facts(run.hardware), run)
    run = load_config(None, ["hardware.gpus=1xH100-80GB", "training.global_batch_size=1", "training.checkpoint_blocks=5"])
    assert {c.layout.checkpointed_blocks for c in plan(facts, hardware_facts(run.hardware), run).candidates} == {5}


def test_units_of_a_unet_and_a_dit():
    flux = recompute.checkpoint_units(trace.build_meta_model(spec_of("tiny-flux", num_layers=2, num_single_layers=3)))
    assert list(flux) == ["transformer_blocks.0", "transformer_blocks.1", "single_transformer_blocks.0",
                          "single_transformer_blocks.1", "single_transformer_blocks.2"]
    unet = recompute.checkpoint_units(trace.build_meta_model(spec_of("tiny-sdxl")))
    assert "mid_block" in unet and any(n.startswith("down_blocks.") for n in unet) and any(
        n.startswith("up_blocks.") for n in unet)
    assert all(isinstance(m, torch.nn.Module) for m in unet.values())


# --- the optimizer dimension (adamw-bf16) -----------------------------------------------------------


def test_auto_optimizer_takes_adamw_first_then_the_least_memory_only_where_needed():
    """optimizer.name auto: fp32 AdamW wherever it fits; where it does not, the first of
    planner.optimizers that fits at about the best speed (OPTIMIZER_TIE): adamw-bf16 where it
    fits, adamw-8bit where only its smaller state fits. Per trainable parameter, master and states,
    partitioned from ZeRO-1: 4 + 8 bytes for adamw, 2 + 4 for adamw-bf16 (ZeRO-3 steps its bf16
    partition itself: 0 + 4), 2 + 2 and an absmax per 256 for adamw-8bit, 2 + 4 for adafactor."""
    from zerotrain.planner import memory
    from zerotrain.planner.memory import Layout
    from zerotrain.planner.search import OPTIMIZER_TIE, sizes_from

    facts = facts_with_units()
    roomy = load_config(None, ["hardware.gpus=1xH100-80GB", "training.global_batch_size=1", "optimizer.name=auto"])
    chosen = plan(facts, hardware_facts(roomy.hardware), roomy).chosen
    assert chosen.layout.optimizer == "adamw"

    def tight(gib: float):
        run = load_config(None, ["hardware.gpus=1", f"hardware.gpu_memory={gib}GiB", "training.global_batch_size=1",
                                 "optimizer.name=auto", "planner.offload=[none]"])
        return run, plan(facts, hardware_facts(run.hardware), run)

    run, result = tight(20)
    assert result.chosen.layout.optimizer == "adamw-bf16" and result.chosen.layout.stage > 0
    assert not any(c.fits for c in result.candidates if c.layout.optimizer == "adamw")
    # adamw-8bit also fits, a little faster (fewer bytes per step): a tie, so the preferred numerics win.
    faster = max((c for c in result.candidates if c.fits and c.layout.optimizer == "adamw-8bit"),
                 key=lambda c: c.images_per_second)
    assert result.chosen.images_per_second < faster.images_per_second
    assert result.chosen.images_per_second >= faster.images_per_second * (1 - OPTIMIZER_TIE)
    assert "adamw-bf16" in describe(result.chosen.layout)
    assert any(line.startswith("Optimizer adamw-bf16: no adamw candidate fits") for line in result.reasons)
    # A GPU between the smallest adamw-bf16 and the smallest adamw-8bit: only 8-bit moments fit.
    smallest = {name: min(c.memory.device_total for c in result.candidates if c.layout.optimizer == name)
                for name in ("adamw-bf16", "adamw-8bit")}
    assert smallest["adamw-8bit"] < smallest["adamw-bf16"]
    between = sum(smallest.values()) / 2 / (1 - run.planner.headroom) / 2**30
    _, squeezed = tight(round(between, 2))
    assert squeezed.chosen.layout.optimizer == "adamw-8bit", describe(squeezed.chosen.layout)
    assert any(line.startswith("Optimizer adamw-8bit: no adamw/adamw-bf16 candidate fits") for line in squeezed.reasons)
    # Client optimizers step on the GPU, with bf16 masters: never offloaded, never without ZeRO.
    for c in result.candidates:
        if c.layout.optimizer in ("adamw-8bit", "adafactor"):
            assert c.layout.stage > 0 and c.layout.offload_optimizer == "none", c.layout
        if c.layout.optimizer != "adamw":
            assert c.layout.stage > 0, c.layout
    s = sizes_from(facts, hardware_facts(run.hardware), run)
    per_param = {"adamw": (12, 12), "adamw-bf16": (6, 4), "adamw-8bit": (4 + 8 / 256, 2 + 8 / 256), "adafactor": (6, 4)}
    for optimizer, (zero12, zero3) in per_param.items():
        for stage in (1, 2, 3):
            layout = Layout(stage, optimizer=optimizer)
            held = memory.master_weights(layout, s) + memory.optimizer_states(layout, s)
            assert held == pytest.approx((zero3 if stage == 3 else zero12) * 10**9, rel=1e-5), (optimizer, stage)
    # ZeRO-3 with the parameters offloaded keeps its bf16 master copy on the GPU.
    assert memory.master_weights(Layout(3, offload_param="cpu", optimizer="adamw-8bit"), s) == 2 * 10**9


def test_adafactor_step_transient_matches_a_real_step():
    """memory.step_transient: transformers' Adafactor.step on one flat bf16 partition (what DeepSpeed
    hands it) allocates 4 fp32 copies of it beyond what it keeps, measured with the allocator's
    events; the 8-bit and AdamW kernels none."""
    from transformers.optimization import Adafactor

    from tests.distributed.engine_bytes_worker import allocator_window
    from zerotrain.optimizers import client_settings
    from zerotrain.planner import memory
    from zerotrain.planner.memory import Buffers, Layout, Sizes

    n = 1 << 18
    run = load_config(None, [])
    flat = torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16))
    flat.grad = torch.randn(n, dtype=torch.bfloat16)
    kwargs = dict(client_settings("adafactor", run)["params"], eps=(1e-30, 1e-3))
    optimizer = Adafactor([flat], **kwargs)
    for step in range(2):  # the first step also creates the state
        _, peak, end = allocator_window(optimizer.step)
        if step == 1:
            sizes = Sizes(trainable_params=2 * n, frozen_bytes=0, frozen_shardable=True, largest_layer_params=n,
                          buffer_bytes=0, world_size=2, gpus_per_node=2)
            predicted = memory.step_transient(Layout(2, optimizer="adafactor"), sizes, Buffers())
            assert predicted == 16 * n
            assert abs((peak - end) - predicted) <= 1024, (peak - end, predicted)
    assert memory.step_transient(Layout(2, optimizer="adamw-8bit"), sizes, Buffers()) == 0
    assert memory.step_transient(Layout(3, optimizer="adafactor"), sizes, Buffers(sub_group_size=n // 4)) == 4 * n


# --- ZeRO++ across nodes -------------------------------------------------------------------------


def test_zeropp_joins_the_search_on_several_nodes_and_moves_traffic_into_the_node():
    from zerotrain.planner import memory
    from zerotrain.planner.search import sizes_from

    facts = facts_with_units()
    run = load_config(None, ["hardware.gpus=8xH100-80GB", "hardware.nodes=2", "training.global_batch_size=16",
                             "planner.stages=[3]", "planner.offload=[none]", "training.gradient_checkpointing=false",
                             "planner.zeropp=[none, hpz, hpz-qwz-qgz]"])
    hw = hardware_facts(run.hardware)
    result = plan(facts, hw, run)
    by = {c.layout.zeropp: c for c in result.candidates if c.layout.micro_batch == 1}
    assert set(by) == {"none", "hpz", "hpz-qwz-qgz"}
    inter = {k: c.time_terms["communication (inter-node)"] for k, c in by.items()}
    assert inter["hpz-qwz-qgz"] < inter["hpz"] < inter["none"]
    assert by["none"].time_terms["communication (intra-node)"] == 0 < by["hpz"].time_terms["communication (intra-node)"]
    # hpZ's secondary partition: the partitioned bf16 parameters over the node's 8 GPUs.
    s = sizes_from(facts, hw, run)
    assert memory.hpz_secondary(by["hpz"].layout, s) == 2 * (10**9 - s.persistent_params) // 8
    assert by["hpz"].memory.phases["forward"] - by["none"].memory.phases["forward"] == memory.hpz_secondary(
        by["hpz"].layout, s)
    # One node: no ZeRO++ candidates, one communication term.
    single = load_config(None, ["hardware.gpus=8xH100-80GB", "training.global_batch_size=16"])
    candidates = plan(facts, hardware_facts(single.hardware), single).candidates
    assert {c.layout.zeropp for c in candidates} == {"none"}
    assert all("communication (inter-node)" not in c.time_terms for c in candidates)


# --- Streaming a frozen base ---------------------------------------------------------------------


def test_lora_plans_weigh_streaming_the_base_against_quantizing_it():
    """LoRA on Flux-dev in 17 GiB (a qint8 base fits it beside the measured 1.07 GiB of NCCL workspace,
    not 16 GiB): the plan streams the frozen base with ZeRO-3 parameter offload
    and says what that costs per step, then plans qint8 and qint4 bases (their own facts) and
    states each one's step time; over a quantized base it weighs the unquantized one."""
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.measure import measure_model
    from zerotrain.planner.report import base_choices

    def choices(*overrides: str) -> tuple[object, list[str]]:
        run = load_config(None, ["model.name_or_path=flux-dev", "training.mode=lora", "hardware.gpus=1",
                                 "hardware.gpu_memory=17GiB", *overrides])
        spec = resolve_model(run.model)
        facts = measure_model(spec, run)
        hw = hardware_facts(run.hardware)
        result = plan(facts, hw, run)
        return result, base_choices(spec, facts, hw, run, result)

    result, lines = choices()
    assert result.chosen.layout.offload_param == "cpu", describe(result.chosen.layout)
    transfers = result.chosen.time_terms["param transfers"]
    assert lines[0].startswith("Streams the frozen base: ZeRO-3 param->cpu keeps its 22.2 GiB in host memory")
    assert f"{transfers:.2f} of the {result.chosen.step_seconds:.2f} s/step" in lines[0]
    assert "qint8 (training.quantize_base=qint8): ZeRO-" in lines[1] and "qint4 (training.quantize_base=qint4)" in lines[1]
    assert "Streaming and quantization do not combine" in lines[1]
    _, quantized = choices("training.quantize_base=qint8")
    assert len(quantized) == 1 and "unquantized, streamed: ZeRO-3" in quantized[0], quantized
    # A roomy GPU that needs no streaming: nothing to weigh.
    assert choices("hardware.gpus=1xH100-80GB", "hardware.gpu_memory=80GiB")[1] == []


def test_regression_guard_flux_dev_full_fits_a_24gb_card_with_128gb_of_host():
    """A regression guard: planner output against a planner target, not a measurement (no GPU has
    run this layout; a CPU engine's host buffers per parameter: tests/distributed/test_engine_bytes.py).
    Issue 14's stretch target: a full fine-tune of Flux-dev at 1024px on one 24 GB card with
    128 GB of host RAM. Only ZeRO-3 with the optimizer and the parameters on the host fits the
    GPU; with adamw-bf16 its host buffers are the pinned bf16 partition (which is the master), the
    pinned bf16 gradient partition (which is the master's gradient) and the bf16 moments, 8 bytes
    per parameter (deepspeed_compat.sharing._zero3_shares_bf16_masters), where fp32 AdamW needs 18. The plan prints
    them."""
    from rich.console import Console

    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.measure import measure_model
    from zerotrain.planner.report import print_plan

    run = load_config(None, ["model.name_or_path=flux-dev", "training.mode=full", "hardware.gpus=1",
                             "hardware.gpu_memory=24GiB", "hardware.host_memory=128GB", "optimizer.name=auto",
                             "training.global_batch_size=8"])
    facts = measure_model(resolve_model(run.model), run)
    result = plan(facts, hardware_facts(run.hardware), run)
    chosen = result.chosen
    assert chosen is not None, result.reasons
    layout = chosen.layout
    assert (layout.stage, layout.offload_optimizer, layout.offload_param, layout.optimizer) == \
        (3, "cpu", "cpu", "adamw-bf16"), describe(layout)
    params = facts.trainable_params
    buffers = chosen.memory.host_buffers
    assert {"fp32 master", "fp32 grads (pinned)"}.isdisjoint(buffers), buffers
    optimizer_bytes = sum(buffers[k] for k in ("bf16 params (pinned)", "bf16 grad partition (pinned)", "adam moments"))
    assert optimizer_bytes == pytest.approx(8 * params, rel=1e-3)
    assert chosen.memory.host_per_node <= result.host_budget_bytes
    assert sum(buffers.values()) * run.planner.host_offload_factor == pytest.approx(chosen.memory.host_terms["offload"], abs=1)
    # fp32 AdamW's host buffers (fp32 master, its pinned gradient, moments, bf16 partitions): no fit.
    fp32 = [c for c in result.candidates if c.layout.optimizer == "adamw" and c.layout.offload_param == "cpu"]
    assert fp32 and not any(c.fits for c in fp32)
    assert all("host RAM" in c.rejected for c in fp32 if c.memory.device_total < result.gpu_budget_bytes)
    console = Console(record=True, width=400)
    print_plan(result, facts, console=console)
    text = console.export_text()
    assert "Host RAM per node: " in text and "bf16 grad partition (pinned) 22.2" in text, text
