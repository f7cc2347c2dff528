"""Checkpoints that resume exactly: DeepSpeed's engine state (every rank takes part), the
sampler position, every random number generator, step counters, the config and the plan.

RUN/checkpoints/<tag>/ holds DeepSpeed's files, rng-<rank>.pt per rank and zerotrain_state.json.
zerotrain_state.json is written last (atomically, by rank 0) and marks the tag complete: it
holds the size and SHA-256 of every other file of the tag, computed after every rank has
finished writing (and fsync'ed them). RUN/checkpoints/latest names the newest complete tag; it
moves (atomically, by rank 0) only after that, so a checkpoint interrupted mid-write is never
chosen. A write that fails on any rank (a full disk) is agreed on by every rank, so that none is
left waiting in a collective. The newest `keep` checkpoints are kept. Frozen parameters (a LoRA
run's base) are not saved: they come from the model folder at every start.

Before a resume, the ranks check the chosen checkpoint's files against those checksums
(`usable`). A damaged one (a truncated file, a flipped byte) is named, and with training.resume
auto the previous complete checkpoint is used instead; nothing damaged is ever loaded.

zerotrain's own files load with weights_only=True or are JSON: rng-<rank>.pt holds only tensors
and plain numbers. DeepSpeed's own files (model and optimizer states) are pickles that may hold
code: a checkpoint from someone else is to be trusted like code.

A checkpoint saved by another number of processes cannot be loaded as it is (DeepSpeed's optimizer
files are partitioned per rank). A resume keeps the ZeRO stage the checkpoint was saved under
(resume_stage: DeepSpeed cannot load one into another stage). It is converted once, by rank 0,
with DeepSpeed's universal checkpointing (deepspeed.checkpoint.ds_to_universal) into
<tag>/universal/, which every rank then loads with the config's checkpoint.load_universal. The
sampler re-partitions by global position (data/sampler.py), so no sample of the epoch repeats or
is skipped. Each rank restores its own rng-<rank>.pt where there is one; a rank the saving run
did not have keeps its freshly seeded generators."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import random
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerotrain import deepspeed_compat
from zerotrain.distributed import Topology, accelerator, all_ok, barrier, gather_objects, patient_barrier
from zerotrain.errors import ZerotrainError
from zerotrain.optimizers import CLIENT_OPTIMIZERS, name_of
from zerotrain.units import gib

LATEST = "latest"
STATE = "zerotrain_state.json"
UNIVERSAL = "universal"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def device_generator() -> torch.Generator | None:
    """The default generator of this rank's own accelerator device (CUDA: the current device, which the engine
    set from LOCAL_RANK), whose draws dropout and other device-side randomness take; None where the accelerator
    is the CPU, whose draws take torch's generator, saved beside. One device's, not every visible GPU's: a run
    resumed on fewer GPUs per node, or with one GPU per task, has no state to give the others."""
    if accelerator()[0] != "cuda":
        return None
    torch.cuda.init()
    return torch.cuda.default_generators[torch.cuda.current_device()]


def rng_state(generators: dict[str, torch.Generator], device: torch.Generator | None = None) -> dict[str, Any]:
    """Every generator's state as tensors and plain numbers (so it loads with weights_only=True): Python's,
    NumPy's, torch's, the run's own `generators`, and this rank's device's (`device`, device_generator())."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                    cached),
             "torch": torch.get_rng_state(), "generators": {name: g.get_state() for name, g in generators.items()}}
    if device is not None:
        state["device"] = device.get_state()
    return state


def restore_rng(state: dict[str, Any], generators: dict[str, torch.Generator],
                device: torch.Generator | None = None) -> None:
    """rng_state's generators set back; `device` (device_generator()) from the rank's device state. A checkpoint
    of zerotrain before 2026-12-07 holds every visible GPU's ("cuda", in device order): the rank takes its own
    device's, where that run had as many."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    saved = state.get("device")
    if saved is None and device is not None and "cuda" in state:
        index = torch.cuda.current_device()  # the device device_generator() gave
        saved = state["cuda"][index] if index < len(state["cuda"]) else None
    if device is not None and saved is not None:
        device.set_state(saved)
    for name, g in generators.items():
        g.set_state(state["generators"][name])


def layout(engine: Any) -> dict[str, Any]:
    """What a checkpoint's DeepSpeed files depend on: how many ranks partitioned it, how, and the
    optimizer (optimizer.name: its states' layout and dtypes)."""
    return {"world_size": engine.dp_world_size, "zero_stage": engine.zero_optimization_stage(),
            "optimizer": name_of(engine.optimizer)}


class _GuardedWrites:
    """DeepSpeed's checkpoint engine for one save, with the first write failure kept instead of
    raised: a rank that raised inside engine.save_checkpoint would leave the others waiting in its
    collectives (its barriers, ZeRO-3's gathers), so every rank goes through the whole save and the
    failure is agreed on afterwards. Later writes after a failure are skipped. `kill` (tests:
    testing.kill) ends the process with SIGKILL at that point of the write."""

    def __init__(self, inner: Any, kill: str | None):
        self.inner = inner
        self.kill = kill
        self.error: BaseException | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        if self.error is None:
            try:
                self.inner.makedirs(path, exist_ok=exist_ok)
            except OSError as err:
                self.error = err

    def save(self, state_dict: Any, path: str) -> None:
        if self.kill == "before_model":
            _kill_self()
        if self.kill == "optimizer" and "optim_states" in Path(path).name:
            _write_half_and_die(state_dict, path)
        if self.error is not None:
            return
        try:
            self.inner.save(state_dict, path)
        except (OSError, RuntimeError) as err:  # torch.save reports a full disk as a RuntimeError
            self.error = err if getattr(err, "filename", None) else OSError(
                getattr(err, "errno", None), f"torch.save failed ({' '.join(str(err).split())[:160]})", path)


def _kill_self() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _write_half_and_die(state_dict: Any, path: str) -> None:
    """What a process killed in the middle of writing a file leaves behind: its first half."""
    data = io.BytesIO()
    torch.save(state_dict, data)
    with open(path, "wb") as out:
        out.write(data.getbuffer()[: data.tell() // 2])
        out.flush()
        os.fsync(out.fileno())
    _kill_self()


def save(engine: Any, run_dir: Path, step: int, topo: Topology, state: dict[str, Any],
         generators: dict[str, torch.Generator], keep: int, inject_failure: bool = False,
         extra: Callable[[Path], Any] | None = None, kill: str | None = None) -> Path:
    """Every rank calls this. Returns the checkpoint folder.

    Nothing half-written is ever taken for a checkpoint: the ranks agree that every file was
    written, checksum the files, then rank 0 writes zerotrain_state.json and moves `latest`. If any
    rank fails (a full disk, an I/O error), the partial folder is removed, `latest` keeps naming the
    previous checkpoint, and every rank raises one ZerotrainError. inject_failure
    (testing.save_failure_at, for tests) makes rank 0 fail after DeepSpeed has written its
    files; kill (testing.kill) SIGKILLs this process at that point of the write.
    extra(folder) writes this rank's further files (the EMA) into the checkpoint, inside the same
    agreement."""
    from deepspeed.checkpoint.constants import (
        UNIVERSAL_CHECKPOINT_INFO,
        UNIVERSAL_CHECKPOINT_VERSION_KEY,
        UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    )

    root = run_dir / "checkpoints"
    tag = tag_for(step)
    folder = root / tag
    # ds_to_universal requires the client to declare the universal checkpoint version.
    info = {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}
    with deepspeed_compat.guarded_writes(engine, lambda inner: _GuardedWrites(inner, kill)) as guard:
        engine.save_checkpoint(str(root), tag=tag, client_state=info, save_latest=False, exclude_frozen_parameters=True)
    error = guard.error
    if error is None:
        try:
            if inject_failure and topo.is_main:
                raise OSError(errno.ENOSPC, "No space left on device (injected by testing.save_failure_at)",
                              str(folder / f"rng-{topo.rank}.pt"))
            torch.save(rng_state(generators, device_generator()), folder / f"rng-{topo.rank}.pt")
            if extra is not None:
                extra(folder)
        except (OSError, RuntimeError) as err:
            error = err
    if not all_ok(error is None):
        _abandon(folder, root, topo, error)
    files = checksums(folder, topo, fsync=True)
    if topo.is_main:
        try:
            _write_atomic(folder / STATE, json.dumps({**state, **layout(engine), "files": files}, indent=1,
                                                     default=str))
        except OSError as err:
            error = err
    if not all_ok(error is None):
        _abandon(folder, root, topo, error)
    if kill == "before_latest":
        _kill_self()
    if topo.is_main:
        try:
            _write_atomic(root / LATEST, tag)
        except OSError as err:
            error = err
    if not all_ok(error is None):
        _abandon(folder, root, topo, error)
    if topo.is_main:
        complete = sorted(p for p in root.glob("step-*") if (p / STATE).is_file())
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for partial in root.glob("step-*"):  # left by a run killed while writing it
            if partial.name < tag and not (partial / STATE).is_file():
                shutil.rmtree(partial, ignore_errors=True)
    barrier()
    return folder


def _sha256(path: Path, fsync: bool) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
        if fsync:  # the file's pages reach the disk before `latest` can name it
            os.fsync(f.fileno())
    return digest.hexdigest()


def _shares(folder: Path, names: list[str] | None, topo: Topology) -> tuple[list[str], list[str]]:
    """The files of `folder` (all of them, or `names`) that some rank sees, and those this rank
    hashes: each file goes to one of the ranks that see it (a multi-node job without a shared file
    system sees only its own node's files), in turn. Every rank calls this."""
    if names is None:
        names = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != STATE
                 and not p.relative_to(folder).as_posix().startswith(UNIVERSAL)]
    visible = {name for name in names if (folder / name).is_file()}
    seen: dict[str, list[int]] = {}
    for rank, found in enumerate(gather_objects(sorted(visible))):
        for name in found:
            seen.setdefault(name, []).append(rank)
    everywhere = sorted(seen)
    return everywhere, [name for i, name in enumerate(everywhere) if seen[name][i % len(seen[name])] == topo.rank]


def checksums(folder: Path, topo: Topology, fsync: bool = False) -> dict[str, dict[str, Any]]:
    """{relative path: {bytes, sha256}} of every file of a checkpoint folder, the hashing shared
    among the ranks that see each file. Every rank calls this and gets the whole result."""
    _, mine_names = _shares(folder, None, topo)
    mine = {name: {"bytes": (folder / name).stat().st_size, "sha256": _sha256(folder / name, fsync)}
            for name in mine_names}
    merged: dict[str, dict[str, Any]] = {}
    for part in gather_objects(mine):
        merged.update(part)
    return dict(sorted(merged.items()))


def damage(checkpoint: Path, topo: Topology) -> str | None:
    """What is wrong with a checkpoint's files, in one phrase, or None when every file has the size
    and SHA-256 recorded when it was saved. Every rank calls this (the hashing is shared)."""
    try:
        state = saved_state(checkpoint)
        recorded = state.get("files")
    except (OSError, ValueError) as err:
        problem: str | None = f"{checkpoint / STATE} cannot be read ({err})"
        recorded = None
    else:  # a checkpoint of an earlier zerotrain records none: nothing to check it against
        problem = None if recorded is None or isinstance(recorded, dict) else f"{checkpoint / STATE} is malformed"
    if problem is not None or not recorded:
        return problem
    names, mine = _shares(checkpoint, sorted(recorded), topo)
    found = [f"{checkpoint / name} is missing" for name in sorted(set(recorded) - set(names))]
    for name in mine:
        path, want = checkpoint / name, recorded[name]
        size = path.stat().st_size
        if size != want["bytes"]:
            found.append(f"{path} has {size} bytes, {want['bytes']} were written")
        elif _sha256(path, fsync=False) != want["sha256"]:
            found.append(f"{path} does not match its SHA-256 checksum")
    problems = sorted({p for part in gather_objects(found) for p in part})
    return None if not problems else problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")


def usable(run_dir: Path, chosen: Path | None, topo: Topology, fall_back: bool) -> Path | None:
    """The checkpoint to resume from: `chosen` if its files are intact; else (fall_back, i.e.
    training.resume auto) the newest older complete checkpoint that is, with a warning naming the
    damaged file; else one ZerotrainError. Every rank calls this."""
    if chosen is None:
        return None
    candidates = [chosen]
    if fall_back:
        candidates += sorted((p for p in (run_dir / "checkpoints").glob("step-*")
                              if p.name < chosen.name and (p / STATE).is_file()), reverse=True)
    reasons = []
    for candidate in candidates:
        problem = damage(candidate, topo)
        if problem is None:
            if reasons and topo.is_main:
                print(f"zerotrain: warning: {'; '.join(reasons)}; resuming from {candidate}, the newest intact "
                      "checkpoint", file=sys.stderr, flush=True)
            return candidate
        reasons.append(f"checkpoint {candidate} is damaged: {problem}")
    raise ZerotrainError(f"{'; '.join(reasons)}; no intact checkpoint is left to resume from: start over with "
                         "training.resume=none (or another output_dir), or restore the files from a copy")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _abandon(folder: Path, root: Path, topo: Topology, error: BaseException | None) -> None:
    """A save failed on some rank: remove what was written, keep `latest`, and stop every rank
    with the first rank's reason."""
    reasons = [r for r in gather_objects(None if error is None else f"{getattr(error, 'strerror', None) or error}: "
                                         f"{getattr(error, 'filename', None) or folder}") if r]
    if topo.is_main:
        shutil.rmtree(folder, ignore_errors=True)
    barrier()
    latest = root / LATEST
    previous = f"{root / latest.read_text().strip()} is still the latest checkpoint" if latest.is_file() \
        else "no earlier checkpoint exists"
    free = shutil.disk_usage(root).free if root.exists() else 0
    raise ZerotrainError(f"checkpoint {folder} could not be written ({reasons[0] if reasons else 'unknown error'}; "
                         f"{gib(free, units=('GiB', 'MiB'))} free there); {previous}; free space, then resume with the same "
                         "command (training.resume: auto)")


def find(run_dir: Path, resume: str | Path) -> Path | None:
    """The checkpoint to continue from: None to start fresh (resume=none, or auto with nothing
    saved yet); a path may be a checkpoint folder or a run folder."""
    if str(resume) == "none":
        return None
    if str(resume) == "auto":
        latest = run_dir / "checkpoints" / LATEST
        return run_dir / "checkpoints" / latest.read_text().strip() if latest.is_file() else None
    path = Path(resume)
    if (path / STATE).is_file():
        return path
    latest = path / "checkpoints" / LATEST
    if latest.is_file():
        return path / "checkpoints" / latest.read_text().strip()
    raise ZerotrainError(f"training.resume={resume}: holds no zerotrain checkpoint (no {STATE}, no checkpoints/{LATEST})")


def saved_state(checkpoint: Path) -> dict[str, Any]:
    return json.loads((checkpoint / STATE).read_text())


def resume_stage(run: Any, checkpoint: Path) -> Any:
    """The run config a resume plans with: planner.stages narrowed to the ZeRO stage the checkpoint
    was saved under. DeepSpeed 0.19 cannot load a checkpoint into another stage, not even through
    universal checkpointing (between ZeRO 0-2 and ZeRO-3 it opens the model-states file under the
    loading stage's name, and ds_to_universal's optimizer_state.pt differs: KeyError
    'optimizer_state_dict', "Empty ds_version"); the number of processes may change. A run whose
    planner.stages exclude the saved stage stops with one line."""
    state = saved_state(checkpoint)
    run = resume_optimizer(run, checkpoint, state.get("optimizer"))
    stage = state.get("zero_stage")
    if stage is None or list(run.planner.stages) == [stage]:
        return run
    if stage not in run.planner.stages:
        raise ZerotrainError(f"{checkpoint} was saved under ZeRO-{stage}, which planner.stages={list(run.planner.stages)} "
                             f"excludes; a checkpoint resumes under the ZeRO stage it was saved with (on any number of "
                             f"GPUs): add {stage} to planner.stages, or start over with training.resume=none")
    return run.model_copy(update={"planner": run.planner.model_copy(update={"stages": [stage]})})


def resume_optimizer(run: Any, checkpoint: Path, saved: str | None) -> Any:
    """The optimizer a resume uses: the one the checkpoint was saved with (its states' dtypes are in
    the files). optimizer.name auto takes it; another name stops with one line."""
    if saved is None or run.optimizer.name == saved:
        return run
    if run.optimizer.name != "auto":
        raise ZerotrainError(f"{checkpoint} was saved with optimizer {saved}, this run asks for {run.optimizer.name}; a "
                             f"checkpoint resumes with the optimizer it was saved with: set optimizer.name to {saved} "
                             "(or auto), or start over with training.resume=none")
    return run.model_copy(update={"optimizer": run.optimizer.model_copy(update={"name": saved})})


def needs_universal(checkpoint: Path, world_size: int, zero_stage: int) -> bool:
    """Whether the checkpoint was partitioned for another world size than this run's (and so must be
    converted to a universal checkpoint). Another ZeRO stage (a given DeepSpeed JSON's) is refused
    with one line: see resume_stage."""
    state = saved_state(checkpoint)
    if state.get("zero_stage") not in (None, zero_stage):
        raise ZerotrainError(f"{checkpoint} was saved under ZeRO-{state['zero_stage']}, this run's DeepSpeed config "
                             f"uses ZeRO-{zero_stage}; a checkpoint resumes under the ZeRO stage it was saved with "
                             f"(on any number of GPUs): set zero_optimization.stage to {state['zero_stage']}, or "
                             "start over with training.resume=none")
    if state.get("world_size") == world_size:
        return False
    if state.get("optimizer") in CLIENT_OPTIMIZERS:
        raise ZerotrainError(f"{checkpoint} was saved by {state['world_size']} process(es) with optimizer "
                             f"{state['optimizer']}, whose state DeepSpeed cannot convert for {world_size}: its universal "
                             "checkpoints know only its own AdamW's per-parameter state. Resume it on "
                             f"{state['world_size']} GPU(s), or start over with training.resume=none")
    return True


def make_universal(checkpoint: Path, topo: Topology) -> Path:
    """The checkpoint in DeepSpeed's universal format (<tag>/universal), converted by rank 0 the
    first time it is needed: into a temporary folder, renamed when complete, so that an
    interrupted conversion is redone rather than loaded. Every rank calls this."""
    target = checkpoint / UNIVERSAL
    if topo.is_main and not target.is_dir():
        partial = checkpoint / f"{UNIVERSAL}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        print(f"converting {checkpoint} to a universal checkpoint for {topo.world_size} process(es)", flush=True)
        try:
            deepspeed_compat.to_universal(checkpoint, partial)
        except ZerotrainError as err:
            raise ZerotrainError(f"{checkpoint}: DeepSpeed cannot convert it to a universal checkpoint ({err}); "
                                 "resume with the world size and ZeRO stage it was saved with "
                                 f"({saved_state(checkpoint)})") from err
        os.replace(partial, target)
    patient_barrier("rank 0's conversion to a universal checkpoint")
    return target


def load(engine: Any, checkpoint: Path, topo: Topology, generators: dict[str, torch.Generator],
         universal: Path | None = None) -> dict[str, Any]:
    """Restore the engine (from `universal`, the converted checkpoint, when given), this rank's
    generators, and return zerotrain's state (step, sampler). Frozen parameters are not in the
    checkpoint (they were loaded from the model folder); every trainable one must be."""
    source = universal or checkpoint
    missing = [name for name, p in engine.module.named_parameters() if p.requires_grad]
    loaded, _ = engine.load_checkpoint(str(source.parent), tag=source.name, load_module_strict=False)
    if loaded is None:
        raise ZerotrainError(f"{checkpoint}: DeepSpeed could not load this checkpoint")
    replay_cpu_adam_steps(engine)
    saved = set(_module_names(source))
    missing = [name for name in missing if name not in saved]
    if missing:
        raise ZerotrainError(f"{checkpoint}: {len(missing)} trained tensors are not in it, e.g. {missing[0]}; "
                             "was it saved by a run of another model or training mode?")
    rng_file = checkpoint / f"rng-{topo.rank}.pt"
    if rng_file.is_file():
        restore_rng(torch.load(rng_file, weights_only=True), generators, device_generator())
    return json.loads((checkpoint / STATE).read_text())


def replay_cpu_adam_steps(engine: Any) -> None:
    """Make a resumed run's CPU Adam bit-identical to an uninterrupted one.

    DeepSpeed's CPU Adam kernels (DeepSpeedCPUAdam, used whenever the optimizer is offloaded, and
    FusedAdam on the CPU accelerator) keep beta^t for the bias correction in a C++ object of the
    process: one multiplication per step, but std::pow when the step jumps, as it does at the
    first step after a resume. The two round differently in float, so without this the resumed
    weights drift from the uninterrupted ones in the last bit at some steps. Replaying steps
    1..t through the kernel on empty tensors rebuilds the same product. (CUDA's FusedAdam
    recomputes pow at every step and needs nothing.)"""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

    basic = getattr(engine.optimizer, "optimizer", engine.optimizer)
    on_cpu = isinstance(basic, FusedAdam) and get_accelerator().device_name() == "cpu"
    if not (isinstance(basic, DeepSpeedCPUAdam) or on_cpu):
        return
    steps = [int(state["step"]) for state in basic.state.values() if "step" in state]
    if steps and not deepspeed_compat.replay_adam_steps(basic, max(steps)) \
            and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        print("zerotrain: warning: CPU Adam's bias correction is not replayed on this DeepSpeed version (untested): "
              "the resumed steps may differ from an uninterrupted run in the last bit", file=sys.stderr, flush=True)


def _module_names(checkpoint: Path) -> list[str]:
    """Parameter names in a DeepSpeed checkpoint's (first) model-states file."""
    files = sorted(checkpoint.glob("*mp_rank_00_model_states.pt"))
    if not files:
        return []
    return list(torch.load(files[0], map_location="cpu", weights_only=False, mmap=True).get("module") or {})
