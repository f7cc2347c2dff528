"""The one way a run is planned: hardware facts, calibration, model facts, plan, and the DeepSpeed
config to train with. `zerotrain plan`, train.py, `zerotrain calibrate` and `zerotrain doctor` all
call plan_for_run, so that they cannot disagree about a run (train.py on rank 0, broadcast by
distributed.from_rank0).

A DeepSpeed config the run gives (deepspeed: PATH or inline) is used as given, completed by
deepspeed_json.complete_given, after the planner has evaluated it. One that `zerotrain plan
--write-config` wrote carries its plan's training settings in its "_zerotrain" header (gradient
checkpointing, the checkpointed blocks, activation offload): they apply unless the run config sets
them itself, and where the two differ a line says which is used."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from zerotrain import adapters, families
from zerotrain.config.sections import RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import HardwareFacts, hardware_facts
from zerotrain.planner import calibration
from zerotrain.planner.deepspeed_json import complete_given, deepspeed_config, given_config, layout_of
from zerotrain.planner.facts import ModelFacts
from zerotrain.planner.measure import measure_model
from zerotrain.planner.memory import Layout
from zerotrain.planner.references import references_reason
from zerotrain.planner.search import Candidate, Plan, describe, evaluate, plan
from zerotrain.protocols import ModelSpec
from zerotrain.units import gib

# The header keys of a written config that are run-config training fields (cli --write-config).
HEADER_TRAINING = ("gradient_checkpointing", "checkpoint_blocks", "activation_offload")


@dataclass
class RunPlan:
    """A planned run: the run config as planned (calibration and a given config's header applied),
    the facts it was planned on, the plan, and the DeepSpeed config with the layout it trains
    (None where nothing fits and no config was given)."""

    run: RunConfig
    spec: ModelSpec
    hw: HardwareFacts
    facts: ModelFacts
    result: Plan
    config: dict[str, Any] | None
    layout: Layout | None
    notes: list[str] = dataclasses.field(default_factory=list)
    """Lines for the person starting the run (warnings), printed by the caller."""
    calibration: str | None = None
    """The plan's line about the calibration it used (calibration.apply); None: none."""
    adjusted: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    """The moves of earlier out-of-memory recoveries that this run keeps (plan.json's "adjusted")."""
    recoverable: tuple[bool, bool] = (False, False)
    """Whether the run config lets an out-of-memory recovery checkpoint more blocks, and offload
    activations (planner.ladder.left_to_planner, of the config as given)."""

    @property
    def used(self) -> Candidate | None:
        """The candidate that trains: the given config's evaluation, or the planner's choice."""
        return self.result.given or self.result.chosen


def plan_for_run(run: RunConfig, spec: ModelSpec, world_size: int | None = None, hw: HardwareFacts | None = None,
                 facts: ModelFacts | None = None, cache: bool = True, calibrated: bool = True) -> RunPlan:
    """Plan `run` for `world_size` processes (spread over run.hardware.nodes; None: the hardware
    config's GPUs) on `hw` (None: hardware.hardware_facts), with the GPU profile's calibration
    (calibrated=False: without, as `zerotrain calibrate` measures the planner's own constants) and
    `facts` (None: measured, or cached unless cache=False)."""
    run = adapters.resolve(run, spec)
    hw = hw or hardware_facts(run.hardware)
    if world_size is not None:
        per_node = world_size // run.hardware.nodes or 1
        hw = dataclasses.replace(hw, gpus_per_node=per_node, nodes=world_size // per_node)
    margin_from = None
    if calibrated:
        run, hw, calibrated, margin_from = calibration.apply(run, hw, families.of(spec).name)
    given = given_config(run)
    notes: list[str] = []
    if given is not None:
        run, notes = apply_header(run, given[0], given[1])
    facts = facts or measure_model(spec, run, cache=cache)
    result = plan(facts, hw, run, margin_from)
    if calibrated:
        result.reasons.insert(3, calibrated)
    referenced = references_reason(spec, run)
    if referenced:
        result.reasons.insert(2, referenced)
    if given is None:
        config = deepspeed_config(result.chosen.layout, run, hw.world_size) if result.chosen else None
        layout = result.chosen.layout if result.chosen else None
        return RunPlan(run, spec, hw, facts, result, config, layout, notes, calibrated or None)
    config, used = evaluate_given(given, run, facts, hw, result)
    return RunPlan(run, spec, hw, facts, result, config, used.layout, notes + given_notes(given[1], used, result),
                   calibrated or None)


def apply_header(run: RunConfig, given: dict[str, Any], source: str) -> tuple[RunConfig, list[str]]:
    """The run with the training settings a written config's "_zerotrain" header records, where the
    run config does not set them itself; and a line for each that the run config sets otherwise."""
    recorded = ((given.get("_zerotrain") or {}).get("training")) or {}
    explicit = run.training.model_fields_set
    if "gradient_checkpointing" in explicit and run.training.gradient_checkpointing is False:
        # which blocks to checkpoint, and their inputs' offload, mean nothing without checkpointing
        recorded = {k: v for k, v in recorded.items() if k == "gradient_checkpointing"}
    update, notes = {}, []
    for key in HEADER_TRAINING:
        if key not in recorded:
            continue
        if key not in explicit:
            update[key] = recorded[key]
        elif getattr(run.training, key) != recorded[key]:
            notes.append(f"{source} was written for training.{key}={recorded[key]}; the run config's "
                         f"training.{key}={getattr(run.training, key)} is used")
    if not update:
        return run, notes
    try:
        training = run.training.model_validate({**run.training.model_dump(exclude_unset=True), **update})
    except ValueError as err:
        raise ZerotrainError(f"{source}: its _zerotrain.training header does not apply to this run "
                             f"({' '.join(str(err).split())[:200]}); remove the header or set the fields") from err
    return run.model_copy(update={"training": training}), notes


def evaluate_given(given: tuple[dict[str, Any], str], run: RunConfig, facts: ModelFacts, hw: HardwareFacts,
                   result: Plan) -> tuple[dict[str, Any], Candidate]:
    """The given config completed, and the planner's evaluation of it. Gradient checkpointing
    follows training.gradient_checkpointing, or with auto, the planner: only if it does not fit
    without. Activation offload only where training.activation_offload is true, with every block
    checkpointed."""
    default_micro = result.chosen.layout.micro_batch if result.chosen else 1
    config = complete_given(*given, run, hw.world_size, default_micro)
    checkpointing = run.training.gradient_checkpointing
    blocks = run.training.checkpoint_blocks
    offload = run.training.activation_offload is True
    if blocks is not None:
        layouts = [dataclasses.replace(layout_of(config, True), checkpointed_blocks=blocks)]
    else:
        options = [False, True] if checkpointing == "auto" else [checkpointing]
        layouts = [dataclasses.replace(layout_of(config, gc), offload_activations=gc and offload) for gc in options]
    evaluated = [evaluate(layout, facts, hw, run) for layout in layouts]
    used = next((c for c in evaluated if c.fits), evaluated[-1])
    result.reasons.append(f"{given[1]} is used as given: {describe(used.layout)}, predicted "
                          f"{gib(used.memory.device_total)} per GPU")
    result.given = used
    return config, used


def given_notes(source: str, used: Candidate, result: Plan) -> list[str]:
    if used.fits:
        return []
    better = f"; the planner would choose {describe(result.chosen.layout)} " \
             f"({gib(result.chosen.memory.device_total)} per GPU)" if result.chosen else ""
    return [(f"{source} is predicted not to fit: {describe(used.layout)} {used.rejected}{better}; "
             "training with it as given")]
