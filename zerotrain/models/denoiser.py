"""A fine-tuned denoiser trained over its base pipeline (model.denoiser): a single .safetensors file, a
diffusers model folder or a hub id, in place of the denoiser of the pipeline that model.name_or_path names,
whose VAE, text encoders and scheduler it trains with.

This half reads no tensor and imports no torch, so that a plan stays instant: `source_of` says where the
denoiser is, `over_base` checks it against its base (a folder's config.json: the base's class, family and
architecture; a single file's header: a denoiser's weights, not an adapter's) and gives the spec the
planner plans, and `fetch` brings a hub denoiser into the Hugging Face cache. Writing the folder training
loads (the base's files with this denoiser in place, a single file converted to diffusers' layout where it
is not in it) is zerotrain.models.fine_tune's, on one rank of each node."""

from __future__ import annotations

import dataclasses
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from zerotrain import families
from zerotrain.config.sections import ModelConfig
from zerotrain.errors import ZerotrainError, one_line
from zerotrain.models.hub import (
    Component,
    components,
    hub_errors,
    hub_file,
    pipeline_index,
    read_json,
    select,
)
from zerotrain.protocols import ModelSpec

_FIELD = "model.denoiser"
# The single-file formats read: safetensors (.sft is Black Forest Labs' and ComfyUI's other suffix for it).
SINGLE_FILES = (".safetensors", ".sft")
# Pickled checkpoints run code when loaded: not read (the one line says how to convert).
PICKLES = (".ckpt", ".pt", ".pth", ".bin")
# owner/name, then a path inside the repo.
_HUB = re.compile(r"^([A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:/(.+))?$")
# Weight names of adapters (peft and diffusers, kohya, LyCORIS' LoHa and LoKr, DoRA): what a LoRA file holds.
_ADAPTER = re.compile(r"(lora_[AB]|lora_down|lora_up|lora\.(down|up)|hada_w[12]|lokr_w[12]|dora_scale)\b|\.alpha$")
# A safetensors header is a little-endian u64 length, then that much JSON (safetensors' format); files whose
# header claims more than this are not safetensors.
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class Source:
    """Where model.denoiser is: a local file or folder (`repo` None), or a hub repo's file or folder."""

    kind: Literal["file", "folder"]
    path: str
    """The local path, or the path inside the hub repo ("" for its root)."""
    repo: str | None = None
    revision: str | None = None

    @property
    def label(self) -> str:
        """What the plan and the log say of it."""
        if self.repo is None:
            return f"{self.kind} {self.path}"
        inside = f"/{self.path}" if self.path else ""
        return f"hub {self.repo}{inside}" + (f"@{self.revision}" if self.revision else "")


def source_of(config: ModelConfig) -> Source:
    """model.denoiser as a Source, or one line where it is neither a file nor a folder here, nor a hub id."""
    value = config.denoiser
    assert value is not None
    path = Path(value).expanduser()
    if path.is_file():
        _check_suffix(value, path.name)
        return Source("file", str(path))
    if path.is_dir():
        return Source("folder", str(path))
    found = _HUB.match(value)
    if found is None or value.startswith((".", "/", "~")):
        raise ZerotrainError(f"{_FIELD}='{value}': no such file or folder, and not a hub id; give a .safetensors "
                             "file, a diffusers model folder, or owner/name[/folder or file] on the hub")
    inner = (found.group(2) or "").strip("/")
    if inner.endswith(SINGLE_FILES + PICKLES):
        _check_suffix(value, inner)
        return Source("file", inner, found.group(1), config.denoiser_revision)
    return Source("folder", inner, found.group(1), config.denoiser_revision)


def _check_suffix(value: str, name: str) -> None:
    if name.endswith(PICKLES):
        raise ZerotrainError(f"{_FIELD}='{value}' is a pickled checkpoint, which zerotrain does not load (loading "
                             "it runs code); convert it to .safetensors (safetensors.torch.save_file) or use the "
                             "model's diffusers folder")
    if not name.endswith(SINGLE_FILES):
        raise ZerotrainError(f"{_FIELD}='{value}' is a file but not .safetensors; give the fine-tune's "
                             ".safetensors file, or its diffusers model folder")


def safetensors_header(path: Path, where: str) -> dict[str, Any]:
    """The header of a safetensors file (each tensor's dtype, shape and offsets; __metadata__), read without
    torch; one line where the file is not safetensors."""
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > _MAX_HEADER:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, ValueError, struct.error) as err:
        raise ZerotrainError(f"{where}: {path} is not a readable safetensors file ({one_line(err, 200)}); "
                             "download it again, or give the model's diffusers folder") from err
    if not isinstance(header, dict):
        raise ZerotrainError(f"{where}: {path} is not a safetensors file (its header is no JSON object)")
    return header


def tensor_names(header: dict[str, Any]) -> list[str]:
    return [name for name in header if name != "__metadata__"]


def check_single_file(path: Path, spec: ModelSpec, where: str) -> None:
    """One line where the file cannot be a full denoiser: no tensors, or an adapter's (LoRA, LoKr, LoHa) names."""
    names = tensor_names(safetensors_header(path, where))
    if not names:
        raise ZerotrainError(f"{where}: {path} holds no tensors; give the fine-tuned denoiser's weights")
    adapter = [name for name in names if _ADAPTER.search(name)]
    if len(adapter) * 2 > len(names):
        raise ZerotrainError(
            f"{where}: {path} is an adapter (LoRA, LoKr or LoHa: {len(adapter)} of its {len(names)} tensors are "
            f"named like {adapter[0]}), not a denoiser; continue training it with training.mode: lora and "
            f"training.lora.init_from: {path}, over {spec.name}")


def over_base(base: ModelSpec, config: ModelConfig) -> ModelSpec:
    """The spec a run with model.denoiser plans and trains: a single file's is the base's architecture (its
    names and shapes are checked where it is converted, before the cache is built); a folder's is its
    config.json, which must be the base's architecture."""
    source = source_of(config)
    where = f"{_FIELD}='{config.denoiser}'"
    if source.kind == "file":
        if source.repo is None:
            check_single_file(Path(source.path), base, where)
        return dataclasses.replace(base, denoiser=source.label)
    denoiser_config, config_path = _folder_config(source, base, where)
    return dataclasses.replace(base, config=matching_config(base, denoiser_config, f"{where}: {config_path}"),
                               denoiser=source.label)


def _folder_config(source: Source, base: ModelSpec, where: str) -> tuple[dict[str, Any], str]:
    """A denoiser folder's config.json (a pipeline folder's: its component of the base's class), and where it is."""
    if source.repo is None:
        folder = Path(source.path)
        inner = denoiser_subfolder(folder, base, where)
        path = folder / inner / "config.json"
        if not path.is_file():
            raise ZerotrainError(f"{where}: {folder} holds no config.json (nor a pipeline index naming a "
                                 f"{base.class_name}); give a diffusers model folder (save_pretrained's) or a .safetensors file")
        return read_json(path, where), str(path)
    for name in ("config.json", "model_index.json", "modular_model_index.json"):
        path = hub_file(source.repo, f"{source.path}/{name}".lstrip("/"), source.revision, field=_FIELD)
        if path is None:
            continue
        if name == "config.json":
            return read_json(path, where), f"{source.repo}/{source.path}/config.json"
        inner = _component(read_json(path, where), base, where)
        found = hub_file(source.repo, f"{source.path}/{inner}/config.json".lstrip("/"), source.revision, field=_FIELD)
        if found is not None:
            return read_json(found, where), f"{source.repo}/{source.path}/{inner}/config.json".replace("//", "/")
    raise ZerotrainError(f"{where}: the hub repo has no config.json or pipeline index at '{source.path or '/'}'; name "
                         "the folder that holds the denoiser (owner/name/transformer) or its .safetensors file")


def denoiser_subfolder(folder: Path, base: ModelSpec, where: str) -> str:
    """Where in a local denoiser folder its config.json is: the folder itself, or a pipeline folder's component."""
    index = pipeline_index(folder)
    if (folder / "config.json").is_file() or index is None:
        return "."
    return _component(read_json(index, where), base, where)


def _component(index: dict[str, Any], base: ModelSpec, where: str) -> str:
    found = [part.folder for part in components(index) if part.class_name == base.class_name]
    if len(found) != 1:
        listed = ", ".join(f"{part.name} ({part.class_name})" for part in components(index))
        raise ZerotrainError(f"{where}: its pipeline index lists {'no' if not found else 'several'} {base.class_name} "
                             f"({listed}); name the denoiser's own folder")
    return found[0]


def matching_config(base: ModelSpec, config: dict[str, Any], where: str) -> dict[str, Any]:
    """The fine-tune's config, keeping the base's family, or one line where it is another model than the base's
    pipeline trains: another class, family, or architecture: an argument both configs give, with another value
    (one that only one gives may be its class default spelled out, as save_pretrained writes every argument;
    a real difference there fails the load's strict check of names and shapes, before the cache is built)."""
    if config.get("_class_name") != base.class_name:
        raise ZerotrainError(f"{where} is a {config.get('_class_name') or 'config without _class_name'}, but "
                             f"{base.name}'s pipeline trains a {base.class_name}; give a fine-tune of that model, or set "
                             "model.name_or_path to the fine-tune's own base pipeline")
    family_key = families.FAMILY_KEY
    named = config.get(family_key)
    if named is not None and named != base.family:
        raise ZerotrainError(f"{where} names family {named}, but {base.name} is a {base.family} pipeline")
    config = {**config, **({family_key: base.config[family_key]} if family_key in base.config else {})}
    differing = sorted(key for key in config.keys() & base.config.keys()
                       if not key.startswith("_") and config[key] != base.config[key])
    if differing:
        shown = ", ".join(f"{key} {json.dumps(config[key])} (base {json.dumps(base.config[key])})"
                          for key in differing[:3])
        raise ZerotrainError(f"{where} is another architecture than {base.name}'s denoiser ({shown}); give a "
                             "fine-tune of that model, or set model.name_or_path to the fine-tune's own base pipeline")
    return config


def fetch(source: Source, spec: ModelSpec) -> Path:
    """The local path of model.denoiser: itself where local; a hub file or folder downloaded into the Hugging
    Face cache (the folder's config and the weights from_pretrained loads) where this node's cache lacks it."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download
    from huggingface_hub.hf_api import RepoFile

    if source.repo is None:
        return Path(source.path)
    with hub_errors(source.repo, source.revision, source.path or "the denoiser", _FIELD):
        if source.kind == "file":
            return Path(hf_hub_download(source.repo, source.path, revision=source.revision))
        tree = HfApi().list_repo_tree(source.repo, revision=source.revision, recursive=True)
        listing = [f.path for f in tree if isinstance(f, RepoFile)]
    where = f"{_FIELD}='{source.repo}/{source.path}'"
    inner = source.path
    if f"{inner}/config.json".lstrip("/") not in listing:
        index = next((name for name in ("model_index.json", "modular_model_index.json")
                      if f"{inner}/{name}".lstrip("/") in listing), None)
        if index is not None:
            local = hub_file(source.repo, f"{inner}/{index}".lstrip("/"), source.revision, field=_FIELD)
            inner = f"{inner}/{_component(read_json(local, where), spec, where)}".strip("/")  # type: ignore[arg-type]
    files = select(listing, [Component("denoiser", inner, spec.class_name)], "")[1:]
    with hub_errors(source.repo, source.revision, "the denoiser's files", _FIELD):
        folder = Path(snapshot_download(source.repo, revision=source.revision, allow_patterns=files))
    return folder / inner
