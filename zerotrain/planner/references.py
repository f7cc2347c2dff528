"""The reference images the planner traces for an edit run (issue 23): how many, and at what size."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from zerotrain import families
from zerotrain.config.sections import RunConfig
from zerotrain.errors import ZerotrainError

if TYPE_CHECKING:
    from zerotrain.protocols import ModelSpec


# The side of the square control image the planner sizes references for: larger than any pipeline's
# area cap, so that a family which encodes a control at its own size up to a cap (FLUX.2: 1024 x 1024
# pixels) is planned at that cap; the data's controls, when smaller, need less.
LARGEST_CONTROL = 8192


def plan_references(spec: ModelSpec, run: RunConfig) -> list[tuple[int, int]]:
    """The (width, height) in pixels of each reference image the planner traces: data.references of
    them, or as many as the datasets' controls where those are more; each the size the family's pipeline
    gives the largest square control (LARGEST_CONTROL) for a square target at data.resolution, or the
    size data.control_resolution gives it. The planner reads no image, so it plans for the most."""
    given = run.data.references or 0
    found = max((dataset_references(dataset.path, dataset.controls) for dataset in run.data.datasets), default=0)
    # The larger of the two: a plan for fewer references than the data has would let the run run out of memory.
    count = max(given, found)
    if not count:
        return []
    family = families.of(spec)
    if count > family.max_references(spec):
        field = "data.references" if given >= found else "data.datasets' controls"
        if not family.max_references(spec):
            raise ZerotrainError(f"{field}: {count} reference images, but {spec.name} ({family.pipeline_name(spec)}) "
                                 f"{family.no_references(spec)}; plan an edit model (flux-kontext-dev, FLUX.2, "
                                 "FLUX.3 [klein]), or drop the references")
        raise ZerotrainError(f"{field}: {count} reference images, but {family.pipeline_name(spec)} takes at most "
                             f"{family.max_references(spec)}")
    side = run.data.resolution
    size = family.reference_size(spec, (side, side), (LARGEST_CONTROL, LARGEST_CONTROL), run.data.control_resolution)
    return [size] * count


def dataset_references(path: Path, controls: list[Path]) -> int:
    """Reference images per sample of one dataset: its control folders, or the most controls a line
    of its manifest names (0 for a path that is neither)."""
    if controls or not (path.is_file() and path.suffix == ".jsonl"):
        return len(controls)
    from zerotrain.data.dataset import manifest_control_count

    return manifest_control_count(path)
