"""The conditioning each family's denoiser trains on, computed exactly as its diffusers pipeline
computes it: VAE latents normalized into the denoiser's space, and text embeddings.

Text embeddings come from the family pipeline's own `encode_prompt`, built around the loaded text
encoders with no denoiser, so they match inference token for token. The encoders are loaded once for
caching and freed before training. What differs between families (which pipeline, which encoders,
how latents are normalized) the family says (zerotrain.families).
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from zerotrain import families
from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import check_trainable
from zerotrain.models.hub import fetch
from zerotrain.protocols import ModelSpec

if TYPE_CHECKING:
    from diffusers import AutoencoderKL

# Pixels the VAE takes are in [-1, 1]; the slack admits resampling overshoot (Lanczos rings past the range).
_PIXEL_RANGE_SLACK = 0.05
# Files up to this size enter the identity by content (configs, tokenizers, tiny weights); larger ones
# (real weights, gigabytes) by size and modification time, or by the hub cache's content-addressed blob name.
_HASHED_BYTES = 16 * 2**20


@dataclass
class Encoders:
    """The VAE, tokenizers and text encoders of one model, loaded for caching and freed afterwards."""

    family: str
    """The family's name, as ModelSpec.family."""
    pipeline: str
    """The family pipeline's class (Family.pipeline_name), whose encode_prompt encodes."""
    vae: AutoencoderKL | None
    """None once freed."""
    tokenizers: list
    """In the pipeline's order (tokenizer, tokenizer_2, ...); empty once freed."""
    text_encoders: list
    """In the pipeline's order (text_encoder, text_encoder_2, ...); empty once freed."""
    identity: str
    """Stable digest of the VAE, tokenizer and text encoder files plus family and dtype: a cache key."""
    settings: dict = dataclasses.field(default_factory=dict)
    """The pipeline's own settings from model_index.json (Krea 2's text_encoder_select_layers,
    is_distilled), which the text-only pipeline of encode_prompt is built with."""


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
    """The local model folder holding vae/, the tokenizers and the text encoders; a hub repo's are
    downloaded once into the hub cache (models.hub.fetch, without its denoiser and scheduler)."""
    folder = Path(folder_or_hub).expanduser()
    if folder.is_dir():
        return folder
    return fetch(spec, str(folder_or_hub), revision, "encode")


def encoders_identity(spec: ModelSpec, folder: Path, dtype: torch.dtype = torch.float32) -> str:
    """What identifies the VAE and text encoders a cache was built with, without loading them."""
    family = families.of(spec)
    subfolders = ["vae", *(name for pair in family.text_parts(family.pipeline_name(spec)) for name in pair)]
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
    skipped = {families.of(spec).denoiser_folder: None, "scheduler": None}
    folder = encoder_folder(spec, folder_or_hub, revision)
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()  # zerotrain reports progress itself
    transformers_logging.disable_progress_bar()
    try:
        pipeline = families.of(spec).encoder_pipeline(pipeline_class, folder, dtype, skipped)
    except (OSError, ValueError) as err:
        reason = " ".join(str(err).split())[:500]
        raise ZerotrainError(
            f"model.name_or_path='{folder_or_hub}': cannot load the VAE and text encoders of a "
            f"{pipeline_class.__name__} from it ({reason})"
        ) from err
    components = families.of(spec).text_parts(pipeline_class.__name__)
    tokenizers = [getattr(pipeline, tokenizer) for tokenizer, _ in components]
    text_encoders = [getattr(pipeline, encoder) for _, encoder in components]
    for module in [pipeline.vae, *text_encoders]:
        module.to(device).requires_grad_(False).eval()
    accepted = inspect.signature(pipeline_class.__init__).parameters
    return Encoders(
        family=spec.family,
        pipeline=pipeline_class.__name__,
        vae=pipeline.vae,
        tokenizers=tokenizers,
        text_encoders=text_encoders,
        identity=encoders_identity(spec, folder, dtype),
        settings={key: value for key, value in pipeline.config.items()
                  if key in accepted and key not in pipeline.components},
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
    return families.by_name(encoders.family).codec.normalize_latents(vae, posterior.sample(generator))


def encode_latent_moments(encoders: Encoders, pixels: torch.Tensor) -> LatentMoments:
    """The posterior behind encode_latents, scaled into the denoiser's latent space, for caching:
    LatentMoments.sample gives what encode_latents gives for the same generator."""
    vae, posterior = _posterior(encoders, pixels)
    family = families.by_name(encoders.family)
    return LatentMoments(mean=family.codec.normalize_latents(vae, posterior.mean), std=family.codec.normalize_std(vae, posterior.std))


def encode_prompts(encoders: Encoders, captions: list[str], text_tokens: int,
                   images: list[list[Any]] | None = None) -> dict[str, torch.Tensor]:
    """Text conditioning for a batch of captions, as the family's pipeline computes it (one image per
    prompt, no classifier-free guidance), named as the family's text_outputs; text_tokens is the
    sequence length the denoiser sees. Each family's encode_prompt says what its tensors hold.
    `images`: each caption's reference images (PIL, at reference_size), for a family whose text encoder
    reads them with the caption (text_reads_references), which then adds its reference_text_outputs."""
    if not encoders.text_encoders:
        raise ZerotrainError("encode_prompts: these encoders were freed; load them again with load_encoders")
    if not captions or not all(isinstance(caption, str) for caption in captions):
        raise ValueError(f"encode_prompts: captions must be a non-empty list of strings, got {captions!r}")
    family = families.by_name(encoders.family)
    if images is not None and (not family.text_reads_references or len(images) != len(captions)):
        raise ValueError(f"encode_prompts: {family.title}'s text encoder reads no images, or not one list per "
                         f"caption ({len(images)} for {len(captions)})")
    pipeline = _text_pipeline(encoders)
    with torch.no_grad():
        out = family.encode_prompt(pipeline, captions, text_tokens, encoders.text_encoders[0].device,
                                   **({} if images is None else {"images": images}))
    batch = len(captions)
    shapes = {name: tuple(value.shape) for name, value in out.items()}
    if (
        tuple(out) != (*family.text_outputs, *(() if images is None else family.reference_text_outputs))
        or any(shape[0] != batch for shape in shapes.values())
        or shapes["prompt_embeds"][:2] != (batch, text_tokens)
    ):
        raise AssertionError(
            f"encode_prompts: expected {family.text_outputs} with {batch} rows and prompt_embeds "
            f"({batch}, {text_tokens}, D), got {shapes}"
        )
    return out


def _pipeline_class(spec: ModelSpec) -> Any:
    import diffusers

    check_trainable(spec)
    return getattr(diffusers, families.of(spec).pipeline_name(spec))


def _text_pipeline(encoders: Encoders) -> Any:
    """The family's pipeline around the text components only: its encode_prompt is the reference."""
    import diffusers

    family = families.by_name(encoders.family)
    components: dict[str, Any] = {"vae": None, "scheduler": None, family.denoiser_folder: None,
                                  **family.pipeline_extras, **encoders.settings}
    for (tokenizer_name, encoder_name), tokenizer, encoder in zip(
        family.text_parts(encoders.pipeline), encoders.tokenizers, encoders.text_encoders, strict=True
    ):
        components[tokenizer_name], components[encoder_name] = tokenizer, encoder
    return family.text_pipeline(getattr(diffusers, encoders.pipeline), components)


def _posterior(encoders: Encoders, pixels: torch.Tensor) -> tuple[Any, Any]:
    vae = encoders.vae
    if vae is None:
        raise ZerotrainError("encode_latents: these encoders were freed; load them again with load_encoders")
    family = families.by_name(encoders.family)
    factor = family.codec.vae_downsampling(vae)
    if pixels.ndim != 4 or pixels.shape[1] != 3:
        raise ValueError(f"encode_latents: expected pixels (B, 3, H, W), got {tuple(pixels.shape)}")
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
        posterior = family.codec.posterior(vae, pixels)
    expected = (batch, family.codec.vae_latent_channels(vae), height // factor, width // factor)
    if tuple(posterior.mean.shape) != expected:
        raise AssertionError(
            f"encode_latents: expected latents {expected}, got {tuple(posterior.mean.shape)}"
        )
    return vae, posterior


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
