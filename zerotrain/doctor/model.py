"""`zerotrain doctor`'s model checks: whether the model's weights can be had (a local folder, the hub cache
or the hub), and the plan for this machine."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

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


def _has_weights(folder: Path) -> bool:
    """A denoiser/VAE folder whose weights are all there: an index's every shard, or a single file."""
    for index in folder.glob("*.index.json"):
        with contextlib.suppress(OSError, ValueError):
            shards = set(json.loads(index.read_text())["weight_map"].values())
            return bool(shards) and all((folder / shard).is_file() for shard in shards)
    return any(p.is_file() for pattern in ("*.safetensors", "*.bin") for p in folder.glob(pattern))


def _hub_finding(ctx: Context, repo: str, subfolder: str | None,
                 size_hint: Callable[[], str] = lambda: "") -> Finding:
    """Whether a hub repo's weights are in the local hub cache, without the network. size_hint is
    called only when the download is still to come."""
    from huggingface_hub import try_to_load_from_cache

    from zerotrain.models.catalog import PIPELINE_INDEXES, pipeline_index

    cache, offline, revision = _hub_cache_dir(ctx.environ), _hub_offline(ctx.environ), ctx.run.model.revision
    where = f"hub repo {repo}" + (f"@{revision}" if revision else "")
    snapshot = None
    for name in (*PIPELINE_INDEXES, "config.json"):
        found = try_to_load_from_cache(repo, name, cache_dir=cache, revision=revision)
        if isinstance(found, str):
            snapshot = Path(found).parent
            break
    folders = [f for f in (subfolder, "vae") if f] if snapshot and pipeline_index(snapshot) else [""]
    complete = snapshot is not None and all(_has_weights(snapshot / f) for f in folders)
    if complete:
        return Finding("ok", f"{where}: weights ({', '.join(f or 'denoiser' for f in folders)}) in the local hub "
                             f"cache {snapshot}")
    state = "partly in" if snapshot else "not in"
    fetch = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
    if offline:
        return Finding("fail", f"{where} is {state} the hub cache {cache}, and HF_HUB_OFFLINE is set: loading fails",
                       f"where there is network run `{fetch}` (with this HF_HOME / HF_HUB_CACHE), or download it to "
                       "a folder and set model.name_or_path to it; or unset HF_HUB_OFFLINE")
    return Finding("warn", f"{where} is {state} the hub cache {cache}: the first run downloads it"
                           f"{size_hint()}",
                   f"download it before the job: `{fetch}` (gated repos: accept the license on huggingface.co and "
                   "`hf auth login` first)")


def _denoiser_size(ctx: Context) -> str:
    facts = ctx.facts
    return "" if isinstance(facts, Missing) else f" (the denoiser alone is {_size(2 * facts.total_params)} in bf16)"


def check_model(ctx: Context) -> Finding:
    from zerotrain.models.catalog import HUB_ID, catalog_names, resolve_model

    model = ctx.run.model
    name = model.name_or_path
    if name in catalog_names():
        spec = resolve_model(model)  # a catalog entry resolves offline
        if spec.pretrained is None:
            return Finding("ok", f"{name} is built locally on first use (random weights, for tests and CPU demos)")
        # A catalog architecture is measured offline, so its size can be told; a bare hub id's config
        # would need the network.
        return _hub_finding(ctx, spec.pretrained, model.subfolder or spec.subfolder, lambda: _denoiser_size(ctx))
    path = Path(name).expanduser()
    if path.exists():
        spec = ctx.spec
        if isinstance(spec, Missing):
            return Finding("fail", spec.reason, "point model.name_or_path at a diffusers model folder")
        if path.is_file():
            return Finding("warn", f"{path} is a bare config.json: it plans, but caching and training need the "
                                   "weights", "point model.name_or_path at the diffusers model folder or hub id")
        denoiser = Path(spec.pretrained) / (spec.subfolder or "")
        if not _has_weights(denoiser):
            return Finding("fail", f"{denoiser} holds no complete weights (*.safetensors, *.bin)",
                           "finish the download or save_pretrained into the folder")
        return Finding("ok", f"local folder {path}: {spec.class_name} weights in {denoiser}")
    if HUB_ID.match(name) and not name.endswith(".json"):
        return _hub_finding(ctx, name, model.subfolder)
    return Finding("fail", f"model.name_or_path={name}: no such folder or file, and not a catalog name or hub id",
                   f"fix the path, or use a catalog name ({', '.join(catalog_names())}) or a hub id (owner/name)")


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
