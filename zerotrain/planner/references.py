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
    them, or as many as the datasets' controls where those are more, or, with data.references unset, at
    least the edit pipeline's own (Family.min_references: an edit sample always has its reference); each
    the size the family's pipeline gives the largest square control (LARGEST_CONTROL) for a square target
    at data.resolution, or the size data.control_resolution gives it. The planner reads no image, so it
    plans for the most."""
    family = families.of(spec)
    given = run.data.references
    found = datasets_references(run)
    # The largest: a plan for fewer references than the data has would let the run run out of memory.
    count = max(given or 0, found, family.min_references(spec) if given is None else 0)
    if not count:
        return []
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


def references_reason(spec: ModelSpec, run: RunConfig) -> str | None:
    """The plan's line on the references it planned for: how many, at what size, and why that many."""
    references = plan_references(spec, run)
    if not references:
        return None
    family = families.of(spec)
    count, (width, height) = len(references), references[0]
    found = datasets_references(run)
    if run.data.references is not None and run.data.references >= found:
        why = "data.references (--references)"
    elif found >= family.min_references(spec):
        why = "the datasets' controls"
    else:
        why = (f"{family.pipeline_name(spec)} always takes {'one' if count == 1 else count}; data.references: 0 "
               "(--references 0) plans it for text to image")
    return f"{count} reference image{'s' if count > 1 else ''} per sample, each {width}x{height} px: {why}"


def datasets_references(run: RunConfig) -> int:
    """The most reference images per sample any of the run's datasets has."""
    return max((dataset_references(dataset.path, dataset.controls) for dataset in run.data.datasets), default=0)


def dataset_references(path: Path | str, controls: list[Path]) -> int:
    """Reference images per sample of one dataset: its control folders, or the most controls a line
    of its manifest names (0 for a path that is neither: tables and shards carry no controls)."""
    if controls or not (isinstance(path, Path) and path.is_file() and path.suffix == ".jsonl"):
        return len(controls)
    from zerotrain.data.dataset import manifest_control_count

    return manifest_control_count(path)
