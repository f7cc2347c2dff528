"""Search: enumerate ZeRO stage x offload x checkpointing x micro-batch, keep what fits, pick
the fastest by a simple step-time model.

plan() is a pure function of measured model facts, hardware facts and the run config. The
step-time model: FLOPs at an assumed MFU, plus ring-collective traffic over the slowest link, plus
ZeRO-3's fixed cost per module fetch, plus host<->GPU offload transfers, CPU-Adam and NVMe time,
with no overlap assumed. It ranks candidates; it is not a promise of seconds."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from zerotrain import families, optimizers
from zerotrain.config.sections import Loading, Mode, Quantization, RunConfig
from zerotrain.data.index import indexed_entries
from zerotrain.deepspeed_compat import sharing_in_force
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import HardwareFacts
from zerotrain.planner.facts import ModelFacts
from zerotrain.planner.memory import (
    LP,
    Buffers,
    Layout,
    MemoryEstimate,
    Sizes,
    dataset_index_bytes,
    estimate,
    master_element,
    moment_bytes,
)
from zerotrain.units import gib


def count(value: int) -> str:
    """11901408320 -> '11.90B', 78544 -> '78.5K'."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if value >= scale:
            return f"{value / scale:.{2 if suffix == 'B' else 1}f}{suffix}"
    return str(value)


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    fits: bool
    rejected: str | None
    step_seconds: float
    images_per_second: float
    time_terms: dict[str, float] = field(default_factory=dict)
    margin_bytes: int = 0
    """What the layout must leave free on each GPU beyond its prediction (activation_margin)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "layout": dataclasses.asdict(self.layout), "fits": self.fits, "rejected": self.rejected,
            "step_seconds": self.step_seconds, "images_per_second": self.images_per_second,
            "time_terms": self.time_terms, "memory": dataclasses.asdict(self.memory),
            "margin_bytes": self.margin_bytes,
        }


@dataclass
class Plan:
    model: str
    resolution: int
    mode: str
    quantize: str
    hardware: str
    world_size: int
    gpus_per_node: int
    nodes: int
    global_batch: int
    gpu_budget_bytes: int
    host_budget_bytes: int
    nvme_budget_bytes: int | None
    chosen: Candidate | None
    candidates: list[Candidate]
    reasons: list[str]
    suggestions: list[str] = field(default_factory=list)
    flops_per_sample: float = 0.0
    given: Candidate | None = None
    """A DeepSpeed config the user gave (train.py's deepspeed: path), as the planner evaluates it."""
    checkpoint_order: list[str] = field(default_factory=list)
    """The blocks partial checkpointing takes, best first (ModelFacts.checkpoint_order)."""
    margin_measured_on: str | None = None
    """Where a calibration measured planner.activation_margin: its device and lane (calibration.Lane);
    None: the default."""

    def checkpointed(self, layout: Layout) -> bool | list[str]:
        """What a layout checkpoints, as engine.apply_mode takes it: True for every block, the
        names of some, or [] for none."""
        if not layout.gradient_checkpointing:
            return []
        if layout.checkpointed_blocks is None or layout.checkpointed_blocks >= len(self.checkpoint_order):
            return True
        return self.checkpoint_order[:layout.checkpointed_blocks]

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("chosen", "candidates", "given")}
        data["chosen"] = self.chosen.to_json() if self.chosen else None
        data["given"] = self.given.to_json() if self.given else None
        data["candidates"] = [c.to_json() for c in self.candidates]
        return data


def buffers_from(run: RunConfig) -> Buffers:
    p = run.planner
    return Buffers(
        reduce_bucket_size=p.reduce_bucket_size, overlap_comm=p.overlap_comm,
        stage3_prefetch_bucket_size=p.stage3_prefetch_bucket_size,
        stage3_max_live_parameters=p.stage3_max_live_parameters, sub_group_size=p.sub_group_size,
        cuda_context_bytes=p.cuda_context_bytes, nccl_workspace_bytes=p.nccl_workspace_bytes,
        fragmentation=p.fragmentation,
        pinned_exact_above=None if p.pinned_exact_above_mib is None else p.pinned_exact_above_mib * 2**20,
        host_offload_factor=p.host_offload_factor,
        shares_copies=sharing_in_force().enabled,
    )


def sizes_from(facts: ModelFacts, hw: HardwareFacts, run: RunConfig) -> Sizes:
    threshold = run.planner.stage3_param_persistence_threshold
    return Sizes(
        trainable_params=facts.trainable_params, frozen_bytes=facts.frozen_bytes,
        frozen_shardable=facts.quantize == Quantization.none.value,
        largest_layer_params=facts.largest_layer_params, buffer_bytes=facts.buffer_bytes,
        world_size=hw.world_size, gpus_per_node=hw.gpus_per_node,
        persistent_params=sum(n for n in facts.param_numels if n <= threshold),
        largest_trainable_param=facts.largest_trainable_param,
        total_params=facts.total_params, param_numels=tuple(facts.param_numels),
        all_trainable=facts.trainable_params == facts.total_params,
        offload_activation_bytes=tuple(facts.offload_input_bytes),
        load_whole=run.model.load is Loading.whole or run.training.lora.use_dora,
        validation_host_bytes=validation_host_bytes(facts, run),
        loader_bytes=run.data.num_workers * run.planner.loader_worker_bytes,
        dataset_bytes=dataset_index_bytes(indexed_entries(run.data.cache_dir), run.planner.dataset_entry_bytes),
        ema=run.ema.enabled, ema_validation=run.ema.enabled and run.validation.use_ema and bool(run.validation.prompts),
    )


def validation_host_bytes(facts: ModelFacts, run: RunConfig) -> int:
    """Per rank, the bf16 weights rendering run.validation's images loads beside the trained model
    (Family.validation_params); 0 without validation prompts."""
    if not run.validation.prompts:
        return 0
    base = facts.total_params - (facts.trainable_params if facts.mode == Mode.lora.value else 0)
    return LP * families.by_name(facts.family).validation_params(base)


def layouts(run: RunConfig, hw: HardwareFacts, per_rank_batch: int) -> list[Layout]:
    """Every configuration the search considers."""
    allowed = set(run.planner.offload)
    if hw.nvme_free_bytes is None:
        allowed.discard("nvme")
    offloads: dict[int, list[tuple[str, str]]] = {}
    # Compiled blocks (training.compile=true) need ZeRO 0-2: ZeRO-3's hooks split them (engine.compile_choice).
    for stage in [st for st in run.planner.stages if st < 3 or run.training.compile is not True]:
        options = [("none", "none")] if "none" in allowed else []
        if stage > 0 and "cpu" in allowed:
            options.append(("cpu", "none"))
        if stage == 3:
            options += [o for o in [("cpu", "cpu"), ("nvme", "none"), ("nvme", "nvme")]
                        if o[0] in allowed and o[1] in allowed | {"none"}]
        offloads[stage] = options
    training = run.training
    # (checkpointing, blocks, activation offload): offload is a tier after checkpointing every block
    offload_acts = {"auto": [False, True] if "cpu" in allowed else [False], True: [True], False: [False]}[
        training.activation_offload]
    if training.checkpoint_blocks is not None:
        checkpointing = [(True, training.checkpoint_blocks, False)]
    elif training.gradient_checkpointing == "auto":
        # activation_offload=true asks for the offload, which needs every block checkpointed
        none = [] if training.activation_offload is True else [(False, None, False)]
        checkpointing = [*none, *((True, None, act) for act in offload_acts)]
    elif training.gradient_checkpointing:
        checkpointing = [(True, None, act) for act in offload_acts]
    else:
        checkpointing = [(False, None, False)]
    if training.micro_batch_size == "auto":
        micros = [m for m in range(1, min(per_rank_batch, run.planner.max_micro_batch) + 1) if per_rank_batch % m == 0]
    else:
        micros = [training.micro_batch_size]
    names = run.planner.optimizers if run.optimizer.name == "auto" else [run.optimizer.name]
    # ZeRO++ splits ZeRO-3's traffic between the node and the network: several nodes only.
    zeropp = run.planner.zeropp if hw.nodes > 1 and hw.gpus_per_node > 1 else ["none"]
    return [
        Layout(stage, opt, param, gc, micro, per_rank_batch // micro, blocks, optimizer, plus, act)
        for stage, options in offloads.items() for opt, param in options
        for gc, blocks, act in checkpointing for micro in micros
        # bf16 masters need ZeRO 1-3; the client optimizers step on the GPU (zerotrain/optimizers.py)
        for optimizer in names if (stage > 0 or not optimizers.get(optimizer).needs_zero)
        and (opt == "none" or not optimizers.get(optimizer).client)
        for plus in (zeropp if stage == 3 else ["none"])
    ]


def recomputed_fraction(layout: Layout, facts: ModelFacts) -> float:
    """The share of the blocks whose forward runs again in backward."""
    if not layout.gradient_checkpointing:
        return 0.0
    if layout.checkpointed_blocks is None or not facts.checkpoint_blocks:
        return 1.0
    return min(1.0, layout.checkpointed_blocks / facts.checkpoint_blocks)


def activations(layout: Layout, facts: ModelFacts):
    return facts.activations(layout.gradient_checkpointing, layout.checkpointed_blocks, layout.offload_activations)


def fetches(layout: Layout, facts: ModelFacts, persistence_threshold: int) -> float:
    """Module fetches per optimizer step at ZeRO-3: each module holding a parameter above the
    persistence threshold is fetched in forward, backward and recomputation, every micro-step.
    Parameter offload fetches the same modules (from the host), so one count serves both."""
    passes = 2 + recomputed_fraction(layout, facts)
    return facts.fetched_modules(persistence_threshold) * passes * layout.accumulation


def step_time(layout: Layout, facts: ModelFacts, hw: HardwareFacts, s: Sizes, run: RunConfig) -> dict[str, float]:
    """Seconds per optimizer step, by term."""
    samples = layout.micro_batch * layout.accumulation
    compute = activations(layout, facts).flops * samples / (
        hw.peak_bf16_flops * run.planner.assumed_mfu)
    n = hw.world_size
    ring = (n - 1) / n
    # A ring collective moves (N-1)/N of the buffer per GPU; across nodes each GPU's share of
    # the node's network link bounds it.
    bandwidth = hw.intra_node_bandwidth if hw.nodes == 1 else min(
        hw.intra_node_bandwidth, hw.inter_node_bandwidth / hw.gpus_per_node)
    grads = LP * s.trainable_params
    shardable = grads + (s.frozen_bytes if s.frozen_shardable else 0)
    local = 0.0  # bytes of collectives within one node (ZeRO++'s), at the node's bandwidth
    if layout.stage <= 1:
        traffic = 2 * ring * grads  # one all-reduce at the accumulation boundary
    elif layout.stage == 2:
        traffic = ring * grads * layout.accumulation  # reduce-scatter every micro-step
    elif layout.zeropp == "none":
        gathers = 2 + recomputed_fraction(layout, facts)  # forward, backward, recompute
        traffic = ring * (gathers * shardable + grads) * layout.accumulation
    else:
        # ZeRO++ (arXiv 2306.10209): the forward gather spans the nodes (int8 with qwZ, half the
        # bytes); backward and recompute gather the secondary partition within the node (hpZ);
        # gradients reduce within the node, then across nodes (int4 with qgZ, a quarter).
        quantized = layout.zeropp == "hpz-qwz-qgz"
        g = hw.gpus_per_node
        traffic = ring * ((0.5 if quantized else 1.0) * shardable + (0.25 if quantized else 1.0) * grads)
        local = (g - 1) / g * ((1 + recomputed_fraction(layout, facts)) * shardable + grads)
        traffic, local = traffic * layout.accumulation, local * layout.accumulation
    if layout.stage in (1, 2):
        traffic += ring * grads  # all-gather of the updated partitions
    if hw.nodes > 1:
        terms = {"compute": compute, "communication (inter-node)": traffic / bandwidth,
                 "communication (intra-node)": local / hw.intra_node_bandwidth}
    else:
        terms = {"compute": compute, "communication": traffic / bandwidth if n > 1 else 0.0}
    per_rank = s.trainable_params / n
    if layout.offload_optimizer == "none":
        # the optimizer step on the GPU, bound by memory bandwidth (optimizers.Optimizer.step_bytes)
        stepped = s.trainable_params / (1 if layout.stage == 0 else n)
        terms["optimizer step"] = optimizers.get(layout.optimizer).step_bytes * stepped / hw.memory_bandwidth
    else:
        # gradients down every micro-step, updated bf16 parameters up once per step
        terms["offload transfers"] = LP * per_rank * (layout.accumulation + 1) / hw.host_to_device_bandwidth
        terms["cpu adam"] = per_rank * hw.gpus_per_node / run.planner.cpu_adam_params_per_second
    if layout.offload_activations:
        # each offloaded input down in forward and up for its recomputation, not overlapped
        moved = sum(facts.offload_input_bytes) * layout.micro_batch * layout.accumulation
        terms["activation transfers"] = 2 * moved / hw.host_to_device_bandwidth
    if layout.stage == 3:
        threshold = run.planner.stage3_param_persistence_threshold
        terms["parameter fetches"] = fetches(layout, facts, threshold) * run.planner.stage3_fetch_latency
    if layout.offload_param != "none":
        moves = 2 + recomputed_fraction(layout, facts)
        terms["param transfers"] = moves * shardable / n * layout.accumulation / hw.host_to_device_bandwidth
    swapped = 0.0
    if layout.offload_optimizer == "nvme":
        swapped += 2 * (2 * master_element(layout) + moment_bytes(layout)) * per_rank  # read, write back
    if layout.offload_param == "nvme":
        swapped += 2 * shardable / n * layout.accumulation
    if swapped:
        terms["nvme"] = swapped * hw.gpus_per_node / run.planner.nvme_bandwidth
    return terms


def budgets(hw: HardwareFacts, run: RunConfig) -> tuple[int, int, int | None]:
    headroom = 1 - run.planner.headroom
    gpu = hw.gpu_memory_bytes if hw.gpu_free_bytes is None else min(hw.gpu_memory_bytes, hw.gpu_free_bytes)
    nvme = None if hw.nvme_free_bytes is None else int(hw.nvme_free_bytes * headroom)
    return int(gpu * headroom), int(hw.host_memory_bytes * headroom), nvme


def uncheckpointed_bytes(layout: Layout, facts: ModelFacts) -> int:
    """The activations a layout keeps because some blocks are not checkpointed: its peak above
    checkpointing every block, per micro-batch (0 when every block is checkpointed)."""
    if layout.gradient_checkpointing and (layout.checkpointed_blocks is None
                                          or layout.checkpointed_blocks >= facts.checkpoint_blocks):
        return 0
    kept = activations(layout, facts).peak_bytes - facts.activations(True).peak_bytes
    return max(kept, 0) * layout.micro_batch


def activation_margin(layout: Layout, facts: ModelFacts, run: RunConfig) -> int:
    """What a layout must leave free beyond its prediction: planner.activation_margin of the
    activations of its uncheckpointed blocks. Traced activations of checkpointed blocks matched
    published peaks within 3%; those of uncheckpointed blocks came out low by up to 30%."""
    return math.ceil(run.planner.activation_margin * uncheckpointed_bytes(layout, facts))


def pointless_zero3(layout: Layout, hw: HardwareFacts, run: RunConfig) -> bool:
    """ZeRO-3 on one GPU without its parameters offloaded, where the search has other stages: its partition is the
    whole tensor (one H200: 2.75 GB allocated at ZeRO-3 against 2.36 GB at ZeRO-0, 8x the step's time). evaluate
    rejects it rather than leave it out, so that calibrate still measures it (its fetch latency); no memory makes it
    worth suggesting."""
    return layout.stage == 3 and layout.offload_param == "none" and hw.world_size == 1 and set(run.planner.stages) != {3}


def evaluate(layout: Layout, facts: ModelFacts, hw: HardwareFacts, run: RunConfig) -> Candidate:
    s = sizes_from(facts, hw, run)
    acts = activations(layout, facts)
    memory = estimate(layout, s, buffers_from(run), acts.peak_bytes * layout.micro_batch,
                      facts.input_bytes * layout.micro_batch)
    gpu_budget, host_budget, nvme_budget = budgets(hw, run)
    margin = activation_margin(layout, facts, run)
    rejected = None
    if memory.device_total + margin > gpu_budget:
        rejected = f"needs {gib(memory.device_total)} per GPU" + (
            f" + {gib(margin)} activation margin" if margin else "") + f" > {gib(gpu_budget)} budget"
    elif memory.host_per_node > host_budget:
        rejected = f"needs {gib(memory.host_per_node)} host RAM per node > {gib(host_budget)}"
    elif memory.nvme_per_node and (nvme_budget is None or memory.nvme_per_node > nvme_budget):
        rejected = f"needs {gib(memory.nvme_per_node)} NVMe per node > {gib(nvme_budget or 0)}"
    elif pointless_zero3(layout, hw, run):
        rejected = ("one GPU: ZeRO-3 without its parameters offloaded saves nothing over ZeRO 0-2 (its partition is "
                    "the whole tensor) and adds a fetch per module; planner.stages: [3] alone allows it")
    terms = step_time(layout, facts, hw, s, run)
    seconds = sum(terms.values())
    images = layout.micro_batch * layout.accumulation * hw.world_size / seconds
    return Candidate(layout, memory, rejected is None, rejected, seconds, images, terms, margin)


def check_batch(run: RunConfig, hw: HardwareFacts) -> int:
    """The batch invariant global = micro x accumulation x world, checked in one place.
    Returns the images each rank processes per step."""
    global_batch, world = run.training.global_batch_size, hw.world_size
    if global_batch % world:
        raise ZerotrainError(
            f"training.global_batch_size={global_batch} is not divisible by the world size {world} "
            f"({hw.nodes} node(s) x {hw.gpus_per_node} GPUs); use a multiple of {world}, e.g. "
            f"{max(world, global_batch // world * world)}"
        )
    per_rank = global_batch // world
    micro = run.training.micro_batch_size
    if micro != "auto" and per_rank % micro:
        raise ZerotrainError(
            f"training.micro_batch_size={micro} does not divide the {per_rank} images per GPU "
            f"(global {global_batch} / {world} GPUs); choose a divisor of {per_rank}, or auto"
        )
    return per_rank


def check_blocks(run: RunConfig, facts: ModelFacts) -> None:
    """training.checkpoint_blocks and activation_offload against the model's checkpointable blocks."""
    blocks, training = run.training.checkpoint_blocks, run.training
    if training.activation_offload is True:
        if training.gradient_checkpointing is False or blocks is not None:
            raise ZerotrainError("training.activation_offload=true offloads the inputs of every checkpointed block: it "
                                 "needs gradient_checkpointing auto or true and no checkpoint_blocks")
        if not facts.offload_input_bytes:
            raise ZerotrainError(f"training.activation_offload=true: {facts.model}'s checkpointed blocks take no input "
                                 "large enough to offload (1 MiB or more); set it to auto or false")
    if blocks is None:
        return
    if run.training.gradient_checkpointing is False:
        raise ZerotrainError(f"training.checkpoint_blocks={blocks} asks for checkpointing while "
                             "training.gradient_checkpointing is false; set it to auto or true, or drop checkpoint_blocks")
    if blocks > facts.checkpoint_blocks:
        raise ZerotrainError(f"training.checkpoint_blocks={blocks}: {facts.model} has {facts.checkpoint_blocks} blocks "
                             f"that checkpointing can choose from; use at most {facts.checkpoint_blocks}")


def partial_checkpointing(candidates: list[Candidate], facts: ModelFacts, hw: HardwareFacts,
                          run: RunConfig) -> list[Candidate]:
    """Where checkpointing every block fits and checkpointing none does not: the layout with the
    fewest blocks checkpointed that fits (the first k of facts.checkpoint_order(), the blocks that
    free the most activation memory per recomputed FLOP). Memory falls and time rises with k, so
    the fewest that fit are the fastest; a bisection finds them."""
    n = facts.checkpoint_blocks
    if n < 2 or run.training.gradient_checkpointing != "auto" or run.training.checkpoint_blocks is not None:
        return []
    by_layout = {c.layout: c for c in candidates}
    found = []
    for c in candidates:
        layout = c.layout
        if not (c.fits and layout.gradient_checkpointing and layout.checkpointed_blocks is None) \
                or layout.offload_activations:
            continue
        plain = by_layout.get(dataclasses.replace(layout, gradient_checkpointing=False))
        if plain is None or plain.fits:
            continue
        low, high, best = 1, n, None
        while low < high:
            middle = (low + high) // 2
            trial = evaluate(dataclasses.replace(layout, checkpointed_blocks=middle), facts, hw, run)
            if trial.fits:
                high, best = middle, trial
            else:
                low = middle + 1
        if best is not None:
            found.append(best)
    return found


# Candidates this close in predicted speed count as equally fast when choosing an optimizer: the
# step-time model is not finer than a few percent, and an optimizer's numerics are worth more.
OPTIMIZER_TIE = 0.05


def optimizer_preference(run: RunConfig) -> dict[str, int]:
    return {name: index for index, name in enumerate(run.planner.optimizers)}


def optimizer_reason(p: Plan, run: RunConfig) -> str | None:
    """Why the chosen optimizer is not the first of planner.optimizers (optimizer.name auto)."""
    chosen = p.chosen.layout.optimizer
    rank = optimizer_preference(run)
    if run.optimizer.name != "auto" or rank.get(chosen, 0) == 0:
        return None
    preferred = [c for c in p.candidates if rank.get(c.layout.optimizer, 0) < rank[chosen]]
    names = "/".join(sorted({c.layout.optimizer for c in preferred}, key=rank.__getitem__))
    fitting = [c for c in preferred if c.fits]
    if fitting:
        best = max(fitting, key=lambda c: c.images_per_second)
        return (f"Optimizer {chosen}: {p.chosen.images_per_second / best.images_per_second - 1:.0%} faster than the "
                f"fastest fitting {best.layout.optimizer} candidate, {describe(best.layout)} "
                f"({best.images_per_second:.2f} images/s); it changes numerics (optimizer.name)")
    smallest = min(preferred, key=lambda c: c.memory.device_total) if preferred else None
    why = f": the smallest, {describe(smallest.layout)}, {smallest.rejected}" if smallest else ""
    return f"Optimizer {chosen}: no {names or 'other'} candidate fits{why}"


def plan(facts: ModelFacts, hw: HardwareFacts, run: RunConfig, margin_measured_on: str | None = None) -> Plan:
    """All candidates, the fastest one that fits, and the reasons, in words. margin_measured_on:
    the device and lane on which a calibration measured planner.activation_margin (None: the default)."""
    per_rank = check_batch(run, hw)
    check_blocks(run, facts)
    candidates = [evaluate(layout, facts, hw, run) for layout in layouts(run, hw, per_rank)
                  if facts.offload_input_bytes or not layout.offload_activations]
    if not candidates:
        listed = {key: "[" + ",".join(str(v) for v in values) + "]"
                  for key, values in (("stages", run.planner.stages), ("offload", run.planner.offload))}
        compiled = "; training.compile=true leaves out ZeRO-3" if run.training.compile is True else ""
        raise ZerotrainError(
            f"planner.stages={listed['stages']} with planner.offload={listed['offload']} and "
            f"optimizer.name={run.optimizer.name} leave no layout to plan (ZeRO-0 offloads nothing and trains adamw "
            f"only{compiled}); allow more planner.stages or planner.offload targets")
    candidates += partial_checkpointing(candidates, facts, hw, run)
    preference = optimizer_preference(run)
    candidates.sort(key=lambda c: (not c.fits, -c.images_per_second, preference.get(c.layout.optimizer, 0),
                                   c.memory.device_total))
    fitting = [c for c in candidates if c.fits]
    # Among the candidates within OPTIMIZER_TIE of the fastest: the optimizer listed first in
    # planner.optimizers (fp32 AdamW's numerics first), then the fastest, then the smaller memory.
    band = [c for c in fitting if c.images_per_second >= fitting[0].images_per_second * (1 - OPTIMIZER_TIE)]
    chosen = min(band, key=lambda c: (preference.get(c.layout.optimizer, 0), -c.images_per_second,
                                      c.memory.device_total)) if band else None
    gpu_budget, host_budget, nvme_budget = budgets(hw, run)
    result = Plan(
        model=facts.model, resolution=facts.resolution, mode=facts.mode, quantize=facts.quantize,
        hardware=hw.describe(), world_size=hw.world_size, gpus_per_node=hw.gpus_per_node, nodes=hw.nodes,
        global_batch=run.training.global_batch_size, gpu_budget_bytes=gpu_budget,
        host_budget_bytes=host_budget, nvme_budget_bytes=nvme_budget, chosen=chosen,
        candidates=candidates, reasons=[], flops_per_sample=facts.model_flops_per_sample,
        checkpoint_order=facts.checkpoint_order(), margin_measured_on=margin_measured_on,
    )
    result.reasons = reasons(result, facts, run)
    return result


def reasons(p: Plan, facts: ModelFacts, run: RunConfig) -> list[str]:
    what = "full fine-tune" if facts.mode == "full" else f"LoRA rank {facts.lora_rank}"
    if facts.quantize != "none":
        what += f" over a {facts.quantize} base"
    frozen = f"; frozen weights {gib(facts.frozen_bytes)}" if facts.frozen_params else ""
    lines = [
        f"{facts.model} {what}: {count(facts.trainable_params)} trainable of {count(facts.total_params)} parameters{frozen}",
        (f"Activations per image at {facts.resolution}px ({facts.image_tokens} image + "
        f"{f'{facts.reference_tokens} reference + ' if facts.reference_tokens else ''}{facts.text_tokens} text "
        f"tokens), traced with flash-attention accounting: peak {gib(facts.no_checkpointing.peak_bytes)} "
        f"without checkpointing, {gib(facts.checkpointing.peak_bytes)} with"),
        (f"Budget per GPU {gib(p.gpu_budget_bytes)} ({run.planner.headroom:.0%} headroom); includes CUDA context "
        f"{gib(run.planner.cuda_context_bytes)}, NCCL {gib(run.planner.nccl_workspace_bytes)} and "
        f"{run.planner.fragmentation:.0%} allocator fragmentation"),
        margin_reason(p, run),
    ]
    if run.training.compile is True and 3 in run.planner.stages:
        lines.append("training.compile=true: ZeRO-3 is left out, since its parameter hooks would split every compiled "
                     "block into pieces")
    if facts.quantize != "none" and 3 in run.planner.stages:
        lines.append("ZeRO-3 cannot shard the quantized base: it stays whole on every GPU; only LoRA is partitioned")
    fitting = [c for c in p.candidates if c.fits]
    if p.chosen is None:
        best = min(p.candidates, key=lambda c: c.memory.device_total)
        lines.append(f"Nothing fits: the smallest candidate, {describe(best.layout)}, {best.rejected}")
        return lines
    c = p.chosen
    lines.append(
        f"Chosen: {describe(c.layout)}: the fastest of {len(fitting)} fitting candidates"
        f"{'' if c is fitting[0] else f' within {OPTIMIZER_TIE:.0%} (planner.optimizers: preferred numerics)'} "
        f"({c.images_per_second:.2f} images/s predicted at {run.planner.assumed_mfu:.0%} MFU), "
        f"{gib(c.memory.device_total)} per GPU at its peak phase ({c.memory.peak_phase})"
    )
    optimizer = optimizer_reason(p, run)
    if optimizer:
        lines.append(optimizer)
    if not c.layout.gradient_checkpointing:
        lines.append("No gradient checkpointing: the activations fit, so no time is spent recomputing them")
    elif c.layout.checkpointed_blocks is not None and c.layout.checkpointed_blocks < facts.checkpoint_blocks:
        lines.append(partial_reason(c, p.candidates, facts))
    elif c.layout.offload_activations:
        lines.append(offload_reason(c, p.candidates, facts))
    else:
        faster = [x for x in p.candidates if not x.layout.gradient_checkpointing and x.layout.stage == c.layout.stage]
        if faster and not any(x.fits for x in faster):
            smallest = min(faster, key=lambda x: x.memory.device_total)
            lines.append(f"Gradient checkpointing is needed: without it, even at micro-batch "
                         f"{smallest.layout.micro_batch}, it {smallest.rejected}")
    lower = [x for x in p.candidates if x.layout.stage < c.layout.stage and not x.fits]
    if lower:
        x = min(lower, key=lambda x: x.memory.device_total)
        lines.append(f"Lower stages do not fit: {describe(x.layout)} {x.rejected}")
    return lines


def margin_reason(p: Plan, run: RunConfig) -> str:
    """What the activation estimate rests on, and the margin kept for it."""
    share = run.planner.activation_margin
    if p.margin_measured_on:
        return (f"Activation margin {share:.0%} of the activations of uncheckpointed blocks, measured on "
                f"{p.margin_measured_on} (zerotrain calibrate)")
    if share == 0:
        return ("Activations traced, not yet measured on this GPU in this plan's lane; planner.activation_margin=0 "
                "trusts the trace as it is")
    return (f"Activations traced, not yet measured on this GPU in this plan's lane: a layout that keeps blocks "
            f"uncheckpointed also leaves {share:.0%} of their activations free (planner.activation_margin; "
            "zerotrain calibrate measures it)")


def offload_reason(c: Candidate, candidates: list[Candidate], facts: ModelFacts) -> str:
    """Why the chosen layout offloads activations: what moves, what it costs, and the layout
    without it."""
    moved = sum(facts.offload_input_bytes) * c.layout.micro_batch
    line = (f"Activation offload: the inputs of every checkpointed block ({len(facts.offload_input_bytes)} tensors, "
            f"{gib(moved)} per micro-batch) wait in pinned host memory, {c.time_terms['activation transfers']:.2f} "
            f"s/step of transfers")
    kept = {x.layout: x for x in candidates}.get(dataclasses.replace(c.layout, offload_activations=False))
    if kept is not None:
        line += (f"; kept on the GPU, this layout {kept.rejected}" if not kept.fits else
                 f"; kept on the GPU it predicts {kept.step_seconds:.2f} s/step, this {c.step_seconds:.2f}")
    return line


def partial_reason(c: Candidate, candidates: list[Candidate], facts: ModelFacts) -> str:
    """Why the chosen layout checkpoints only some blocks, with the step times on either side."""
    k, n = c.layout.checkpointed_blocks, facts.checkpoint_blocks
    alike = {x.layout: x for x in candidates}
    none = alike.get(dataclasses.replace(c.layout, gradient_checkpointing=False, checkpointed_blocks=None))
    every = alike.get(dataclasses.replace(c.layout, checkpointed_blocks=None))
    first = facts.checkpoint_units[0]
    kind = first.names[0].rsplit(".", 1)[0]
    line = (f"Checkpointing {k} of {n} blocks, the fewest that fit, {kind} first (each frees "
            f"{gib(first.freed_bytes * c.layout.micro_batch)} per micro-batch for "
            f"{first.recompute_flops / 1e12:.2f} TFLOP per image recomputed, the most per FLOP): predicted "
            f"{c.step_seconds:.2f} s/step")
    if none is not None and every is not None:
        line += (f", between {none.step_seconds:.2f} without checkpointing (which {none.rejected}) and "
                 f"{every.step_seconds:.2f} with every block checkpointed")
    return line


def describe(layout: Layout) -> str:
    gc = "checkpointing" if layout.gradient_checkpointing else "no checkpointing"
    if layout.gradient_checkpointing and layout.checkpointed_blocks is not None:
        gc = f"checkpointing {layout.checkpointed_blocks} block{'' if layout.checkpointed_blocks == 1 else 's'}"
    if layout.bf16_masters:  # fp32 AdamW, the default, goes unnamed
        gc = f"{layout.optimizer}, {gc}"
    if layout.offload_activations:
        gc = f"{gc} with activations offloaded to the CPU"
    if layout.zeropp != "none":
        gc = f"ZeRO++ {layout.zeropp}, {gc}"
    return f"{layout.label()}, {gc}, micro-batch {layout.micro_batch} x accumulation {layout.accumulation}"


def suggest_more_gpus(facts: ModelFacts, hw: HardwareFacts, run: RunConfig) -> str | None:
    """The smallest multiple of the node count (up to 64 nodes) on which something fits. The global
    batch becomes the nearest multiple of the world size (times a fixed training.micro_batch_size)
    at or below the configured one, at least one step of it; a node count the config cannot
    plan for is skipped."""
    for nodes in range(hw.nodes + 1, 65):
        batch = fits_on(facts, dataclasses.replace(hw, nodes=nodes), run)
        if batch:
            return f"{nodes} nodes of {hw.gpus_per_node} GPU{'s' if hw.gpus_per_node > 1 else ''} (global batch {batch})"
    return None


def suggest_gpus_per_node(facts: ModelFacts, hw: HardwareFacts, run: RunConfig) -> str | None:
    """The fewest GPUs per node (2, 4 or 8, more than now) with which something fits on the same
    number of nodes: a bigger machine rather than more of them."""
    for per_node in (n for n in (2, 4, 8) if n > hw.gpus_per_node):
        batch = fits_on(facts, dataclasses.replace(hw, gpus_per_node=per_node), run)
        if batch:
            return f"--gpus {per_node}x{hw.gpu_name} (global batch {batch})"
    return None


def fits_on(facts: ModelFacts, bigger: HardwareFacts, run: RunConfig) -> int | None:
    """The global batch with which something fits on `bigger` (the nearest multiple of its world
    size, times a fixed micro-batch, at or below the configured one), or None."""
    micro = run.training.micro_batch_size
    step = bigger.world_size * (1 if micro == "auto" else micro)
    batch = max(run.training.global_batch_size // step, 1) * step
    trial = run.model_copy(update={"training": run.training.model_copy(update={"global_batch_size": batch})})
    try:
        result = plan(facts, bigger, trial)
    except ZerotrainError:
        return None
    return batch if result.chosen else None


def suggest_host_memory(facts: ModelFacts, hw: HardwareFacts, run: RunConfig) -> str | None:
    """The host RAM per node that the thriftiest layout fitting the GPUs (and NVMe) needs, when the
    node has less: offloading trades GPU memory for host RAM, so a plan can fail on the host alone."""
    gpu_budget, _, nvme_budget = budgets(hw, run)
    hosts = [c.memory.host_per_node for c in (evaluate(layout, facts, hw, run)
                                              for layout in layouts(run, hw, check_batch(run, hw))
                                              if not pointless_zero3(layout, hw, run))
             if c.memory.device_total <= gpu_budget
             and (not c.memory.nvme_per_node or (nvme_budget is not None and c.memory.nvme_per_node <= nvme_budget))]
    if not hosts:
        return None
    needed = min(hosts) / (1 - run.planner.headroom)
    if needed <= hw.host_memory_bytes:
        return None
    return f"host RAM of at least {gib(needed)} per node: --host-memory {math.ceil(needed / 2**30)}GiB"


def suggest_gpu_memory(facts: ModelFacts, hw: HardwareFacts, run: RunConfig) -> str | None:
    smallest = min(evaluate(layout, facts, hw, run).memory.device_total
                   for layout in layouts(run, hw, check_batch(run, hw)) if not pointless_zero3(layout, hw, run))
    needed = smallest / (1 - run.planner.headroom)
    # Rounded up to the 0.1 GiB it is printed with: a GPU of the printed size must fit it.
    return f"GPUs with at least {math.ceil(needed / 2**30 * 10) / 10:.1f} GiB each" if needed > hw.gpu_memory_bytes \
        else None
