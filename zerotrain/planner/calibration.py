"""Calibrations written by `zerotrain calibrate` (zerotrain/calibrate.py), and how a plan uses one:
the fitted constants replace the planner's textbook defaults for the fields the run config leaves
unset. Reading one imports no torch, so a calibrated plan stays instant."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path
from typing import Any

from zerotrain.config.sections import RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import HardwareFacts
from zerotrain.planner.facts import ModelFacts
from zerotrain.planner.memory import Layout
from zerotrain.planner.search import fetches

VERSION = 1
# planner.<field> constants a calibration may fit.
PLANNER_CONSTANTS = ("fragmentation", "cuda_context_bytes", "nccl_workspace_bytes", "cpu_adam_params_per_second",
                     "host_offload_factor", "activation_margin", "stage3_fetch_latency")
# What a ZeRO-3 row and its companion at a lower stage must share to run the same FLOPs the same way.
SAME_WORK = ("micro_batch", "accumulation", "gradient_checkpointing", "checkpointed_blocks", "offload_activations",
             "offload_optimizer")


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
    cut = "" if data.get("complete", True) else \
        f", a run cut off after {len(data.get('measurements', []))} layouts (its .partial file)"
    return run, hw, f"Calibrated on {data['device']}, {data['date']} ({path}{cut}): {used}", margin_from


def fit_fetch_latency(rows: list[dict[str, Any]], facts: ModelFacts, persistence_threshold: int) -> float | None:
    """planner.stage3_fetch_latency from calibrate's rows (its calibration.json "measurements"): each
    clean ZeRO-3 row's forward and backward, less the median of its companions' (clean rows at a
    lower stage with the same micro-batch, accumulation, checkpointing and optimizer offload: the same
    FLOPs without fetches) and less its predicted parameter transfers, over its fetches
    (search.fetches with the model's facts and planner.stage3_param_persistence_threshold); the
    median over the rows, in seconds. A ZeRO-3 row without a companion is not used: its compute would
    come from the assumed MFU, whose error the fetches would absorb. The optimizer phase is not used,
    so a row's skipped steps do not matter. None: no usable ZeRO-3 row."""
    ok = [r for r in rows if r["status"] == "ok"]
    found = []
    for row in (r for r in ok if r["layout"]["stage"] == 3):
        layout = Layout(**row["layout"])
        companions = [r["measured"]["forward_backward_s"] for r in ok if r["layout"]["stage"] < 3
                      and all(r["layout"][key] == row["layout"][key] for key in SAME_WORK)]
        count = fetches(layout, facts, persistence_threshold)
        if not companions or not count:
            continue
        extra = (row["measured"]["forward_backward_s"] - statistics.median(companions)
                 - row["predicted"]["time_terms"].get("param transfers", 0.0))
        found.append(extra / count)
    return round(max(statistics.median(found), 0.0), 6) if found else None
