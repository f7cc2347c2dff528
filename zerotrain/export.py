"""Export a run's checkpoint as weights that diffusers (and ComfyUI) load, offline, on the CPU.

Run folder (written by the training loop):

    RUN/config.yaml                 the resolved RunConfig
    RUN/checkpoints/<tag>/          DeepSpeed engine.save_checkpoint files (+ zerotrain_state.json)
    RUN/checkpoints/latest          the newest complete tag
    RUN/export/                     what `export` writes (default `out`)

The full weights come from DeepSpeed's own files, never from a live (possibly ZeRO-3 partitioned)
module, so nothing can be saved as size-0 tensors (kohya#1782):

- ZeRO 1-3: deepspeed.utils.zero_to_fp32 merges the fp32 master partitions of every rank
  (get_fp32_state_dict_from_zero_checkpoint, lazily, one tensor at a time).
- Stage 0 (bf16 without ZeRO, DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer): the fp32 master
  is in the "optimizer" entry of mp_rank_00_model_states.pt as flat groups without names. They are
  matched to the trainable parameters in module order, each slice checked to round to the bf16
  module tensor DeepSpeed saved beside it; where that does not match (another group layout), the
  bf16 module tensors are used, which DeepSpeed keeps equal to the master rounded to bf16.
- ZeRO-1 with fp32 gradient accumulation (BF16_Optimizer, no ZeRO state in its optimizer file):
  the bf16 module tensors of mp_rank_00_model_states.pt, for the same reason.

Every tensor is checked against the shapes of the denoiser built on the meta device (with the run's
LoRA adapters), must have data (numel > 0), and is written in bf16 without "module." prefixes:

- full fine-tune: OUT/transformer (Flux, SD3) or OUT/unet (SDXL, SD1.x), via save_pretrained;
- LoRA: OUT/lora/pytorch_lora_weights.safetensors, via the family pipeline's save_lora_weights, in
  the key format of peft's get_peft_model_state_dict, with the adapter's rank and alpha as diffusers'
  lora_adapter_metadata so load_lora_weights applies the trained scale alpha / rank;
- comfyui=True: also OUT/comfyui/<run>-<tag>.safetensors, see comfyui_lora_state_dict (LoRA),
  comfyui_dora and Family.comfyui_adapter (LoKr, LoHa), or a single-file denoiser with diffusers
  keys, which ComfyUI's "Load Diffusion Model" converts (full).

LoKr and LoHa export as _write_lora says: the adapter where the family's diffusers loader reads it,
else a LoRA converted by peft's convert_to_lora.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import shutil
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from zerotrain import families
from zerotrain.adapters import ADAPTER, is_adapter, lora_pairs
from zerotrain.config import Mode, RunConfig
from zerotrain.errors import ZerotrainError, one_line
from zerotrain.families.runtime.base import kohya_lora
from zerotrain.models.catalog import resolve_model
from zerotrain.protocols import ModelSpec
from zerotrain.quiet import hidden_warnings

CHECKPOINTS = "checkpoints"
LATEST = "latest"
EXPORT = "export"
CONFIG = "config.yaml"
MANIFEST = "export.json"
STATE = "zerotrain_state.json"
LORA_DIR = "lora"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
COMFYUI_DIR = "comfyui"
# Wrappers that prefix parameter names: DeepSpeed/DDP ("module.", diffusers#9393), torch.compile
# ("_orig_mod."), peft's get_peft_model ("base_model.model.").
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")
_ZERO_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"
_MODEL_STATES = "mp_rank_00_model_states.pt"


def latest_tag(run_dir: Path) -> str:
    """The newest complete checkpoint tag of a run folder (RUN/checkpoints/latest)."""
    path = Path(run_dir) / CHECKPOINTS / LATEST
    if not path.is_file():
        raise ZerotrainError(
            f"{run_dir}: no checkpoint to export ({path} not found); train until a checkpoint is written, "
            "or pass the tag of one"
        )
    tag = path.read_text(encoding="utf-8").strip()
    if not tag:
        raise ZerotrainError(f"{path} is empty; pass the tag of a checkpoint under {path.parent}")
    return tag


def export(run_dir: Path, tag: str | None = None, out: Path | None = None, comfyui: bool = False,
           ema: bool = False) -> Path:
    """Write the weights of checkpoint `tag` (default: the latest) of `run_dir` into `out` (default
    RUN/export) and return `out`. See the module docstring for the layout. ema: the EMA of the
    trained weights (ema.enabled runs) instead of the trained weights themselves."""
    run_dir = Path(run_dir)
    run = _load_run(run_dir)
    spec = resolve_model(run.model)
    tag = tag or latest_tag(run_dir)
    checkpoint = _checkpoint_dir(run_dir, tag)
    lora = run.training.mode is Mode.lora
    meta = _meta_model(spec, run)
    expected = {name: tuple(t.shape) for name, t in meta.state_dict().items() if not lora or is_adapter(name)}
    weights, source = read_checkpoint(run_dir / CHECKPOINTS, tag, expected, lora)
    if ema:
        weights, source = _with_ema(weights, checkpoint), f"EMA of the trained weights (zerotrain ema-*.pt in {tag})"
    out = Path(out) if out is not None else run_dir / EXPORT
    out.mkdir(parents=True, exist_ok=True)
    name = f"{run_dir.resolve().name}-{tag}"
    if lora:
        files, adapter = _write_lora(out, spec, meta, weights, comfyui, name, run.training.lora.export_rank)
    else:
        files = _write_full(out, spec, weights, comfyui, name)
    state_path = checkpoint / STATE
    state = json.loads(state_path.read_text(encoding="utf-8")) if state_path.is_file() else {}
    manifest = {
        "run": str(run_dir.resolve()),
        "tag": tag,
        "model": spec.name,
        "class_name": spec.class_name,
        "family": spec.family,
        "mode": run.training.mode.value,
        "source": source,
        "dtype": "bfloat16",
        "tensors": len(weights),
        "parameters": sum(t.numel() for t in weights.values()),
        "files": [str(path.relative_to(out)) for path in files],
        "step": state.get("step"),
        "ema": ema,
    }
    if lora:
        manifest["lora"] = adapter
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
    return out


def notes(out: Path) -> list[str]:
    """What a person should know of an export beyond where it is: how close a converted LoRA is."""
    manifest = json.loads((Path(out) / MANIFEST).read_text(encoding="utf-8"))
    fit = (manifest.get("lora") or {}).get("conversion")
    if not fit:
        return []
    kind = manifest["lora"]["type"]
    line = (f"the {kind} is in {LORA_DIR}/{LORA_WEIGHTS} as a LoRA of rank {fit['rank']} converted by peft "
            f"(diffusers reads no {kind} for {manifest['model']}): each layer's update is off by "
            f"{fit['mean_relative_error']:.1%} on average, {fit['worst_relative_error']:.1%} at worst "
            f"(training.lora.export_rank raises the rank; {MANIFEST})")
    return [line]


# --- reading ---------------------------------------------------------------------------------------


def _with_ema(weights: dict[str, torch.Tensor], checkpoint: Path) -> dict[str, torch.Tensor]:
    """`weights` with every trained tensor replaced by its EMA (in bf16, like the rest)."""
    from zerotrain.ema import ema_state_dict

    if not any(checkpoint.glob("ema-*.pt")):
        raise ZerotrainError(f"{checkpoint}: holds no EMA (ema-*.pt); it was saved without ema.enabled, "
                             "export the trained weights instead (without --ema)")
    averaged = {strip_prefixes(name): tensor for name, tensor in ema_state_dict(checkpoint).items()}
    foreign = sorted(set(averaged) - set(weights))
    if foreign:
        raise ZerotrainError(f"{checkpoint}: the EMA holds {foreign[0]}, which the model does not have")
    for name, tensor in averaged.items():
        if tuple(tensor.shape) != tuple(weights[name].shape):
            raise ZerotrainError(f"{checkpoint}: EMA {name} has shape {tuple(tensor.shape)}, the model "
                                 f"{tuple(weights[name].shape)}")
    return {name: averaged[name].to(torch.bfloat16).contiguous() if name in averaged else tensor
            for name, tensor in weights.items()}


def read_checkpoint(
    checkpoints: Path, tag: str, expected: dict[str, tuple[int, ...]], lora: bool
) -> tuple[dict[str, torch.Tensor], str]:
    """The tensors of `expected` (names without wrapper prefixes -> shapes) from DeepSpeed checkpoint
    `checkpoints/tag`, in bf16, each checked for data and shape; and where they came from.
    lora: read only the LoRA tensors (ZeRO merges only trainable parameters then)."""
    checkpoint = checkpoints / tag
    states_path = _model_states_path(checkpoint)
    states = _torch_load(states_path)
    stage = _zero_stage(states, states_path)
    if stage == 0:
        module = _strip_names(states.get("module") or {}, states_path)
        master = _stage0_master(states.get("optimizer"), module, expected) or {}
        source = "bf16 module weights (stage 0)"
        if master:
            source = f"fp32 master weights (stage 0 optimizer state) for {len(master)} of {len(expected)} tensors"
        tensors: Iterable[tuple[str, Any]] = ((n, master.get(n, t)) for n, t in module.items())
    elif _zero_optimizer_state(checkpoint):
        tensors = _zero_to_fp32(checkpoints, tag, lora)
        source = f"fp32 master weights (ZeRO-{stage} partitions merged by deepspeed.utils.zero_to_fp32)"
    elif stage < 3:
        tensors, source = _strip_names(states.get("module") or {}, states_path).items(), "bf16 module weights"
    else:
        raise ZerotrainError(f"{checkpoint}: ZeRO-3 checkpoint without ZeRO optimizer states; it is incomplete")
    return _checked(tensors, expected, lora, checkpoint), source


def _checked(
    tensors: Iterable[tuple[str, Any]], expected: dict[str, tuple[int, ...]], lora: bool, where: Path
) -> dict[str, torch.Tensor]:
    """Materialise the wanted tensors (LoRA: only lora_ ones) one at a time in bf16; every one must
    have data and the expected shape, and every expected name must be there."""
    out: dict[str, torch.Tensor] = {}
    empty, wrong = [], []
    for raw_name, value in tensors:
        name = strip_prefixes(raw_name)
        if lora and not is_adapter(name):
            continue  # the frozen base
        if name not in expected:
            wrong.append(f"{name} (not in the model)")
            continue
        tensor = value if isinstance(value, torch.Tensor) else value.contiguous()  # zero_to_fp32's lazy tensors
        if tensor.numel() == 0:
            empty.append(name)
        elif tuple(tensor.shape) != expected[name]:
            wrong.append(f"{name} {tuple(tensor.shape)} != {expected[name]}")
        else:
            out[name] = tensor.detach().to(torch.bfloat16).contiguous()
    if empty:
        raise ZerotrainError(
            f"{where}: {len(empty)} tensors have no data (size 0), e.g. {empty[0]}; the checkpoint holds "
            "unmerged ZeRO-3 partitions where full weights were expected"
        )
    if wrong:
        raise ZerotrainError(
            f"{where}: {len(wrong)} tensors do not fit the run's model, e.g. {wrong[0]}; "
            f"was it trained with another model or mode than {CONFIG} says?"
        )
    missing = [name for name in expected if name not in out]
    if missing:
        raise ZerotrainError(
            f"{where}: {len(missing)} of the model's {len(expected)} tensors are missing, e.g. {missing[0]}; "
            f"was it trained with another model or mode than {CONFIG} says?"
        )
    return out


def strip_prefixes(name: str) -> str:
    """Drop wrapper prefixes ("module.", "_orig_mod.", "base_model.model.") from a parameter name."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


def _strip_names(state: dict[str, Any], where: Path) -> dict[str, Any]:
    out = {}
    for name, value in state.items():
        key = strip_prefixes(name)
        if key in out:
            raise ZerotrainError(f"{where}: two tensors are named {key} once prefixes are dropped")
        out[key] = value
    return out


def _model_states_path(checkpoint: Path) -> Path:
    if any(checkpoint.glob("*mp_rank_01_*")):
        raise ZerotrainError(f"{checkpoint}: tensor-parallel checkpoints (mp_rank_01) are not supported")
    for name in (_MODEL_STATES, _ZERO_MODEL_STATES):
        if (checkpoint / name).is_file():
            return checkpoint / name
    raise ZerotrainError(
        f"{checkpoint}: no DeepSpeed model states ({_MODEL_STATES} or {_ZERO_MODEL_STATES}); "
        "the checkpoint is incomplete or not a DeepSpeed checkpoint"
    )


def _torch_load(path: Path) -> dict[str, Any]:
    """A DeepSpeed checkpoint file (pickled config and optimizer objects, hence weights_only=False:
    only load run folders you trust), memory-mapped so large tensors are read only when used."""
    try:
        with contextlib.redirect_stdout(sys.stderr):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as err:  # torch raises assorted types for a truncated or foreign file
        raise ZerotrainError(f"{path}: cannot be read ({one_line(err)}); the checkpoint is damaged") from err


def _zero_stage(states: dict[str, Any], path: Path) -> int:
    config = states.get("ds_config")
    if isinstance(config, dict):
        return int((config.get("zero_optimization") or {}).get("stage", 0))
    return 3 if path.name == _ZERO_MODEL_STATES else (1 if any(path.parent.glob("*_optim_states.pt")) else 0)


def _zero_optimizer_state(checkpoint: Path) -> bool:
    """Whether the checkpoint's optimizer files hold ZeRO state (zero_to_fp32 can merge them);
    BF16_Optimizer's files have no zero_stage."""
    files = sorted(checkpoint.glob("*_optim_states.pt"))
    if not files:
        return False
    state = _torch_load(files[0]).get("optimizer_state_dict") or {}
    return "zero_stage" in state


def _zero_to_fp32(checkpoints: Path, tag: str, trainable_only: bool) -> Iterator[tuple[str, Any]]:
    with contextlib.redirect_stdout(sys.stderr):  # zero_to_fp32 prints its progress
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        try:
            state = get_fp32_state_dict_from_zero_checkpoint(
                str(checkpoints), tag=tag, exclude_frozen_parameters=trainable_only, lazy_mode=True
            )
        except (FileNotFoundError, ValueError, KeyError, NotImplementedError) as err:
            raise ZerotrainError(
                f"{checkpoints / tag}: DeepSpeed cannot merge the ZeRO checkpoint ({one_line(err)})"
            ) from err
    return iter(state.items())


def _stage0_master(
    optimizer: Any, module: dict[str, Any], expected: dict[str, tuple[int, ...]]
) -> dict[str, torch.Tensor] | None:
    """Stage 0's fp32 master tensors by name, or None when they cannot be matched with certainty.

    FP16_Optimizer saves one flat fp32 tensor per parameter group ("fp32_groups_flat"),
    FP16_UnfusedOptimizer a list per group ("fp32_groups"); neither names the parameters. Each group
    is the trainable parameters it was given, in order: walk the module's parameters in order and
    take the next slice of the group for each one whose slice rounds exactly to the bf16 tensor
    DeepSpeed saved for it (DeepSpeed copies master -> bf16 after every step)."""
    if not isinstance(optimizer, dict):
        return None
    if isinstance(optimizer.get("fp32_groups_flat"), (list, tuple)):
        groups = [flat.reshape(-1) for flat in optimizer["fp32_groups_flat"]]
    elif isinstance(optimizer.get("fp32_groups"), (list, tuple)):
        groups = [torch.cat([t.reshape(-1) for t in group]) for group in optimizer["fp32_groups"] if len(group)]
    else:
        return None
    remaining = [
        n for n, t in module.items() if n in expected and isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    master: dict[str, torch.Tensor] = {}
    for flat in groups:
        position, unmatched = 0, []
        for name in remaining:
            reference = module[name]
            size = reference.numel()
            piece = flat[position:position + size]
            if size and piece.numel() == size and torch.equal(piece.to(reference.dtype), reference.reshape(-1)):
                master[name] = piece.view(reference.shape)
                position += size
            else:
                unmatched.append(name)
        if position != flat.numel():
            return None
        remaining = unmatched
    return master


# --- the model -------------------------------------------------------------------------------------


def _load_run(run_dir: Path) -> RunConfig:
    """The run's model and training sections from RUN/config.yaml. Only these are validated: the rest
    (datasets, hardware, cache) need not exist where the export runs."""
    from pydantic import ValidationError

    from zerotrain.config.loader import format_validation_error, read_config_file

    path = run_dir / CONFIG
    if not path.is_file():
        raise ZerotrainError(f"{run_dir}: not a zerotrain run folder ({path} not found)")
    data = read_config_file(path)
    training = dict(data.get("training") or {})
    if training.get("mode", Mode.full.value) == Mode.full.value:
        training.pop("lora", None)  # a dumped full-mode config carries the unused default LoRA section
    try:
        return RunConfig.model_validate({"model": data.get("model") or {}, "training": training})
    except ValidationError as err:
        raise ZerotrainError(format_validation_error(err, str(path))) from err


def _checkpoint_dir(run_dir: Path, tag: str) -> Path:
    checkpoints = run_dir / CHECKPOINTS
    checkpoint = checkpoints / tag
    if not checkpoint.is_dir() or "/" in tag or tag in (".", ".."):
        found = sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) if checkpoints.is_dir() else []
        raise ZerotrainError(
            f"{run_dir}: no checkpoint '{tag}' under {checkpoints}; "
            + (f"found: {', '.join(found)}" if found else "the run has no checkpoints yet")
        )
    return checkpoint


def _meta_model(spec: ModelSpec, run: RunConfig) -> torch.nn.Module:
    """The denoiser as the run trained it, on the meta device: the shapes every tensor must have."""
    from zerotrain.adapters import apply_lora
    from zerotrain.models.meta import build_meta_model

    model = build_meta_model(spec)
    if run.training.mode is Mode.lora:
        apply_lora(model, spec, run)
    return model


def denoiser_folder(spec: ModelSpec) -> str:
    """Where a diffusers pipeline folder keeps this denoiser."""
    return families.of(spec).denoiser_folder


def pipeline_class(spec: ModelSpec) -> type:
    """The diffusers pipeline whose LoRA loader matches the denoiser."""
    import diffusers

    return getattr(diffusers, families.of(spec).pipeline_name(spec))


# --- writing ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _replacing(target: Path) -> Iterator[Path]:
    """A fresh sibling folder to write into, which replaces `target` once complete."""
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        yield partial
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    if target.is_dir():
        shutil.rmtree(target)
    elif target.exists():
        target.unlink()
    partial.rename(target)


def _write_full(
    out: Path, spec: ModelSpec, weights: dict[str, torch.Tensor], comfyui: bool, name: str
) -> list[Path]:
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        with torch.device("meta"), hidden_warnings():
            model = spec.denoiser_class().from_config(spec.config)
        try:
            model.load_state_dict(weights, strict=True, assign=True)
        except RuntimeError as err:
            raise ZerotrainError(f"the checkpoint does not load into {spec.class_name}: {one_line(err)}") from err
        leftover = [n for n, t in model.state_dict().items() if t.device.type == "meta"]
        if leftover:
            raise ZerotrainError(f"{spec.class_name}: {leftover[0]} has no weights after loading the checkpoint")
        folder = out / denoiser_folder(spec)
        with _replacing(folder) as partial:
            model.save_pretrained(partial, safe_serialization=True)
    finally:
        diffusers_logging.set_verbosity(verbosity)
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if comfyui:
        markers = families.of(spec).comfyui_markers(spec)
        comfy = {**families.of(spec).comfyui_model(weights), **markers}
        files.append(_save_single_file(out / COMFYUI_DIR / f"{name}.safetensors", comfy, {"format": "pt"},
                                       allow_empty=set(markers)))
    return files


def _write_lora(
    out: Path, spec: ModelSpec, meta: torch.nn.Module, weights: dict[str, torch.Tensor], comfyui: bool, name: str,
    export_rank: int = 64,
) -> tuple[list[Path], dict[str, Any]]:
    """OUT/lora/pytorch_lora_weights.safetensors, which the family pipeline's load_lora_weights loads: a
    LoRA (and DoRA) with its rank and alpha as metadata; a LoKr where the family's loader takes LoKr
    (Z-Image, FLUX.2), with alpha baked in; otherwise (LoHa, and LoKr elsewhere) the LoRA of rank
    export_rank that peft's convert_to_lora makes of the adapter. And, with comfyui, the adapter in
    ComfyUI's names. Returns the files and what the manifest records of the adapter."""
    from peft import get_peft_model_state_dict

    layers = get_peft_model_state_dict(meta, state_dict=weights, adapter_name=ADAPTER)
    if len(layers) != len(weights) or any(k.startswith("module.") or f".{ADAPTER}." in k for k in layers):
        raise ZerotrainError(f"internal: peft kept {len(layers)} of {len(weights)} adapter tensors or left prefixes")
    config = meta.peft_config[ADAPTER]
    kind = adapter_kind(config)
    family = families.of(spec)
    dora = kind == "lora" and bool(config.use_dora)
    if comfyui and (kind != "lora" or dora):
        family.comfyui_adapter_name(next(iter(layers)).rsplit(".", 1)[0])  # one line now where there is none
    info: dict[str, Any] = {"type": kind, "rank": int(config.r), "alpha": float(_alpha(config))}
    if kind == "lora":
        info["use_dora"] = bool(config.use_dora)
        saved, metadata = layers, lora_metadata(config)
    elif kind == "lokr" and family.diffusers_lokr:
        saved, metadata = baked(layers, config), None
        info["diffusers"] = "LoKr, alpha baked in"
    else:
        lora_config, saved, fit = converted_lora(meta, weights, export_rank)
        metadata = lora_metadata(lora_config)
        info["diffusers"] = f"LoRA of rank {export_rank} converted by peft's convert_to_lora"
        info["conversion"] = fit
    component = denoiser_folder(spec)
    cls = pipeline_class(spec)
    kwargs: dict[str, Any] = {f"{component}_lora_layers": saved}
    metadata_arg = f"{component}_lora_adapter_metadata"
    if metadata is not None and metadata_arg in inspect.signature(cls.save_lora_weights).parameters:
        kwargs[metadata_arg] = metadata
    elif metadata is not None:  # older diffusers infers alpha = rank: fold the scale into B instead
        scale = metadata["lora_alpha"] / metadata["r"]
        kwargs[f"{component}_lora_layers"] = {
            k: (v.float() * scale).to(v.dtype) if ".lora_B." in k else v for k, v in saved.items()
        }
    folder = out / LORA_DIR
    with _replacing(folder) as partial:
        cls.save_lora_weights(partial, safe_serialization=True, **kwargs)
    files = [folder / LORA_WEIGHTS]
    if not files[0].is_file():
        raise ZerotrainError(f"internal: {cls.__name__}.save_lora_weights wrote no {LORA_WEIGHTS}")
    if comfyui:
        if dora:
            comfy = comfyui_dora(spec, layers, config)
        elif kind == "lora":
            comfy = comfyui_lora_state_dict(spec, meta, layers, config.lora_alpha)
        else:
            comfy = family.comfyui_adapter(meta, baked(layers, config))
        meta_info = {"format": "pt", "ss_network_dim": str(config.r), "ss_network_alpha": str(_alpha(config))}
        files.append(_save_single_file(out / COMFYUI_DIR / f"{name}.safetensors", comfy, meta_info))
    return files, info


def comfyui_dora(spec: ModelSpec, layers: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A DoRA in the names ComfyUI's LoRA loader reads (Family.comfyui_adapter_name, kohya's lora_down /
    lora_up / alpha) with `dora_scale` (out, 1). peft's DoRA is m (W0 + s B A) / ||W0 + s B A|| per output
    row; ComfyUI's weight_decompose (comfy/weight_adapter/base.py) divides by the base weight's row
    norm ||W0|| (plus float32's eps) instead. So the magnitude is written as m (||W0|| + eps) / ||W0 + s B A||,
    computed as ComfyUI merges, in float32 from the base weights in the model's folder and the factors as
    written (not the training copy they were rounded from), and stored in float32: ComfyUI's merge then
    equals peft's of the exported factors to float32 rounding (a bf16 dora_scale alone moves it by up to
    2^-8)."""
    from safetensors import safe_open

    from zerotrain.loading import weight_files

    family = families.of(spec)
    if spec.denoiser is not None:  # the base weights are the fine-tune's, which spec.pretrained does not hold
        raise ZerotrainError(f"the ComfyUI export of a DoRA trained over model.denoiser ({spec.denoiser}) is not "
                             "written yet; export without --comfyui (the diffusers DoRA loads in diffusers)")
    files = weight_files(spec, Path(spec.pretrained)) if spec.pretrained else "the model has no weights folder"
    if isinstance(files, str):
        raise ZerotrainError(f"the ComfyUI export of a DoRA needs the base weights: {files}")
    scale = config.lora_alpha / config.r
    out: dict[str, torch.Tensor] = {}
    for module, (down, up) in lora_pairs(layers, "internal").items():
        name = f"{module}.weight"
        if name not in files:
            raise ZerotrainError(f"the ComfyUI export of a DoRA needs {name}, which {spec.pretrained} does not hold")
        with safe_open(str(files[name]), framework="pt") as handle:
            base = handle.get_tensor(name).float()
        target = family.comfyui_adapter_name(module)
        written = kohya_lora(target, down, up, config.lora_alpha)
        out.update(written)
        delta = written[f"{target}.lora_up.weight"].float() @ written[f"{target}.lora_down.weight"].float()
        adapted = base + scale * delta
        magnitude = layers[f"{module}.lora_magnitude_vector"].float()
        ratio = (base.norm(dim=1) + torch.finfo(torch.float32).eps) / adapted.norm(dim=1).clamp_min(1e-12)
        out[f"{target}.dora_scale"] = (magnitude * ratio).reshape(-1, 1).contiguous()
    return out


def adapter_kind(config: Any) -> str:
    """lora, lokr or loha, from a peft config."""
    return {"LORA": "lora", "LOKR": "lokr", "LOHA": "loha"}[str(config.peft_type.value)]


def _alpha(config: Any) -> float:
    return float(config.lora_alpha if hasattr(config, "lora_alpha") else config.alpha)


def baked(layers: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """A LoKr or LoHa state dict (peft's names) with its scale alpha / r multiplied into the first factor
    of each layer (lokr_w1 or lokr_w1_a, hada_w1_a), so that a loader that scales by 1 without an alpha
    (ComfyUI, diffusers' LoKr) applies what peft applies."""
    scale = _alpha(config) / config.r
    first = (".lokr_w1", ".lokr_w1_a", ".hada_w1_a")
    modules = {k.rsplit(".", 1)[0] for k in layers}
    out = dict(layers)
    for module in modules:
        key = next((module + f for f in first if module + f in layers), None)
        if key is None:
            raise ZerotrainError(f"internal: adapter layer {module} has no first factor among {first}")
        out[key] = (layers[key].float() * scale).to(layers[key].dtype)
    return out


def converted_lora(meta: torch.nn.Module, weights: dict[str, torch.Tensor], rank: int
                   ) -> tuple[Any, dict[str, torch.Tensor], dict[str, Any]]:
    """The LoRA of `rank` that peft's convert_to_lora makes of a LoKr or LoHa (an SVD of each layer's
    delta, the scale baked in: alpha = rank), its layers in bf16, and how close it is: the relative
    Frobenius error ||delta - B A|| / ||delta|| of the worst layer and the mean over layers."""
    from peft import convert_to_lora
    from peft.tuners.tuners_utils import BaseTunerLayer

    # peft's SVD keeps at most the smaller side of a layer: the rank is capped by the narrowest layer.
    sides = [min(m.get_base_layer().weight.shape[:2]) for m in meta.modules() if isinstance(m, BaseTunerLayer)]
    rank = min([rank, *sides])
    adapter = {n: p for n, p in meta.named_parameters() if is_adapter(n)}
    held = {n: weights[n].float() for n in adapter}
    meta.load_state_dict(held, strict=False, assign=True)  # the base stays on meta: only deltas are needed
    with torch.no_grad(), hidden_warnings():
        config, state = convert_to_lora(meta, rank=rank, adapter_name=ADAPTER)
        errors = []
        layers = dict(meta.named_modules())
        for key, down in state.items():
            if key.endswith(".lora_A.weight"):
                module = key[: -len(".lora_A.weight")]
                delta = layers[module].get_delta_weight(ADAPTER).float().reshape(state[f"{module}.lora_B.weight"].shape[0], -1)
                approx = state[f"{module}.lora_B.weight"].float() @ down.float()
                errors.append(float((delta - approx).norm() / delta.norm().clamp_min(1e-30)))
    return config, {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, {
        "rank": rank, "worst_relative_error": max(errors), "mean_relative_error": sum(errors) / len(errors)}


def lora_metadata(config: Any) -> dict[str, Any]:
    """The LoraConfig arguments diffusers needs to rebuild the adapter (its lora_adapter_metadata):
    rank, alpha and targets, as diffusers' own get_peft_kwargs derives them."""
    return {
        "r": int(config.r),
        "lora_alpha": float(config.lora_alpha),
        "target_modules": sorted(config.target_modules) if not isinstance(config.target_modules, str)
        else config.target_modules,
        "rank_pattern": dict(config.rank_pattern or {}),
        "alpha_pattern": dict(config.alpha_pattern or {}),
        "use_dora": bool(config.use_dora),
        "lora_bias": bool(getattr(config, "lora_bias", False)),
    }


def _save_single_file(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str],
                      allow_empty: set[str] | frozenset[str] = frozenset()) -> Path:
    """Written under a partial name, then renamed. An empty tensor is refused (a weight lost on the way)
    unless `allow_empty` names it (a marker ComfyUI reads by its presence: Family.comfyui_markers)."""
    from safetensors.torch import save_file

    empty = [k for k, v in tensors.items() if v.numel() == 0 and k not in allow_empty]
    if empty or any(k.startswith("module.") for k in tensors):
        first = (empty or [""])[0]
        raise ZerotrainError(f"internal: refusing to write {path}: an empty tensor or a module. prefix ({first})")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial), metadata=metadata)
    partial.replace(path)
    return path


# --- ComfyUI ---------------------------------------------------------------------------------------


def comfyui_lora_state_dict(
    spec: ModelSpec, model: torch.nn.Module, layers: dict[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """The LoRA in the naming ComfyUI loads for the family (Family.comfyui_lora; kohya's
    "<name>.lora_down.weight" (A), ".lora_up.weight" (B) and ".alpha", ComfyUI and kohya scaling by
    alpha / rank). `layers` is in get_peft_model_state_dict's format ("<module>.lora_A.weight")."""
    pairs = lora_pairs(layers, "internal")
    if len(pairs) * 2 != len(layers):
        extra = sorted(set(layers) - {f"{m}.lora_{x}.weight" for m in pairs for x in "AB"})
        raise ZerotrainError(f"the ComfyUI export supports plain LoRA (lora_A/lora_B) only, found {extra[0]}")
    return families.of(spec).comfyui_lora(model, pairs, alpha)
