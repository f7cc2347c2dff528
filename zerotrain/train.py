"""Train a diffusion model with DeepSpeed, with the memory planner's configuration.

    deepspeed zerotrain/train.py --config run.yaml [--set key=value ...]
    deepspeed --include localhost:0,1 zerotrain/train.py --config run.yaml   # choose GPUs this way
    torchrun --nproc_per_node 8 zerotrain/train.py --config run.yaml
    srun python zerotrain/train.py --config run.yaml                         # ranks from SLURM_*
    python zerotrain/train.py --config run.yaml                              # one process
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 zerotrain/train.py --config examples/tiny-cpu.yaml

Reads top to bottom: parse, validate, plan, data, model, loop, checkpoint, export.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import yaml

from zerotrain.checkpoint import (
    find,
    load,
    make_universal,
    needs_universal,
    resume_stage,
    save,
    usable,
)
from zerotrain.config import RunConfig, load_config
from zerotrain.distributed import (
    Heartbeat,
    Topology,
    accelerator,
    barrier,
    local_device,
    shutdown,
    slurm_rendezvous,
    topology,
    use_device,
)
from zerotrain.errors import ZerotrainError
from zerotrain.faults import StopSignal, oom_advice
from zerotrain.monitor import Monitor, StepTimes, measured_peaks


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="zerotrain train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="run config (YAML, JSON or TOML)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks and all library output (as logging.verbose: true)")
    return parser.parse_args(argv)


def plan_deepspeed(run: RunConfig, spec, topo: Topology) -> tuple[dict, object, object, object]:
    """The DeepSpeed config, the plan, the Layout in use and the hardware facts: planned on rank 0
    (for the real world size) and broadcast, so every rank uses the same config even when nodes
    report different free memory. A planning error on rank 0 is raised on every rank."""
    outcome: object = None
    error: Exception | None = None
    if topo.is_main:
        try:
            outcome = _plan_here(run, spec, topo)
        except Exception as err:  # noqa: BLE001 - the other ranks must not wait for a plan that will not come
            error = err
            outcome = err if isinstance(err, ZerotrainError) else ZerotrainError(f"planning failed on rank 0: {err}")
    if torch.distributed.is_initialized() and topo.world_size > 1:
        box = [outcome]
        torch.distributed.broadcast_object_list(box, src=0)
        outcome = box[0]
    if error is not None:
        raise error
    if isinstance(outcome, ZerotrainError):
        raise outcome
    return outcome


def _plan_here(run: RunConfig, spec, topo: Topology) -> tuple[dict, object, object, object]:
    """deepspeed: auto uses the planner's choice. A given config is used as given (completed by
    deepspeed_json.complete_given), after the planner has evaluated it: a warning is printed when
    it is predicted not to fit. Gradient checkpointing for a given config follows
    training.gradient_checkpointing, or with auto, the planner: only if it does not fit without."""
    from zerotrain import families
    from zerotrain.hardware import hardware_facts
    from zerotrain.planner import calibration
    from zerotrain.planner.deepspeed_json import (
        complete_given,
        deepspeed_config,
        given_config,
        layout_of,
        validate,
    )
    from zerotrain.planner.measure import measure_model
    from zerotrain.planner.search import describe, evaluate, gib, plan

    hw = hardware_facts(run.hardware)
    per_node = topo.world_size // run.hardware.nodes or 1
    hw = dataclasses.replace(hw, gpus_per_node=per_node, nodes=topo.world_size // per_node)
    run, hw, calibrated = calibration.apply(run, hw, families.of(spec).name)
    facts = measure_model(spec, run)
    result = plan(facts, hw, run)
    if calibrated:
        result.reasons.insert(3, calibrated)
    given = given_config(run)
    if given is None:
        if result.chosen is None:
            raise ZerotrainError("the planner finds no configuration that fits: " + "; ".join(result.reasons[-1:]) +
                                 " (run zerotrain plan for suggestions)")
        config = deepspeed_config(result.chosen.layout, run, topo.world_size)
        validate(config)
        return config, result, result.chosen.layout, hw

    default_micro = result.chosen.layout.micro_batch if result.chosen else 1
    config = complete_given(*given, run, topo.world_size, default_micro)
    checkpointing = run.training.gradient_checkpointing
    options = [False, True] if checkpointing == "auto" else [checkpointing]
    blocks = run.training.checkpoint_blocks
    if blocks is None:
        offload = run.training.activation_offload is True  # a given config: only when asked for
        evaluated = [evaluate(dataclasses.replace(layout_of(config, gc), offload_activations=gc and offload), facts, hw,
                              run) for gc in options]
    else:
        evaluated = [evaluate(dataclasses.replace(layout_of(config, True), checkpointed_blocks=blocks), facts, hw, run)]
    used = next((c for c in evaluated if c.fits), evaluated[-1])
    result.reasons.append(f"{given[1]} is used as given: {describe(used.layout)}, predicted "
                          f"{gib(used.memory.device_total)} per GPU")
    if not used.fits:
        better = f"; the planner would choose {describe(result.chosen.layout)} " \
                 f"({gib(result.chosen.memory.device_total)} per GPU)" if result.chosen else ""
        print(f"zerotrain: warning: {given[1]} is predicted not to fit: {describe(used.layout)} "
              f"{used.rejected}{better}; training with it as given", file=sys.stderr, flush=True)
    result.given = used
    return config, result, used.layout, hw


def standalone_rendezvous() -> None:
    """A plain `python zerotrain/train.py` has no launcher: act as a one-process launcher and
    set the rendezvous variables one would set, on a free local port (otherwise DeepSpeed falls
    back to MPI discovery)."""
    if "MASTER_ADDR" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0"})


def write_run_folder(run: RunConfig, ds_config: dict, plan_result, topo: Topology) -> None:
    if topo.is_main:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        (run.output_dir / "config.yaml").write_text(yaml.safe_dump(run.model_dump(mode="json"), sort_keys=False))
        (run.output_dir / "deepspeed.json").write_text(json.dumps(ds_config, indent=2))
        (run.output_dir / "plan.json").write_text(json.dumps(plan_result.to_json(), indent=1, default=str))
    barrier()


def to_device(value, device: torch.device):
    """Tensors (also inside dicts, like SDXL's added_cond_kwargs, and lists) moved to the model's
    device; dtypes are the objective's choice."""
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    return value.to(device) if isinstance(value, torch.Tensor) else value


def collective_failure(err: BaseException) -> bool:
    """Whether an error came from a collective whose peer failed (gloo reports a closed socket as a
    plain RuntimeError naming its source file)."""
    text = str(err)
    return isinstance(err, torch.distributed.DistError) or (
        isinstance(err, RuntimeError) and any(k in text for k in ("gloo", "NCCL", "Connection reset", "Connection closed")))


def exact_pinning_supported() -> bool:
    """Whether this torch knows pinned_max_round_threshold_mb (2.13 is the oldest checked)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 13)


def allocator_settings(run: RunConfig) -> None:
    """The allocator settings the planner's constants assume, set before any CUDA allocation and
    added to what the user or launcher set: expandable segments (planner.fragmentation) and exact
    pinning of host buffers above planner.pinned_exact_above_mib (memory.pinned_bytes)."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    threshold = run.planner.pinned_exact_above_mib
    if threshold is not None and "pinned_max_round_threshold_mb" not in conf and exact_pinning_supported():
        conf += f",pinned_max_round_threshold_mb:{threshold}"
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf


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
    import deepspeed

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
    deepspeed.init_distributed(dist_backend=accelerator()[1],
                               timeout=timedelta(seconds=run.faults.collective_timeout_seconds))
    heartbeat = Heartbeat(topo, run.faults.lost_rank_seconds)
    finished = False
    try:
        checkpoint = usable(run.output_dir, checkpoint, topo, fall_back=str(run.training.resume) == "auto")
        completed = fit(run, spec, topo, checkpoint)
        finished = True
    except Exception as err:
        if not collective_failure(err):
            raise
        lost = heartbeat.verdict()
        latest = find(run.output_dir, "auto")
        where = f"{latest} is the latest complete checkpoint" if latest else "no checkpoint was completed yet"
        what = heartbeat.describe() if lost else \
            f"a collective failed ({' '.join(str(err).split())[:200]}) while every rank's heartbeat still moves"
        raise ZerotrainError(f"rank {topo.rank}: {what}; stopping; {where}: resume with the same command "
                             "(training.resume: auto)") from err
    finally:
        # Every rank leaves the same way: a last barrier when every rank finished, the heartbeat
        # stopped, the process group destroyed, while the interpreter is fully alive.
        shutdown(clean=finished, heartbeat=heartbeat)

    # Close: rank 0 exports weights diffusers loads, from the final checkpoint every rank has
    # finished writing (save() ends with a barrier). The process group is gone: a long export (a
    # large ZeRO-3 model) cannot run into a collective timeout.
    if completed and topo.is_main:
        from zerotrain.export import export

        print(f"exported to {export(run.output_dir, ema=run.ema.export)}", flush=True)
    return 0


def fit(run: RunConfig, spec, topo: Topology, checkpoint: Path | None) -> bool:
    """Plan, data, model, loop and checkpoints, every rank together. True when max_steps were
    trained, False when a signal stopped the run (after its checkpoint)."""
    from zerotrain.data.cache import model_folder
    from zerotrain.data.prepare import make_loader, prepare
    from zerotrain.ema import ShardedEMA
    from zerotrain.engine import apply_mode, build_engine, denoiser, load_denoiser
    from zerotrain.objectives import make_objective
    from zerotrain.planner.search import describe, gib
    from zerotrain.sampling import Validator

    device = local_device(topo)

    # Plan (a resume keeps the checkpoint's ZeRO stage), and record the run.
    if checkpoint is not None:
        run = resume_stage(run, checkpoint)
    ds_config, plan_result, layout, hw = plan_deepspeed(run, spec, topo)
    peak_flops = hw.peak_bf16_flops if device.type == "cuda" else None
    if (topo.is_main and device.type == "cuda" and layout.offload_optimizer == "cpu"
            and run.planner.pinned_exact_above_mib is not None and not exact_pinning_supported()):
        print(f"zerotrain: warning: torch {torch.__version__} rounds every pinned host buffer up to a power of two "
              "(no pinned_max_round_threshold_mb before torch 2.13): the offload may take up to twice the planned "
              "host RAM; plan with planner.pinned_exact_above_mib: null, or upgrade torch", file=sys.stderr, flush=True)
    write_run_folder(run, ds_config, plan_result, topo)
    micro, accumulation = layout.micro_batch, layout.accumulation
    checkpointing = plan_result.checkpointed(layout)  # every block (True), the named ones, or none ([])

    # Data: build or top up the cache (the encoders are freed before the model loads).
    prepared = prepare(run, spec, topo, device)
    folder = model_folder(spec, run.model.revision, run.data.cache_dir / "models")
    loader, sampler = make_loader(prepared, run, micro, topo, pin_memory=device.type == "cuda")
    if topo.is_main:
        for line in prepared.summary():
            print(line, flush=True)

    # A checkpoint partitioned for another world size or stage is converted first (host memory is
    # still free of the model), then loaded universally.
    universal = None
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if checkpoint is not None and needs_universal(checkpoint, topo.world_size, stage):
        universal = make_universal(checkpoint, topo)
        ds_config = {**ds_config, "checkpoint": {**ds_config.get("checkpoint", {}), "load_universal": True}}

    # Validation prompts are encoded now, before the model loads (the text encoders are freed again).
    validator = Validator(spec, folder, run, topo, device) if run.validation.prompts else None

    # Model and engine.
    scheduler_config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    objective = make_objective(spec, scheduler_config, run.objective, run.data.resolution, model_dtype=torch.bfloat16)
    torch.manual_seed(run.training.seed)  # LoRA's initial weights come from torch's global generator
    model = load_denoiser(spec, folder)
    for line in apply_mode(model, spec, run, checkpointing, layout.offload_activations, layout.stage):
        if topo.is_main:
            print(line, flush=True)
    engine = build_engine(model, ds_config, run, device)
    generator = torch.Generator().manual_seed(run.training.seed * 100_003 + topo.rank)
    generators = {"objective": generator}
    ema = ShardedEMA(engine, run.ema.decay, run.ema.start_step) if run.ema.enabled else None
    step = 0
    if checkpoint is not None:
        state = load(engine, checkpoint, topo, generators, universal)
        if ema is not None and any(checkpoint.glob("ema-*.pt")):
            ema.load(checkpoint)
        elif ema is not None and topo.is_main:
            print(f"zerotrain: warning: {checkpoint} holds no EMA (ema was not enabled when it was saved); "
                  "the EMA starts from the resumed weights", file=sys.stderr, flush=True)
        step = state["step"]
        try:
            sampler.load_state_dict(state["sampler"])
        except ValueError as err:  # the data (or global batch) changed since the checkpoint
            sampler.set_epoch(int(state["sampler"]["epoch"]))
            if topo.is_main:
                print(f"zerotrain: warning: {err}; epoch {state['sampler']['epoch']} starts over with the current "
                      "data", file=sys.stderr, flush=True)
        if topo.is_main:
            print(f"resumed from {checkpoint} at step {step}", flush=True)
    sampler.set_epoch(sampler.state_dict()["epoch"])
    batches = iter(loader)
    images_per_step = run.training.global_batch_size
    used = plan_result.given or plan_result.chosen
    monitor = Monitor(run.output_dir, topo, device, max_steps=run.training.max_steps, start_step=step,
                      images_per_step=images_per_step, predicted=used.memory, layout_text=describe(layout),
                      flops_per_image=plan_result.flops_per_sample, peak_flops_per_gpu=peak_flops,
                      every=run.logging.every, tensorboard=run.logging.tensorboard,
                      progress_bar=run.logging.progress_bar, memory_check_step=run.logging.memory_check_step)
    stop = StopSignal(run.faults.grace_seconds)
    faults = run.faults

    def checkpoint_now(at: int) -> Path:
        state = {"step": at, "sampler": sampler.state_dict(), "images": at * images_per_step}
        return save(engine, run.output_dir, at, topo, state, generators, run.training.keep_checkpoints,
                    inject_failure=at in faults.inject_save_failure_at,
                    extra=None if ema is None else lambda folder: ema.save(folder, topo.rank),
                    kill=faults.inject_kill.point if faults.inject_kill and faults.inject_kill.step == at else None)

    def validate(at: int) -> None:
        """Every rank renders its share of the validation images (with the EMA weights if asked)."""
        if validator is None or not validator.due(at, run.training.max_steps, resumed=checkpoint is not None):
            return
        with ema.applied() if run.validation.use_ema else contextlib.nullcontext():
            paths = validator.render(denoiser(engine), at, run.output_dir, monitor.writer)
        if paths:
            monitor.log(f"validation images of step {at}: {paths[-1].parent}")

    # The loop: one iteration is one optimizer step of `accumulation` micro-batches.
    bad_in_a_row = 0
    try:
        if step == 0:
            validate(0)
        while step < run.training.max_steps:
            lr = engine.get_lr()[0]  # this step's learning rate (engine.step() moves the schedule on)
            times = StepTimes(device)
            losses = []
            for micro_index in range(accumulation):
                batch = next(batches, None)
                if batch is None:  # an epoch ends exactly at a step boundary (see data/sampler.py)
                    sampler.set_epoch(sampler.state_dict()["epoch"] + 1)
                    batches = iter(loader)
                    batch = next(batches)
                inputs = objective.prepare(batch, generator)
                kwargs = to_device(inputs.model_kwargs, device)
                times.lap("data")
                if step + 1 in faults.inject_oom_at:  # every rank, as a failed CUDA allocation would
                    raise torch.OutOfMemoryError(f"CUDA out of memory (faults.inject_oom_at, step {step + 1})")
                pred = engine(**kwargs, return_dict=False)[0]
                loss = objective.loss(pred, dataclasses.replace(inputs, target=inputs.target.to(device),
                                                                weights=None if inputs.weights is None
                                                                else inputs.weights.to(device)))
                if step + 1 in faults.inject_nan_at and topo.is_main and micro_index == 0:
                    loss = loss * float("nan")
                # A non-finite loss on any rank makes the reduced gradients of every rank non-finite, and
                # DeepSpeed skips the step on all of them (tests/distributed/test_bad_gradients.py): no
                # collective of zerotrain's own is needed per micro-batch.
                engine.backward(loss)
                times.lap("forward_backward")
                engine.step()  # the optimizer step at the accumulation boundary
                times.lap("optimizer")
                losses.append(loss.detach().float())
            sampler.advance()
            step += 1
            # One collective per step: the summed mean loss of the ranks, and whether any rank was
            # asked to stop (a signal reaches ranks at different moments; all must stop after the same step).
            totals = torch.stack([torch.stack(losses).mean(), torch.tensor(float(bool(stop.received)), device=device)])
            if torch.distributed.is_initialized():
                torch.distributed.all_reduce(totals)
            mean_loss, stopping = (totals[0] / topo.world_size).item(), totals[1].item() > 0
            skipped = not engine.was_step_applied()
            grad_norm = engine.get_global_grad_norm()
            grad_norm = None if grad_norm is None else float(grad_norm)
            monitor.step(step, sampler.state_dict()["epoch"], mean_loss, lr, grad_norm, times, skipped)
            monitor.memory_check(step)
            if ema is not None and not skipped:
                ema.update(step)
            bad_in_a_row = bad_in_a_row + 1 if skipped else 0
            if bad_in_a_row >= faults.max_bad_steps:
                saved = checkpoint_now(step)
                raise ZerotrainError(
                    f"{bad_in_a_row} consecutive steps (up to step {step}) had a non-finite loss or gradient norm "
                    f"and were skipped; stopped with {saved}, which holds the last good weights. Lower "
                    "optimizer.lr or check the data, then resume (training.resume: auto)")
            saved = None
            if step % run.training.checkpoint_every == 0 or step == run.training.max_steps:
                saved = checkpoint_now(step)
            if stopping and step < run.training.max_steps:
                saved = saved or checkpoint_now(step)
                if topo.is_main:
                    monitor.log(f"stopped by {stop.received or 'a signal on another rank'} during step {step + 1}: "
                                f"checkpoint {saved}; resume with the same command (training.resume: auto)")
                return False
            validate(step)
    except torch.OutOfMemoryError as err:
        measured = measured_peaks(device)
        raise ZerotrainError(
            f"CUDA out of memory at step {step + 1} with {describe(layout)}: the planner predicted "
            f"{gib(used.memory.device_total)} per GPU, the peak measured on this rank was "
            f"{gib(measured['max_allocated'] or 0)} allocated, {gib(measured['max_reserved'] or 0)} reserved "
            f"({' '.join(str(err).split())[:200]}). {oom_advice(plan_result, used, run.planner.headroom)}. "
            "The last checkpoint is untouched") from err
    finally:
        stop.restore()
        monitor.close()
    return True


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
