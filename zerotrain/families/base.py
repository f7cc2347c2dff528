"""The protocol every model family implements, with the defaults most families share.

A family is one object (a subclass of `Family`) in one module of zerotrain/families/. It declares
everything that differs between model families: the diffusers classes, the VAE and latent layout,
how captions become conditioning (the pipeline's own `encode_prompt`), the denoiser's forward
arguments for training and for the planner's trace, the objective, the pipeline that renders
validation images, the default LoRA targets, the export formats and the tiny model for tests.
The rest of zerotrain asks the family (`zerotrain.families.of(spec)`) and never tests its name.

Family modules import nothing heavy at module level (torch and diffusers are imported inside the
methods), so resolving a model and reading cached plan facts stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from zerotrain.errors import ZerotrainError

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from zerotrain.models.catalog import ModelSpec
    from zerotrain.objectives import FlowMatching

# AutoencoderKL's defaults, used when a vae/config.json leaves a field out.
AUTOENCODER_DEFAULTS = {"block_out_channels": [64], "latent_channels": 4, "scaling_factor": 0.18215}
# Every published VAE of the supported families downsamples 8x (FLUX.1, SD3, SDXL, SD1.x); assumed
# when only a denoiser config is given.
PUBLISHED_VAE_SCALE_FACTOR = 8


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


class Family:
    """One model family. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    """Stored in caches, plan facts and export manifests; never compared outside families/."""
    title: ClassVar[str]
    """For people: FLUX.1, SD3, SDXL."""
    denoiser_classes: ClassVar[tuple[str, ...]]
    """The diffusers denoiser classes this family trains."""
    denoiser_folder: ClassVar[str] = "transformer"
    """The denoiser's subfolder in a diffusers model folder, and its pipeline component name."""
    vae_class: ClassVar[str] = "AutoencoderKL"
    pipeline: ClassVar[str]
    """The diffusers pipeline: its encode_prompt, its validation images, its LoRA file format."""
    text_components: ClassVar[tuple[tuple[str, str], ...]]
    """(tokenizer, text encoder) component names of the pipeline, in the pipeline's order."""
    text_outputs: ClassVar[tuple[str, ...]] = ("prompt_embeds", "pooled_prompt_embeds")
    """What encode_prompt returns per caption, as the cache stores it."""
    default_text_tokens: ClassVar[int]
    """Text sequence length the pipeline feeds the denoiser by default."""
    lora_targets: ClassVar[tuple[str, ...]]
    """Default LoRA target modules (peft semantics), as diffusers' training script chooses them."""
    default_guidance: ClassVar[float]
    """The pipeline __call__'s default guidance_scale."""
    classifier_free_guidance: ClassVar[bool]
    """Guidance is classifier-free (a negative prompt, two predictions per step) above 1."""
    pipeline_extras: ClassVar[dict[str, Any]] = {}
    """Further pipeline constructor arguments when zerotrain builds one from components."""
    default_in_channels: ClassVar[int]
    """The denoiser class's own default in_channels, when a config leaves it out."""
    shift_defaults: ClassVar[dict[str, float]] = {}
    """calculate_shift's parameters when the scheduler config omits them (dynamic-shift families)."""

    # --- the model and its latents -----------------------------------------------------------------

    def latent_channels(self, config: dict[str, Any], where: Path | str) -> int:
        """Latent channels the denoiser predicts. out_channels, not in_channels: inpainting variants
        feed extra mask/image channels in, but always predict the VAE latent."""
        return int(config.get("out_channels") or config.get("in_channels") or self.default_in_channels)

    def published_vae(self, config: dict[str, Any]) -> VaeFacts:
        """The family's published VAE, assumed when only a denoiser config is given."""
        raise NotImplementedError

    def vae_facts(self, vae_config: dict[str, Any]) -> VaeFacts:
        """The facts of a vae/config.json (an AutoencoderKL by default)."""
        vae = {**AUTOENCODER_DEFAULTS, **vae_config}
        return VaeFacts(
            scale_factor=2 ** (len(vae["block_out_channels"]) - 1),
            latent_channels=int(vae["latent_channels"]),
            scaling_factor=vae["scaling_factor"],
            shift_factor=vae.get("shift_factor"),
        )

    def patch(self, spec: ModelSpec) -> int:
        """Latent cells per image token along each side (the denoiser's patching or packing)."""
        return int(spec.config.get("patch_size", 1))

    def pixel_factor(self, spec: ModelSpec) -> int:
        """Sides of a training image must be multiples of this: the VAE's downsampling times the
        denoiser's own patching."""
        return spec.vae_scale_factor * self.patch(spec)

    def image_tokens(self, spec: ModelSpec, resolution: int) -> int:
        """Image tokens (DiTs) of a square image at this resolution."""
        side = resolution // self.pixel_factor(spec)
        return side * side

    def latent_tokens(self, spec: ModelSpec, height: int, width: int) -> int:
        """Image tokens of (height, width) latents: the sequence length a dynamic shift follows."""
        patch = self.patch(spec)
        if height % patch or width % patch:
            raise ValueError(f"{self.name}: latents {height}x{width} are not a multiple of the patch {patch}")
        return (height // patch) * (width // patch)

    def plan_only(self, spec: ModelSpec) -> str | None:
        """What kind of model zerotrain can plan but not cache or train, when this is one (in words:
        "SD 1.x/2.x UNets"); None when it trains it."""
        return None

    def pipeline_name(self, spec: ModelSpec) -> str:
        """The diffusers pipeline class of this model."""
        return self.pipeline

    def default_lora_targets(self, spec: ModelSpec) -> list[str]:
        """LoRA target modules when training.lora.target_modules is not given."""
        return list(self.lora_targets)

    depth_keys: ClassVar[tuple[str, ...]] = ("num_layers",)
    """Config keys that count the denoiser's repeated blocks (what `zerotrain calibrate --blocks`
    shortens)."""

    def with_blocks(self, config: dict[str, Any], blocks: int) -> dict[str, Any]:
        """The denoiser config with `blocks` blocks in all at full width, shared among depth_keys in
        proportion to the published depths (at least one each): a quick calibration model."""
        depths = {key: int(config[key]) for key in self.depth_keys if key in config}
        if not depths:
            raise ValueError(f"{self.name}: the config has none of {', '.join(self.depth_keys)} to shorten")
        return {**config, **share_blocks(depths, blocks)}

    def enable_checkpointing(self, model: torch.nn.Module, blocks: list[str] | None = None,
                             checkpoint_fn: Any = None) -> None:
        """Gradient checkpointing of every block (blocks None), as diffusers'
        enable_gradient_checkpointing does it, or of the named blocks (zerotrain.recompute), through
        checkpoint_fn(function, *args) (default: non-reentrant torch.utils.checkpoint; activation
        offload: recompute.OffloadingCheckpoint)."""
        from zerotrain import recompute

        recompute.enable(model, blocks, checkpoint_fn or recompute.default_checkpoint)

    # --- conditioning ------------------------------------------------------------------------------

    def encode_prompt(
        self, pipeline: Any, captions: list[str], text_tokens: int, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Text conditioning of a batch of captions through the pipeline's own encode_prompt (one image
        per prompt, no classifier-free guidance), named as text_outputs."""
        raise NotImplementedError

    def vae_downsampling(self, vae: Any) -> int:
        """Pixels per latent cell of a loaded VAE."""
        return 2 ** (len(vae.config.block_out_channels) - 1)

    def vae_latent_channels(self, vae: Any) -> int:
        return int(vae.config.latent_channels)

    def posterior(self, vae: Any, pixels: torch.Tensor) -> Any:
        """The VAE's latent distribution of (B, 3, H, W) pixels in [-1, 1]: .mean, .std and
        .sample(generator), each (B, C, h, w)."""
        return vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist

    def normalize_latents(self, vae: Any, latents: torch.Tensor) -> torch.Tensor:
        """VAE latents (B, C, h, w) into the denoiser's space, as the pipeline's inverse before
        decoding expects them: (z - shift) * scaling by default."""
        return scale_latents(latents, vae.config.scaling_factor, getattr(vae.config, "shift_factor", None))

    def normalize_std(self, vae: Any, std: torch.Tensor) -> torch.Tensor:
        """The posterior's std through normalize_latents (the shift drops out)."""
        return std * vae.config.scaling_factor

    def negative_embeds(self, folder: Path, negative_prompt: str, encoded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The negative conditioning classifier-free guidance uses, given the encoded negative prompt."""
        return encoded

    # --- training ----------------------------------------------------------------------------------

    objective: ClassVar[str] = "flow"
    """flow: rectified flow with the scheduler's shift, inputs laid out by flow_inputs; ddpm: noise
    prediction with the scheduler's betas, for UNets (ddpm_time_ids says what conditions them)."""

    def ddpm_time_ids(self, spec: ModelSpec) -> bool:
        """DDPM families: whether the UNet takes SDXL's pooled text and size/crop time ids."""
        return False

    def dynamic_shift(self, scheduler_config: dict[str, Any], image_seq_len: int) -> float:
        """The shift the pipeline samples with for image_seq_len image tokens when the scheduler uses
        dynamic shifting. By default FluxPipeline's: mu from diffusers' calculate_shift, linear in the
        sequence length between the scheduler config's (base_image_seq_len, base_shift) and
        (max_image_seq_len, max_shift), shift_defaults filling what the config leaves out."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        if image_seq_len < 1:
            raise ValueError(f"dynamic_shift: image_seq_len must be positive, got {image_seq_len}")
        params = {key: scheduler_config.get(key, value) for key, value in self.shift_defaults.items()}
        mu = calculate_shift(image_seq_len, params["base_image_seq_len"], params["max_image_seq_len"],
                             params["base_shift"], params["max_shift"])
        return shift_from_mu(scheduler_config, mu)

    def flow_inputs(
        self, objective: FlowMatching, x_t: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor,
        batch: dict[str, torch.Tensor],
    ) -> tuple[dict[str, Any], torch.Tensor]:
        """The denoiser's forward arguments for noised latents x_t (B, C, h, w) at sigma (B,), as the
        pipeline feeds them, and the target (noise - x0) laid out as the denoiser's output."""
        raise NotImplementedError

    def prediction(self, output: Any) -> torch.Tensor:
        """The denoiser's prediction as one tensor the shape of the target, from the first element of
        its return_dict=False output."""
        return output

    def example_inputs(
        self, spec: ModelSpec, batch: int, height: int, width: int, text_tokens: int,
        device: torch.device | str, dtype: torch.dtype,
    ) -> dict[str, Any]:
        """Keyword arguments for one training forward of the denoiser, shaped as the pipeline shapes
        them, for the planner's trace. Values are uninitialised on meta, random elsewhere."""
        raise NotImplementedError

    # --- validation images -------------------------------------------------------------------------

    def classifier_free(self, guidance_scale: float) -> bool:
        """Whether the pipeline runs classifier-free guidance (a negative prediction per step, from the
        negative prompt's embeddings) at this guidance_scale: above 1 (do_classifier_free_guidance)."""
        return self.classifier_free_guidance and guidance_scale > 1

    def takes_negative(self, spec: ModelSpec, folder: Path) -> bool:
        """Whether the pipeline of this model (its folder's model_index.json) guides with a negative
        prompt at all: always by default; a family whose models differ (guidance-distilled ones beside
        classifier-free ones) says per model."""
        return True

    def pipeline_kwargs(self, spec: ModelSpec, folder: Path) -> dict[str, Any]:
        """Constructor arguments beyond the components when zerotrain builds this model's pipeline around
        the trained denoiser (settings of its folder's model_index.json): pipeline_extras by default."""
        return dict(self.pipeline_extras)

    def validation_kwargs(
        self, embeds: dict[str, torch.Tensor], negative: dict[str, torch.Tensor] | None, guidance_scale: float
    ) -> dict[str, Any]:
        """The pipeline __call__ arguments that carry the conditioning and guidance."""
        kwargs: dict[str, Any] = dict(embeds)
        if negative is not None:
            kwargs.update({f"negative_{name}": value for name, value in negative.items()})
        kwargs["guidance_scale"] = guidance_scale
        return kwargs

    # --- export ------------------------------------------------------------------------------------

    def comfyui_lora(
        self, model: torch.nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], alpha: float
    ) -> dict[str, torch.Tensor]:
        """The LoRA in the key naming ComfyUI loads for this family: pairs maps each adapted diffusers
        module to its (lora_A, lora_B) weights; kohya's "<name>.lora_down/.lora_up/.alpha"."""
        raise NotImplementedError

    def comfyui_model(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full fine-tune's denoiser weights in the key naming ComfyUI's "Load Diffusion Model" reads
        (diffusers' own names, which ComfyUI converts, by default)."""
        return weights

    # --- the tiny model ----------------------------------------------------------------------------

    def tiny_components(self, denoiser: dict[str, Any]) -> tuple[type, dict[str, Any]]:
        """The pipeline class and every component but the VAE for a tiny model of this family, the
        denoiser built from `denoiser` (a catalog config) and text encoders as narrow as it expects."""
        raise NotImplementedError


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


def scale_latents(latents: torch.Tensor, scaling_factor: float, shift_factor: float | None) -> torch.Tensor:
    """VAE latents (B, C, h, w) into the denoiser's space: (z - shift) * scaling (Flux, SD3) or
    z * scaling (SDXL, shift None). The pipelines undo it before decoding: z / scaling + shift."""
    if latents.ndim != 4:
        raise ValueError(f"scale_latents: expected latents (B, C, h, w), got shape {tuple(latents.shape)}")
    if shift_factor is not None:
        latents = latents - shift_factor
    return latents * scaling_factor


def text_and_pooled(batch: dict[str, torch.Tensor], b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's prompt_embeds (b, T, D) and pooled_prompt_embeds (b, P), shapes checked."""
    text, pooled = batch["prompt_embeds"], batch["pooled_prompt_embeds"]
    if text.ndim != 3 or text.shape[0] != b:
        raise ValueError(f"prompt_embeds must be ({b}, T, D), got {tuple(text.shape)}")
    if pooled.ndim != 2 or pooled.shape[0] != b:
        raise ValueError(f"pooled_prompt_embeds must be ({b}, P), got {tuple(pooled.shape)}")
    return text, pooled


def shift_from_mu(scheduler_config: dict[str, Any], mu: float) -> float:
    """The static shift equal to the scheduler's time_shift(mu, 1, t): e^mu for its exponential
    time_shift_type, mu for the linear one."""
    kind = scheduler_config.get("time_shift_type", "exponential")
    if kind == "exponential":
        return math.exp(mu)
    if kind == "linear":
        return float(mu)
    raise ZerotrainError(f"scheduler_config.json: time_shift_type '{kind}' is not exponential or linear")


def kohya_lora(name: str, down: torch.Tensor, up: torch.Tensor, alpha: float) -> dict[str, torch.Tensor]:
    """One LoRA layer in kohya's naming, as ComfyUI reads it (it scales by alpha / rank)."""
    import torch

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


def check_tokens(text_tokens: int, low: int, high: int, what: str) -> None:
    """One line when data.text_tokens is outside what the pipeline accepts."""
    if not low <= text_tokens <= high:
        raise ZerotrainError(f"text_tokens={text_tokens}: must be {low}..{high} ({what})")


def meta_or_random(device: torch.device | str, dtype: torch.dtype) -> Any:
    """A tensor maker for example_inputs: uninitialised on meta, standard normal elsewhere."""
    import torch

    def tensor(*shape: int, kind: torch.dtype = dtype) -> torch.Tensor:
        if torch.device(device).type == "meta":
            return torch.empty(*shape, device=device, dtype=kind)
        return torch.randn(*shape, device=device, dtype=kind)

    return tensor


def example_timestep(tensor: Any, batch: int, device: torch.device | str) -> Any:
    """The trace's timestep: positive draws off meta, an empty tensor on meta (as before families/)."""
    import torch

    return tensor(batch, kind=torch.float32).abs() if torch.device(device).type != "meta" else tensor(batch)
