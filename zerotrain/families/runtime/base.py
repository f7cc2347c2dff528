"""The torch side of the defaults most model families share (`BaseRuntime`, beside the declarations'
zerotrain.families.base.BaseFamily), and the tensor helpers the families' torch sides use.

A family's torch side subclasses its declarations and the torch side of their base
(`class SD3Runtime(SD3, BaseRuntime)`), and implements the members zerotrain.protocols marks torch_side:
encode_prompt, flow_inputs, example_inputs, the key maps, the tiny model. Everything here imports torch and
diffusers at module level; nothing that plans imports it (zerotrain.families.parts.declared)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift

from zerotrain import recompute
from zerotrain.errors import ZerotrainError
from zerotrain.families.base import (
    BaseFamily,
    shift_from_mu,
)
from zerotrain.protocols import FlowObjective, ModelSpec


def text_and_pooled(batch: dict[str, torch.Tensor], b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's prompt_embeds (b, T, D) and pooled_prompt_embeds (b, P), shapes checked."""
    text, pooled = batch["prompt_embeds"], batch["pooled_prompt_embeds"]
    if text.ndim != 3 or text.shape[0] != b:
        raise ValueError(f"prompt_embeds must be ({b}, T, D), got {tuple(text.shape)}")
    if pooled.ndim != 2 or pooled.shape[0] != b:
        raise ValueError(f"pooled_prompt_embeds must be ({b}, P), got {tuple(pooled.shape)}")
    return text, pooled


def kohya_lora(name: str, down: torch.Tensor, up: torch.Tensor, alpha: float) -> dict[str, torch.Tensor]:
    """One LoRA layer in kohya's naming, as ComfyUI reads it (it scales by alpha / rank)."""
    return {
        f"{name}.lora_down.weight": down.contiguous(),
        f"{name}.lora_up.weight": up.contiguous(),
        f"{name}.alpha": torch.tensor(float(alpha), dtype=torch.float32),
    }


def kohya_prefixed(
    prefix: str, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float
) -> dict[str, torch.Tensor]:
    """Every pair named prefix + the diffusers module path with "." -> "_"."""
    out: dict[str, torch.Tensor] = {}
    for module, (down, up) in pairs.items():
        out.update(kohya_lora(prefix + module.replace(".", "_"), down, up, alpha))
    return out


def compact_rows(embeds: torch.Tensor, mask: torch.Tensor, tokens: int) -> dict[str, torch.Tensor]:
    """A pipeline's per-token text (B, T, ...) and its (B, T) mask, wherever the mask puts the padding,
    as the cache keeps them: each caption's own rows in order, zero-padded at the end to `tokens`, and a
    prefix mask (B, tokens) int64 (prompt_embeds, prompt_embeds_mask). For a transformer that is blind
    to where padding sits (its text positions do not count the padding, padded keys are masked)."""
    if embeds.ndim < 3 or tuple(mask.shape) != tuple(embeds.shape[:2]):
        raise ValueError(f"expected prompt_embeds (B, T, ...) and a (B, T) mask, got {tuple(embeds.shape)} "
                         f"and {tuple(mask.shape)}")
    valid = mask.bool()
    lengths = valid.sum(dim=1)
    if int(lengths.max()) > tokens or int(lengths.min()) < 1:
        raise ValueError(f"caption lengths {lengths.tolist()} must be 1..{tokens}")
    out = embeds.new_zeros(embeds.shape[0], tokens, *embeds.shape[2:])
    prefix = torch.zeros(embeds.shape[0], tokens, dtype=torch.int64, device=embeds.device)
    for i in range(embeds.shape[0]):
        out[i, : int(lengths[i])] = embeds[i][valid[i]]
        prefix[i, : int(lengths[i])] = 1
    return {"prompt_embeds": out, "prompt_embeds_mask": prefix}


def trim_rows(text: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cached text (B, T, ...) and its prefix mask (compact_rows) cut to the longest caption: (B, n, ...)
    and a bool (B, n) mask."""
    if text.ndim < 3 or tuple(mask.shape) != tuple(text.shape[:2]):
        raise ValueError(f"prompt_embeds (B, T, ...) and prompt_embeds_mask (B, T) do not match: "
                         f"{tuple(text.shape)} and {tuple(mask.shape)}")
    valid = mask > 0
    length = int(valid.sum(dim=1).max())
    if length < 1:
        raise ValueError("prompt_embeds_mask marks no token of any caption")
    return text[:, :length], valid[:, :length]


def meta_or_random(device: torch.device | str, dtype: torch.dtype) -> Any:
    """A tensor maker for example_inputs: uninitialised on meta, standard normal elsewhere."""
    def tensor(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
        if torch.device(device).type == "meta":
            return torch.empty(*shape, device=device, dtype=kind)
        return torch.randn(*shape, device=device, dtype=kind)

    return tensor


def example_timestep(tensor: Any, batch: int, device: torch.device | str) -> Any:
    """The trace's timestep: positive draws off meta, an empty tensor on meta (as before families/)."""
    return tensor(batch, kind=torch.float32).abs() if torch.device(device).type != "meta" else tensor(batch)


class BaseRuntime(BaseFamily):
    """The torch side of BaseFamily: the defaults of the torch_side members of zerotrain.protocols.Family."""

    def enable_checkpointing(self, model: torch.nn.Module, blocks: list[str] | None = None,
                             checkpoint_fn: Any = None) -> None:
        recompute.enable(model, blocks, checkpoint_fn or recompute.default_checkpoint)

    def encoder_pipeline(self, pipeline_class: Any, folder: Path, dtype: torch.dtype, skipped: dict[str, None]) -> Any:
        return pipeline_class.from_pretrained(folder, dtype=dtype, **skipped)

    def text_reference_identity(self, spec: ModelSpec) -> tuple[Any, ...]:
        return ()

    def text_pipeline(self, pipeline_class: Any, components: dict[str, Any]) -> Any:
        return pipeline_class(**components)

    def negative_embeds(self, folder: Path, negative_prompt: str, encoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return encoded

    def scheduler_config(self, folder: Path) -> dict[str, Any]:
        path = Path(folder) / "scheduler" / "scheduler_config.json"
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise ZerotrainError(f"{path}: cannot read the {self.title} model's scheduler config "
                                 f"({' '.join(str(err).split())[:300]}); point model.name_or_path to a complete "
                                 "diffusers folder") from err
        if not isinstance(config, dict) or "_class_name" not in config:
            raise ZerotrainError(f"{path}: not a diffusers scheduler config (no _class_name)")
        return config

    def dynamic_shift(self, scheduler_config: dict[str, Any], image_seq_len: int) -> float:
        if image_seq_len < 1:
            raise ValueError(f"dynamic_shift: image_seq_len must be positive, got {image_seq_len}")
        params = {key: scheduler_config.get(key, value) for key, value in self.shift_defaults.items()}
        mu = calculate_shift(image_seq_len, params["base_image_seq_len"], params["max_image_seq_len"],
                             params["base_shift"], params["max_shift"])
        return shift_from_mu(scheduler_config, mu)

    def sampling_shift(self, spec: ModelSpec, scheduler_config: dict[str, Any], image_seq_len: int) -> float:
        if scheduler_config.get("use_dynamic_shifting", False):
            return self.dynamic_shift(scheduler_config, image_seq_len)
        return float(scheduler_config.get("shift", 1.0))

    def flow_inputs(self, objective: FlowObjective, x_t: Any, target: Any, sigma: Any, batch: dict[str, Any]) -> Any:
        raise NotImplementedError(f"{self.name} trains with the {self.objective} objective, not flow matching")

    def prediction(self, output: Any) -> torch.Tensor:
        return output

    def target_layout(self, latents: torch.Tensor) -> torch.Tensor:
        return latents

    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        raise self._no_references(spec)

    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[torch.Tensor]) -> dict[str, Any]:
        raise self._no_references(spec)

    def reference_kwargs(self, spec: ModelSpec, images: list[Any], size: tuple[int, int],
                         area: int | None = None) -> dict[str, Any]:
        raise self._no_references(spec)

    def validation_pipeline(self, spec: ModelSpec, folder: Path, components: dict[str, Any], device: torch.device) -> Any:
        return getattr(diffusers, self.pipeline_name(spec))(**components)

    def validation_kwargs(
        self, embeds: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None, guidance_scale: float
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(embeds)
        if negative is not None:
            kwargs.update({f"negative_{name}": value for name, value in negative.items()})
        kwargs["guidance_scale"] = guidance_scale
        return kwargs

    def comfyui_model(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return weights

    def diffusers_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        return None

    def comfyui_markers(self, spec: ModelSpec) -> dict[str, torch.Tensor]:
        return {}

    def comfyui_adapter(self, model: torch.nn.Module, layers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for key, tensor in layers.items():
            module, factor = key.rsplit(".", 1)
            out[f"{self.comfyui_adapter_name(module)}.{factor}"] = tensor.contiguous()
        return out
