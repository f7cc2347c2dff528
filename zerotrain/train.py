"""Train a diffusion model with DeepSpeed, with the memory planner's configuration.

    deepspeed zerotrain/train.py --config run.yaml [--set key=value ...]
    deepspeed --include localhost:0,1 zerotrain/train.py --config run.yaml   # choose GPUs this way
    torchrun --nproc_per_node 8 zerotrain/train.py --config run.yaml
    srun python zerotrain/train.py --config run.yaml                         # ranks from SLURM_*
    python zerotrain/train.py --config run.yaml                              # one process
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 zerotrain/train.py --config examples/tiny-cpu.yaml

Reads top to bottom: parse, validate, start the process group, plan (rank 0, broadcast), data,
model and engine, the loop (zerotrain/trainer.py), close with an export.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
import yaml

from zerotrain.checkpoint import find, make_universal, needs_universal, resume_stage, usable
from zerotrain.config import RunConfig, load_config
from zerotrain.distributed import (
    Heartbeat,
    Topology,
    accelerator,
    barrier,
    from_rank0,
    local_device,
    shutdown,
    slurm_rendezvous,
    standalone_rendezvous,
    topology,
    use_device,
)
from zerotrain.errors import ZerotrainError, one_line
from zerotrain.faults import OomRecovery
from zerotrain.planner.entry import RunPlan, plan_for_run
from zerotrain.protocols import ModelSpec
from zerotrain.trainer import allocator_settings, build_trainer, make_monitor, pinning_warnings, run_loop


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zerotrain train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="run config (YAML, JSON or TOML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks and all library output (as logging.verbose: true)")
    return parser.parse_args(argv)


def plan_run(run: RunConfig, spec: ModelSpec, topo: Topology, resuming: bool = False) -> RunPlan:
    """planner.entry.plan_for_run for the launched world size; a run with neither a plan that fits
    nor a given DeepSpeed config stops here, with the planner's reason. A resume keeps the layout
    earlier out-of-memory recoveries moved the run to (plan.json's "adjusted")."""
    from zerotrain.planner import ladder

    recoverable = ladder.left_to_planner(run)
    adjusted = previous_adjustments(run.output_dir) if resuming else []
    run, kept = ladder.keep_adjustment(run, adjusted)
    planned = plan_for_run(run, spec, topo.world_size)
    if planned.config is None:
        raise ZerotrainError("the planner finds no configuration that fits: " + "; ".join(planned.result.reasons[-1:])
                             + " (run zerotrain plan for suggestions)")
    planned.adjusted, planned.recoverable = adjusted if kept else [], recoverable
    planned.notes += [kept] if kept else []
    return planned


def previous_adjustments(run_dir: Path) -> list[dict]:
    """The moves of the out-of-memory recoveries recorded in a run folder's plan.json."""
    try:
        return list(json.loads((run_dir / "plan.json").read_text()).get("adjusted") or [])
    except (OSError, ValueError):
        return []


def write_run_folder(planned: RunPlan, topo: Topology) -> None:
    run = planned.run
    if topo.is_main:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        (run.output_dir / "config.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json"), sort_keys=False))
        (run.output_dir / "deepspeed.json").write_text(json.dumps(planned.config, indent=2))
        plan = {**planned.result.to_json(), "adjusted": planned.adjusted}
        (run.output_dir / "plan.json").write_text(json.dumps(plan, indent=1, default=str))
    barrier()


def collective_failure(err: BaseException) -> bool:
    """Whether an error came from a collective whose peer failed (gloo reports a closed socket as a
    plain RuntimeError naming its source file)."""
    text = str(err)
    return isinstance(err, torch.distributed.DistError) or (
        isinstance(err, RuntimeError) and any(k in text for k in ("gloo", "NCCL", "Connection reset", "Connection closed")))


# Seconds the process groups' timeout exceeds faults.collective_timeout_seconds by (see start()).
BACKSTOP_S = 60


def warn(line: str) -> None:
    print(f"zerotrain: warning: {line}", file=sys.stderr, flush=True)


def train(args: argparse.Namespace) -> int:
    """Parse and validate everything before any model loads, and hide the library output nobody
    needs to read before the libraries load (DeepSpeed may log as it is imported); undone at the
    end, for callers in the same process."""
    from zerotrain.quiet import quiet_libraries

    run = load_config(args.config, args.overrides)
    with quiet_libraries(args.debug or run.logging.verbose, topology().rank):
        return start(run)


def start(run: RunConfig) -> int:
    """Start-up, the process group, and one orderly way out of it on every rank (fit() is the run)."""
    from zerotrain.deepspeed_compat import init_distributed
    from zerotrain.families import check_resolution
    from zerotrain.models.catalog import resolve_model

    allocator_settings(run)
    slurm_rendezvous()
    topo = topology()
    spec = resolve_model(run.model)
    check_resolution(spec, run.data.resolution)
    checkpoint = find(run.output_dir, run.training.resume)
    if topo.world_size == 1:
        standalone_rendezvous()
    use_device(topo)
    # The groups' own timeout, on every group (DeepSpeed's too), is the backstop: the heartbeat ends a rank
    # whose phase outlasts faults.collective_timeout_seconds first, with one line (NCCL's watchdog would abort).
    init_distributed(accelerator()[1], timedelta(seconds=run.faults.collective_timeout_seconds + BACKSTOP_S))
    heartbeat = Heartbeat(topo, run.faults.lost_rank_seconds, stall_after=run.faults.collective_timeout_seconds,
                          resume=lambda: resume_words(run))
    finished = False
    try:
        checkpoint = usable(run.output_dir, checkpoint, topo, fall_back=str(run.training.resume) == "auto")
        completed = fit(run, spec, topo, checkpoint)
        finished = True
    except Exception as err:
        if not collective_failure(err):
            # The other ranks stop with this rank's line, wherever they wait (unless one posted first).
            heartbeat.post(f"rank {topo.rank} stopped: {one_line(err, 300)}")
            raise
        raise lost_rank_error(err, heartbeat, run, topo) from err
    finally:
        # Every rank leaves the same way: a last barrier when every rank finished, the heartbeat
        # stopped, the process group destroyed, while the interpreter is fully alive.
        shutdown(clean=finished, heartbeat=heartbeat)

    # Close: rank 0 exports weights diffusers loads, from the final checkpoint every rank has
    # finished writing (save() ends with a barrier). The process group is gone: a long export (a
    # large ZeRO-3 model) cannot run into a collective timeout.
    if completed and topo.is_main:
        from zerotrain.export import export, notes

        out = export(run.output_dir, ema=run.ema.export)
        print(f"exported to {out}", *notes(out), sep="\n", flush=True)
    return 0


def resume_words(run: RunConfig) -> str:
    """How to go on after a stop: the latest complete checkpoint, and the command."""
    latest = find(run.output_dir, "auto")
    where = f"{latest} is the latest complete checkpoint" if latest else "no checkpoint was completed yet"
    return f"{where}: resume with the same command (training.resume: auto)"


def lost_rank_error(err: BaseException, heartbeat: Heartbeat, run: RunConfig, topo: Topology) -> ZerotrainError:
    lost = heartbeat.verdict()
    what = heartbeat.describe() if lost else \
        f"a collective failed ({one_line(err, 200)}) while every rank's heartbeat still moves"
    return ZerotrainError(f"rank {topo.rank}: {what}; stopping; {resume_words(run)}")


def fit(run: RunConfig, spec: ModelSpec, topo: Topology, checkpoint: Path | None) -> bool:
    """Plan, data, model and the loop, every rank together. True when max_steps were trained,
    False when a signal stopped the run (after its checkpoint)."""
    from zerotrain.data.cache import model_folder
    from zerotrain.data.prepare import make_loader, prepare
    from zerotrain.sampling import Validator

    device = local_device(topo)
    if checkpoint is not None:  # a resume keeps the checkpoint's ZeRO stage
        run = resume_stage(run, checkpoint)
    planned = from_rank0(plan_run, topo, run, spec, topo, checkpoint is not None)
    run, layout = planned.run, planned.layout
    for line in [*planned.notes, *pinning_warnings(run, planned, device)] if topo.is_main else []:
        warn(line)
    write_run_folder(planned, topo)

    # The model's files, on every node before anything long starts (a hub repo downloaded once per node); then
    # the data: build or top up the cache (the encoders are freed before the model loads).
    folder = model_folder(spec, run, topo, "train")
    prepared = prepare(run, spec, topo, device, folder)
    loader, sampler = make_loader(prepared, run, layout.micro_batch, topo, pin_memory=device.type == "cuda")
    for line in prepared.summary() if topo.is_main else []:
        print(line, flush=True)

    # A checkpoint partitioned for another world size or stage is converted first (host memory is
    # still free of the model), then loaded universally.
    universal = None
    stage = int((planned.config.get("zero_optimization") or {}).get("stage", 0))
    if checkpoint is not None and needs_universal(checkpoint, topo.world_size, stage):
        universal = make_universal(checkpoint, topo)
        planned.config = {**planned.config, "checkpoint": {**planned.config.get("checkpoint", {}),
                                                           "load_universal": True}}
    # Validation prompts are encoded now, before the model loads (the text encoders are freed again).
    validator = Validator(spec, folder, run, topo, device) if run.validation.prompts else None
    trainer = build_trainer(planned, folder, topo, device, loader, sampler)
    trainer.validator, trainer.resumed = validator, checkpoint is not None
    notes = trainer.checkpointer.restore(checkpoint, universal) if checkpoint is not None else []
    if topo.is_main and checkpoint is not None:
        for line in notes:
            warn(line)
        print(f"resumed from {checkpoint} at step {trainer.counter.step}", flush=True)
    sampler.set_epoch(sampler.state_dict()["epoch"])
    from zerotrain.engine import denoiser

    trainer.monitor = make_monitor(planned, topo, device, trainer.counter.step)
    trainer.recovery = OomRecovery(planned, denoiser(trainer.engine), trainer.counter.step, device, topo.is_main)
    return run_loop(trainer, planned, device)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return train(args)
    except ZerotrainError as err:
        if args.debug:
            raise
        print(f"zerotrain: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
