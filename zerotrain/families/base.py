"""The defaults most model families share (`BaseFamily`), and helpers the family modules use.

A family is one object in one module of zerotrain/families/, implementing the protocol
`zerotrain.protocols.Family` (whose docstrings say what each member means); most subclass `BaseFamily`
and override what differs. It declares everything that differs between model families: the diffusers
classes, the VAE and latent layout, how captions become conditioning (the pipeline's own
`encode_prompt`), the denoiser's forward arguments for training and for the planner's trace, the
objective, the pipeline that renders validation images, the default LoRA targets, the export formats
and the tiny model for tests. The rest of zerotrain asks the family (`zerotrain.families.of(spec)`) and
never tests its name.

A family is composed of parts: what several families share lives once under zerotrain/families/parts/
(the VAE codecs, FLUX.1's transformer, the key maps, the Qwen-VL text parts), and no family module imports
another (tests/unit/test_layout.py).

A family is two classes (zerotrain.families.parts.declared): these declarations, which import no torch,
diffusers or transformers, so that resolving a model and planning from cached facts stays fast; and its torch
side under zerotrain/families/runtime/ (BaseRuntime for these defaults), which the declarations reach on
first use for the members zerotrain.protocols marks torch_side.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.errors import ZerotrainError
from zerotrain.families.parts.declared import Declared
from zerotrain.families.parts.latents import AUTOENCODER_KL
from zerotrain.protocols import Family

if TYPE_CHECKING:
    from zerotrain.protocols import LatentCodec, ModelSpec, VaeFacts


class BaseFamily(Declared):
    """The shared defaults of zerotrain.protocols.Family's declarations. A subclass sets the class attributes
    without defaults here, names its VAE part (codec, from zerotrain.families.parts.latents; an AutoencoderKL by
    default) and its torch side (runtime_class, a subclass of it and of zerotrain.families.runtime.base.BaseRuntime),
    which implements encode_prompt, example_inputs, comfyui_lora and tiny_components (and flow_inputs, for a
    flow-matching family); it implements published_vae where its codec has no one published VAE."""

    runtime_protocol = Family
    name: ClassVar[str]
    default_for_class: ClassVar[bool] = True
    denoiser_folder: ClassVar[str] = "transformer"
    codec: ClassVar[LatentCodec] = AUTOENCODER_KL
    text_outputs: ClassVar[tuple[str, ...]] = ("prompt_embeds", "pooled_prompt_embeds")
    pipeline: ClassVar[str]
    pipeline_extras: ClassVar[dict[str, Any]] = {}
    default_in_channels: ClassVar[int]
    lora_targets: ClassVar[tuple[str, ...]]
    classifier_free_guidance: ClassVar[bool]
    shift_defaults: ClassVar[dict[str, float]] = {}
    depth_keys: ClassVar[tuple[str, ...]] = ("num_layers",)
    objective: ClassVar[str] = "flow"
    timestep_logit_std: ClassVar[float] = 1.0
    joint_output: ClassVar[bool] = False
    target_last: ClassVar[bool] = False
    text_reads_references: ClassVar[bool] = False
    reference_text_outputs: ClassVar[tuple[str, ...]] = ("image_pad_mask",)
    diffusers_lokr: ClassVar[bool] = False
    """Whether the family pipeline's load_lora_weights reads a LoKr (diffusers 0.42: Z-Image, FLUX.2)."""

    # --- the model and its latents -----------------------------------------------------------------

    def latent_channels(self, config: dict[str, Any], where: Path | str) -> int:
        return int(config.get("out_channels") or config.get("in_channels") or self.default_in_channels)

    def published_vae(self, config: dict[str, Any]) -> VaeFacts:
        return self.codec.published(self.latent_channels(config, "config"))

    def patch(self, spec: ModelSpec) -> int:
        return int(spec.config.get("patch_size", 1))

    def pixel_factor(self, spec: ModelSpec) -> int:
        return spec.vae_scale_factor * self.patch(spec)

    def image_tokens(self, spec: ModelSpec, resolution: int) -> int:
        side = resolution // self.pixel_factor(spec)
        return side * side

    def latent_tokens(self, spec: ModelSpec, height: int, width: int) -> int:
        patch = self.patch(spec)
        if height % patch or width % patch:
            raise ValueError(f"{self.name}: latents {height}x{width} are not a multiple of the patch {patch}")
        return (height // patch) * (width // patch)

    def plan_only(self, spec: ModelSpec) -> str | None:
        return None

    def pipeline_name(self, spec: ModelSpec) -> str:
        return self.pipeline

    def default_lora_targets(self, spec: ModelSpec) -> list[str]:
        return list(self.lora_targets)

    def with_blocks(self, config: dict[str, Any], blocks: int) -> dict[str, Any]:
        depths = {key: int(config[key]) for key in self.depth_keys if key in config}
        if not depths:
            raise ValueError(f"{self.name}: the config has none of {', '.join(self.depth_keys)} to shorten")
        return {**config, **share_blocks(depths, blocks)}

    # --- conditioning ------------------------------------------------------------------------------

    def text_parts(self, pipeline_name: str) -> tuple[tuple[str, str], ...]:
        return self.text_components

    # --- training ----------------------------------------------------------------------------------

    def ddpm_time_ids(self, spec: ModelSpec) -> bool:
        return False

    # --- references (edit training) ----------------------------------------------------------------

    def max_references(self, spec: ModelSpec) -> int:
        return 0

    def min_references(self, spec: ModelSpec) -> int:
        return 0

    def reference_text_rows(self, spec: ModelSpec, references: list[tuple[int, int]]) -> int:
        return 0

    def no_references(self, spec: ModelSpec) -> str:
        return "takes no reference images"

    def _no_references(self, spec: ModelSpec) -> ZerotrainError:
        return ZerotrainError(f"model.name_or_path='{spec.name}': {self.title} ({self.pipeline_name(spec)}) "
                              f"{self.no_references(spec)}; train an edit model, or remove the controls")

    # --- validation images -------------------------------------------------------------------------

    def classifier_free(self, guidance_scale: float) -> bool:
        return self.classifier_free_guidance and guidance_scale > 1

    def takes_negative(self, spec: ModelSpec, folder: Path) -> bool:
        return True

    def pipeline_kwargs(self, spec: ModelSpec, folder: Path) -> dict[str, Any]:
        return dict(self.pipeline_extras)

    def validation_params(self, trained_base_params: int) -> int:
        return 0

    # --- export ------------------------------------------------------------------------------------

    def comfyui_adapter_name(self, module: str) -> str:
        """The name ComfyUI gives an adapted diffusers module in a LyCORIS file; families whose ComfyUI
        names are their diffusers paths under a prefix say which."""
        raise ZerotrainError(f"{self.title}: a LoKr or LoHa has no ComfyUI export yet (a LoRA has); "
                             "export without --comfyui")


def model_index(folder: Path | str, title: str) -> dict[str, Any]:
    """A model folder's model_index.json: the pipeline's own settings (is_distilled, ...)."""
    path = Path(folder) / "model_index.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ZerotrainError(f"{path}: cannot read the pipeline settings of the {title} model ({err})") from err


def area_size(control: tuple[int, int], area: int, multiple: int) -> tuple[int, int]:
    """(width, height) of a control image scaled to about area x area pixels at its own aspect, each side
    floored to a multiple of `multiple` (as Flux2Pipeline and QwenImageEditPlusPipeline size their
    references); at least one multiple a side."""
    width, height = control
    scale = math.sqrt(area * area / (width * height))
    return (max(multiple, int(width * scale) // multiple * multiple),
            max(multiple, int(height * scale) // multiple * multiple))


def capped_size(control: tuple[int, int], area: int | None, multiple: int, cap: int) -> tuple[int, int]:
    """(width, height) of a control image as Flux2Pipeline (and FLUX.3's image processor) size references: its
    own size, each side floored to `multiple`, when at most cap x cap pixels and no `area` is given; otherwise
    scaled to `area` (or `cap`) squared at its own aspect (area_size)."""
    width, height = control
    if area is None and width * height <= cap * cap:
        return max(multiple, width // multiple * multiple), max(multiple, height // multiple * multiple)
    return area_size(control, area or cap, multiple)


def packed_channels(channels: int, where: Path | str, title: str, kind: str) -> int:
    """The latent channels of a denoiser that packs each 2x2 patch of latents into one token of `channels`
    (`kind`: its input or output channels): a quarter of them, one line where they are no multiple of 4."""
    if channels % 4:
        raise ZerotrainError(f"model.name_or_path: {where} has {channels} {kind} channels; {title} packs 2x2 latent "
                             "patches, so it must be a multiple of 4")
    return channels // 4


def share_blocks(depths: dict[str, int], blocks: int) -> dict[str, int]:
    """`blocks` shared among the depths in proportion to them (largest remainders), at least one
    each where there are enough; depths unchanged when `blocks` is not fewer than their sum."""
    total = sum(depths.values())
    if blocks >= total:
        return dict(depths)
    floor = 1 if blocks >= len(depths) else 0
    exact = {k: max(floor, blocks * d / total) for k, d in depths.items()}
    out = {k: int(v) for k, v in exact.items()}
    for key in sorted(exact, key=lambda k: exact[k] - out[k], reverse=True)[:max(0, blocks - sum(out.values()))]:
        out[key] += 1
    return out


def shift_from_mu(scheduler_config: dict[str, Any], mu: float) -> float:
    """The static shift equal to the scheduler's time_shift(mu, 1, t): e^mu for its exponential
    time_shift_type, mu for the linear one."""
    kind = scheduler_config.get("time_shift_type", "exponential")
    if kind == "exponential":
        return math.exp(mu)
    if kind == "linear":
        return float(mu)
    raise ZerotrainError(f"scheduler_config.json: time_shift_type '{kind}' is not exponential or linear")


def caption_too_long(caption: str, count: int, text_tokens: int, where: str, note: str = "",
                     most: int | None = None) -> ZerotrainError:
    """The one line for a caption of `count` tokens (in `where`: "FLUX.3's chat template") above
    data.text_tokens, for a pipeline that does not cut it (`note` says so where it never does)."""
    shown = caption if len(caption) <= 60 else caption[:57] + "..."
    up_to = f" (up to {most})" if most else ""
    return ZerotrainError(f"the caption '{shown}' is {count} tokens in {where}, above data.text_tokens={text_tokens}"
                          f"{note}; raise data.text_tokens{up_to} or shorten the caption")


def check_tokens(text_tokens: int, low: int, high: int, what: str) -> None:
    """One line when data.text_tokens is outside what the pipeline accepts."""
    if not low <= text_tokens <= high:
        raise ZerotrainError(f"text_tokens={text_tokens}: must be {low}..{high} ({what})")


