"""Checkpoints that resume exactly: DeepSpeed's engine state (every rank takes part), the
sampler position, every random number generator, step counters, the config and the plan.

RUN/checkpoints/<tag>/ holds DeepSpeed's files, rng-<rank>.pt per rank and zerotrain_state.json.
RUN/checkpoints/latest names the newest complete tag. It is written (atomically, by rank 0)
only after every rank has finished saving, so a checkpoint interrupted mid-write is never
chosen. The newest `keep` checkpoints are kept."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zerotrain.distributed import Topology, barrier
from zerotrain.errors import ZerotrainError

LATEST = "latest"
STATE = "zerotrain_state.json"


def tag_for(step: int) -> str:
    return f"step-{step:08d}"


def rng_state(generators: dict[str, torch.Generator]) -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "generators": {name: g.get_state() for name, g in generators.items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any], generators: dict[str, torch.Generator]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for name, g in generators.items():
        g.set_state(state["generators"][name])


def save(engine: Any, run_dir: Path, step: int, topo: Topology, state: dict[str, Any],
         generators: dict[str, torch.Generator], keep: int) -> Path:
    """Every rank calls this. Returns the checkpoint folder."""
    root = run_dir / "checkpoints"
    tag = tag_for(step)
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    torch.save(rng_state(generators), root / tag / f"rng-{topo.rank}.pt")
    barrier()
    if topo.is_main:
        (root / tag / STATE).write_text(json.dumps(state, indent=1, default=str))
        tmp = root / f"{LATEST}.tmp"
        tmp.write_text(tag)
        os.replace(tmp, root / LATEST)
        complete = sorted(p for p in root.glob("step-*") if (p / STATE).is_file())
        for old in complete[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return root / tag


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


def load(engine: Any, checkpoint: Path, topo: Topology, generators: dict[str, torch.Generator]) -> dict[str, Any]:
    """Restore the engine, this rank's generators, and return zerotrain's state (step, sampler)."""
    loaded, _ = engine.load_checkpoint(str(checkpoint.parent), tag=checkpoint.name)
    if loaded is None:
        raise ZerotrainError(f"{checkpoint}: DeepSpeed could not load this checkpoint")
    rng_file = checkpoint / f"rng-{topo.rank}.pt"
    if rng_file.is_file():
        restore_rng(torch.load(rng_file, weights_only=False), generators)
    return json.loads((checkpoint / STATE).read_text())
