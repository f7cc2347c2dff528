"""The adapters of training.mode=lora, all through peft: LoRA (optionally DoRA), LoKr and LoHa, and
continuing from a LoRA file (training.lora.init_from).

One function builds them, for the planner's trace on the meta device, for training and for the
export's shapes (apply_lora), so what is planned is what trains and what is exported. LoKr and LoHa
layers on linear layers compute peft's product without building its full delta weight
(zerotrain.adapter_forward), with peft's modules, parameters and names.

init_from reads a LoRA in whatever key format the family's diffusers pipeline reads
(`<Pipeline>.lora_state_dict`: diffusers and peft names, kohya's lora_down/lora_up/alpha, ComfyUI's
and Black Forest Labs' names), so a file another trainer wrote, or zerotrain's own export in either
format, starts the adapter. zerotrain trains one rank and one alpha for all layers, so a file's
layers are brought to its most common rank and scale: a layer of a higher rank whose extra
singular values are zero (the q, k and v of a fused qkv LoRA, as the ComfyUI exports of Flux hold
them) is cut to that rank exactly, and a layer of another scale has the ratio folded into its B.
The product B A x scale of every layer is what the file's loader would apply.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zerotrain import adapter_forward, families
from zerotrain.errors import ZerotrainError

if TYPE_CHECKING:
    import torch

    from zerotrain.config.sections import LoraConfig, RunConfig
    from zerotrain.protocols import ModelSpec

ADAPTER = "default"
# The names of peft's adapter parameters: LoRA and DoRA (lora_A, lora_B, lora_magnitude_vector),
# LoKr (lokr_w1, lokr_w2, ...), LoHa (hada_w1_a, ...).
PREFIXES = ("lora_", "lokr_", "hada_")
# Singular values a layer's extra rank may keep, relative to its largest, to be cut without loss.
RANK_CUT_TOLERANCE = 1e-4


def is_adapter(name: str) -> bool:
    """Whether a parameter (or module) name is an adapter's."""
    return any(prefix in name for prefix in PREFIXES)


def targets(spec: ModelSpec, run: RunConfig) -> list[str]:
    """training.lora.target_modules, or the family's default targets."""
    return run.training.lora.target_modules or families.of(spec).default_lora_targets(spec)


def measured(lora: LoraConfig) -> dict[str, Any]:
    """The settings that shape the adapter, for the planner's measurement key: rank, alpha, targets and
    dropout, and the adapter type, DoRA and LoKr's factor where not the defaults (so the keys of plain
    LoRA runs, and the facts shipped for them, stay as they were); for LoKr and LoHa, which forward
    runs (factored or peft's, whose full deltas are activations)."""
    out = lora.model_dump(mode="json", include={"rank", "alpha", "target_modules", "dropout"})
    defaults = type(lora)()
    out.update({field: getattr(lora, field) for field in ("type", "use_dora", "factor")
                if getattr(lora, field) != getattr(defaults, field)})
    if lora.type in ("lokr", "loha"):
        out["forward"] = "peft" if adapter_forward.gate() else "factored"
    return out


def peft_config(spec: ModelSpec, run: RunConfig) -> Any:
    """The peft config of training.lora."""
    lora = run.training.lora
    alpha = lora.alpha or lora.rank
    if lora.type == "lokr":
        from peft import LoKrConfig

        return LoKrConfig(r=lora.rank, alpha=alpha, module_dropout=lora.dropout, decompose_factor=lora.factor,
                          target_modules=targets(spec, run))
    if lora.type == "loha":
        from peft import LoHaConfig

        return LoHaConfig(r=lora.rank, alpha=alpha, module_dropout=lora.dropout, target_modules=targets(spec, run))
    from peft import LoraConfig

    return LoraConfig(r=lora.rank, lora_alpha=alpha, lora_dropout=lora.dropout, target_modules=targets(spec, run),
                      use_dora=lora.use_dora)


def apply_lora(model: torch.nn.Module, spec: ModelSpec, run: RunConfig) -> None:
    """Inject the run's peft adapters (on meta too, so the planner counts their parameters exactly) and
    freeze the base; with init_from, a model with weights starts from the file's adapter."""
    from peft import inject_adapter_in_model, set_peft_model_state_dict

    inject_adapter_in_model(peft_config(spec, run), model, adapter_name=ADAPTER)
    adapter_forward.install(model)  # LoKr and LoHa without their full delta weights
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter(name))
    source = run.training.lora.init_from
    if source is None or any(p.is_meta for p in model.parameters() if p.requires_grad):
        return
    state = read_lora(Path(source), spec).state_dict()
    result = set_peft_model_state_dict(model, state, adapter_name=ADAPTER)
    unexpected = [key for key in result.unexpected_keys if is_adapter(key)]
    if unexpected:
        raise ZerotrainError(f"training.lora.init_from={source}: {unexpected[0]} has no place in the model")


def lora_pairs(layers: dict[str, torch.Tensor], where: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (lora_A, lora_B) of a state dict in peft's names ("<module>.lora_A.weight")."""
    pairs = {}
    for key, down in layers.items():
        if key.endswith(".lora_A.weight"):
            module = key[: -len(".lora_A.weight")]
            up = layers.get(f"{module}.lora_B.weight")
            if up is None:
                raise ZerotrainError(f"{where}: LoRA {module} has lora_A but no lora_B")
            pairs[module] = (down, up)
    return pairs


# --- continuing from a LoRA file --------------------------------------------------------------------


@dataclass(frozen=True)
class FileLora:
    """A LoRA file's layers at one rank and one alpha: module -> (A (r, in), B (out, r))."""

    layers: dict[str, tuple[Any, Any]]
    rank: int
    alpha: float
    magnitudes: dict[str, Any]
    """DoRA's lora_magnitude_vector per module, where the file has them."""

    def state_dict(self) -> dict[str, Any]:
        """In peft's names, without the adapter name (set_peft_model_state_dict's input)."""
        out = {}
        for module, (down, up) in self.layers.items():
            out[f"{module}.lora_A.weight"] = down
            out[f"{module}.lora_B.weight"] = up
        for module, magnitude in self.magnitudes.items():
            out[f"{module}.lora_magnitude_vector"] = magnitude
        return out


def resolve(run: RunConfig, spec: ModelSpec) -> RunConfig:
    """The run with training.lora's rank, alpha, targets and DoRA taken from init_from's file, where
    it names one; one line where the config sets them otherwise."""
    lora = run.training.lora
    if lora.init_from is None:
        return run
    if lora.type != "lora":
        raise ZerotrainError(f"training.lora.init_from: continues a LoRA; type {lora.type} starts fresh (remove "
                             "init_from or set type: lora)")
    found = read_lora(Path(lora.init_from), spec)
    settled = {"rank": found.rank, "alpha": float(found.alpha), "target_modules": short_targets(spec, set(found.layers)),
               "use_dora": bool(found.magnitudes)}
    for field, value in settled.items():
        given = getattr(lora, field)
        if field in lora.model_fields_set and given is not None and not _same(field, given, value, spec):
            raise ZerotrainError(f"training.lora.{field}={given}: init_from {lora.init_from} has {field} "
                                 f"{_shown(value)}; remove training.lora.{field} to take the file's")
    training = run.training.model_copy(update={"lora": lora.model_copy(update=settled)})
    return run.model_copy(update={"training": training})


def _same(field: str, given: Any, value: Any, spec: ModelSpec) -> bool:
    if field == "target_modules":
        return modules_matching(spec, given) == modules_matching(spec, value)
    return given == value


def _shown(value: Any) -> str:
    return f"[{', '.join(value[:4])}{', ...' if len(value) > 4 else ''}]" if isinstance(value, list) else str(value)


def _spec_key(spec: ModelSpec) -> str:
    return spec.class_name + json.dumps(spec.config, sort_keys=True, default=str)


_MODULES: dict[str, tuple[str, ...]] = {}
_FILES: dict[tuple, FileLora] = {}


def _module_names(spec: ModelSpec) -> tuple[str, ...]:
    """The names of the denoiser's modules, from the model built on meta (kept per architecture)."""
    key = _spec_key(spec)
    if key not in _MODULES:
        from zerotrain.models.meta import build_meta_model

        _MODULES[key] = tuple(name for name, _ in build_meta_model(spec).named_modules() if name)
    return _MODULES[key]


def modules_matching(spec: ModelSpec, names: list[str]) -> set[str]:
    """The modules that peft's target_modules list selects (a name, or a suffix after a dot)."""
    return {m for m in _module_names(spec) if any(m == t or m.endswith("." + t) for t in names)}


def short_targets(spec: ModelSpec, modules: set[str]) -> list[str]:
    """The shortest suffixes (the last k name parts) that select exactly these modules, or the full names."""
    for parts in range(1, 1 + max((m.count(".") + 1 for m in modules), default=1)):
        suffixes = sorted({".".join(m.split(".")[-parts:]) for m in modules})
        if modules_matching(spec, suffixes) == modules:
            return suffixes
    return sorted(modules)


def read_lora(path: Path, spec: ModelSpec) -> FileLora:
    """The denoiser's layers of a LoRA file, at one rank and alpha (see the module docstring)."""
    if not path.is_file():
        raise ZerotrainError(f"training.lora.init_from: {path} is not a file")
    stat = path.stat()
    key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size, _spec_key(spec))
    if key not in _FILES:
        _FILES[key] = _read_lora(path, spec)
    return _FILES[key]


def _read_lora(path: Path, spec: ModelSpec) -> FileLora:
    import diffusers
    from diffusers.utils import convert_unet_state_dict_to_peft

    from zerotrain.quiet import hidden_warnings

    family = families.of(spec)
    component = family.denoiser_folder
    try:
        with hidden_warnings():
            loaded = getattr(diffusers, family.pipeline_name(spec)).lora_state_dict(str(path))
    except Exception as err:  # diffusers raises assorted types for files it cannot read
        raise ZerotrainError(f"training.lora.init_from: {path} is not a LoRA the {spec.class_name} loader reads "
                             f"({' '.join(str(err).split())[:200] or type(err).__name__})") from err
    state, alphas = (loaded[0], loaded[1]) if isinstance(loaded, tuple) else (loaded, None)
    state = {k.removeprefix(f"{component}."): v for k, v in state.items() if not k.startswith("text_encoder")}
    if state and "lora_A" not in next(iter(state)):
        state = convert_unet_state_dict_to_peft(state)
    per_module_alpha = _file_alphas(path, component, alphas)
    layers = {m: (down.float(), up.float()) for m, (down, up) in lora_pairs(state, f"training.lora.init_from: {path}").items()}
    magnitudes = {key.removesuffix(".lora_magnitude_vector"): value.reshape(-1) for key, value in state.items()
                  if key.endswith(".lora_magnitude_vector")}
    if not layers:
        raise ZerotrainError(f"training.lora.init_from: {path} holds no LoRA layers of the {component}")
    rank = Counter(down.shape[0] for down, _ in layers.values()).most_common(1)[0][0]
    scales = {m: per_module_alpha(m, down.shape[0]) / down.shape[0] for m, (down, _) in layers.items()}
    alpha = Counter(scales[m] * rank for m, (down, _) in layers.items() if down.shape[0] == rank).most_common(1)[0][0]
    out = {}
    for module, (down, up) in layers.items():
        if down.shape[0] != rank:
            down, up = _cut(down, up, rank, path, module)
        if abs(scales[module] - alpha / rank) > 1e-9 * abs(alpha / rank):
            up = up * (scales[module] / (alpha / rank))
        out[module] = (down, up)
    return FileLora(out, rank, float(alpha), magnitudes)


def _file_alphas(path: Path, component: str, alphas: dict | None) -> Any:
    """module, rank -> its alpha: the diffusers metadata's lora_alpha and alpha_pattern, else kohya's
    network alphas as the loader returns them, else the rank (scale 1: diffusers folds kohya's alpha
    into the weights where it converts them)."""
    from safetensors import safe_open

    metadata: dict[str, Any] = {}
    if path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as handle:
            raw = (handle.metadata() or {}).get("lora_adapter_metadata")
        if raw:
            data = json.loads(raw)
            metadata = {k.removeprefix(f"{component}."): v for k, v in data.items()}
    if "lora_alpha" in metadata:
        pattern = metadata.get("alpha_pattern") or {}
        return lambda module, rank: float(pattern.get(module, metadata["lora_alpha"]))
    from diffusers.utils import convert_unet_state_dict_to_peft

    # Named as the loader names the weights they scale ("<module>.processor.to_k_lora.down.weight.alpha"
    # for SDXL's kohya files): put into peft's names the same way, then cut to the module.
    alphas = {k.removeprefix(f"{component}."): v for k, v in (alphas or {}).items() if not k.startswith("text_encoder")}
    named = {key.split(".lora_A")[0].removesuffix(".alpha"): float(value)
             for key, value in convert_unet_state_dict_to_peft(alphas).items()}
    return lambda module, rank: named.get(module, float(rank))


def _cut(down: Any, up: Any, rank: int, path: Path, module: str) -> tuple[Any, Any]:
    """A layer of another rank as an equal one of `rank`, where its product has at most that rank."""
    import torch

    u, s, vh = torch.linalg.svd(up.double() @ down.double(), full_matrices=False)
    if s.numel() > rank and s[rank] > RANK_CUT_TOLERANCE * s[0]:
        raise ZerotrainError(f"training.lora.init_from: {path}: {module} has rank {down.shape[0]}, the file's other "
                             f"layers {rank}; zerotrain continues a LoRA of one rank")
    root = s[:rank].sqrt()
    return (root[:, None] * vh[:rank]).float(), (u[:, :rank] * root[None, :]).float()
