"""Training objectives: what one micro-step feeds the denoiser, and how its output is scored.

- Flow matching (Flux, SD3), as diffusers' train_dreambooth_flux.py / train_dreambooth_sd3.py and the
  pipelines: x_t = (1 - sigma) * x0 + sigma * noise, target noise - x0, t drawn as in the SD3 paper
  (uniform, logit-normal or mode) and shifted toward noise, by a fixed shift or by the resolution-dependent
  one FluxPipeline computes from the image sequence length.
- DDPM (SDXL-style UNets), as train_text_to_image_sdxl.py: integer timesteps drawn uniformly,
  scheduler.add_noise, an epsilon or v-prediction target, optional min-SNR loss weights.

Every tensor function asserts its shapes, and t is always (batch,), broadcast explicitly. x-flux computes
(1 - t) * x1 + t * x0 with t (batch,) against (batch, L, C) latents, which is only right at batch 1
(FIELD_NOTES, item 12). All randomness comes from the caller's generator, so a step can be replayed from
its seed.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from zerotrain import families
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.errors import ZerotrainError
from zerotrain.families.runtime.base import text_and_pooled
from zerotrain.protocols import Family, ModelSpec

if TYPE_CHECKING:
    from diffusers import DDPMScheduler

# The mode density of the SD3 paper (eq. 20) maps [0, 1] onto [0, 1] only while it is monotonic,
# which holds for mode_scale <= 2 / (pi - 2) (the paper's stated range for s).
MAX_MODE_SCALE = 2 / (math.pi - 2)


@dataclass
class Prepared:
    """What one training micro-step feeds the denoiser."""

    model_kwargs: dict[str, Any]
    """Keyword arguments of the diffusers denoiser's forward (the caller adds return_dict=False). Tensors,
    except SDXL's added_cond_kwargs, a dict of tensors. Latents and text embeddings are in the model
    dtype given to make_objective; timesteps, guidance, Flux's ids and SDXL's time ids stay float32."""
    target: torch.Tensor
    """Float32, the shape of the denoiser's output."""
    weights: torch.Tensor | None
    """(batch,) float32 per-sample loss weights, or None for uniform weights."""
    mask: torch.Tensor | None = None
    """Float32 per-element loss weights laid out as the target (the samples' loss masks), or None."""
    references: int = 0
    """Edit training: reference images appended after the target's tokens; the denoiser's output is
    cut back to the target's tokens before it is scored."""


class Objective(Protocol):
    def prepare(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> Prepared: ...

    def loss(self, pred: torch.Tensor, prepared: Prepared) -> torch.Tensor: ...


def make_objective(
    spec: ModelSpec,
    scheduler_config: dict[str, Any],
    config: ObjectiveConfig,
    resolution: int,
    *,
    model_dtype: torch.dtype = torch.float32,
) -> Objective:
    """The objective of spec's family. scheduler_config is the model folder's
    scheduler/scheduler_config.json; resolution is data.resolution (checked against the model's pixel
    factor; a dynamic shift itself follows each batch's own sequence length, as the pipelines' does);
    model_dtype is the denoiser's parameter dtype."""
    family = families.of(spec)
    families.check_resolution(spec, resolution)
    scheduler_config = dict(scheduler_config)
    if family.objective == "ddpm":
        return make_ddpm(spec, scheduler_config, config, model_dtype, time_ids=family.ddpm_time_ids(spec))
    return make_flow_matching(family, spec, scheduler_config, config, model_dtype)


# ---------------------------------------------------------------------------------------------------
# Shared pieces: latents from the cached posterior, and the loss.


class Chosen(NamedTuple):
    """A batch's samples as this step trains them: each flipped or not (choose_flip)."""

    mean: torch.Tensor
    """The latent posterior's mean (B, C, h, w)."""
    std: torch.Tensor
    mask: torch.Tensor | None
    """The loss mask (B, 1, h, w), when the batch carries loss_mask (B, h, w)."""
    references: list[torch.Tensor]
    """Edit training: each reference's clean latents (B, C, h_r, w_r), in reference order."""


def choose_flip(batch: dict[str, torch.Tensor], generator: torch.Generator) -> Chosen:
    """The latent posterior (mean, std) of each sample, (B, C, h, w): the horizontally flipped one with
    probability 1/2 per sample when the batch carries latent_flip_mean/std, else the plain one; the
    loss mask and the references (reference_0, reference_1, ...), flipped with their sample."""
    mean, std = batch["latent_mean"], batch["latent_std"]
    _check_latents(mean, "latent_mean")
    _check_same(std, mean, "latent_std", "latent_mean")
    mask = batch.get("loss_mask")
    if mask is not None:
        _check_same(mask, mean[:, 0], "loss_mask", "latent_mean[:, 0]")
        mask = mask.float().unsqueeze(1)
    references = [batch[f"reference_{r}"] for r in range(sum(1 for k in batch if re.fullmatch(r"reference_\d+", k)))]
    for r, reference in enumerate(references):
        _check_latents(reference, f"reference_{r}")
        if reference.shape[:2] != mean.shape[:2]:
            raise ValueError(f"reference_{r} {tuple(reference.shape)} must have the batch and channels of "
                             f"latent_mean {tuple(mean.shape)}")
    if "latent_flip_mean" not in batch:
        return Chosen(mean, std, mask, references)
    flip_mean, flip_std = batch["latent_flip_mean"], batch["latent_flip_std"]
    _check_same(flip_mean, mean, "latent_flip_mean", "latent_mean")
    _check_same(flip_std, mean, "latent_flip_std", "latent_mean")
    flip = _rand(mean.shape[0], generator, mean.device) < 0.5
    pick = flip.view(-1, 1, 1, 1)
    if mask is not None:
        mask = torch.where(pick, torch.flip(mask, dims=[3]), mask)
    references = [torch.where(pick, batch[f"reference_{r}_flip"], reference) for r, reference in enumerate(references)]
    return Chosen(torch.where(pick, flip_mean, mean), torch.where(pick, flip_std, std), mask, references)


def sample_posterior(mean: torch.Tensor, std: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """x0 = mean + std * noise in float32, (B, C, h, w): a fresh draw of the VAE posterior, as the
    diffusers training scripts get by encoding every step (latent_dist.sample())."""
    _check_latents(mean, "latent_mean")
    _check_same(std, mean, "latent_std", "latent_mean")
    return mean.float() + std.float() * _randn(mean.shape, generator, mean.device)


def dataset_weights(batch: dict[str, torch.Tensor], weights: torch.Tensor | None) -> torch.Tensor | None:
    """The per-sample weights times each sample's dataset loss_weight, where the batch carries them."""
    if "loss_weight" not in batch:
        return weights
    mine = batch["loss_weight"].float().reshape(-1)
    return mine if weights is None else weights.float() * mine.to(weights.device)


def mse_loss(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None,
             mask: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 scalar: the squared error, times mask (the target's shape) when given, averaged over
    every non-batch dim, times weights (B,) when given, averaged over the batch. A masked sample is
    averaged over all its elements, not over its mask's area (as kohya and SimpleTuner do): a sample
    whose mask keeps half of it weighs half. A NaN stays a NaN: hiding one hides a diverged run."""
    if pred.shape != target.shape:
        raise ValueError(f"mse_loss: pred {tuple(pred.shape)} and target {tuple(target.shape)} differ")
    error = (pred.float() - target.float()).pow(2)
    if mask is not None:
        _check_same(mask, target, "mask", "target")
        error = error * mask.float()
    per_sample = error.reshape(pred.shape[0], -1).mean(dim=1)
    if weights is not None:
        _check_batch(weights, pred.shape[0], "weights")
        per_sample = per_sample * weights.float()
    return per_sample.mean()


# ---------------------------------------------------------------------------------------------------
# Flow matching (Flux, SD3).


def sample_flow_timesteps(
    config: ObjectiveConfig, batch_size: int, generator: torch.Generator, auto_logit_std: float = 1.0
) -> torch.Tensor:
    """t (batch_size,) float32 in [0, 1] on the generator's device, drawn per config.timestep_sampling
    by diffusers' compute_density_for_timestep_sampling (SD3 paper, section 3.1); auto_logit_std is the
    logit-normal's std when config.logit_std is auto (the family's, Family.timestep_logit_std)."""
    from diffusers.training_utils import compute_density_for_timestep_sampling

    t = compute_density_for_timestep_sampling(
        weighting_scheme=config.timestep_sampling,
        batch_size=batch_size,
        logit_mean=config.logit_mean,
        logit_std=auto_logit_std if config.logit_std == "auto" else config.logit_std,
        mode_scale=config.mode_scale,
        device=generator.device,
        generator=generator,
    ).float()
    _check_batch(t, batch_size, "t")
    return t


def shift_sigmas(t: torch.Tensor, shift: float) -> torch.Tensor:
    """sigma = shift * t / (1 + (shift - 1) * t), (B,): FlowMatchEulerDiscreteScheduler's static shift;
    shift > 1 moves training toward noise. Its exponential time_shift(mu, 1, t) is this with shift = e^mu,
    and the linear one this with shift = mu."""
    _check_t(t, "t")
    if not shift > 0:
        raise ValueError(f"shift_sigmas: shift must be positive, got {shift}")
    return shift * t / (1 + (shift - 1) * t)


def dynamic_shift(scheduler_config: dict[str, Any], family: str, image_seq_len: int) -> float:
    """The shift the family's pipeline samples with for image_seq_len image tokens when its scheduler
    uses dynamic shifting (Family.dynamic_shift: FluxPipeline's calculate_shift unless the family
    says otherwise), mapped through the scheduler's time_shift_type."""
    return families.by_name(family).dynamic_shift(scheduler_config, image_seq_len)


def flow_interpolate(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_t = (1 - sigma) * x0 + sigma * noise, sigma (B,) broadcast over every other dim of x0."""
    _check_same(noise, x0, "noise", "x0")
    _check_t(sigma, "sigma")
    _check_batch(sigma, x0.shape[0], "sigma")
    s = sigma.to(x0.dtype).view(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise


def flow_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The velocity d x_t / d sigma = noise - x0 that flow-matching models predict."""
    _check_same(noise, x0, "noise", "x0")
    return noise - x0


@dataclass(frozen=True)
class FlowMatching:
    """Rectified flow, conditioned as the family's pipeline conditions its denoiser."""

    family: Family
    """Lays out the denoiser's inputs and target (Family.flow_inputs) and the tokens a shift follows."""
    spec: ModelSpec
    config: ObjectiveConfig
    scheduler_config: dict[str, Any]
    num_train_timesteps: int
    """From the scheduler config; SD3's transformer takes sigma * num_train_timesteps."""
    model_dtype: torch.dtype

    def shift(self, image_seq_len: int) -> float:
        """config.shift when set; else the scheduler's: dynamic for this many image tokens when it
        uses dynamic shifting (Flux), its static shift otherwise (SD3: 3.0), or the family's own
        (Family.sampling_shift)."""
        if self.config.shift != "auto":
            return float(self.config.shift)
        return self.family.sampling_shift(self.spec, self.scheduler_config, image_seq_len)

    def prepare(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> Prepared:
        mean, std, mask, references = choose_flip(batch, generator)
        x0 = sample_posterior(mean, std, generator)
        b, _, h, w = x0.shape
        tokens = self.family.latent_tokens(self.spec, h, w)
        t = sample_flow_timesteps(self.config, b, generator, self.family.timestep_logit_std).to(x0.device)
        sigma = shift_sigmas(t, self.shift(tokens))
        noise = _randn(x0.shape, generator, x0.device)
        x_t = flow_interpolate(x0, noise, sigma)
        kwargs, target = self.family.flow_inputs(self, x_t, flow_target(x0, noise), sigma, batch)
        if references:  # clean reference tokens after the noisy ones, as the family's edit pipeline appends them
            kwargs = self.family.add_references(self.spec, kwargs, [r.float() for r in references])
        if mask is not None:  # laid out as the target: the family packs it as it packs the target
            mask = self.family.target_layout(mask.expand_as(x0).contiguous())
        return Prepared(model_kwargs=kwargs, target=target, weights=dataset_weights(batch, None), mask=mask,
                        references=len(references))

    def loss(self, pred: Any, prepared: Prepared) -> torch.Tensor:
        """pred: the first element of the denoiser's return_dict=False output; with references, its
        target tokens (the first ones, as the edit pipelines cut noise_pred) are scored, and so they are of
        a family whose output covers its text rows too (Family.joint_output)."""
        pred = self.family.prediction(pred)
        if prepared.references or self.family.joint_output:
            pred = target_tokens(pred, prepared.target, last=self.family.target_last)
        return mse_loss(pred, prepared.target, prepared.weights, prepared.mask)


def target_tokens(pred: torch.Tensor, target: torch.Tensor, last: bool = False) -> torch.Tensor:
    """The target's tokens of an edit prediction (B, L_target + L_references, C): the first L_target,
    as FluxKontextPipeline, Flux2Pipeline and QwenImageEditPipeline cut noise_pred[:, :L_target]; the last
    L_target with `last` (QwenImage21Pipeline's noise_pred[:, -L_target:])."""
    if pred.ndim != 3 or target.ndim != 3 or pred.shape[0] != target.shape[0] or pred.shape[2] != target.shape[2] \
            or pred.shape[1] < target.shape[1]:
        raise ValueError(f"target_tokens: an edit prediction {tuple(pred.shape)} does not hold the target's "
                         f"{tuple(target.shape)} tokens")
    return pred[:, pred.shape[1] - target.shape[1]:] if last else pred[:, :target.shape[1]]


def make_flow_matching(
    family: Family, spec: ModelSpec, scheduler_config: dict[str, Any], config: ObjectiveConfig,
    model_dtype: torch.dtype,
) -> FlowMatching:
    """Flow matching for a family whose scheduler is FlowMatchEulerDiscreteScheduler."""
    _check_flow_config(spec, config)
    return FlowMatching(
        family=family,
        spec=spec,
        config=config,
        scheduler_config=scheduler_config,
        num_train_timesteps=int(scheduler_config.get("num_train_timesteps", 1000)),
        model_dtype=model_dtype,
    )


def _check_flow_config(spec: ModelSpec, config: ObjectiveConfig) -> None:
    ddpm_only = {"prediction_type": config.prediction_type != "auto", "min_snr_gamma": config.min_snr_gamma}
    for field, value in ddpm_only.items():
        if value:
            raise ZerotrainError(
                f"objective.{field}: applies to DDPM models (SDXL) only; {spec.name} trains with flow "
                "matching, so leave it unset"
            )
    if config.timestep_sampling == "mode" and config.mode_scale > MAX_MODE_SCALE:
        raise ZerotrainError(
            f"objective.mode_scale={config.mode_scale}: above {MAX_MODE_SCALE:.4f} the mode density is not "
            "monotonic and draws t outside [0, 1]; use at most that (1.29 is the SD3 paper's)"
        )


# ---------------------------------------------------------------------------------------------------
# DDPM (SDXL-style UNets).


def sample_ddpm_timesteps(
    num_train_timesteps: int, batch_size: int, generator: torch.Generator
) -> torch.Tensor:
    """Integer timesteps (batch_size,) int64, uniform in [0, num_train_timesteps), on the generator's
    device."""
    t = torch.randint(0, num_train_timesteps, (batch_size,), generator=generator, device=generator.device)
    _check_batch(t, batch_size, "timesteps")
    return t


def min_snr_weights(snr: torch.Tensor, gamma: float, prediction_type: str) -> torch.Tensor:
    """Min-SNR-gamma loss weights (B,) (Hang et al. 2023), as diffusers' training scripts apply them to
    an epsilon loss, min(snr, gamma) / snr, or a v loss, min(snr, gamma) / (snr + 1)."""
    _check_t(snr, "snr")
    clipped = torch.clamp(snr, max=gamma)
    if prediction_type == "epsilon":
        return clipped / snr
    if prediction_type == "v_prediction":
        return clipped / (snr + 1)
    raise ValueError(
        f"min_snr_weights: prediction_type must be epsilon or v_prediction, got {prediction_type}"
    )


def sdxl_time_ids_batch(
    original_size: torch.Tensor, crop_top_left: torch.Tensor, target_size: torch.Tensor
) -> torch.Tensor:
    """SDXL's add_time_ids (B, 6) float32, each row laid out as conditioning.sdxl_time_ids: original
    (height, width), crop (top, left), target (height, width); every input (B, 2)."""
    parts = {"original_size": original_size, "crop_top_left": crop_top_left, "target_size": target_size}
    batch = original_size.shape[0] if original_size.ndim else 0
    for name, value in parts.items():
        if value.shape != (batch, 2):
            raise ValueError(f"sdxl_time_ids_batch: {name} must be ({batch}, 2), got {tuple(value.shape)}")
    return torch.cat([value.float() for value in parts.values()], dim=1)


@dataclass(frozen=True)
class DDPM:
    """Denoising diffusion for UNets, noised by the scheduler config's beta schedule."""

    scheduler: DDPMScheduler
    prediction_type: str
    """epsilon or v_prediction."""
    min_snr_gamma: float | None
    time_ids: bool
    """SDXL's text_time conditioning: pooled text embeddings and size/crop time ids."""
    model_dtype: torch.dtype

    def prepare(self, batch: dict[str, torch.Tensor], generator: torch.Generator) -> Prepared:
        from diffusers.training_utils import compute_snr

        mean, std, mask, references = choose_flip(batch, generator)
        if references:
            raise ZerotrainError("edit training is for flow-matching models; this DDPM model takes no references")
        x0 = sample_posterior(mean, std, generator)
        b = x0.shape[0]
        text, pooled = text_and_pooled(batch, b)
        timesteps = sample_ddpm_timesteps(self.scheduler.config.num_train_timesteps, b, generator)
        timesteps = timesteps.to(x0.device)
        noise = _randn(x0.shape, generator, x0.device)
        noisy = self.scheduler.add_noise(x0, noise, timesteps)
        if self.prediction_type == "epsilon":
            target = noise
        else:
            target = self.scheduler.get_velocity(x0, noise, timesteps)
        kwargs: dict[str, Any] = {
            "sample": noisy.to(self.model_dtype),
            "timestep": timesteps,
            "encoder_hidden_states": text.to(self.model_dtype),
        }
        if self.time_ids:
            kwargs["added_cond_kwargs"] = {
                "text_embeds": pooled.to(self.model_dtype),
                "time_ids": sdxl_time_ids_batch(
                    batch["original_size"], batch["crop_top_left"], batch["target_size"]
                ).to(x0.device),
            }
        weights = None
        if self.min_snr_gamma is not None:
            snr = compute_snr(self.scheduler, timesteps)
            weights = min_snr_weights(snr, self.min_snr_gamma, self.prediction_type)
        mask = None if mask is None else mask.expand_as(x0)
        return Prepared(model_kwargs=kwargs, target=target, weights=dataset_weights(batch, weights), mask=mask)

    def loss(self, pred: torch.Tensor, prepared: Prepared) -> torch.Tensor:
        return mse_loss(pred, prepared.target, prepared.weights, prepared.mask)


def make_ddpm(
    spec: ModelSpec, scheduler_config: dict[str, Any], config: ObjectiveConfig, model_dtype: torch.dtype,
    *, time_ids: bool,
) -> DDPM:
    """DDPM for a UNet; time_ids: SDXL's text_time conditioning."""
    from diffusers import DDPMScheduler

    if config.shift != "auto":
        raise ZerotrainError(
            f"objective.shift={config.shift}: applies to flow-matching models (Flux, SD3) only; {spec.name} "
            "is a DDPM model, so leave it unset"
        )
    prediction_type = config.prediction_type
    if prediction_type == "auto":
        prediction_type = scheduler_config.get("prediction_type", "epsilon")
    if prediction_type not in ("epsilon", "v_prediction"):
        raise ZerotrainError(
            f"scheduler_config.json: prediction_type '{prediction_type}' is not epsilon or v_prediction; "
            "set objective.prediction_type"
        )
    if (
        config.min_snr_gamma is not None
        and prediction_type == "epsilon"
        and scheduler_config.get("rescale_betas_zero_snr", False)
    ):
        raise ZerotrainError(
            "objective.min_snr_gamma: with a zero-terminal-SNR schedule (rescale_betas_zero_snr) the last "
            "timestep has SNR 0 and its epsilon weight min(snr, gamma) / snr is undefined; use "
            "objective.prediction_type=v_prediction or unset min_snr_gamma"
        )
    # Only the noise schedule (betas, num_train_timesteps) matters for training; SDXL ships an
    # EulerDiscreteScheduler config, whose betas DDPMScheduler builds identically.
    scheduler = DDPMScheduler.from_config(scheduler_config, prediction_type=prediction_type)
    return DDPM(
        scheduler=scheduler,
        prediction_type=prediction_type,
        min_snr_gamma=config.min_snr_gamma,
        time_ids=time_ids,
        model_dtype=model_dtype,
    )


# ---------------------------------------------------------------------------------------------------
# Shape contracts and random draws.


def _check_latents(x: torch.Tensor, name: str) -> None:
    if x.ndim != 4 or x.shape[0] < 1:
        raise ValueError(f"{name} must be (B, C, h, w), got {tuple(x.shape)}")


def _check_same(x: torch.Tensor, like: torch.Tensor, name: str, like_name: str) -> None:
    if x.shape != like.shape:
        raise ValueError(f"{name} {tuple(x.shape)} must have the shape of {like_name} {tuple(like.shape)}")


def _check_t(t: torch.Tensor, name: str) -> None:
    if t.ndim != 1:
        raise ValueError(f"{name} must have shape (batch,), got {tuple(t.shape)}")


def _check_batch(t: torch.Tensor, batch: int, name: str) -> None:
    if t.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), got {tuple(t.shape)}")


def _rand(n: int, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniform [0, 1) draws on the generator's device, moved to device (a CPU generator serves GPU
    batches, as diffusers' randn_tensor allows)."""
    return torch.rand(n, generator=generator, device=generator.device).to(device)


def _randn(shape: torch.Size, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator, device=device, dtype=torch.float32)
