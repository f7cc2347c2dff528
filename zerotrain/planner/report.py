"""How a plan is shown to a person (rich tables), and what to try when nothing fits."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from zerotrain import optimizers
from zerotrain.config.sections import Mode, Quantization, RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import HardwareFacts
from zerotrain.planner.facts import ModelFacts
from zerotrain.planner.measure import measure_model
from zerotrain.planner.search import (
    Candidate,
    Plan,
    describe,
    plan,
    suggest_gpu_memory,
    suggest_gpus_per_node,
    suggest_host_memory,
    suggest_more_gpus,
)
from zerotrain.protocols import ModelSpec
from zerotrain.units import gib

# Largest terms shown inline per candidate row.
TOP_TERMS = 3


def model_document(spec: ModelSpec, facts: ModelFacts, calibration: str | None) -> dict:
    """What a plan planned for (`zerotrain plan --json`'s "model"): the denoiser's exact parameter counts, its
    name and family, where a fine-tuned denoiser over the pipeline comes from (model.denoiser; null: the
    pipeline's own), the tokens of one sample, where the facts came from, and the calibration used."""
    return {
        "name": spec.name, "family": spec.family, "class": spec.class_name, "denoiser": spec.denoiser,
        "total_params": facts.total_params, "trainable_params": facts.trainable_params,
        "frozen_params": facts.frozen_params,
        "image_tokens": facts.image_tokens, "text_tokens": facts.text_tokens, "reference_tokens": facts.reference_tokens,
        "facts_source": facts.source, "calibration": calibration,
    }


def best_per_layout(candidates: list[Candidate]) -> list[Candidate]:
    """One row per (stage, offload, checkpointed blocks, optimizer): its fastest fitting micro-batch, or its
    smallest one when none fits."""
    best: dict[tuple, Candidate] = {}
    for c in candidates:
        key = (c.layout.stage, c.layout.offload_optimizer, c.layout.offload_param, c.layout.gradient_checkpointing,
               c.layout.checkpointed_blocks, c.layout.optimizer, c.layout.zeropp, c.layout.offload_activations)
        current = best.get(key)
        rank = (c.fits, c.images_per_second if c.fits else -c.memory.device_total)
        if current is None or rank > (current.fits, current.images_per_second if current.fits
                                      else -current.memory.device_total):
            best[key] = c
    return sorted(best.values(), key=lambda c: (not c.fits, -c.images_per_second, c.memory.device_total))


def checkpointed(c: Candidate, facts: ModelFacts) -> str:
    """The ckpt column: no, all, or k/N blocks."""
    if not c.layout.gradient_checkpointing:
        return "no"
    blocks = c.layout.checkpointed_blocks
    return "all" if blocks is None or blocks >= facts.checkpoint_blocks else f"{blocks}/{facts.checkpoint_blocks}"


def print_plan(p: Plan, facts: ModelFacts, show_all: bool = False, seconds: float = 0.0,
               console: Console | None = None) -> None:
    console = console or Console(soft_wrap=False, width=160)
    title = (f"{p.model} at {p.resolution}px, {p.mode}"
             f"{'' if p.quantize == 'none' else ' over ' + p.quantize}, global batch {p.global_batch} "
             f"on {p.hardware}")
    table = Table(title=title, title_justify="left")
    for column in ("", "ZeRO / offload", "ZeRO++", "optimizer", "ckpt", "micro x accum", "GiB/GPU", "largest terms", "host GiB/node",
                   "images/s", "verdict"):
        table.add_column(column, justify="right" if column in ("GiB/GPU", "host GiB/node", "images/s") else "left")
    rows = p.candidates if show_all else best_per_layout(p.candidates)
    for c in rows:
        terms = sorted(c.memory.terms.items(), key=lambda kv: -kv[1])[:TOP_TERMS]
        table.add_row(
            "*" if c is p.chosen else "", c.layout.label(), c.layout.zeropp, c.layout.optimizer,
            checkpointed(c, facts),
            f"{c.layout.micro_batch} x {c.layout.accumulation}", f"{c.memory.device_total / 2**30:.1f}",
            ", ".join(f"{k} {v / 2**30:.1f}" for k, v in terms), f"{c.memory.host_per_node / 2**30:.0f}",
            f"{c.images_per_second:.2f}", "fits" if c.fits else c.rejected or "",
            style="bold green" if c is p.chosen else ("dim" if not c.fits else None),
        )
    console.print(table)
    shown = "" if show_all else f" (best micro-batch per layout; --all lists all {len(p.candidates)})"
    console.print(f"{len(p.candidates)} candidates evaluated{shown}; facts "
                  f"{'from cache' if facts.cached else f'measured in {facts.trace_seconds:.1f} s'}; "
                  f"plan in {seconds:.1f} s")
    if p.chosen is not None:
        breakdown = Table(title=f"Chosen: per-GPU memory at its peak phase ({p.chosen.memory.peak_phase})",
                          title_justify="left")
        breakdown.add_column("term")
        breakdown.add_column("GiB", justify="right")
        for name, value in sorted(p.chosen.memory.terms.items(), key=lambda kv: -kv[1]):
            breakdown.add_row(name, f"{value / 2**30:.2f}")
        m = p.chosen.memory
        breakdown.add_row("allocated", f"{m.allocated / 2**30:.2f}", style="bold")
        breakdown.add_row("reserved (with fragmentation)", f"{m.reserved / 2**30:.2f}")
        breakdown.add_row("device total (+ CUDA context, NCCL)", f"{m.device_total / 2**30:.2f}", style="bold")
        if p.chosen.margin_bytes:
            breakdown.add_row("kept free: activation margin", f"{p.chosen.margin_bytes / 2**30:.2f}")
        console.print(breakdown)
        console.print("Phases: " + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in m.phases.items()) + " GiB allocated")
        if m.host_buffers:
            console.print(f"Host RAM per node: {m.host_per_node / 2**30:.1f} GiB at its peak ("
                          + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in m.host_terms.items())
                          + "); the offload's buffers: "
                          + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in
                                      sorted(m.host_buffers.items(), key=lambda kv: -kv[1]) if v) + " GiB",
                          highlight=False)
    console.print("Reasons:")
    for line in p.reasons:
        console.print(f"  - {line}", highlight=False)
    if p.suggestions:
        console.print("What would make it fit:")
        for line in p.suggestions:
            console.print(f"  - {line}", highlight=False)


def _fits_with(spec: ModelSpec, hw: HardwareFacts, run: RunConfig, overrides: dict) -> Plan | None:
    """Plan again with some config sections changed; None if the change is itself invalid."""
    data = run.model_dump(mode="json")
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        data[section][key] = value
    try:
        trial = RunConfig.model_validate(data)
        result = plan(measure_model(spec, trial), hw, trial)
    except (ZerotrainError, ValueError):
        return None
    return result if result.chosen else None


def base_choices(spec: ModelSpec, facts: ModelFacts, hw: HardwareFacts, run: RunConfig, result: Plan) -> list[str]:
    """LoRA on a big model: the frozen base streamed by ZeRO-3 (DeepSpeed's parameter offload) weighed
    against a quantized base, each alternative planned again with its own facts; only where the
    choice is live (the plan streams the base, or the base is quantized). Quantizing changes the
    model's forward, so it stays the config's choice (training.quantize_base): the plan states the
    trade."""
    c = result.chosen
    if run.training.mode is not Mode.lora or c is None:
        return []
    streams = c.layout.offload_param != "none" and facts.quantize == Quantization.none.value
    if not streams and run.training.quantize_base is Quantization.none:
        return []
    lines = []
    if streams:
        transfers = c.time_terms.get("param transfers", 0.0) + c.time_terms.get("nvme", 0.0)
        lines.append(f"Streams the frozen base: ZeRO-3 param->{c.layout.offload_param} keeps its {gib(facts.frozen_bytes)} "
                     f"in host memory and moves it to the GPU in every forward, backward and recomputation: "
                     f"{transfers:.2f} of the {c.step_seconds:.2f} s/step")
    options = []
    for scheme in ("none", "qint8", "qint4"):
        if scheme == run.training.quantize_base.value:
            continue
        trial = _fits_with(spec, hw, run, {"training.quantize_base": scheme})
        what = "unquantized" if scheme == "none" else f"{scheme} (training.quantize_base={scheme})"
        if trial is None:
            options.append(f"{what} does not fit")
            continue
        t = trial.chosen
        how = ", streamed" if t.layout.offload_param != "none" and scheme == "none" else ""
        options.append(f"{what}{how}: {describe(t.layout)}, {t.step_seconds:.2f} s/step")
    lines.append(f"The base, weighed (quantizing changes the model's forward, so training.quantize_base decides): "
                 f"this plan {c.step_seconds:.2f} s/step; " + "; ".join(options) + ". Streaming and quantization do not "
                 "combine: a quantized base stays outside DeepSpeed, which partitions and offloads only the adapters")
    return lines


def suggest_optimizer(spec: ModelSpec, hw: HardwareFacts, run: RunConfig) -> str | None:
    """The first optimizer, in planner.optimizers' default order, that needs less memory than those
    the plan tried and with which something fits; it changes numerics, so the line says how."""
    tried = list(run.planner.optimizers) if run.optimizer.name == "auto" else [run.optimizer.name]
    least = min(optimizers.get(name).training_bytes_per_param() for name in tried)
    for name, kind in optimizers.OPTIMIZERS.items():
        if name in tried or kind.training_bytes_per_param() >= least:
            continue
        if _fits_with(spec, hw, run, {"optimizer.name": name}):
            return f"a lower-memory optimizer ({kind.numerics}): --set optimizer.name={name}"
    return None


def suggestions(spec: ModelSpec, facts: ModelFacts, hw: HardwareFacts, run: RunConfig) -> list[str]:
    """Concrete changes that would make the job fit, each checked by planning again."""
    found = []
    bigger = suggest_gpus_per_node(facts, hw, run)
    if bigger:
        found.append(f"more GPUs in a node: {bigger}")
    more = suggest_more_gpus(facts, hw, run)
    if more:
        found.append(f"more nodes: {more}")
    for memory in (suggest_gpu_memory(facts, hw, run), suggest_host_memory(facts, hw, run)):
        if memory:
            found.append(memory)
    if "cpu" not in run.planner.offload and _fits_with(spec, hw, run, {"planner.offload": ["none", "cpu", "nvme"]}):
        found.append("allow CPU offload: --set 'planner.offload=[none,cpu]'")
    training = run.training
    if training.gradient_checkpointing is False and _fits_with(spec, hw, run, {"training.gradient_checkpointing": "auto"}):
        found.append("gradient checkpointing where needed: --set training.gradient_checkpointing=auto")
    if training.checkpoint_blocks is not None and _fits_with(spec, hw, run, {"training.checkpoint_blocks": None}):
        found.append("let the planner choose the checkpointed blocks: drop training.checkpoint_blocks")
    if training.activation_offload is False and "cpu" in run.planner.offload and \
            _fits_with(spec, hw, run, {"training.activation_offload": "auto"}):
        found.append("activation offload where needed: --set training.activation_offload=auto")
    if training.micro_batch_size != "auto" and _fits_with(spec, hw, run, {"training.micro_batch_size": "auto"}):
        found.append("a smaller micro-batch: --set training.micro_batch_size=auto")
    optimizer = suggest_optimizer(spec, hw, run)
    if optimizer:
        found.append(optimizer)
    if run.training.mode is Mode.full:
        if _fits_with(spec, hw, run, {"training.mode": "lora"}):
            found.append(f"LoRA instead of a full fine-tune: --mode lora (rank {run.training.lora.rank})")
        elif _fits_with(spec, hw, run, {"training.mode": "lora", "training.quantize_base": "qint8"}):
            found.append("LoRA over a qint8-quantized base: --mode lora --quantize qint8")
    elif run.training.quantize_base is not Quantization.qint4:
        # Fewer bits than the base has now: qint8 (or qfloat8) halves bf16, qint4 halves it again.
        schemes = ("qint8", "qint4") if run.training.quantize_base is Quantization.none else ("qint4",)
        for scheme in schemes:
            if _fits_with(spec, hw, run, {"training.quantize_base": scheme}):
                found.append(f"quantize the frozen base: --quantize {scheme}")
                break
    for resolution in (768, 512):
        if resolution < run.data.resolution and _fits_with(spec, hw, run, {"data.resolution": resolution}):
            found.append(f"a lower resolution: --resolution {resolution}")
            break
    return found or [("nothing zerotrain can change fits this model on this hardware; add nodes or GPUs "
                     f"with more than {gib(hw.gpu_memory_bytes)}")]
