"""The training loop, in parts that each decide their own "when" (after torchtitan's trainer):

- train_step: one optimizer step of `accumulation` micro-batches through a DeepSpeed engine. train.py,
  `zerotrain calibrate`, benchmarks/step_overhead.py and the distributed test workers all step
  through it, so that they measure and test the loop users run.
- DataFeed: the micro-batches of a run (the sampler's epochs, the objective's noising, the
  injected faults of tests).
- Checkpointer: when to save (every training.checkpoint_every, at the end, on a stop or after bad
  steps), and what: each component it is given declares its own state (state_dict /
  load_state_dict), as the sampler and the step counter do; the EMA writes its own files.
- BadSteps: the count of skipped steps in a row, and when it ends the run.
- Trainer: the loop over steps, with the stop signal agreed on by every rank once per step, the
  validator's images when due, and the monitor's lines.
- What train.py builds and runs: the allocator settings the plan assumes (also calibrate's), the
  Trainer of a planned run (build_trainer, make_monitor), and run_loop, which turns an out-of-memory
  step into one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from zerotrain import families
from zerotrain.config.sections import FaultInjection, RunConfig
from zerotrain.distributed import PROGRESS, Topology
from zerotrain.errors import ZerotrainError, one_line
from zerotrain.faults import StopSignal, oom_advice
from zerotrain.monitor import Monitor, StepTimes, measured_peaks
from zerotrain.units import gib

if TYPE_CHECKING:
    from zerotrain.planner.entry import RunPlan

# What a micro-batch is to train_step: the model's keyword inputs (on the device), and the loss of
# the model's prediction.
MicroBatch = tuple[dict[str, Any], Callable[[torch.Tensor], torch.Tensor]]


class Laps(Protocol):
    def lap(self, phase: str) -> None: ...


def train_step(engine: Any, next_micro_batch: Callable[[int], MicroBatch], accumulation: int,
               laps: Laps) -> torch.Tensor:
    """One optimizer step: `accumulation` micro-batches forward and backward, DeepSpeed stepping at
    the boundary. laps.lap(phase) is called after each phase (data, forward_backward, optimizer).
    Returns this rank's mean loss (a detached fp32 scalar)."""
    losses = []
    for index in range(accumulation):
        failed = forward_backward(engine, next_micro_batch, index, laps, losses)
        if failed is not None:  # raised here, outside the handler, so that nothing holds the step's tensors
            raise StepOutOfMemory(*failed)
        if index == accumulation - 1:
            PROGRESS.at("optimizer step")
        try:
            engine.step()  # the optimizer step at the accumulation boundary
        except torch.OutOfMemoryError as err:
            raise StepOutOfMemory(str(err), "optimizer step") from err
        laps.lap("optimizer")
    return torch.stack(losses).mean()


class StepOutOfMemory(torch.OutOfMemoryError):
    """A step ran out of memory in `phase`: a micro-batch's forward or backward (which recovery may drop and run
    again), or the optimizer step (which it may not: its states may be half-made, and more checkpointing would
    not shrink them). Its message is the original's."""

    def __init__(self, message: str, phase: str):
        super().__init__(message)
        self.phase = phase
        self.alone = False  # it ran out of memory on this rank, not on every rank (Trainer.recoverable)


def forward_backward(engine: Any, next_micro_batch: Callable[[int], MicroBatch], index: int, laps: Laps,
                     losses: list[torch.Tensor]) -> tuple[str, str] | None:
    """One micro-batch's forward and backward; the out-of-memory error's message and phase if one ran out."""
    phase = "data"
    try:
        PROGRESS.at(phase)
        kwargs, loss_of = next_micro_batch(index)
        laps.lap("data")
        PROGRESS.at(phase := "forward")
        pred = engine(**kwargs, return_dict=False)[0]
        loss = loss_of(pred)
        PROGRESS.at(phase := "backward")
        engine.backward(loss)
        losses.append(loss.detach().float())
        del kwargs, pred, loss  # not held through the next micro-batch's forward
        laps.lap("forward_backward")
    except torch.OutOfMemoryError as err:
        return str(err), phase
    return None


def to_device(value: Any, device: torch.device) -> Any:
    """Tensors (also inside dicts, like SDXL's added_cond_kwargs, and lists) moved to the model's
    device; dtypes are the objective's choice."""
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    return value.to(device) if isinstance(value, torch.Tensor) else value


class DataFeed:
    """The run's micro-batches: the loader's batches (a new epoch at an epoch's end, which falls on
    a step boundary, data/sampler.py), noised by the objective with this rank's generator. A step
    dropped after running out of memory runs again on the same batches and noise (begin, rewind).
    A test's non-finite loss (RunConfig.testing.nan_at) is made here, on rank 0."""

    def __init__(self, loader: Any, sampler: Any, objective: Any, generator: torch.Generator, device: torch.device,
                 faults: FaultInjection, is_main: bool, accumulation: int = 1):
        self.loader, self.sampler, self.objective = loader, sampler, objective
        self.generator, self.device, self.faults, self.is_main = generator, device, faults, is_main
        self.accumulation = accumulation
        # The loader's iterator is made at the first micro-batch: making it draws the sampler's
        # order, which a resume sets first (the sampler's load_state_dict and set_epoch).
        self.batches: Iterator[Any] | None = None
        self.step = 0  # the step being trained, counted from 1
        self.taken: list[Any] = []  # this step's batches so far
        self.replay: list[Any] = []  # a dropped step's batches, to run again
        self.noise_state = generator.get_state()
        self.index = 0  # the micro-batch of the step being trained, counted from 0

    def begin(self, step: int) -> None:
        self.step, self.taken, self.noise_state = step, [], self.generator.get_state()

    def rewind(self) -> None:
        """The step begun last runs again: the same batches, the same noise."""
        self.replay, self.taken = self.taken + self.replay, []
        self.generator.set_state(self.noise_state)

    def next_batch(self) -> Any:
        if self.replay:
            return self.replay.pop(0)
        if self.batches is None:
            self.batches = iter(self.loader)
        batch = next(self.batches, None)
        if batch is None:
            self.sampler.set_epoch(self.sampler.state_dict()["epoch"] + 1)
            self.batches = iter(self.loader)
            batch = next(self.batches)
        return batch

    def __call__(self, index: int) -> MicroBatch:
        self.index = index
        batch = self.next_batch()
        self.taken.append(batch)
        inputs = self.objective.prepare(batch, self.generator)
        poison = self.step in self.faults.nan_at and self.is_main and index == 0
        return to_device(inputs.model_kwargs, self.device), _Loss(self.objective, inputs, self.device, poison)


class InjectedOom:
    """testing.oom_at: a CUDA out-of-memory error in the last micro-batch of the listed steps, once each, on
    testing.oom_rank (every rank when unset, as the same shapes would fail on every GPU), in testing.oom_phase:
    raised in the middle checkpoint unit's forward, from a gradient hook of its output half-way through the
    backward, or in the optimizer's step inside engine.step(), so that the other ranks are wherever the real
    failure would leave them (in DeepSpeed's gathers and reductions, at ZeRO 0-3)."""

    def __init__(self, faults: FaultInjection, rank: int, feed: DataFeed):
        self.faults, self.rank, self.feed = faults, rank, feed
        self.done: set[int] = set()

    def armed(self, phase: str) -> bool:
        feed, faults = self.feed, self.faults
        return (phase == faults.oom_phase and feed.step in faults.oom_at and feed.step not in self.done
                and feed.index == feed.accumulation - 1 and faults.oom_rank in (None, self.rank))

    def fire(self, phase: str) -> None:
        if self.armed(phase):
            self.done.add(self.feed.step)
            raise torch.OutOfMemoryError(f"CUDA out of memory (testing.oom_at, step {self.feed.step}, {phase})")

    def install(self, engine: Any, model: torch.nn.Module) -> None:
        from zerotrain.recompute import checkpoint_units

        if not self.faults.oom_at:
            return
        units = list(checkpoint_units(model).values())
        units[len(units) // 2].register_forward_hook(self._forward)
        optimizer, step = engine.optimizer, engine.optimizer.step

        def stepping(*args: Any, **kwargs: Any) -> Any:
            self.fire("optimizer step")
            return step(*args, **kwargs)

        optimizer.step = stepping

    def _forward(self, _module: Any, _inputs: Any, output: Any) -> None:
        self.fire("forward")
        if self.armed("backward"):
            for tensor in output if isinstance(output, tuple) else (output,):
                if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                    tensor.register_hook(lambda _grad: self.fire("backward"))


@dataclasses.dataclass
class _Loss:
    """The objective's loss of one micro-batch's prediction (non-finite when poisoned)."""

    objective: Any
    inputs: Any
    device: torch.device
    poison: bool

    def __call__(self, pred: torch.Tensor) -> torch.Tensor:
        inputs = self.inputs
        loss = self.objective.loss(pred, dataclasses.replace(
            inputs, target=inputs.target.to(self.device),
            weights=None if inputs.weights is None else inputs.weights.to(self.device)))
        # A non-finite loss on any rank makes the reduced gradients of every rank non-finite, and
        # DeepSpeed skips the step on all of them (tests/distributed/test_bad_gradients.py): no
        # collective of zerotrain's own is needed per micro-batch.
        return loss * float("nan") if self.poison else loss


class Counter:
    """The optimizer steps trained, and the images they saw: checkpointed state of the loop."""

    def __init__(self, images_per_step: int):
        self.step, self.images_per_step = 0, images_per_step

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "images": self.step * self.images_per_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Checkpointer:
    """Saves and restores the engine, every rank's generators, the EMA's files and the state each
    component declares (checkpoint.save and load; zerotrain_state.json holds the components' states
    under their names, the step counter's at the top level)."""

    def __init__(self, engine: Any, run: RunConfig, topo: Topology, generators: dict[str, torch.Generator],
                 components: dict[str, Stateful], ema: Any = None):
        self.engine, self.run, self.topo, self.generators = engine, run, topo, generators
        self.components, self.ema = components, ema

    def due(self, step: int) -> bool:
        return step % self.run.training.checkpoint_every == 0 or step == self.run.training.max_steps

    def save(self, step: int) -> Path:
        from zerotrain.checkpoint import save

        PROGRESS.at("checkpoint")
        faults = self.run.testing
        state = {**self.components["counter"].state_dict(),
                 **{name: c.state_dict() for name, c in self.components.items() if name != "counter"}}
        kill = faults.kill.point if faults.kill and faults.kill.step == step else None
        return save(self.engine, self.run.output_dir, step, self.topo, state, self.generators,
                    self.run.training.keep_checkpoints, inject_failure=step in faults.save_failure_at,
                    extra=None if self.ema is None else self._save_ema, kill=kill)

    def _save_ema(self, folder: Path) -> None:
        self.ema.save(folder, self.topo.rank)

    def restore(self, checkpoint: Path, universal: Path | None) -> list[str]:
        """Load `checkpoint` into the engine and every component; returns warnings for the log."""
        from zerotrain.checkpoint import load

        state = load(self.engine, checkpoint, self.topo, self.generators, universal)
        notes = []
        if self.ema is not None and any(checkpoint.glob("ema-*.pt")):
            self.ema.load(checkpoint)
        elif self.ema is not None:
            notes.append(f"{checkpoint} holds no EMA (ema was not enabled when it was saved); the EMA starts from "
                         "the resumed weights")
        self.components["counter"].load_state_dict(state)
        for name, component in self.components.items():
            if name == "counter":
                continue
            try:
                component.load_state_dict(state[name])
            except ValueError as err:  # the data (or global batch) changed since the checkpoint
                notes.append(f"{err}; epoch {state[name]['epoch']} starts over with the current data")
                component.set_epoch(int(state[name]["epoch"]))
        return notes


class BadSteps:
    """Steps skipped in a row (a non-finite loss or gradient norm); after faults.max_bad_steps the
    run stops with a checkpoint of the last good weights."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def record(self, skipped: bool) -> bool:
        """Whether the run must stop after this step."""
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        return self.in_a_row >= self.limit

    def error(self, step: int, saved: Path) -> ZerotrainError:
        return ZerotrainError(
            f"{self.in_a_row} consecutive steps (up to step {step}) had a non-finite loss or gradient norm and "
            f"were skipped; stopped with {saved}, which holds the last good weights. Lower optimizer.lr or check "
            "the data, then resume (training.resume: auto)")


def agree(loss: torch.Tensor, stop_received: bool, topo: Topology, device: torch.device,
          ran_out: bool = False) -> tuple[float, bool, bool]:
    """One collective per step: the ranks' mean loss, whether any rank was asked to stop (a signal
    reaches ranks at different moments; all must stop after the same step), and whether any rank
    ran out of memory in it (every rank then drops the step)."""
    totals = torch.stack([loss.to(device), torch.tensor(float(stop_received), device=device),
                          torch.tensor(float(ran_out), device=device)])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(totals)
    return (totals[0] / topo.world_size).item(), totals[1].item() > 0, totals[2].item() > 0


@dataclasses.dataclass
class Trainer:
    """The loop of a built run: one iteration is one optimizer step of `accumulation`
    micro-batches."""

    engine: Any
    run: RunConfig
    topo: Topology
    device: torch.device
    feed: DataFeed
    counter: Counter
    checkpointer: Checkpointer
    stop: Any
    monitor: Any = None
    """The run's Monitor, made once the start step is known (after a resume)."""
    validator: Any = None
    ema: Any = None
    resumed: bool = False
    recovery: Any = None
    """faults.OomRecovery: where a step that runs out of memory goes (None: nowhere)."""

    def fit(self, accumulation: int) -> bool:
        """Train to max_steps: True when done, False when a signal stopped the run (after its
        checkpoint)."""
        if self.counter.step == 0:
            self.validate(0)
        bad = BadSteps(self.run.faults.max_bad_steps)
        while self.counter.step < self.run.training.max_steps:
            if not self.one_step(accumulation, bad):
                return False
        return True

    def one_step(self, accumulation: int, bad: BadSteps) -> bool:
        """Train, report and checkpoint one step; False when the run stops after it."""
        engine, counter, max_steps = self.engine, self.counter, self.run.training.max_steps
        lr = engine.get_lr()[0]  # this step's learning rate (engine.step() moves the schedule on)
        times = StepTimes(self.device)
        self.feed.begin(counter.step + 1)
        PROGRESS.step = counter.step + 1
        micro_steps, failure = engine.micro_steps, None
        try:
            loss = train_step(engine, self.feed, accumulation, times)
        except StepOutOfMemory as err:
            if not self.recoverable(err, counter.step + 1):
                raise
            failure, loss = one_line(err, 200), torch.tensor(float("nan"))
        PROGRESS.at("agreement")
        mean_loss, stopping, ran_out = agree(loss, bool(self.stop.received), self.topo, self.device, failure is not None)
        if ran_out:  # the failed step's tensors were released with the exception
            self.drop_step(micro_steps, failure)
            return True
        self.feed.sampler.advance()
        counter.step += 1
        step = counter.step
        skipped = not engine.was_step_applied()
        grad_norm = engine.get_global_grad_norm()
        self.monitor.step(step, self.feed.sampler.state_dict()["epoch"], mean_loss, lr,
                          None if grad_norm is None else float(grad_norm), times, skipped)
        self.monitor.memory_check(step)
        if self.ema is not None and not skipped:
            PROGRESS.at("EMA update")
            self.ema.update(step)
        if bad.record(skipped):
            raise bad.error(step, self.checkpointer.save(step))
        saved = self.checkpointer.save(step) if self.checkpointer.due(step) else None
        if stopping and step < max_steps:
            saved = saved or self.checkpointer.save(step)
            if self.topo.is_main:
                self.monitor.log(f"stopped by {self.stop.received or 'a signal on another rank'} during step "
                                 f"{step + 1}: checkpoint {saved}; resume with the same command (training.resume: auto)")
            return False
        self.validate(step)
        return True

    def recoverable(self, err: StepOutOfMemory, step: int) -> bool:
        """Whether every rank drops `step`, which ran out of memory here, and runs it again: in the recovery window
        (faults.OomRecovery.allowed), in a forward or backward, and only when every rank ran out of memory in it
        too (the same shapes fail on every GPU). A rank that ran out alone cannot be waited for: the others are
        inside the step's collectives (ZeRO-3's gathers, the gradients' reduction), which it will not join; it
        waits faults.lost_rank_seconds for the others, then the run stops (run_loop: the line goes to every
        rank)."""
        from zerotrain import distributed

        if err.phase == "optimizer step" or self.recovery is None or not self.recovery.allowed(step):
            return False
        heartbeat = distributed.CURRENT
        if heartbeat is None or heartbeat.everyone(f"oom/{step}/{self.recovery.retries_left}",
                                                   self.run.faults.lost_rank_seconds):
            return True
        err.alone = True
        return False

    def drop_step(self, micro_steps: int, failure: str | None) -> None:
        """Every rank drops the step that ran out of memory on one of them, frees what it held, and
        moves to the next rung (faults.OomRecovery); the step then runs again."""
        from zerotrain.deepspeed_compat import abandon_step
        from zerotrain.monitor import measured_peaks

        step = self.counter.step + 1
        if failure is None:  # this rank finished the step: its optimizer has stepped
            raise ZerotrainError(f"rank {self.topo.rank} finished step {step} while another rank ran out of memory "
                                 "in it: the ranks' weights now differ; stopping; resume from the last checkpoint "
                                 "(training.resume: auto) with more checkpointing (training.checkpoint_blocks)")
        peak = measured_peaks(self.device)["max_allocated"]
        abandon_step(self.engine, micro_steps)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        self.feed.rewind()
        self.recovery.recover(step, failure, peak, self.monitor)

    def validate(self, step: int) -> None:
        """Every rank renders its share of the validation images (with the EMA weights if asked)."""
        from zerotrain.engine import denoiser

        validator = self.validator
        if validator is None or not validator.due(step, self.run.training.max_steps, resumed=self.resumed):
            return
        PROGRESS.at("validation")
        with self.ema.applied() if self.run.validation.use_ema else contextlib.nullcontext():
            paths = validator.render(denoiser(self.engine), step, self.run.output_dir, self.monitor.writer)
        if paths:
            self.monitor.log(f"validation images of step {step}: {paths[-1].parent}")


# ---- a run's trainer as train.py builds and runs it ----

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


def pinning_warnings(run: RunConfig, planned: RunPlan, device: torch.device) -> list[str]:
    """A warning when this torch cannot pin the offloaded optimizer's host buffers as the plan counts them."""
    if (device.type == "cuda" and planned.layout.offload_optimizer == "cpu"
            and run.planner.pinned_exact_above_mib is not None and not exact_pinning_supported()):
        return [(f"torch {torch.__version__} rounds every pinned host buffer up to a power of two (no "
                 "pinned_max_round_threshold_mb before torch 2.13): the offload may take up to twice the planned host "
                 "RAM; plan with planner.pinned_exact_above_mib: null, or upgrade torch")]
    return []


def build_trainer(planned: RunPlan, folder: Path, topo: Topology, device: torch.device, loader, sampler) -> Trainer:
    """The model as planned (mode, checkpointing, offload, compilation), the engine, the EMA, and the
    loop's components."""
    from zerotrain import loading
    from zerotrain.ema import ShardedEMA
    from zerotrain.engine import apply_mode, build_engine
    from zerotrain.objectives import make_objective

    run, spec, layout = planned.run, planned.spec, planned.layout
    scheduler_config = families.of(spec).scheduler_config(folder)
    objective = make_objective(spec, scheduler_config, run.objective, run.data.resolution, model_dtype=torch.bfloat16)
    torch.manual_seed(run.training.seed)  # LoRA's initial weights come from torch's global generator
    model, done = loading.load(spec, folder, run, topo, device, planned.config)
    checkpointing = planned.result.checkpointed(layout)  # every block (True), the named ones, or none ([])
    done += apply_mode(model, spec, run, checkpointing, layout.offload_activations, layout.stage)
    if topo.is_main:
        print("\n".join(done), flush=True)
    engine = build_engine(model, planned.config, run, device)
    generator = torch.Generator().manual_seed(run.training.seed * 100_003 + topo.rank)
    ema = ShardedEMA(engine, run.ema.decay, run.ema.start_step) if run.ema.enabled else None
    counter = Counter(run.training.global_batch_size)
    checkpointer = Checkpointer(engine, run, topo, {"objective": generator}, {"counter": counter, "sampler": sampler},
                                ema)
    feed = DataFeed(loader, sampler, objective, generator, device, run.testing, topo.is_main, layout.accumulation)
    InjectedOom(run.testing, topo.rank, feed).install(engine, model)
    return Trainer(engine, run, topo, device, feed, counter, checkpointer, StopSignal(run.faults.grace_seconds),
                   ema=ema)


def make_monitor(planned: RunPlan, topo: Topology, device: torch.device, start_step: int) -> Monitor:
    from zerotrain.planner.search import describe

    run = planned.run
    return Monitor(run.output_dir, topo, device, max_steps=run.training.max_steps, start_step=start_step,
                   images_per_step=run.training.global_batch_size, predicted=planned.used.memory,
                   layout_text=describe(planned.layout), flops_per_image=planned.result.flops_per_sample,
                   peak_flops_per_gpu=planned.hw.peak_bf16_flops if device.type == "cuda" else None,
                   every=run.logging.every, tensorboard=run.logging.tensorboard,
                   progress_bar=run.logging.progress_bar, memory_check_step=run.logging.memory_check_step,
                   margin_bytes=planned.used.margin_bytes, wandb=wandb_setup(planned))


def wandb_setup(planned: RunPlan) -> tuple | None:
    """What the W&B run gets besides the scalars (logging.wandb): the resolved config, and the plan's
    summary (the layout, the predicted memory and speed)."""
    from zerotrain.planner.search import describe

    run, used = planned.run, planned.used
    if run.logging.wandb is None:
        return None
    summary = {"plan/layout": describe(used.layout), "plan/predicted_gib_per_gpu": used.memory.device_total / 2**30,
               "plan/predicted_images_per_second": used.images_per_second,
               "plan/gpus": planned.hw.world_size}
    return run.logging.wandb, run.model_dump(mode="json"), summary


def run_loop(trainer: Trainer, planned: RunPlan, device: torch.device) -> bool:
    """trainer.fit, with an out-of-memory step turned into one line: what was predicted, what was
    measured, and what to change."""
    from zerotrain.planner.search import describe

    run = planned.run
    try:
        return trainer.fit(planned.layout.accumulation)
    except torch.OutOfMemoryError as err:
        from zerotrain import distributed

        measured, used = measured_peaks(device), trainer.recovery.current
        step, phase = trainer.counter.step + 1, getattr(err, "phase", "step")
        where = f"rank {trainer.topo.rank} ran out of memory in the {phase} of step {step}"
        alone = " (the other ranks did not: a step is dropped only when every rank ran out in it)" \
            if getattr(err, "alone", False) else ""
        if distributed.CURRENT is not None:  # every other rank stops with it, wherever it waits
            distributed.CURRENT.post(f"{where}{alone} ({one_line(err, 160)})")
        raise ZerotrainError(
            f"CUDA out of memory: {where}{alone} with {describe(used.layout)}{moves(trainer)}: "
            f"the planner predicted {gib(used.memory.device_total)} per GPU, the peak measured on this rank was "
            f"{gib(measured['max_allocated'] or 0)} allocated, {gib(measured['max_reserved'] or 0)} reserved "
            f"({one_line(err, 200)}). {oom_advice(planned.result, used, run.planner.headroom)}. "
            "The last checkpoint is untouched") from err
    finally:
        trainer.stop.restore()
        trainer.monitor.close()


def moves(trainer: Trainer) -> str:
    """How the run got to its layout, for the out-of-memory line."""
    recovery = trainer.recovery
    done = len(recovery.adjusted) - len(recovery.planned.adjusted)
    if done:
        return f" (after {done} out-of-memory recover{'y' if done == 1 else 'ies'} this run)"
    return ""
