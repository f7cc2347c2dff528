"""The conditioning each family's denoiser trains on, computed exactly as its diffusers pipeline
computes it: VAE latents (scaled, and shifted for Flux/SD3), text embeddings and SDXL's time ids.

Text embeddings come from the pipeline's own `encode_prompt` (FluxPipeline, StableDiffusion3Pipeline,
StableDiffusionXLPipeline), built around the loaded text encoders with no denoiser, so they match
inference token for token. The encoders are loaded once for caching and freed before training.
"""

from __future__ import annotations

import gc
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import ModelSpec, check_trainable
from zerotrain.models.families import DENOISER_FOLDER

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

# The pipeline whose encode_prompt defines each family's text conditioning.
PIPELINES = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline", "unet": "StableDiffusionXLPipeline"}
# (tokenizer, text encoder) components of each pipeline, in the pipeline's order.
TEXT_COMPONENTS = {
    "flux": [("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")],
    "sd3": [
        ("tokenizer", "text_encoder"),
        ("tokenizer_2", "text_encoder_2"),
        ("tokenizer_3", "text_encoder_3"),
    ],
    "unet": [("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")],
}
# FluxPipeline and StableDiffusion3Pipeline refuse max_sequence_length above 512 T5 tokens.
_MAX_T5_TOKENS = 512
# Pixels the VAE takes are in [-1, 1]; the slack admits resampling overshoot (Lanczos rings past the range).
_PIXEL_RANGE_SLACK = 0.05
# Files up to this size enter the identity by content (configs, tokenizers, tiny weights); larger ones
# (real weights, gigabytes) by size and modification time, or by the hub cache's content-addressed blob name.
_HASHED_BYTES = 16 * 2**20


@dataclass
class Encoders:
    """The VAE, tokenizers and text encoders of one model, loaded for caching and freed afterwards."""

    family: str
    """flux, sd3 or unet (SDXL), as ModelSpec.family."""
    vae: AutoencoderKL | None
    """None once freed."""
    tokenizers: list
    """In the pipeline's order (tokenizer, tokenizer_2, ...); empty once freed."""
    text_encoders: list
    """In the pipeline's order (text_encoder, text_encoder_2, ...); empty once freed."""
    identity: str
    """Stable digest of the VAE, tokenizer and text encoder files plus family and dtype: a cache key."""


class LatentMoments(NamedTuple):
    """A VAE posterior already in the denoiser's latent space: mean = (mu - shift) * scaling and
    std = sigma * scaling. Caching both lets training draw a fresh latent each epoch, as the diffusers
    training scripts do by encoding every step."""

    mean: torch.Tensor
    std: torch.Tensor

    def sample(self, generator: torch.Generator | None = None) -> torch.Tensor:
        """mean + std * noise, drawing the noise as DiagonalGaussianDistribution.sample does."""
        from diffusers.utils.torch_utils import randn_tensor

        noise = randn_tensor(
            self.mean.shape, generator=generator, device=self.mean.device, dtype=self.mean.dtype
        )
        return self.mean + self.std * noise


def encoder_folder(spec: ModelSpec, folder_or_hub: str | Path, revision: str | None = None) -> Path:
    """The local model folder holding vae/, the tokenizers and the text encoders; a hub repo is
    downloaded once, without its denoiser and scheduler."""
    folder = Path(folder_or_hub).expanduser()
    if folder.is_dir():
        return folder
    pipeline_class = _pipeline_class(spec)
    try:
        return Path(pipeline_class.download(str(folder_or_hub), revision=revision,
                                            **{DENOISER_FOLDER[spec.family]: None, "scheduler": None}))
    except (OSError, ValueError) as err:
        reason = " ".join(str(err).split())[:500]
        raise ZerotrainError(f"model.name_or_path='{folder_or_hub}': cannot fetch its VAE and text encoders "
                             f"({reason}); download the model folder and point to it") from err


def encoders_identity(spec: ModelSpec, folder: Path, dtype: torch.dtype = torch.float32) -> str:
    """What identifies the VAE and text encoders a cache was built with, without loading them."""
    components = TEXT_COMPONENTS[spec.family]
    subfolders = ["vae", *(name for pair in components for name in pair)]
    return _identity(folder, subfolders, f"{spec.family} {dtype}")


def load_encoders(
    spec: ModelSpec,
    folder_or_hub: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
) -> Encoders:
    """Load vae/, the tokenizers and the text encoders of a diffusers model folder or hub repo through
    the family's pipeline (its denoiser and scheduler are not loaded, nor downloaded), frozen, on
    `device` in `dtype`. SDXL's VAE overflows in float16 (diffusers keeps it in float32 there): use
    float32 or bfloat16."""
    pipeline_class = _pipeline_class(spec)
    skipped = {DENOISER_FOLDER[spec.family]: None, "scheduler": None}
    folder = encoder_folder(spec, folder_or_hub, revision)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()  # zerotrain reports progress itself
    transformers_logging.disable_progress_bar()
    try:
        pipeline = pipeline_class.from_pretrained(folder, dtype=dtype, **skipped)
    except (OSError, ValueError) as err:
        reason = " ".join(str(err).split())[:500]
        raise ZerotrainError(
            f"model.name_or_path='{folder_or_hub}': cannot load the VAE and text encoders of a "
            f"{pipeline_class.__name__} from it ({reason})"
        ) from err
    components = TEXT_COMPONENTS[spec.family]
    tokenizers = [getattr(pipeline, tokenizer) for tokenizer, _ in components]
    text_encoders = [getattr(pipeline, encoder) for _, encoder in components]
    for module in [pipeline.vae, *text_encoders]:
        module.to(device).requires_grad_(False).eval()
    return Encoders(
        family=spec.family,
        vae=pipeline.vae,
        tokenizers=tokenizers,
        text_encoders=text_encoders,
        identity=encoders_identity(spec, folder, dtype),
    )


def free(encoders: Encoders) -> None:
    """Drop the encoders' models so their memory returns (the caller must hold no other reference)."""
    encoders.vae = None
    encoders.tokenizers.clear()
    encoders.text_encoders.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def encode_latents(
    encoders: Encoders, pixels: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Latents the denoiser trains on, as diffusers' training scripts make them:
    vae.encode(pixels).latent_dist.sample(), then scaled (and shifted). pixels: (B, 3, H, W) in [-1, 1];
    returns (B, latent_channels, H / f, W / f) in the VAE's dtype."""
    vae, posterior = _posterior(encoders, pixels)
    return scale_latents(posterior.sample(generator), *_vae_scaling(vae))


def encode_latent_moments(encoders: Encoders, pixels: torch.Tensor) -> LatentMoments:
    """The posterior behind encode_latents, scaled into the denoiser's latent space, for caching:
    LatentMoments.sample gives what encode_latents gives for the same generator."""
    vae, posterior = _posterior(encoders, pixels)
    scaling, shift = _vae_scaling(vae)
    return LatentMoments(mean=scale_latents(posterior.mean, scaling, shift), std=posterior.std * scaling)


def scale_latents(latents: torch.Tensor, scaling_factor: float, shift_factor: float | None) -> torch.Tensor:
    """VAE latents (B, C, h, w) into the denoiser's space: (z - shift) * scaling (Flux, SD3) or
    z * scaling (SDXL, shift None). The pipelines undo it before decoding: z / scaling + shift."""
    if latents.ndim != 4:
        raise ValueError(f"scale_latents: expected latents (B, C, h, w), got shape {tuple(latents.shape)}")
    if shift_factor is not None:
        latents = latents - shift_factor
    return latents * scaling_factor


def encode_prompts(encoders: Encoders, captions: list[str], text_tokens: int) -> dict[str, torch.Tensor]:
    """Text conditioning for a batch of captions, as the family's pipeline computes it (one image per
    prompt, no classifier-free guidance). text_tokens is the sequence length the denoiser sees:
    - Flux: T5 tokens (max_sequence_length). prompt_embeds (B, T, d_T5); pooled_prompt_embeds (B, d_CLIP),
      CLIP-L's pooled output.
    - SD3: CLIP's 77 tokens plus text_tokens - 77 T5 tokens. prompt_embeds (B, T, d_T5): the two CLIPs'
      penultimate states concatenated and zero-padded to d_T5, followed by T5's; pooled_prompt_embeds
      (B, p_L + p_G), the two CLIP projections.
    - SDXL: CLIP's 77 tokens. prompt_embeds (B, 77, d_L + d_G): both CLIPs' penultimate states;
      pooled_prompt_embeds (B, p_G), text_encoder_2's projection.
    Flux's text ids are zeros (text_tokens, 3) and are not returned."""
    if not encoders.text_encoders:
        raise ZerotrainError("encode_prompts: these encoders were freed; load them again with load_encoders")
    if not captions or not all(isinstance(caption, str) for caption in captions):
        raise ValueError(f"encode_prompts: captions must be a non-empty list of strings, got {captions!r}")
    pipeline = _text_pipeline(encoders)
    clip_tokens = pipeline.tokenizer.model_max_length
    device = encoders.text_encoders[0].device
    with torch.no_grad():
        if encoders.family == "flux":
            _check_tokens(text_tokens, 1, _MAX_T5_TOKENS, "T5 tokens for Flux")
            prompt_embeds, pooled, _ = pipeline.encode_prompt(
                captions, device=device, max_sequence_length=text_tokens
            )
        elif encoders.family == "sd3":
            _check_tokens(
                text_tokens,
                clip_tokens + 1,
                clip_tokens + _MAX_T5_TOKENS,
                f"{clip_tokens} CLIP + T5 tokens for SD3",
            )
            prompt_embeds, _, pooled, _ = pipeline.encode_prompt(
                captions,
                None,
                None,
                device=device,
                do_classifier_free_guidance=False,
                max_sequence_length=text_tokens - clip_tokens,
            )
        else:
            _check_tokens(text_tokens, clip_tokens, clip_tokens, "CLIP tokens for SDXL")
            prompt_embeds, _, pooled, _ = pipeline.encode_prompt(
                captions, device=device, do_classifier_free_guidance=False
            )
    batch = len(captions)
    if prompt_embeds.shape[:2] != (batch, text_tokens) or pooled.ndim != 2 or pooled.shape[0] != batch:
        raise AssertionError(
            f"encode_prompts: expected ({batch}, {text_tokens}, D) and ({batch}, P), "
            f"got {tuple(prompt_embeds.shape)} and {tuple(pooled.shape)}"
        )
    return {"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled}


def sdxl_time_ids(
    original_size: tuple[int, int], crop_top_left: tuple[int, int], target_size: tuple[int, int]
) -> torch.Tensor:
    """SDXL's add_time_ids of one image, (6,) float32, as StableDiffusionXLPipeline._get_add_time_ids
    lays them out: original (height, width), crop (top, left), target (height, width). Training records
    the original size before resizing and the crop actually taken, as train_text_to_image_sdxl.py does."""
    parts = {"original_size": original_size, "crop_top_left": crop_top_left, "target_size": target_size}
    for name, value in parts.items():
        if len(value) != 2 or any(int(v) != v or v < 0 for v in value):
            raise ValueError(f"sdxl_time_ids: {name} must be two non-negative integers, got {value!r}")
    return torch.tensor([int(v) for value in parts.values() for v in value], dtype=torch.float32)


def _pipeline_class(spec: ModelSpec) -> Any:
    import diffusers

    check_trainable(spec)
    return getattr(diffusers, PIPELINES[spec.family])


def _text_pipeline(encoders: Encoders) -> Any:
    """The family's pipeline around the text components only: its encode_prompt is the reference."""
    import diffusers

    components: dict[str, Any] = {"vae": None, "scheduler": None, DENOISER_FOLDER[encoders.family]: None}
    for (tokenizer_name, encoder_name), tokenizer, encoder in zip(
        TEXT_COMPONENTS[encoders.family], encoders.tokenizers, encoders.text_encoders, strict=True
    ):
        components[tokenizer_name], components[encoder_name] = tokenizer, encoder
    if encoders.family == "unet":
        components["add_watermarker"] = False  # only decoded images are watermarked
    return getattr(diffusers, PIPELINES[encoders.family])(**components)


def _posterior(encoders: Encoders, pixels: torch.Tensor) -> tuple[Any, Any]:
    vae = encoders.vae
    if vae is None:
        raise ZerotrainError("encode_latents: these encoders were freed; load them again with load_encoders")
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    if pixels.ndim != 4 or pixels.shape[1] != vae.config.in_channels:
        raise ValueError(
            f"encode_latents: expected pixels (B, {vae.config.in_channels}, H, W), got {tuple(pixels.shape)}"
        )
    batch, _, height, width = pixels.shape
    if height % factor or width % factor:
        raise ValueError(
            f"encode_latents: H and W must be multiples of the VAE's {factor}, got {height}x{width}"
        )
    low, high = pixels.aminmax()
    if low < -1 - _PIXEL_RANGE_SLACK or high > 1 + _PIXEL_RANGE_SLACK:
        raise ValueError(
            f"encode_latents: pixels must lie in [-1, 1], got [{low.item():.3g}, {high.item():.3g}]"
        )
    with torch.no_grad():
        posterior = vae.encode(pixels.to(device=vae.device, dtype=vae.dtype)).latent_dist
    expected = (batch, vae.config.latent_channels, height // factor, width // factor)
    if tuple(posterior.mean.shape) != expected:
        raise AssertionError(
            f"encode_latents: expected latents {expected}, got {tuple(posterior.mean.shape)}"
        )
    return vae, posterior


def _vae_scaling(vae: Any) -> tuple[float, float | None]:
    return vae.config.scaling_factor, getattr(vae.config, "shift_factor", None)


def _check_tokens(text_tokens: int, low: int, high: int, what: str) -> None:
    if not low <= text_tokens <= high:
        raise ZerotrainError(f"text_tokens={text_tokens}: must be {low}..{high} ({what})")


def _identity(folder: Path, subfolders: list[str], salt: str) -> str:
    """sha256 over every file of the subfolders: relative path plus content (small files) or
    size and mtime (large ones; the blob name in the hub cache, which is the content's hash)."""
    digest = hashlib.sha256(salt.encode())
    for subfolder in subfolders:
        for path in sorted((folder / subfolder).rglob("*")):
            if path.is_file():
                digest.update(f"\0{path.relative_to(folder).as_posix()}\0".encode())
                digest.update(_fingerprint(path))
    return digest.hexdigest()


def _fingerprint(path: Path) -> bytes:
    stat = path.stat()
    if stat.st_size <= _HASHED_BYTES:
        return hashlib.sha256(path.read_bytes()).digest()
    target = path.resolve()
    if path.is_symlink() and target.parent.name == "blobs":
        return target.name.encode()
    return f"{stat.st_size} {stat.st_mtime_ns}".encode()
