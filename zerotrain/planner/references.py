"""The reference images the planner traces for an edit run (issue 23): how many, and at what size."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from zerotrain import families
from zerotrain.config.sections import RunConfig
from zerotrain.errors import ZerotrainError

if TYPE_CHECKING:
    from zerotrain.protocols import ModelSpec


def plan_references(spec: ModelSpec, run: RunConfig) -> list[tuple[int, int]]:
    """The (width, height) in pixels of each reference image the planner traces: data.references of
    them (or as many as the datasets' controls), each sized as the family's pipeline sizes a square
    control for a square target at data.resolution (or at data.control_resolution)."""
    count = run.data.references
    if count is None:
        count = max((dataset_references(dataset.path, dataset.controls) for dataset in run.data.datasets), default=0)
    if not count:
        return []
    family = families.of(spec)
    if count > family.max_references(spec):
        field = "data.references" if run.data.references is not None else "data.datasets' controls"
        if not family.max_references(spec):
            raise ZerotrainError(f"{field}: {count} reference images, but {spec.name} ({family.pipeline_name(spec)}) "
                                 "takes none; plan an edit model (flux-kontext-dev, FLUX.2), or drop the references")
        raise ZerotrainError(f"{field}: {count} reference images, but {family.pipeline_name(spec)} takes at most "
                             f"{family.max_references(spec)}")
    side = run.data.resolution
    size = family.reference_size(spec, (side, side), (side, side), run.data.control_resolution)
    return [size] * count


def dataset_references(path: Path, controls: list[Path]) -> int:
    """Reference images per sample of one dataset: its control folders, or the most controls a line
    of its manifest names (0 for a path that is neither)."""
    if controls or not (path.is_file() and path.suffix == ".jsonl"):
        return len(controls)
    from zerotrain.data.dataset import manifest_control_count

    return manifest_control_count(path)
