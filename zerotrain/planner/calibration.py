"""Calibrations written by `zerotrain calibrate` (zerotrain/calibrate.py), and how a plan uses one:
the fitted constants replace the planner's textbook defaults for the fields the run config leaves
unset. Reading one imports no torch, so a calibrated plan stays instant."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from zerotrain.config.sections import RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import HardwareFacts

VERSION = 1
# planner.<field> constants a calibration may fit.
PLANNER_CONSTANTS = ("fragmentation", "cuda_context_bytes", "nccl_workspace_bytes", "cpu_adam_params_per_second",
                     "host_offload_factor", "activation_margin")


def default_path(profile: str) -> Path:
    """Where `zerotrain calibrate` on a GPU node keeps the calibration of its GPU profile."""
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "zerotrain" / "calibration" / f"{profile}.json"


def read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ZerotrainError(f"planner.calibration={path}: cannot read it ({err}); run zerotrain calibrate "
                             "again, or remove the field") from err
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("constants"), dict):
        raise ZerotrainError(f"planner.calibration={path}: not a calibration of this zerotrain (version "
                             f"{VERSION}); run zerotrain calibrate again")
    return data


def apply(run: RunConfig, hw: HardwareFacts, family: str) -> tuple[RunConfig, HardwareFacts, str | None, str | None]:
    """The run and hardware facts with a calibration's constants, the line the plan says about it
    (None without a calibration), and the device on which it measured planner.activation_margin
    (None: not measured; the default stands). Fields the config sets itself win over the calibration."""
    path = run.planner.calibration
    if path is None:
        path = default_path(hw.gpu_name)
        if not path.is_file():
            return run, hw, None, None
    data = read(path)
    constants = data["constants"]
    given = run.planner.model_fields_set
    update = {k: constants[k] for k in PLANNER_CONSTANTS if k in constants and k not in given}
    mfu = constants.get("assumed_mfu", {}).get(family)
    if mfu is not None and "assumed_mfu" not in given:
        update["assumed_mfu"] = mfu
    planner = run.planner.model_copy(update=update)
    run = run.model_copy(update={"planner": planner})
    if "host_to_device_bandwidth" in constants:
        hw = dataclasses.replace(hw, host_to_device_bandwidth=float(constants["host_to_device_bandwidth"]))
        update["host_to_device_bandwidth"] = constants["host_to_device_bandwidth"]
    used = ", ".join(sorted(update)) or "none of its constants (the config sets them all)"
    margin_from = data["device"] if "activation_margin" in update else None
    return run, hw, f"Calibrated on {data['device']}, {data['date']} ({path}): {used}", margin_from
