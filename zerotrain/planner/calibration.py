"""Calibrations written by `zerotrain calibrate` (zerotrain/calibrate.py), and how a plan uses one:
the fitted constants replace the planner's defaults for the fields the run config leaves unset,
each where it holds. Constants of the GPU, its host and their link (HARDWARE) hold for every plan
of the calibrated GPU profile, whatever it trains. Constants of the workload measured (WORKLOAD)
hold only for a plan in the calibration's lane (Lane): the same family, mode, checkpointing and
resolution band; any other plan keeps the defaults, and its plan line says why. Reading one imports
no torch, so a calibrated plan stays instant."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotrain.config.sections import Mode, Quantization, RunConfig
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import HardwareFacts
from zerotrain.planner.facts import ModelFacts
from zerotrain.planner.memory import Layout
from zerotrain.planner.search import fetches

VERSION = 1
# Constants of the GPU, its host and the link between them: memory outside the allocator, the host's
# CPU Adam rate and its pinned buffers, the copy bandwidth, ZeRO-3's fixed cost per module fetch (a
# stream synchronization and DeepSpeed's hooks, the compute of the module taken out by the fit).
# They transfer to any model, mode and resolution planned for the same GPU profile.
HARDWARE = ("cuda_context_bytes", "nccl_workspace_bytes", "cpu_adam_params_per_second", "host_offload_factor",
            "stage3_fetch_latency", "host_to_device_bandwidth")
# Constants of the workload measured: the error of the traced activations, the allocator's overhead
# over them, the achieved MFU. They apply to a plan in the calibration's lane only.
WORKLOAD = ("activation_margin", "fragmentation", "assumed_mfu")
# What a ZeRO-3 row and its companion at a lower stage must share to run the same FLOPs the same way.
SAME_WORK = ("micro_batch", "accumulation", "gradient_checkpointing", "checkpointed_blocks", "offload_activations",
             "offload_optimizer")
# The resolution bands, by their largest square side in pixels (a last band holds everything above):
# the workload constants are shares of the traced activations, and what those shares rest on (how
# much of a block's memory is attention, how the allocator packs its tensors) moves with the tokens
# per image. Above 512 px, the pixels within a band change by at most 4x; 512, 1024 and 2048 px, the
# usual training sizes, are each the top of their band.
BANDS = (512, 1024, 2048)
CHECKPOINTING = {"auto": "checkpointing left to the planner", "none": "no checkpointing",
                 "all": "every block checkpointed", "some": "a set count of blocks checkpointed (training.checkpoint_blocks)"}


@dataclass(frozen=True)
class Lane:
    """What a calibration's workload constants were measured on, and what a plan trains: the family,
    the mode (full, or the adapter with DoRA and a quantized base), the checkpointing the run config
    asks of the planner (CHECKPOINTING: it decides which layouts the planner, and calibrate's grid
    around the plan, consider) and the training resolution, compared by its band (BANDS)."""

    family: str
    mode: str
    checkpointing: str
    resolution: int

    @classmethod
    def of(cls, run: RunConfig, family: str) -> Lane:
        training = run.training
        mode = "full"
        if training.mode is Mode.lora:
            lora = training.lora
            mode = lora.type + ("+dora" if lora.use_dora else "")
            if training.quantize_base is not Quantization.none:
                mode += f" over {training.quantize_base.value}"
        if training.checkpoint_blocks is not None:
            checkpointing = "some"
        else:
            checkpointing = {True: "all", False: "none"}.get(training.gradient_checkpointing, "auto")
        return cls(family, mode, checkpointing, run.data.resolution)

    @classmethod
    def from_json(cls, data: Any) -> Lane | None:
        try:
            return cls(str(data["family"]), str(data["mode"]), str(data["checkpointing"]), int(data["resolution"]))
        except (TypeError, KeyError, ValueError):
            return None

    @property
    def band(self) -> int:
        """The largest side of the resolution's band (BANDS); 0: above the largest."""
        return next((side for side in BANDS if self.resolution <= side), 0)

    def band_text(self) -> str:
        return f"up to {self.band}²" if self.band else f"above {BANDS[-1]}²"

    def differences(self, other: Lane) -> list[str]:
        """The dimensions in which `other` is another lane."""
        found = [name for name in ("family", "mode", "checkpointing") if getattr(self, name) != getattr(other, name)]
        return found + (["resolution band"] if self.band != other.band else [])

    def describe(self) -> str:
        return (f"{self.family} {self.mode} at {self.resolution} px ({self.band_text()}), "
                f"{CHECKPOINTING.get(self.checkpointing, self.checkpointing)}")


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


def measured_lanes(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A calibration's lanes, each with its workload constants and where and when they were measured:
    the document's own first ("lane": none in a calibration older than lanes), then those it kept
    from the calibration it replaced ("lanes", kept_lanes)."""
    own = {"lane": data.get("lane"), "device": data["device"], "date": data["date"], "model": data.get("model"),
           "constants": {k: v for k, v in data["constants"].items() if k in WORKLOAD}}
    return [own, *(entry for entry in data.get("lanes") or [] if isinstance(entry, dict))]


def kept_lanes(path: Path, lane: Lane, profile: str) -> list[dict[str, Any]]:
    """The lanes of the calibration at `path` that a new calibration of `lane` keeps beside its own:
    the other lanes of a calibration of the same GPU profile (the new one's hardware constants, and
    its lane's workload constants, replace the old). None from a missing or unreadable file."""
    try:
        data = read(path)
    except ZerotrainError:
        return []
    if data.get("profile") != profile:
        return []
    kept = []
    for entry in measured_lanes(data):
        other = Lane.from_json(entry.get("lane"))
        if other is not None and other.differences(lane) and entry.get("constants"):
            kept.append({**entry, "lane": dataclasses.asdict(other)})
    return kept


def apply(run: RunConfig, hw: HardwareFacts, family: str) -> tuple[RunConfig, HardwareFacts, str | None, str | None]:
    """The run and hardware facts with a calibration's constants, the line the plan says about it
    (None without a calibration), and where it measured planner.activation_margin (None: not for
    this plan; the default stands). Its HARDWARE constants apply to every plan of the GPU profile;
    its WORKLOAD constants only from the lane that is this run's (Lane.of), and the line says which
    calibration, which constants, and why the others were not used. Fields the config sets itself win."""
    path = run.planner.calibration
    if path is None:
        path = default_path(hw.gpu_name)
        if not path.is_file():
            return run, hw, None, None
    data = read(path)
    given = run.planner.model_fields_set
    hardware = {k: v for k, v in data["constants"].items() if k in HARDWARE and k not in given}
    lanes = measured_lanes(data)
    here = Lane.of(run, family)
    entry = next((e for e in lanes if in_lane(e, here)), None)
    workload = {} if entry is None else unset_workload(entry["constants"], family, given)
    planner = {k: v for k, v in {**hardware, **workload}.items() if k != "host_to_device_bandwidth"}
    run = run.model_copy(update={"planner": run.planner.model_copy(update=planner)})
    if "host_to_device_bandwidth" in hardware:
        hw = dataclasses.replace(hw, host_to_device_bandwidth=float(hardware["host_to_device_bandwidth"]))
    said = [f"{', '.join(sorted(hardware))} (the GPU profile's)"] if hardware else []
    margin_from = None
    if workload:
        lane = Lane.from_json(entry["lane"]).describe()  # type: ignore[union-attr]  (in_lane read it)
        when = "" if entry is lanes[0] else f", measured {entry['date']}"
        said.append(f"{', '.join(sorted(workload))} (this plan's lane: {lane}{when})")
        margin_from = f"{entry['device']} for {lane}" if "activation_margin" in workload else None
    unused = set() if entry is not None else {k for e in lanes for k in unset_workload(e["constants"], None, given)}
    if unused:
        said.append(f"{', '.join(sorted(unused))} not used: {outside_lane(lanes, here)}")
    cut = "" if data.get("complete", True) else \
        f", a run cut off after {len(data.get('measurements', []))} layouts (its .partial file)"
    used = "; ".join(said) or "none of its constants (the config sets them all)"
    return run, hw, f"Calibrated on {data['device']}, {data['date']} ({path}{cut}): {used}", margin_from


def in_lane(entry: dict[str, Any], here: Lane) -> bool:
    """Whether a calibration's lane (measured_lanes) is `here`: none recorded is no lane."""
    lane = Lane.from_json(entry.get("lane"))
    return lane is not None and not lane.differences(here)


def unset_workload(constants: dict[str, Any], family: str | None, given: set[str]) -> dict[str, Any]:
    """A lane's workload constants for the planner fields the config leaves unset: assumed_mfu the
    family's (any family's with family None)."""
    found = {k: constants[k] for k in WORKLOAD if k in constants and k != "assumed_mfu" and k not in given}
    mfu = constants.get("assumed_mfu") or {}
    mfu = mfu.get(family) if family is not None else next(iter(mfu.values()), None)
    if mfu is not None and "assumed_mfu" not in given:
        found["assumed_mfu"] = mfu
    return found


def outside_lane(lanes: list[dict[str, Any]], here: Lane) -> str:
    """Why no lane of a calibration is this plan's, in words."""
    known = [lane for e in lanes if (lane := Lane.from_json(e.get("lane"))) is not None]
    if not known:
        return ("the calibration records no lane (family, mode, checkpointing, resolution) that they hold for; "
                "zerotrain calibrate records it")
    others = f" and {len(known) - 1} other lane{'s' * (len(known) > 2)}" if len(known) > 1 else ""
    return (f"measured for {known[0].describe()}{others}; this plan is {here.describe()} "
            f"(another {', '.join(known[0].differences(here))})")


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
