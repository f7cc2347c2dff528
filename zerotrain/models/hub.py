"""The files of a model that training reads, wherever the model lives: a local diffusers folder, or a hub
repo downloaded into the Hugging Face cache.

A pipeline repo holds more than training reads (variants such as fp16, .bin beside .safetensors, Flax
and ONNX weights, single-file checkpoints at the root). What a run reads is every component the
pipeline's index lists (model_index.json, or a modular pipeline's modular_model_index.json), each with
the files `from_pretrained` loads: its configs and tokenizer files, and its weights, safetensors without
a variant (pickled .bin where a component has no safetensors). `survey` lists those files and which of
them this node has; `fetch` downloads what is missing through huggingface_hub's own snapshot_download,
which honours HF_HOME / HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT and the token in HF_TOKEN (or
`hf auth login`'s), and checks that what it got is complete; `check_folder` checks a local folder the same
way. Both fail with one line: a gated repo without a token, a revision the repo lacks, a repo without the
files the family needs, a file missing while offline.

Training asks for "train" (every component: the denoiser, the scheduler, the VAE and the text encoders,
which validation's pipeline loads too); the cache alone asks for "encode" (the VAE and the text parts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from zerotrain import families
from zerotrain.errors import ZerotrainError, one_line
from zerotrain.protocols import ModelSpec
from zerotrain.units import readable

Purpose = Literal["train", "encode"]
_FIELD = "model.name_or_path"
# The files that describe a diffusers pipeline folder: a pipeline's model_index.json, or the
# modular_model_index.json of a modular pipeline (FLUX.3's), which lists components as [library, class,
# loading spec].
PIPELINE_INDEXES = ("model_index.json", "modular_model_index.json")
# Weight files of every framework a repo may carry; a component keeps only the kind from_pretrained loads.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".msgpack", ".h5", ".onnx", ".onnx_data",
                    ".pb", ".gguf")
# diffusers' single weights file of a model folder (sharded: with .index.json beside its shards).
WEIGHTS = "diffusion_pytorch_model.safetensors"
# In the order from_pretrained prefers them (use_safetensors=None: safetensors where present).
_LOADED_WEIGHTS = (".safetensors", ".bin")


def pipeline_index(folder: Path) -> Path | None:
    """The folder's pipeline index (PIPELINE_INDEXES, the first present), or None."""
    return next((folder / name for name in PIPELINE_INDEXES if (folder / name).is_file()), None)


@dataclass(frozen=True)
class Component:
    name: str
    folder: str
    class_name: str
    config_only: bool = False
    """Only its config is read: the base's denoiser where model.denoiser replaces its weights (a single file
    is converted with the base's config)."""

    @property
    def is_model(self) -> bool:
        """A model (config.json and weights) rather than a tokenizer, processor or scheduler: diffusers'
        and transformers' model classes are *Model*, *For<Task>* and Autoencoder*."""
        return "Model" in self.class_name or "For" in self.class_name or self.class_name.startswith("Autoencoder")


def components(index: dict[str, Any]) -> list[Component]:
    """The components a pipeline index lists with a class: [library, class] entries, and a modular index's
    [library, class, loading spec] (its subfolder; a component the spec loads from another repo is not this
    repo's, and diffusers fetches it itself)."""
    out = []
    for key, value in index.items():
        if (key.startswith("_") or not isinstance(value, list) or len(value) not in (2, 3)
                or not all(isinstance(part, str) for part in value[:2])):  # a setting (Krea 2's layer list), or unset
            continue
        spec = value[2] if len(value) == 3 and isinstance(value[2], dict) else {}
        if spec.get("pretrained_model_name_or_path"):
            continue
        out.append(Component(key, spec.get("subfolder") or key, str(value[1])))
    return out


def needed(spec: ModelSpec, index: dict[str, Any], index_name: str, purpose: Purpose, where: str) -> list[Component]:
    """The components a run of `purpose` reads, after checking that the index lists what the family needs
    (its denoiser, VAE and text parts; a scheduler where the pipeline is not modular, whose blocks make
    their own)."""
    family = families.of(spec)
    listed = {c.name: c for c in components(index)}
    text = [name for pair in family.text_parts(family.pipeline_name(spec)) for name in pair]
    wanted = ["vae", *text]
    denoiser = spec.subfolder or family.denoiser_folder
    if purpose == "train":
        wanted += [denoiser] + (["scheduler"] if index_name == "model_index.json" else [])
    absent = [name for name in wanted if name not in listed]
    if absent:
        raise ZerotrainError(f"{where}: its {index_name} lists no {', '.join(absent)}, which {family.title} "
                             f"training needs; point {_FIELD} to the model's complete diffusers pipeline")
    if spec.denoiser is not None and denoiser in listed:
        listed[denoiser] = dataclasses.replace(listed[denoiser], config_only=True)
    return list(listed.values()) if purpose == "train" else [listed[name] for name in wanted]


def _basename(path: str) -> str:
    return path.rpartition("/")[2]


def _plain(name: str, suffix: str) -> bool:
    """A weight file without a variant: model.safetensors, model-00001-of-00002.safetensors (not
    model.fp16.safetensors)."""
    return name.endswith(suffix) and "." not in name[: -len(suffix)]


def select(paths: Iterable[str], parts: list[Component], index_name: str) -> list[str]:
    """Of a repo's files, those a run reads: the index, and each component's files as from_pretrained loads
    them (every file directly in its folder but weights of other kinds or variants and their indexes)."""
    paths = list(paths)
    chosen = [index_name]
    for part in parts:
        inside = [p for p in paths if p.rpartition("/")[0] == part.folder]
        names = [_basename(p) for p in inside]
        kind = None if part.config_only else next((s for s in _LOADED_WEIGHTS if any(_plain(n, s) for n in names)), None)
        for path, name in zip(inside, names):
            if name.endswith(_WEIGHT_SUFFIXES):
                if kind is not None and _plain(name, kind):
                    chosen.append(path)
            elif ".index" in name and name.endswith(".json"):  # a sharded weight's index: only the kind loaded
                if kind is not None and name.count(".") == 3 and name.endswith(f"{kind}.index.json"):
                    chosen.append(path)
            else:
                chosen.append(path)
    return chosen


def incomplete(files: Iterable[str], parts: list[Component]) -> list[str]:
    """What the files lack for each component to load: a model's config.json and weights (every shard its
    index names is checked by check_folder), any file of a tokenizer, processor or scheduler."""
    files = set(files)
    lacking = []
    for part in parts:
        inside = {_basename(p) for p in files if p.rpartition("/")[0] == part.folder}
        if not inside:
            lacking.append(f"{part.folder}/")
        elif part.is_model and "config.json" not in inside:
            lacking.append(f"{part.folder}/config.json")
        elif part.is_model and not part.config_only and not any(n.endswith(_LOADED_WEIGHTS) for n in inside):
            lacking.append(f"{part.folder}/ weights (*.safetensors)")
    return lacking


def local_files(folder: Path) -> list[str]:
    """Every file under a local model folder, as repo paths (a dangling link in a hub snapshot, whose blob
    is gone, is not a file)."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def shards_missing(folder: Path, files: Iterable[str]) -> list[str]:
    """The shards that the weight indexes among `files` name and the folder lacks."""
    missing = []
    for path in files:
        if path.endswith(".index.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, AttributeError):
                base = path.rpartition("/")[0]
                for shard in sorted(set(json.loads((folder / path).read_text())["weight_map"].values())):
                    if not (folder / base / shard).is_file():
                        missing.append(f"{base}/{shard}")
    return missing


def check_folder(spec: ModelSpec, folder: Path, purpose: Purpose) -> Path:
    """A local diffusers folder that holds every file a run of `purpose` reads, or one line naming what it
    lacks (before any cache is built)."""
    index_path = pipeline_index(folder)
    where = f"{_FIELD}='{spec.name}'"
    if index_path is None:
        raise ZerotrainError(f"{where}: {folder} holds no {' or '.join(PIPELINE_INDEXES)}; training needs the "
                             "model's complete diffusers pipeline folder (save_pretrained's, or a hub id)")
    parts = needed(spec, read_json(index_path), index_path.name, purpose, f"{where}: {folder}")
    files = local_files(folder)
    lacking = incomplete(files, parts) + shards_missing(folder, files)
    if lacking:
        raise ZerotrainError(f"{where}: {folder} lacks {', '.join(lacking[:4])}"
                             f"{f' and {len(lacking) - 4} more' if len(lacking) > 4 else ''}, which training reads; "
                             "complete the folder (save_pretrained of the whole pipeline, or download it again)")
    return folder


def read_json(path: Path, where: str = _FIELD) -> dict[str, Any]:
    """A JSON object file (a pipeline index, a config), or one line starting with `where` (the field)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ZerotrainError(f"{where}: cannot read {path} ({one_line(err, 200)})") from err
    if not isinstance(data, dict):
        raise ZerotrainError(f"{where}: {path} must hold a JSON object")
    return data


# --- the hub --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def hub_errors(repo_id: str, revision: str | None, what: str, field: str = _FIELD) -> Iterator[None]:
    """huggingface_hub's errors as one line each: what went wrong with `what` of which repo (named by the config
    `field`: model.name_or_path, or model.denoiser with its revision model.denoiser_revision), and what to do."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{field}='{repo_id}'"
    revision_field = "model.denoiser_revision" if field == "model.denoiser" else "model.revision"
    instead = "or pass a local diffusers folder instead"
    try:
        yield
    except GatedRepoError as err:
        raise ZerotrainError(
            f"{where}: the hub repo is gated and no token that may read it was sent; accept its license on "
            f"huggingface.co, then set HF_TOKEN (or run hf auth login) on every node, {instead}") from err
    except RepositoryNotFoundError as err:
        raise ZerotrainError(
            f"{where}: no such hub repo (or it is private); check the id and your token (HF_TOKEN), {instead}") from err
    except RevisionNotFoundError as err:
        raise ZerotrainError(
            f"{revision_field}='{revision}': no such revision of hub repo {repo_id}; fix {revision_field}, {instead}"
        ) from err
    except (LocalEntryNotFoundError, *_unreachable()) as err:
        raise ZerotrainError(
            f"{where}: could not reach the Hugging Face hub for {what} (HF_HUB_OFFLINE is set, or no network) and "
            f"it is not in the local hub cache {constants.HF_HUB_CACHE}; connect and retry (or download it where there is network: "
            f"hf download {repo_id}{f' --revision {revision}' if revision else ''}), {instead}") from err
    except HFValidationError as err:
        raise ZerotrainError(f"{where}: not a valid hub id ({one_line(err)}); {instead}") from err
    except HfHubHTTPError as err:
        raise ZerotrainError(f"{where}: the hub answered {one_line(err, 300)} for {what}; {instead}") from err


def hub_file(repo_id: str, filename: str, revision: str | None, cache: Path | None = None,
             offline: bool = False, field: str = _FIELD) -> Path | None:
    """Download one file of a hub repo into the hub cache (`cache`: huggingface_hub's, from HF_HOME /
    HF_HUB_CACHE, when None; `offline`: only look there); None when the repo has no such file."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import RemoteEntryNotFoundError

    with hub_errors(repo_id, revision, filename, field):
        try:
            return Path(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache,
                                        local_files_only=offline))
        except RemoteEntryNotFoundError:
            return None


def hub_index(repo_id: str, revision: str | None, required: bool = True, cache: Path | None = None,
              offline: bool = False) -> tuple[str, dict[str, Any]]:
    """The hub repo's pipeline index (PIPELINE_INDEXES, the first it has) and its file name; ("", {}) where
    it has none. A hub that cannot be reached is no error when not `required`."""
    for name in PIPELINE_INDEXES:
        try:
            path = hub_file(repo_id, name, revision, cache, offline)
        except ZerotrainError:
            if required:
                raise
            return "", {}
        if path is not None:
            return name, read_json(path)
    return "", {}


@dataclass
class Survey:
    """The files of a hub repo a run reads, and which of them this node's hub cache holds."""

    repo_id: str
    revision: str | None
    cache: Path
    index_name: str
    parts: list[Component]
    sizes: dict[str, int | None]
    """Every file a run reads -> its size in bytes (None where the hub was not asked: offline)."""
    present: set[str] = field(default_factory=set)
    online: bool = True

    @property
    def missing(self) -> list[str]:
        return [path for path in self.sizes if path not in self.present]

    @property
    def missing_bytes(self) -> int | None:
        sizes = [self.sizes[path] for path in self.missing]
        return None if any(size is None for size in sizes) else sum(sizes)  # type: ignore[misc]

    @property
    def where(self) -> str:
        return f"hub repo {self.repo_id}" + (f"@{self.revision}" if self.revision else "")


def _unreachable() -> tuple[type[BaseException], ...]:
    """The errors that mean the hub cannot be reached: offline mode, and the HTTP clients' transport errors
    (huggingface_hub 1.x speaks httpx, 2.x httpx2)."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    found: list[type[BaseException]] = [OfflineModeIsEnabled, ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError):
            found.append(__import__(module).TransportError)
    return tuple(found)


def _listing(repo_id: str, revision: str | None, cache: Path, offline: bool) -> tuple[dict[str, int | None], bool]:
    """Every file of the repo with its size, from the hub; offline, the listing the hub cache kept from an
    earlier download (huggingface_hub's trees/), else the files of the cached snapshot, without sizes."""
    from huggingface_hub import HfApi, get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError
    from huggingface_hub.hf_api import RepoFile

    with hub_errors(repo_id, revision, "the repo's file list"):
        try:
            if not offline:
                tree = HfApi().list_repo_tree(repo_id, revision=revision, recursive=True)
                return {f.path: f.size for f in tree if isinstance(f, RepoFile)}, True
        except _unreachable():
            pass
    with contextlib.suppress(CachedRepoTreeNotFoundError):
        return {f.path: None for f in get_cached_repo_tree(repo_id, revision=revision, cache_dir=cache)}, False
    with hub_errors(repo_id, revision, "the cached snapshot"):
        folder = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                        allow_patterns=[]))
    return dict.fromkeys(local_files(folder)), False


def survey(spec: ModelSpec, repo_id: str, revision: str | None, purpose: Purpose, cache: Path | None = None,
           offline: bool | None = None) -> Survey:
    """What a run of `purpose` reads of hub repo `repo_id`, and what the hub cache (`cache`; None:
    huggingface_hub's own, from HF_HOME / HF_HUB_CACHE) already holds; one line where the repo lacks what
    the family needs. `offline` (None: HF_HUB_OFFLINE) asks no hub."""
    from huggingface_hub import constants, try_to_load_from_cache

    cache = Path(cache or constants.HF_HUB_CACHE)
    offline = constants.HF_HUB_OFFLINE if offline is None else offline
    where = f"{_FIELD}='{repo_id}'" + (f" (model.revision {revision})" if revision else "")
    index_name, index = hub_index(repo_id, revision, cache=cache, offline=offline)
    if not index:
        raise ZerotrainError(f"{where}: the hub repo has no {' or '.join(PIPELINE_INDEXES)} (a denoiser alone?); "
                             "training needs the model's complete diffusers pipeline repo")
    parts = needed(spec, index, index_name, purpose, where)
    listing, online = _listing(repo_id, revision, cache, offline)
    files = select(listing, parts, index_name)
    lacking = incomplete(files, parts)
    if lacking and online:
        raise ZerotrainError(f"{where}: the hub repo has no {', '.join(lacking[:4])}, which {families.of(spec).title} "
                             f"training reads; point {_FIELD} to the model's complete diffusers pipeline repo")
    present = {path for path in files
               if isinstance(try_to_load_from_cache(repo_id, path, cache_dir=cache, revision=revision), str)}
    found = Survey(repo_id, revision, cache, index_name, parts, {path: listing.get(path) for path in files},
                   present, online)
    if lacking:  # offline, from what the cache holds: name what is known to be absent
        found.sizes.update(dict.fromkeys(lacking))
    return found


def fetch(spec: ModelSpec, repo_id: str, revision: str | None, purpose: Purpose) -> Path:
    """The local snapshot of hub repo `repo_id` holding every file a run of `purpose` reads, downloaded
    where this node's hub cache lacks them (one line where it cannot be)."""
    from huggingface_hub import snapshot_download

    found = survey(spec, repo_id, revision, purpose)
    if found.missing and not found.online:
        raise ZerotrainError(
            f"{_FIELD}='{repo_id}': the hub cache {found.cache} lacks {len(found.missing)} of the {len(found.sizes)} "
            f"files training reads ({', '.join(found.missing[:3])}{', ...' if len(found.missing) > 3 else ''}) and the "
            f"hub cannot be reached (HF_HUB_OFFLINE is set, or no network); download them where there is network "
            f"(hf download {repo_id}{f' --revision {revision}' if revision else ''}, with this HF_HOME / HF_HUB_CACHE), "
            "or point it to a complete local folder")
    if found.missing:
        size = found.missing_bytes
        print(f"zerotrain: downloading {len(found.missing)} files of {found.where}"
              f"{f' ({readable(size)})' if size is not None else ''} into {found.cache}", flush=True)
    with hub_errors(repo_id, revision, "the model's files"):
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(found.sizes),
                                        local_files_only=not found.online))
    files = local_files(folder)
    lacking = [path for path in found.sizes if path not in set(files)] + shards_missing(folder, files)
    if lacking:
        raise ZerotrainError(f"{_FIELD}='{repo_id}': after the download, {folder} still lacks "
                             f"{', '.join(lacking[:3])}; run again (a download that was cut off resumes)")
    return folder


def model_files(spec: ModelSpec, revision: str | None, purpose: Purpose) -> Path:
    """The local folder of a model's files for a run of `purpose`: a local folder checked, a hub repo
    fetched (one process; data.cache.model_folder runs it once per node)."""
    source = spec.pretrained
    if source is None:
        raise ZerotrainError(f"{_FIELD}={spec.name}: training needs the model's weights; point it at a diffusers "
                             "model folder or hub id, not a bare config.json")
    folder = Path(os.path.expanduser(source))
    if folder.is_dir():
        return check_folder(spec, folder, purpose)
    return fetch(spec, source, revision, purpose)
