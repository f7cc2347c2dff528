"""What every launcher's recipe shares: the Recipe `zerotrain launch` produces, and the Request
(arguments, config, this machine) it is made from."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zerotrain.launch.commands import planner_overrides, train_arguments


@dataclass
class Recipe:
    """What `zerotrain launch` produces: the command --run executes (None for Slurm), the files
    to write (name -> text; the first is the script), and notes for the person launching."""

    launcher: str
    nodes: int
    gpus_per_node: int | None
    command: list[str] | None
    files: dict[str, str]
    notes: list[str] = field(default_factory=list)
    hostfile: Path | None = None  # where a generated hostfile must be written for --run


@dataclass
class Request:
    """One `zerotrain launch`: its arguments, the config they load, and this machine's state."""

    args: argparse.Namespace
    run: Any  # RunConfig
    hosts: list[str] | None
    environ: Mapping[str, str]
    nvml: Any
    script: str

    def train_args(self, nodes: int, gpus: int | None) -> tuple[list[str], str]:
        """train.py's arguments with the planner told the topology, and the `zerotrain plan` command
        that shows the same plan."""
        overrides = [*self.args.overrides, *planner_overrides(self.run.hardware.gpus, nodes, gpus)]
        plan = "zerotrain plan --config " + shlex.quote(str(self.args.config))
        plan += "".join(f" --set {shlex.quote(o)}" for o in overrides)
        return train_arguments(self.script, self.args.config, overrides), plan
