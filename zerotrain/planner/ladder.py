"""Where a run goes when a step runs out of memory after all (faults.oom_recovery_steps): the
layouts it can move to without a new engine, and the run config that keeps the one it moved to.

Only the recomputation changes: more blocks checkpointed, in the planner's order
(Plan.checkpoint_order: the blocks that free the most activation memory per recomputed FLOP
first), then the inputs of every checkpointed block offloaded to host RAM where the node has the
room. The stage, offload of states, micro-batch and optimizer stay: changing them needs another
DeepSpeed engine, which a run does not improvise (faults.oom_advice names it instead).

Each rung checkpoints half the blocks still uncheckpointed (at least one): a few retries reach
every block, and the first rungs cost little time. Rungs are taken only where the run config
leaves checkpointing to the planner (gradient_checkpointing auto or true, no checkpoint_blocks)
and, for the offload, activation_offload auto."""

from __future__ import annotations

import dataclasses
from typing import Any

from zerotrain.config.sections import RunConfig
from zerotrain.hardware import HardwareFacts
from zerotrain.planner.facts import ModelFacts
from zerotrain.planner.memory import Layout
from zerotrain.planner.search import Candidate, budgets, evaluate


def checkpointed_count(layout: Layout, facts: ModelFacts) -> int:
    if not layout.gradient_checkpointing:
        return 0
    n = facts.checkpoint_blocks
    return n if layout.checkpointed_blocks is None else min(layout.checkpointed_blocks, n)


def left_to_planner(run: RunConfig) -> tuple[bool, bool]:
    """Whether the run config (as given, before a kept adjustment) lets a run checkpoint more
    blocks, and offload activations, after running out of memory."""
    training = run.training
    more = training.gradient_checkpointing is not False and training.checkpoint_blocks is None
    return more, more and training.activation_offload == "auto" and "cpu" in run.planner.offload


def rungs(used: Layout, facts: ModelFacts, hw: HardwareFacts, run: RunConfig, offload: bool) -> list[Candidate]:
    """The cheaper layouts after `used`, in the order a run takes them, each as the planner
    evaluates it (activation offload last, if `offload`, where the node's host RAM allows it)."""
    if used.offload_activations:
        return []
    n, k = facts.checkpoint_blocks, checkpointed_count(used, facts)
    layouts = []
    while k < n or not layouts and not used.gradient_checkpointing:
        k = min(n, k + max(1, (n - k + 1) // 2))
        layouts.append(dataclasses.replace(used, gradient_checkpointing=True,
                                           checkpointed_blocks=None if k >= n else k))
    every = dataclasses.replace(used, gradient_checkpointing=True, checkpointed_blocks=None)
    if offload and facts.offload_input_bytes:
        layouts.append(dataclasses.replace(every, offload_activations=True))
    host_budget = budgets(hw, run)[1]
    found = [evaluate(layout, facts, hw, run) for layout in layouts]
    return [c for c in found if c.memory.host_per_node <= host_budget]


def config_fields(layout: Layout, facts: ModelFacts) -> dict[str, Any]:
    """The training.* fields that make the planner plan this rung's recomputation."""
    if layout.offload_activations:
        return {"activation_offload": True}
    k = checkpointed_count(layout, facts)
    return {"checkpoint_blocks": k} if k < facts.checkpoint_blocks else {"gradient_checkpointing": True}


def set_lines(fields: dict[str, Any]) -> str:
    return " ".join(f"--set training.{key}={str(value).lower() if isinstance(value, bool) else value}"
                    for key, value in fields.items())


def keep_adjustment(run: RunConfig, adjustments: list[dict[str, Any]]) -> tuple[RunConfig, str | None]:
    """The run config of a resume after recoveries (plan.json's "adjusted" list, newest last): the
    last rung's training fields, where the run config leaves checkpointing to the planner; and a
    line saying so (None: nothing to keep)."""
    if not adjustments:
        return run, None
    training, last = run.training, adjustments[-1]
    fields = last["training"]
    more, offload = left_to_planner(run)
    if not more or fields.get("activation_offload") and not offload:
        return run, None
    run = run.model_copy(update={"training": training.model_validate(
        {**training.model_dump(exclude_unset=True), **fields})})
    return run, (f"keeping the layout the run moved to after running out of memory at step {last['step']} "
                 f"({last['to']}; plan.json): {set_lines(fields)}")
