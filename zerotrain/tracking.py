"""Where a run's scalars and validation images go besides metrics.jsonl: TensorBoard's event files
and, with logging.wandb, a Weights & Biases run. Both take the same calls (add_scalar, add_image,
close: TensorBoard's SummaryWriter interface), so the monitor and the validator write once to
Writers, which hands each call to every writer. Rank 0 only.

wandb is an optional extra (pip install 'zerotrain[wandb]'): it is imported only when
logging.wandb is set. The W&B run's id is kept in <output_dir>/wandb_id, so a resumed run logs
to the same W&B run; its files go under <output_dir>/wandb (WANDB_MODE=offline keeps them there
without a network, for `wandb sync` later)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from zerotrain.config.sections import WandbConfig
from zerotrain.errors import ZerotrainError

ID_FILE = "wandb_id"


class Writers:
    """Every call handed to each writer."""

    def __init__(self, writers: list[Any]):
        self.writers = writers

    def add_scalar(self, name: str, value: float, step: int) -> None:
        for writer in self.writers:
            writer.add_scalar(name, value, step)

    def add_image(self, name: str, image: Any, step: int, dataformats: str = "HWC") -> None:
        for writer in self.writers:
            writer.add_image(name, image, step, dataformats=dataformats)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


class WandbWriter:
    """A W&B run taking SummaryWriter's calls: a step's values are sent together when a later step
    starts (wandb.log with the step and commit=False), and everything at close."""

    def __init__(self, config: WandbConfig, run_dir: Path, resolved: dict[str, Any], summary: dict[str, Any]):
        try:
            import wandb
        except ImportError as err:
            raise ZerotrainError("logging.wandb is set, but wandb is not installed: pip install 'zerotrain[wandb]' "
                                 "(or remove logging.wandb)") from err
        self.wandb = wandb
        run_id = run_identity(run_dir)
        try:
            self.run = wandb.init(project=config.project, entity=config.entity, name=config.name or run_dir.name,
                                  tags=config.tags or None, id=run_id, resume="allow", dir=str(run_dir),
                                  config=resolved)
        except Exception as err:  # wandb raises its own errors (login, network, permissions)
            raise ZerotrainError(f"logging.wandb: W&B did not start a run ({' '.join(str(err).split())[:300]}); "
                                 "run `wandb login`, or set WANDB_MODE=offline to log to the run folder") from err
        self.run.summary.update(summary)

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.run.log({name: value}, step=step, commit=False)

    def add_image(self, name: str, image: Any, step: int, dataformats: str = "HWC") -> None:
        if dataformats != "HWC":
            raise ValueError(f"WandbWriter.add_image: HWC arrays only, got {dataformats}")
        self.run.log({name: self.wandb.Image(image)}, step=step, commit=False)

    def close(self) -> None:
        self.run.finish()


def run_identity(run_dir: Path) -> str:
    """The W&B run id of this run folder: the one kept in wandb_id, or a new one (12 random
    lowercase hex digits, as W&B's ids are letters and digits) written there atomically for a
    resume to find."""
    path = run_dir / ID_FILE
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = secrets.token_hex(6)
    tmp = path.with_name(f"{ID_FILE}.{os.getpid()}.tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id
