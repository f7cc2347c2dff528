"""The types every layer names, in a leaf module that imports nothing else of zerotrain: the resolved
model (`ModelSpec`), the protocol every model family implements (`Family`), and what a family reads of the
flow-matching objective (`FlowObjective`).

`Family` is composed of small protocols, one per part of a family: `DenoiserModel` (the model, its latents
and tiny model), its VAE part `LatentCodec` (a component of its own, shared between families), `TextConditioning`,
`Objective`, `References` (edit training), `Validation` (the pipeline and its renders) and `KeyMaps`
(export names).

Layers point one way: zerotrain.families implements `Family` on top of this module, zerotrain.models
resolves models into `ModelSpec`s by asking the families, and zerotrain.objectives drives a family's
`flow_inputs`; none of them needs another to name these types (tests/unit/test_layout.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    import torch


def torch_side(member: Any) -> Any:
    """Marks a protocol member whose work needs torch, diffusers or transformers (tensors, modules, pipelines).
    A family (or codec) is two classes: its declarations, in a module that imports none of them (the planner
    reads those without torch), and its torch side, a subclass of them in zerotrain/families/runtime/ that
    imports them at module level. The declarations must hold every other member; a torch-side member may sit
    on either, and the declarations reach the torch side on first use (zerotrain.families.parts.declared)."""
    member.torch_side = True
    return member


@dataclass(frozen=True)
class ModelSpec:
    """A resolved denoiser: enough to build it on the meta device and to shape its latents."""

    name: str
    """What the user gave: a catalog name, a path or a hub id."""
    family: str
    """The name of its family (zerotrain.families), which knows everything family-specific."""
    class_name: str
    """The diffusers class of the denoiser."""
    config: dict[str, Any]
    """The denoiser's diffusers config, with _class_name."""
    vae_scale_factor: int
    """Pixels per latent cell along each side."""
    latent_channels: int
    """Channels of the VAE latents (before the denoiser's own packing)."""
    vae_scaling_factor: float | None
    """Latents are (z - shift) * scaling before the denoiser sees them."""
    vae_shift_factor: float | None
    """See vae_scaling_factor; None means no shift."""
    source: str
    """Where the config came from: catalog, config.json <path>, folder <path> or hub <id>."""
    pretrained: str | None
    """Where weights come from: a hub id or a local folder; None for a bare config.json."""
    subfolder: str | None
    """Subfolder of `pretrained` (or of a saved pipeline folder) that holds the denoiser."""
    pipeline_class: str | None = None
    """The diffusers pipeline the model was published with (its model_index.json's _class_name, or
    the catalog's): what tells an edit model (FluxKontextPipeline) from the text-to-image model that
    shares its denoiser class; None for a bare config.json."""
    denoiser: str | None = None
    """Where a fine-tuned denoiser trained over the pipeline comes from (model.denoiser, resolved: "file
    <path>", "folder <path>" or "hub <id>/<path>"); None: the pipeline's own."""

    def denoiser_class(self) -> type:
        """The diffusers class itself (imported lazily: diffusers takes seconds to import)."""
        import diffusers

        return getattr(diffusers, self.class_name)


@dataclass(frozen=True)
class VaeFacts:
    """What shapes the latents: read from a vae/config.json, or the family's published VAE."""

    scale_factor: int
    """Pixels per latent cell along each side."""
    latent_channels: int
    scaling_factor: float | None
    """Latents are (z - shift) * scaling before the denoiser sees them (per channel for some VAEs:
    then None, and the family normalizes)."""
    shift_factor: float | None


class GuidanceSetting(Protocol):
    @property
    def guidance(self) -> float:
        """The guidance a guidance-distilled denoiser is fed while training (objective.guidance)."""
        ...


class FlowObjective(Protocol):
    """What Family.flow_inputs reads of the flow-matching objective (zerotrain.objectives.FlowMatching)."""

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def config(self) -> GuidanceSetting: ...

    @property
    def num_train_timesteps(self) -> int:
        """From the scheduler config; SD3's transformer takes sigma * num_train_timesteps."""
        ...

    @property
    def model_dtype(self) -> torch.dtype:
        """The denoiser's parameter dtype, which its floating inputs take."""
        ...


class LatentCodec(Protocol):
    """A family's VAE part (zerotrain.families.parts.latents): the diffusers VAE class, what its config
    means, how pixels become a posterior and how latents become the denoiser's inputs. Families that use
    the same VAE share one codec."""

    vae_class: ClassVar[str]
    """The diffusers VAE class in the model folder's vae/."""

    def vae_facts(self, vae_config: dict[str, Any]) -> VaeFacts:
        """The facts of a vae/config.json."""
        ...

    def published(self, latent_channels: int) -> VaeFacts:
        """The published VAE of this class for a denoiser of `latent_channels`, where there is one."""
        ...

    def vae_downsampling(self, vae: Any) -> int:
        """Pixels per latent cell of a loaded VAE."""
        ...

    def vae_latent_channels(self, vae: Any) -> int:
        """Channels of a loaded VAE's latents, as the denoiser sees them (after any folding)."""
        ...

    @torch_side
    def posterior(self, vae: Any, pixels: torch.Tensor) -> Any:
        """The VAE's latent distribution of (B, 3, H, W) pixels in [-1, 1]: .mean, .std and
        .sample(generator), each (B, C, h, w)."""
        ...

    @torch_side
    def normalize_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents (B, C, h, w) into the denoiser's space, as the pipeline's inverse before
        decoding expects them: (z - shift) * scaling for an AutoencoderKL."""
        ...

    @torch_side
    def normalize_std(self, vae: Any, std: torch.Tensor) -> torch.Tensor:
        """The posterior's std through normalize_latents (the shift drops out)."""
        ...


class DenoiserModel(Protocol):
    """The model and its latents: the denoiser's classes and config, its VAE part (codec), its patching, its
    blocks (what checkpointing and calibration see) and the tiny model for tests."""

    name: ClassVar[str]
    """Stored in caches, plan facts and export manifests; never compared outside families/."""

    title: ClassVar[str]
    """For people: FLUX.1, SD3, SDXL."""

    denoiser_classes: ClassVar[tuple[str, ...]]
    """The diffusers denoiser classes this family trains."""

    default_for_class: ClassVar[bool]
    """Whether a config of one of denoiser_classes that names no family trains with this one. Each class has
    one such family; a second family of a class sets False, and its configs name it with the private key
    "_zerotrain_family" (zerotrain.families.for_config)."""

    denoiser_folder: ClassVar[str]
    """The denoiser's subfolder in a diffusers model folder, and its pipeline component name."""

    codec: ClassVar[LatentCodec]
    """The VAE part (zerotrain.families.parts.latents): its class, facts, posterior and normalization."""

    default_in_channels: ClassVar[int]
    """The denoiser class's own default in_channels, when a config leaves it out."""

    depth_keys: ClassVar[tuple[str, ...]]
    """Config keys that count the denoiser's repeated blocks (what `zerotrain calibrate --blocks`
    shortens)."""

    lora_targets: ClassVar[tuple[str, ...]]
    """Default LoRA target modules (peft semantics), as diffusers' training script chooses them."""

    def latent_channels(self, config: dict[str, Any], where: Path | str) -> int:
        """Latent channels the denoiser predicts. out_channels, not in_channels: inpainting variants
        feed extra mask/image channels in, but always predict the VAE latent."""
        ...

    def published_vae(self, config: dict[str, Any]) -> VaeFacts:
        """The family's published VAE, assumed when only a denoiser config is given."""
        ...

    def patch(self, spec: ModelSpec) -> int:
        """Latent cells per image token along each side (the denoiser's patching or packing)."""
        ...

    def pixel_factor(self, spec: ModelSpec) -> int:
        """Sides of a training image must be multiples of this: the VAE's downsampling times the
        denoiser's own patching."""
        ...

    def image_tokens(self, spec: ModelSpec, resolution: int) -> int:
        """Image tokens (DiTs) of a square image at this resolution."""
        ...

    def latent_tokens(self, spec: ModelSpec, height: int, width: int) -> int:
        """Image tokens of (height, width) latents: the sequence length a dynamic shift follows."""
        ...

    def plan_only(self, spec: ModelSpec) -> str | None:
        """What kind of model zerotrain can plan but not cache or train, when this is one (in words:
        "SD 1.x/2.x UNets"); None when it trains it."""
        ...

    def default_lora_targets(self, spec: ModelSpec) -> list[str]:
        """LoRA target modules when training.lora.target_modules is not given."""
        ...

    def with_blocks(self, config: dict[str, Any], blocks: int) -> dict[str, Any]:
        """The denoiser config with `blocks` blocks in all at full width, shared among depth_keys in
        proportion to the published depths (at least one each): a quick calibration model."""
        ...

    @torch_side
    def enable_checkpointing(self, model: torch.nn.Module, blocks: list[str] | None = None,
                             checkpoint_fn: Any = None) -> None:
        """Gradient checkpointing of every block (blocks None), as diffusers'
        enable_gradient_checkpointing does it, or of the named blocks (zerotrain.recompute), through
        checkpoint_fn(function, *args) (default: non-reentrant torch.utils.checkpoint; activation
        offload: recompute.OffloadingCheckpoint)."""
        ...

    @torch_side
    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """The pipeline class and every component but the VAE for a tiny model of this family, the
        denoiser built from `denoiser` (a catalog config) and text encoders as narrow as it expects."""
        ...


class TextConditioning(Protocol):
    """How captions become conditioning: the pipeline's own text encoders and encode_prompt, what the cache
    keeps of them."""

    text_components: ClassVar[tuple[tuple[str, str], ...]]
    """(tokenizer, text encoder) component names of the pipeline, in the pipeline's order."""

    text_outputs: ClassVar[tuple[str, ...]]
    """What encode_prompt returns per caption, as the cache stores it."""

    default_text_tokens: ClassVar[int]
    """Text sequence length the pipeline feeds the denoiser by default."""

    text_reads_references: ClassVar[bool]
    """The text encoder reads an edit sample's reference images with its caption (Qwen-Image 2.1's Qwen3-VL):
    the cache encodes each such caption with its images (encode_prompt's images), keyed by them too."""

    reference_text_outputs: ClassVar[tuple[str, ...]]
    """What encode_prompt adds to text_outputs for a caption read with its images: image_pad_mask (where the
    images' rows sat), and Qwen-Image-Edit's image_rows (the text encoder's rows of the images)."""

    @torch_side
    def encoder_pipeline(self, pipeline_class: Any, folder: Path, dtype: torch.dtype, skipped: dict[str, None]) -> Any:
        """The family's pipeline loaded from a model folder with its VAE, tokenizers and text encoders and
        without the components named in `skipped` (the denoiser, the scheduler): pipeline_class.from_pretrained
        by default."""
        ...

    def text_parts(self, pipeline_name: str) -> tuple[tuple[str, str], ...]:
        """(tokenizer or processor, text encoder) component names the pipeline `pipeline_name` encodes text
        with: text_components by default (Qwen-Image-Edit's pipelines read through their processor)."""
        ...

    @torch_side
    def text_reference_identity(self, spec: ModelSpec) -> tuple[Any, ...]:
        """What else, besides the references and data.background, an edit caption's text depends on where
        text_reads_references (the image processor that reads them), for its cache key: () by default."""
        ...

    @torch_side
    def text_pipeline(self, pipeline_class: Any, components: dict[str, Any]) -> Any:
        """The family's pipeline around loaded tokenizers and text encoders (the other components None),
        whose encode_prompt is the reference: pipeline_class(**components) by default."""
        ...

    @torch_side
    def encode_prompt(
        self, pipeline: Any, captions: list[str], text_tokens: int, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Text conditioning of a batch of captions through the pipeline's own encode_prompt (one image
        per prompt, no classifier-free guidance), named as text_outputs. A family whose
        text_reads_references also takes images= (each caption's reference images, PIL at reference_size)
        and adds reference_text_outputs to its outputs."""
        ...

    @torch_side
    def negative_embeds(self, folder: Path, negative_prompt: str, encoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The negative conditioning classifier-free guidance uses, given the encoded negative prompt."""
        ...


class Objective(Protocol):
    """The training objective's family side: the scheduler and its shift, the denoiser's forward arguments
    (for training and for the planner's trace) and the layout of its prediction."""

    objective: ClassVar[str]
    """flow: rectified flow with the scheduler's shift, inputs laid out by flow_inputs; ddpm: noise
    prediction with the scheduler's betas, for UNets (ddpm_time_ids says what conditions them)."""

    timestep_logit_std: ClassVar[float]
    """Flow: the logit-normal timestep distribution's standard deviation when objective.logit_std is
    auto (the family's training script's; 1.0, the SD3 paper's, for most)."""

    shift_defaults: ClassVar[dict[str, float]]
    """calculate_shift's parameters when the scheduler config omits them (dynamic-shift families)."""

    joint_output: ClassVar[bool]
    """The denoiser's output covers its whole input sequence, text rows included, the target's tokens
    first (flow_inputs lays them out so; last with target_last): only those are scored, as with references."""

    target_last: ClassVar[bool]
    """The target's tokens are the output's last rows (Qwen-Image 2.1's block-causal sequence puts the
    target after the text and the references), not its first."""

    @torch_side
    def scheduler_config(self, folder: Path) -> dict[str, Any]:
        """The scheduler config the pipeline samples with: the model folder's scheduler/scheduler_config.json
        by default."""
        ...

    def ddpm_time_ids(self, spec: ModelSpec) -> bool:
        """DDPM families: whether the UNet takes SDXL's pooled text and size/crop time ids."""
        ...

    @torch_side
    def dynamic_shift(self, scheduler_config: dict[str, Any], image_seq_len: int) -> float:
        """The shift the pipeline samples with for image_seq_len image tokens when the scheduler uses
        dynamic shifting. By default FluxPipeline's: mu from diffusers' calculate_shift, linear in the
        sequence length between the scheduler config's (base_image_seq_len, base_shift) and
        (max_image_seq_len, max_shift), shift_defaults filling what the config leaves out."""
        ...

    @torch_side
    def sampling_shift(self, spec: ModelSpec, scheduler_config: dict[str, Any], image_seq_len: int) -> float:
        """The shift training draws sigma with for image_seq_len image tokens: the one the pipeline samples
        with. By default the scheduler's: dynamic_shift when it uses dynamic shifting, its static shift
        otherwise; a pipeline that sets its own sigmas says how they shift."""
        ...

    @torch_side
    def flow_inputs(
        self, objective: FlowObjective, x_t: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor,
        batch: dict[str, torch.Tensor],
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """Flow families: the denoiser's forward arguments for noised latents x_t (B, C, h, w) at sigma
        (B,), as the pipeline feeds them, and the target (noise - x0) laid out as the denoiser's output."""
        ...

    @torch_side
    def prediction(self, output: Any) -> torch.Tensor:
        """The denoiser's prediction as one tensor the shape of the target, from the first element of
        its return_dict=False output."""
        ...

    @torch_side
    def target_layout(self, latents: torch.Tensor) -> torch.Tensor:
        """Latent-grid values (B, C, h, w) laid out as the target and the denoiser's output (packed into
        tokens where the family packs latents): flow_inputs lays out its target so, and a loss mask
        follows it."""
        ...

    @torch_side
    def example_inputs(
        self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
        device: torch.device | str, dtype: torch.dtype,
    ) -> dict[str, Any]:
        """Keyword arguments for one training forward of the denoiser, shaped as the pipeline shapes
        them, for the planner's trace. Values are uninitialised on meta, random elsewhere."""
        ...


class References(Protocol):
    """Edit training: the condition images a model reads beside its target, and how."""

    def max_references(self, spec: ModelSpec) -> int:
        """How many reference (control) images this model's pipeline takes: 0 for a text-to-image
        model."""
        ...

    def min_references(self, spec: ModelSpec) -> int:
        """How many reference images this model's pipeline always takes: 1 for an edit pipeline (FLUX.1 Kontext,
        Qwen-Image-Edit), which a plan then counts unless told otherwise; 0 where references are optional
        (FLUX.2, FLUX.3 [klein]) or none."""
        ...

    def no_references(self, spec: ModelSpec) -> str:
        """Why a model with max_references 0 takes none, for the one line that stops a run with controls:
        "takes no reference images" (a text-to-image model) by default."""
        ...

    @torch_side
    def reference_size(self, spec: ModelSpec, target: tuple[int, int], control: tuple[int, int],
                       area: int | None) -> tuple[int, int]:
        """The (width, height) in pixels a reference is encoded at, as the pipeline sizes it, for a
        target (its bucket) and a control image of these (width, height) sizes; `area`: a side whose
        square is the reference's area instead of the pipeline's (data.control_resolution)."""
        ...

    @torch_side
    def add_references(self, spec: ModelSpec, kwargs: dict[str, Any], references: list[torch.Tensor]) -> dict[str, Any]:
        """The denoiser's forward arguments (flow_inputs' or example_inputs') with the references'
        clean latents (each (B, C, h, w), normalized as the target's) appended after the noisy tokens,
        with their position ids and timesteps, exactly as the pipeline appends them. The denoiser's
        output then holds the target's tokens first; only they are scored. The count is checked against
        max_references before (the cache's check_references, the planner's plan_references)."""
        ...

    def reference_text_rows(self, spec: ModelSpec, references: list[tuple[int, int]]) -> int:
        """The text encoder's rows for references of these (width, height), beside data.text_tokens of caption,
        where the text keeps them (Qwen-Image-Edit): what the planner adds to the text it traces. 0 by default."""
        ...

    @torch_side
    def reference_kwargs(self, spec: ModelSpec, images: list[Any], size: tuple[int, int],
                         area: int | None = None) -> dict[str, Any]:
        """The pipeline __call__ arguments that give it these reference images (PIL, already at
        reference_size for `area`, data.control_resolution), so that it encodes them at the size they
        are given and renders (width, height) = `size`."""
        ...


class Validation(Protocol):
    """The pipeline (whose encode_prompt the cache runs and whose LoRA format export writes) and the
    validation images it renders from cached conditioning, with its guidance."""

    pipeline: ClassVar[str]
    """The diffusers pipeline: its encode_prompt, its validation images, its LoRA file format."""

    def pipeline_name(self, spec: ModelSpec) -> str:
        """The diffusers pipeline class of this model."""
        ...

    default_guidance: ClassVar[float]
    """The pipeline __call__'s default guidance_scale."""

    classifier_free_guidance: ClassVar[bool]
    """Guidance is classifier-free (a negative prompt, two predictions per step) above 1."""

    pipeline_extras: ClassVar[dict[str, Any]]
    """Further pipeline constructor arguments when zerotrain builds one from components."""

    def classifier_free(self, guidance_scale: float) -> bool:
        """Whether the pipeline runs classifier-free guidance (a negative prediction per step, from the
        negative prompt's embeddings) at this guidance_scale: above 1 (do_classifier_free_guidance)."""
        ...

    def takes_negative(self, spec: ModelSpec, folder: Path) -> bool:
        """Whether the pipeline of this model (its folder's model_index.json) guides with a negative
        prompt at all: always by default; a family whose models differ (guidance-distilled ones beside
        classifier-free ones) says per model."""
        ...

    def pipeline_kwargs(self, spec: ModelSpec, folder: Path) -> dict[str, Any]:
        """Constructor arguments beyond the components when zerotrain builds this model's pipeline around
        the trained denoiser (settings of its folder's model_index.json): pipeline_extras by default."""
        ...

    @torch_side
    def validation_pipeline(self, spec: ModelSpec, folder: Path, components: dict[str, Any], device: torch.device) -> Any:
        """The pipeline that renders validation images from `components` (the trained denoiser, a VAE, the
        scheduler, no text encoders) and the model folder: the family pipeline's own class by default; a
        family whose pipeline needs more (a frozen second denoiser) loads it here."""
        ...

    def validation_params(self, trained_base_params: int) -> int:
        """Parameters that rendering validation images loads beside the trained model (a second denoiser),
        given the trained model's own (its adapters left out): each rank holds them in host memory
        while it renders, and the planner counts them; 0 by default."""
        ...

    @torch_side
    def validation_kwargs(
        self, embeds: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None, guidance_scale: float
    ) -> dict[str, Any]:
        """The pipeline __call__ arguments that carry the conditioning and guidance."""
        ...


class KeyMaps(Protocol):
    """Export: the names other tools read (ComfyUI's, Black Forest Labs', kohya's), for adapters and full models."""

    diffusers_lokr: ClassVar[bool]
    """Whether the family pipeline's load_lora_weights reads a LoKr (diffusers 0.42: Z-Image, FLUX.2): the
    diffusers export writes a LoKr or LoHa only for such a family."""

    @torch_side
    def comfyui_lora(
        self, model: torch.nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float
    ) -> dict[str, torch.Tensor]:
        """The LoRA in the key naming ComfyUI loads for this family: pairs maps each adapted diffusers
        module to its (lora_A, lora_B) weights; kohya's "<name>.lora_down/.lora_up/.alpha"."""
        ...

    @torch_side
    def comfyui_adapter(self, model: torch.nn.Module, layers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A LoKr or LoHa (peft's names, "<module>.lokr_w1", its scale baked in) in the names ComfyUI's
        LyCORIS loaders read for this family, without alpha (ComfyUI then scales by 1)."""
        ...

    def comfyui_adapter_name(self, module: str) -> str:
        """The name ComfyUI gives an adapted diffusers module in a LyCORIS file (comfyui_adapter's names); one
        line where the family has no such export."""
        ...

    @torch_side
    def comfyui_model(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full fine-tune's denoiser weights in the key naming ComfyUI's "Load Diffusion Model" reads
        (diffusers' own names, which ComfyUI converts, by default)."""
        ...

    @torch_side
    def diffusers_weights(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """A single-file denoiser's weights (model.denoiser) in diffusers' names, where the denoiser class has no
        from_single_file: comfyui_model's inverse; None where the family leaves it to diffusers."""
        ...

    @torch_side
    def comfyui_markers(self, spec: ModelSpec) -> dict[str, torch.Tensor]:
        """Keys beside a full fine-tune's ComfyUI weights that ComfyUI's model detection reads as a variant's
        mark (Edit-2511's empty __index_timestep_zero__): none by default."""
        ...


class Family(DenoiserModel, TextConditioning, Objective, References, Validation, KeyMaps, Protocol):
    """One model family: everything that differs between model families, in the parts above. Each module of
    zerotrain/families/ defines one as FAMILY (most subclass zerotrain.families.base.BaseFamily, which
    holds the defaults most families share, and compose the shared parts of zerotrain/families/parts/);
    the rest of zerotrain asks `zerotrain.families.of(spec)` and never tests its name. The whole contract
    (protocol_members(Family)) is checked when the families are found."""


def protocol_members(protocol: type, side: str | None = None) -> tuple[str, ...]:
    """Every attribute and method a protocol of this module asks for, its bases' included: of one side only
    with `side` ("declared": what the planner may read without torch; "torch": the members marked torch_side)."""
    names: dict[str, None] = {}
    for cls in reversed(protocol.__mro__):
        if cls.__module__ == __name__:
            names.update(dict.fromkeys(inspect.get_annotations(cls)))
            names.update(dict.fromkeys(n for n in vars(cls) if not n.startswith("_")))
    if side is None:
        return tuple(names)
    if side not in ("declared", "torch"):
        raise ValueError(f"side must be 'declared' or 'torch', not {side!r}")
    return tuple(n for n in names if (side == "torch") == _is_torch_side(protocol, n))


def _is_torch_side(protocol: type, name: str) -> bool:
    return bool(getattr(getattr(protocol, name, None), "torch_side", False))
