"""The folder a run with model.denoiser trains from: its base pipeline's files with the fine-tuned denoiser in
place of the pipeline's own, so that every loader (the partitioned ZeRO-3 load, from_pretrained, validation's
pipeline, the cache's encoders) reads one diffusers folder as it reads any other.

Written once per node, by local rank 0 (data.cache.model_folder), under data.cache_dir/models/, named by a
digest of the base folder and the denoiser's files: the base's files are links (a hub snapshot's keep
pointing into the Hugging Face cache, so the encoders' cache identity is the base's own), and so is a
diffusers folder's denoiser and a single file already in diffusers' names and shapes. Any other single file is
converted once: diffusers' from_single_file with the base's config (the Black Forest Labs, ComfyUI and
original layouts diffusers reads), or the family's own reading of its ComfyUI layout where diffusers has none
(Family.diffusers_weights), and saved with save_pretrained in the file's dtypes. The folder is
built under a temporary name and renamed when complete, so a cut-off conversion is never mistaken for one."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
from pathlib import Path

import accelerate
import torch
from diffusers.loaders.single_file_model import SINGLE_FILE_LOADABLE_CLASSES
from diffusers.loaders.single_file_utils import SingleFileComponentError
from safetensors import safe_open
from safetensors.torch import load_file

from zerotrain import families
from zerotrain.config.sections import RunConfig
from zerotrain.errors import ZerotrainError, one_line
from zerotrain.models.denoiser import check_single_file, denoiser_subfolder, fetch, source_of
from zerotrain.models.hub import WEIGHTS, Component, incomplete, local_files
from zerotrain.protocols import ModelSpec

# Bump when what the folder holds changes, so that folders written by older code are not reused.
VERSION = 1
_FIELD = "model.denoiser"


def fine_tune_folder(spec: ModelSpec, base: Path, run: RunConfig) -> Path:
    """The base folder `base` with model.denoiser's weights as its denoiser (see the module's docstring): one
    process per node; one line where the denoiser cannot be read as the base's architecture."""
    source = source_of(run.model)
    where = f"{_FIELD}='{run.model.denoiser}'"
    local = fetch(source, spec)
    sub = spec.subfolder or families.of(spec).denoiser_folder
    if source.kind == "folder":
        local = (local / denoiser_subfolder(local, spec, where)).resolve()
        _check_weights(local, spec, where)
    else:  # a hub file's header is first read here, after its download
        check_single_file(local, spec, where)
    root = run.data.cache_dir / "models"
    target = root / f"fine-tune-{_digest(base, local, sub)}"
    if target.is_dir():
        return target
    partial = root / f".{target.name}.{socket.gethostname()}.{os.getpid()}.partial"  # nodes may share the folder
    shutil.rmtree(partial, ignore_errors=True)
    try:
        _link_files(base, partial, skip=sub)
        if source.kind == "folder":
            _link_files(local, partial / sub, skip=None, depth=1)
        else:
            print(f"zerotrain: reading {local} as {spec.name}'s {spec.class_name} into {target}", flush=True)
            write_single_file(spec, local, base / sub, partial / sub, where)
        try:
            partial.rename(target)
        except OSError:
            if not target.is_dir():  # not another node's finished folder (on a shared data.cache_dir)
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def _check_weights(folder: Path, spec: ModelSpec, where: str) -> None:
    lacking = incomplete(local_files(folder), [Component("denoiser", "", spec.class_name)])
    if lacking:
        raise ZerotrainError(f"{where}: {folder} lacks its config.json or weights (*.safetensors); give a "
                             "complete diffusers model folder (save_pretrained's) or a .safetensors file")


def _digest(base: Path, denoiser: Path, sub: str) -> str:
    """What the folder is made of: the base folder, the denoiser's files (path, size and modification time, or
    the hub cache's blob name, which is the content's hash) and where the denoiser goes."""
    digest = hashlib.sha256(f"{VERSION}\0{base.resolve()}\0{sub}".encode())
    files = [denoiser] if denoiser.is_file() else sorted(p for p in denoiser.iterdir() if p.is_file())
    for path in files:
        stat = path.stat()
        digest.update(f"\0{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:20]


def _link_files(source: Path, target: Path, skip: str | None, depth: int | None = None) -> None:
    """Every file under `source` (but those under `skip`, and deeper than `depth` levels) as a link in the same
    place under `target`, to the path as given (a hub snapshot's link, which points at its blob)."""
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if not path.is_file() or (skip is not None and relative.parts[0] == skip) or \
                (depth is not None and len(relative.parts) > depth):
            continue
        (target / relative).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.abspath(path), target / relative)


def write_single_file(spec: ModelSpec, file: Path, base_denoiser: Path, out: Path, where: str) -> str:
    """`file` as a diffusers model folder `out` of the base's config (`base_denoiser`, its config.json): linked
    where it holds exactly the model's names and shapes, else converted. Returns how it was read."""
    cls = spec.denoiser_class()
    config = cls.load_config(base_denoiser)
    with accelerate.init_empty_weights():
        model = cls.from_config(config)
    wanted = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    with safe_open(file, framework="pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118 (not iterable)
    out.mkdir(parents=True)
    if shapes == wanted:
        shutil.copyfile(base_denoiser / "config.json", out / "config.json")
        os.symlink(os.path.abspath(file), out / WEIGHTS)
        return "diffusers' names"
    model = _converted(spec, cls, file, base_denoiser, model, shapes, where)
    model.save_pretrained(out, safe_serialization=True)
    return "converted"


def _converted(spec: ModelSpec, cls: type, file: Path, base_denoiser: Path, meta: torch.nn.Module,
               shapes: dict[str, tuple[int, ...]], where: str) -> torch.nn.Module:
    """The denoiser with the file's weights in their own dtypes (training's from_pretrained casts them as it casts
    any folder's, keeping the class's float32 modules): diffusers' from_single_file where the class has it, else
    the family's own reading of its ComfyUI layout; one line naming the file's first keys where neither reads
    it as the base's model."""
    first = ", ".join(list(shapes)[:3])
    hint = (f"it holds {len(shapes)} tensors ({first}, ...); give a full {spec.class_name} of {spec.name}'s "
            "architecture in diffusers' names, or in the Black Forest Labs / ComfyUI / original layout diffusers' "
            "from_single_file reads, or its diffusers folder")
    try:
        if cls.__name__ in SINGLE_FILE_LOADABLE_CLASSES:
            model = cls.from_single_file(str(file), config=str(base_denoiser.parent), subfolder=base_denoiser.name,
                                         local_files_only=True)
        else:
            tensors = families.of(spec).diffusers_weights(load_file(file))
            if tensors is None:
                raise ZerotrainError(f"{where}: diffusers reads no single file of {spec.class_name}, and {file} is "
                                     f"not in diffusers' names: {hint}")
            meta.load_state_dict(tensors, strict=True, assign=True)
            model = meta
    except (RuntimeError, ValueError, KeyError, IndexError, TypeError, SingleFileComponentError) as err:
        raise ZerotrainError(f"{where}: {file} does not read as {spec.name}'s {spec.class_name} "
                             f"({one_line(err, 160)}); {hint}") from err
    missing = [name for name, tensor in model.state_dict().items() if tensor.device.type == "meta"]
    if missing:
        raise ZerotrainError(f"{where}: {file} has no weights for {len(missing)} of {spec.name}'s {spec.class_name} "
                             f"tensors ({', '.join(missing[:2])}, ...): not that architecture; {hint}")
    return model
