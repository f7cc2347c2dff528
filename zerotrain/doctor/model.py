"""`zerotrain doctor`'s model checks: whether the files training reads are on this node (a local folder, the
hub cache), what a run would download from the hub, and the plan for this machine."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from zerotrain.doctor.base import Context, Finding, Missing, _layout_words, _size, _truthy
from zerotrain.units import gib


def _hub_cache_dir(environ: Mapping[str, str]) -> Path:
    """The hub cache a new process would use (huggingface_hub.constants, read from the environment now,
    since the library reads it once at import)."""
    explicit = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(os.path.expandvars(os.path.expanduser(explicit)))
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(os.path.expandvars(os.path.expanduser(home))) / "hub"


def _hub_offline(environ: Mapping[str, str]) -> bool:
    return _truthy(environ.get("HF_HUB_OFFLINE") or environ.get("TRANSFORMERS_OFFLINE"))


def _hub_finding(ctx: Context, repo: str, size_hint: Callable[[], str] = lambda: "") -> Finding:
    """Which of the files training reads of a hub repo are on this node, in which hub cache, and what the
    run would download (asking the hub for the repo's file list unless HF_HUB_OFFLINE is set). size_hint
    is called only where the hub gave no sizes."""
    from zerotrain.errors import ZerotrainError
    from zerotrain.models.hub import survey

    cache, offline, revision = _hub_cache_dir(ctx.environ), _hub_offline(ctx.environ), ctx.run.model.revision
    fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    spec = ctx.spec
    if isinstance(spec, Missing):
        return Finding("fail", spec.reason, "fix model.name_or_path")
    try:
        found = survey(spec, repo, revision, "train", cache=cache, offline=offline)
    except ZerotrainError as err:
        return Finding("fail", str(err), "fix what it names; `zerotrain doctor` checks again without training")
    total = sum(size or 0 for size in found.sizes.values())
    count = f"{len(found.sizes)} files training reads" + (f" ({_size(total)})" if found.online else "")
    missing, example = found.missing, ", ".join(found.missing[:3]) + (", ..." if len(found.missing) > 3 else "")
    if not missing:
        return Finding("ok", f"{found.where}: all {count} are in the hub cache {cache}")
    if not found.online:
        return Finding("fail", f"{found.where}: {len(missing)} of the {count} are not in the hub cache {cache} ({example}), "
                               "and the hub cannot be reached (HF_HUB_OFFLINE is set, or no network): training stops "
                               "before its cache build",
                       f"where there is network run `{fetch}` (with this HF_HOME / HF_HUB_CACHE), or download it to "
                       "a folder and set model.name_or_path to it; or unset HF_HUB_OFFLINE")
    size = found.missing_bytes
    return Finding("warn", f"{found.where}: {len(missing)} of the {count} are not on this node ({example}): the run "
                           f"downloads {_size(size) if size is not None else 'them'}{size_hint() if size is None else ''} "
                           f"into {cache} before its cache build, once per node",
                   f"to download ahead: `{fetch}` (the whole repo; gated repos: accept the license on huggingface.co "
                   "and set HF_TOKEN, or `hf auth login`, first)")


def _denoiser_size(ctx: Context) -> str:
    facts = ctx.facts
    return "" if isinstance(facts, Missing) else f" (the denoiser alone is {_size(2 * facts.total_params)} in bf16)"


def check_model(ctx: Context) -> Finding:
    from zerotrain.errors import ZerotrainError
    from zerotrain.models.catalog import HUB_ID, catalog_names, resolve_model
    from zerotrain.models.hub import check_folder

    model = ctx.run.model
    name = model.name_or_path
    if name in catalog_names():
        spec = resolve_model(model)  # a catalog entry resolves offline
        if spec.pretrained is None:
            return Finding("ok", f"{name} is built locally on first use (random weights, for tests and CPU demos)")
        # A catalog architecture is measured offline, so its size can be told; a bare hub id's config
        # would need the network.
        return _hub_finding(ctx, spec.pretrained, lambda: _denoiser_size(ctx))
    path = Path(name).expanduser()
    if path.exists():
        spec = ctx.spec
        if isinstance(spec, Missing):
            return Finding("fail", spec.reason, "point model.name_or_path at a diffusers model folder")
        if path.is_file():
            return Finding("warn", f"{path} is a bare config.json: it plans, but caching and training need the "
                                   "weights", "point model.name_or_path at the diffusers model folder or hub id")
        try:
            check_folder(spec, Path(spec.pretrained), "train")
        except ZerotrainError as err:
            return Finding("fail", str(err), "complete the folder, or point model.name_or_path at the whole pipeline")
        return Finding("ok", f"local folder {path}: every file training reads is there ({spec.class_name})")
    if HUB_ID.match(name) and not name.endswith(".json"):
        return _hub_finding(ctx, name)
    return Finding("fail", f"model.name_or_path={name}: no such folder or file, and not a catalog name or hub id",
                   f"fix the path, or use a catalog name ({', '.join(catalog_names())}) or a hub id (owner/name)")


def check_denoiser(ctx: Context) -> Finding:
    """Where model.denoiser is, how large, whether this node has it, and what the run does with it first."""
    from zerotrain.errors import ZerotrainError
    from zerotrain.models.denoiser import source_of

    model = ctx.run.model
    if model.denoiser is None:
        return Finding("skip", "no model.denoiser: the pipeline's own denoiser trains")
    spec = ctx.spec
    if isinstance(spec, Missing):
        return Finding("fail", spec.reason, "fix model.denoiser (or model.name_or_path)")
    try:
        source = source_of(model)
    except ZerotrainError as err:
        return Finding("fail", str(err), "fix model.denoiser")
    written = ctx.run.data.cache_dir / "models"
    if source.repo is None and source.kind == "folder":
        return Finding("ok", f"diffusers folder {source.path} ({spec.class_name}, {spec.name}'s architecture) trains over "
                             f"{spec.name}'s pipeline; its files are linked into {written} once per node")
    if source.repo is None:
        size = _size(Path(source.path).stat().st_size)
        return Finding("ok", f"{source.path} ({size}) trains as {spec.name}'s {spec.class_name}: once per node, before "
                             f"the cache build, its names and shapes are checked and it is linked (diffusers' names) or "
                             f"converted (other layouts, about {size} more) into {written}")
    cache = _hub_cache_dir(ctx.environ)
    if _hub_cached(source, cache):
        return Finding("ok", f"{source.label}: in the hub cache {cache}")
    fetch = f"hf download {source.repo}" + (f" --revision {source.revision}" if source.revision else "")
    if _hub_offline(ctx.environ):
        return Finding("fail", f"{source.label}: not known to be in the hub cache {cache}, and HF_HUB_OFFLINE is set",
                       f"where there is network run `{fetch}` with this HF_HOME / HF_HUB_CACHE, or unset HF_HUB_OFFLINE")
    return Finding("warn", f"{source.label}: the run downloads what this node's hub cache {cache} lacks of it before "
                           "its cache build, once per node", f"to download ahead: `{fetch}`")


def _hub_cached(source: Any, cache: Path) -> bool:
    """Whether the hub cache holds a hub denoiser: its file; a folder's config.json and its weights (diffusers'
    single file, or the sharded index and every shard it names)."""
    import json

    from huggingface_hub import try_to_load_from_cache

    from zerotrain.models.hub import WEIGHTS

    def cached(path: str) -> Path | None:
        found = try_to_load_from_cache(source.repo, path.lstrip("/"), cache_dir=cache, revision=source.revision)
        return Path(found) if isinstance(found, str) else None

    if source.kind == "file":
        return cached(source.path) is not None
    if cached(f"{source.path}/config.json") is None:
        return False
    if cached(f"{source.path}/{WEIGHTS}") is not None:
        return True
    index = cached(f"{source.path}/{WEIGHTS}.index.json")
    return index is not None and all(cached(f"{source.path}/{shard}") is not None
                                     for shard in set(json.loads(index.read_text())["weight_map"].values()))


def check_plan(ctx: Context) -> Finding:

    plan = ctx.plan
    if isinstance(plan, Missing):
        if plan.expected:
            return Finding("skip", "no GPU visible (NVML absent) and hardware.gpus=auto: nothing to plan for "
                                   "here; name the GPUs (--gpus 8xA100-80GB) to check a plan")
        return Finding("fail", plan.reason, "fix the config; `zerotrain plan` shows the same with more detail")
    if plan.chosen is None:
        return Finding("fail", f"nothing fits {plan.hardware}",
                       "run `zerotrain plan` with the same config: it lists what would fit")
    memory = plan.chosen.memory
    return Finding("ok", f"{_layout_words(plan.chosen)}: {gib(memory.device_total)} per GPU of a "
                         f"{gib(plan.gpu_budget_bytes)} budget, {plan.chosen.images_per_second:.2f} images/s predicted "
                         f"on {plan.hardware}")
