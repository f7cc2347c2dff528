"""Training objectives: shape contracts, per-sample broadcasting (the x-flux bug), timestep draws and
shifts against diffusers' schedulers, and prepare() outputs that run through the real tiny denoisers."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from diffusers import DDPMScheduler, FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.training_utils import compute_snr

from zerotrain.config import ModelConfig
from zerotrain.config.sections import ObjectiveConfig
from zerotrain.errors import ZerotrainError
from zerotrain.families.parts.flux1 import FLUX_SCHEDULER
from zerotrain.families.runtime.parts.flux1 import pack_latents
from zerotrain.families.runtime.sdxl import sdxl_time_ids
from zerotrain.families.sd3 import SD3_SCHEDULER
from zerotrain.families.sdxl import SDXL_TIME_IDS
from zerotrain.models.catalog import resolve_model
from zerotrain.models.tiny import build_tiny_pipeline
from zerotrain.objectives import (
    DDPM,
    FlowMatching,
    choose_flip,
    dynamic_shift,
    flow_interpolate,
    make_objective,
    min_snr_weights,
    mse_loss,
    sample_flow_timesteps,
    sample_posterior,
    sdxl_time_ids_batch,
    shift_sigmas,
)
from zerotrain.protocols import ModelSpec

# Tiny VAEs downsample 2x: 32x32-pixel images give 16x16 latents (64 Flux tokens, 64 SD3 patches).
RESOLUTION = 32
LATENT = 16
TEXT_TOKENS = 8


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module", params=["tiny-flux", "tiny-sd3", "tiny-sdxl"])
def tiny(request, tmp_path_factory) -> tuple[ModelSpec, dict, Path]:
    """A tiny model folder as save_pretrained writes it: its spec, scheduler config and path."""
    folder = build_tiny_pipeline(request.param, tmp_path_factory.mktemp(request.param) / "model")
    spec = resolve_model(ModelConfig(name_or_path=str(folder)))
    scheduler_config = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    return spec, scheduler_config, folder


def make_batch(
    spec: ModelSpec, batch: int = 2, std: float = 0.5, flip: bool = False, seed: int = 1, h: int = LATENT,
    w: int = LATENT,
) -> dict[str, torch.Tensor]:
    """A batch as CachedDataset's items collate: bf16 moments and embeddings, int64 sizes (height, width)."""
    g = gen(seed)
    config = spec.config
    if spec.family == "unet":
        text_dim = config["cross_attention_dim"]
        time_dim = SDXL_TIME_IDS * config["addition_time_embed_dim"]
        pooled_dim = config["projection_class_embeddings_input_dim"] - time_dim
    else:
        text_dim, pooled_dim = config["joint_attention_dim"], config["pooled_projection_dim"]
    shape = (batch, spec.latent_channels, h, w)
    items = {
        "latent_mean": torch.randn(shape, generator=g).bfloat16(),
        "latent_std": torch.full(shape, std).bfloat16(),
        "prompt_embeds": torch.randn(batch, TEXT_TOKENS, text_dim, generator=g).bfloat16(),
        "pooled_prompt_embeds": torch.randn(batch, pooled_dim, generator=g).bfloat16(),
        "original_size": torch.tensor([[1024 + 8 * i, 768 + 8 * i] for i in range(batch)]),
        "crop_top_left": torch.tensor([[i, 2 * i] for i in range(batch)]),
        "target_size": torch.tensor([[h * spec.vae_scale_factor, w * spec.vae_scale_factor]] * batch),
    }
    if flip:
        items["latent_flip_mean"] = items["latent_mean"].flip(-1)
        items["latent_flip_std"] = items["latent_std"].flip(-1)
    return items


# --------------------------------------------------------------------------------- shape contracts


def test_wrong_shapes_raise():
    t = torch.rand(3)
    x0 = torch.randn(3, 4, 8, 8)
    with pytest.raises(ValueError, match=r"shape \(batch,\)"):
        shift_sigmas(t[:, None], 3.0)
    with pytest.raises(ValueError, match=r"shape \(batch,\)"):
        flow_interpolate(x0, torch.randn_like(x0), t.view(3, 1, 1, 1))
    with pytest.raises(ValueError, match=r"\(3,\)"):
        flow_interpolate(x0, torch.randn_like(x0), torch.rand(2))
    with pytest.raises(ValueError, match="shape of x0"):
        flow_interpolate(x0, torch.randn(3, 4, 8, 4), t)
    with pytest.raises(ValueError, match=r"\(B, C, h, w\)"):
        sample_posterior(torch.zeros(3, 64, 16), torch.zeros(3, 64, 16), gen())
    with pytest.raises(ValueError, match="latent_std"):
        sample_posterior(x0, x0[:, :2], gen())
    with pytest.raises(ValueError, match="even"):
        pack_latents(torch.zeros(1, 4, 6, 5))
    with pytest.raises(ValueError, match="differ"):
        mse_loss(torch.zeros(2, 3), torch.zeros(2, 4), None)
    with pytest.raises(ValueError, match="weights"):
        mse_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 1))
    with pytest.raises(ValueError, match="crop_top_left"):
        sdxl_time_ids_batch(torch.zeros(2, 2), torch.zeros(2, 3), torch.zeros(2, 2))
    with pytest.raises(ValueError, match="snr"):
        min_snr_weights(torch.ones(2, 1), 5.0, "epsilon")


def test_prepare_rejects_badly_shaped_batches():
    spec = resolve_model(ModelConfig(name_or_path="tiny-sd3"))
    objective = make_objective(spec, SD3_SCHEDULER, ObjectiveConfig(), RESOLUTION)
    batch = make_batch(spec)
    packed = {**batch, **{key: batch[key].flatten(2) for key in ("latent_mean", "latent_std")}}
    with pytest.raises(ValueError, match="latent_mean"):
        objective.prepare(packed, gen())
    with pytest.raises(ValueError, match="prompt_embeds"):
        objective.prepare({**batch, "prompt_embeds": batch["prompt_embeds"][:1]}, gen())
    with pytest.raises(ValueError, match="patch"):
        objective.prepare(make_batch(spec, h=15), gen())


# ------------------------------------------------------------------ broadcasting (x-flux item 12)


def test_interpolation_is_per_sample_at_batch_3():
    g = gen()
    x0, noise = torch.randn(3, 5, 4, 6, generator=g), torch.randn(3, 5, 4, 6, generator=g)
    sigma = torch.tensor([0.1, 0.5, 0.9])
    one_by_one = torch.stack([(1 - sigma[i]) * x0[i] + sigma[i] * noise[i] for i in range(3)])
    torch.testing.assert_close(flow_interpolate(x0, noise, sigma), one_by_one)
    # x-flux's (1 - t) * x0 + t * noise broadcasts t (3,) against the last dim, not the batch.
    assert not torch.allclose((1 - sigma) * x0[..., :3] + sigma * noise[..., :3], one_by_one[..., :3])


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-sd3"])
def test_prepare_noises_each_sample_with_its_own_sigma(name):
    spec = resolve_model(ModelConfig(name_or_path=name))
    scheduler = FLUX_SCHEDULER if spec.family == "flux" else SD3_SCHEDULER
    objective = make_objective(spec, scheduler, ObjectiveConfig(), RESOLUTION)
    batch = make_batch(spec, batch=3, std=0.0)  # std 0: x0 is the mean exactly
    prepared = objective.prepare(batch, gen(7))
    kwargs = prepared.model_kwargs
    x0 = batch["latent_mean"].float()
    if spec.family == "flux":
        x0, sigma = pack_latents(x0), kwargs["timestep"]
    else:
        sigma = kwargs["timestep"] / 1000
    assert sigma.shape == (3,) and len(set(sigma.tolist())) == 3
    noise = prepared.target + x0
    for i in range(3):
        expected = (1 - sigma[i]) * x0[i] + sigma[i] * noise[i]
        torch.testing.assert_close(kwargs["hidden_states"][i], expected)


# ----------------------------------------------------------------------- timesteps and shifts


@pytest.mark.parametrize("scheme", ["uniform", "logit_normal", "mode"])
def test_timestep_draws_are_deterministic_and_in_range(scheme):
    config = ObjectiveConfig(timestep_sampling=scheme)
    t = sample_flow_timesteps(config, 20_000, gen(3))
    assert t.shape == (20_000,) and t.dtype == torch.float32
    assert torch.equal(t, sample_flow_timesteps(config, 20_000, gen(3)))
    assert not torch.equal(t, sample_flow_timesteps(config, 20_000, gen(4)))
    assert 0 <= t.min() and t.max() <= 1
    assert abs(t.mean().item() - 0.5) < 0.01  # all three are symmetric about 1/2
    uniform_var = 1 / 12
    if scheme == "uniform":
        assert abs(t.var().item() - uniform_var) < 0.003
    else:  # both concentrate on the middle timesteps (SD3 paper, section 3.1)
        assert t.var().item() < uniform_var * 0.8
    if scheme == "mode":
        u = torch.rand(20_000, generator=gen(3))
        expected = 1 - u - config.mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
        torch.testing.assert_close(t, expected)


def test_logit_normal_mean_follows_logit_mean():
    t = sample_flow_timesteps(ObjectiveConfig(logit_mean=1.0), 20_000, gen())
    assert t.mean() > 0.65


def test_mode_scale_beyond_monotonic_is_refused():
    spec = resolve_model(ModelConfig(name_or_path="tiny-sd3"))
    with pytest.raises(ZerotrainError, match="mode_scale"):
        make_objective(spec, SD3_SCHEDULER, ObjectiveConfig(timestep_sampling="mode", mode_scale=2.0), 32)


def test_sd3_static_shift_matches_the_scheduler():
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(SD3_SCHEDULER)
    n = SD3_SCHEDULER["num_train_timesteps"]
    unshifted = torch.linspace(1, n, n).flip(0) / n  # the scheduler's own training sigmas before shifting
    torch.testing.assert_close(shift_sigmas(unshifted, 3.0), scheduler.sigmas)
    torch.testing.assert_close(shift_sigmas(unshifted, 3.0) * n, scheduler.timesteps)


def test_flux_shift_grows_with_sequence_length_and_matches_time_shift():
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(FLUX_SCHEDULER)
    t = torch.linspace(0.01, 0.99, 50)
    previous = t
    for seq_len in (256, 1024, 4096):  # 256, 512 and 1024 px for FLUX.1
        m = (FLUX_SCHEDULER["max_shift"] - FLUX_SCHEDULER["base_shift"]) / (4096 - 256)
        mu = FLUX_SCHEDULER["base_shift"] + m * (seq_len - 256)
        sigma = shift_sigmas(t, dynamic_shift(FLUX_SCHEDULER, "flux", seq_len))
        torch.testing.assert_close(sigma, scheduler.time_shift(mu, 1.0, t))
        assert (sigma > previous).all()
        previous = sigma
    linear = FlowMatchEulerDiscreteScheduler.from_config({**FLUX_SCHEDULER, "time_shift_type": "linear"})
    mu = FLUX_SCHEDULER["max_shift"]
    torch.testing.assert_close(
        shift_sigmas(t, dynamic_shift({**FLUX_SCHEDULER, "time_shift_type": "linear"}, "flux", 4096)),
        linear.time_shift(mu, 1.0, t),
    )


def test_flux_objective_shifts_by_each_batchs_sequence_length():
    spec = resolve_model(ModelConfig(name_or_path="tiny-flux"))
    objective = make_objective(spec, FLUX_SCHEDULER, ObjectiveConfig(), RESOLUTION)
    shifts = []
    for side in (16, 32, 64):  # 64, 256 and 1024 image tokens
        tokens = (side // 2) ** 2
        sigma = objective.prepare(make_batch(spec, h=side, w=side), gen(5)).model_kwargs["timestep"]
        t = sample_flow_timesteps(ObjectiveConfig(), 2, _after_posterior(spec, gen(5), side))
        torch.testing.assert_close(sigma, shift_sigmas(t, dynamic_shift(FLUX_SCHEDULER, "flux", tokens)))
        shifts.append(objective.shift(tokens))
    assert shifts == sorted(shifts) and shifts[0] < shifts[-1]
    assert make_objective(spec, FLUX_SCHEDULER, ObjectiveConfig(shift=2.0), RESOLUTION).shift(4096) == 2.0
    static = make_objective(spec, {**FLUX_SCHEDULER, "use_dynamic_shifting": False}, ObjectiveConfig(), 32)
    assert static.shift(4096) == FLUX_SCHEDULER["shift"]


# ----------------------------------------------------------------------------------- packing


def test_packing_round_trips_through_unpack_latents():
    latents = torch.randn(2, 4, 6, 10, generator=gen())
    packed = pack_latents(latents)
    assert packed.shape == (2, 3 * 5, 16)
    torch.testing.assert_close(FluxPipeline._unpack_latents(packed, 6 * 8, 10 * 8, 8), latents)


def test_flip_is_chosen_per_sample():
    spec = resolve_model(ModelConfig(name_or_path="tiny-sdxl"))
    batch = make_batch(spec, batch=16, flip=True)
    mean = choose_flip(batch, gen()).mean
    flipped = [torch.equal(mean[i], batch["latent_flip_mean"][i]) for i in range(16)]
    plain = [torch.equal(mean[i], batch["latent_mean"][i]) for i in range(16)]
    assert all(f != p for f, p in zip(flipped, plain, strict=True))
    assert 0 < sum(flipped) < 16
    assert torch.equal(choose_flip(batch, gen())[0], mean)


# ------------------------------------------------------------------ through the real denoisers


def test_prepare_runs_through_the_tiny_denoiser_and_backpropagates(tiny):
    spec, scheduler_config, folder = tiny
    config = ObjectiveConfig(min_snr_gamma=5.0) if spec.family == "unet" else ObjectiveConfig()
    objective = make_objective(spec, scheduler_config, config, RESOLUTION)
    model = spec.denoiser_class().from_pretrained(folder, subfolder=spec.subfolder)
    model.train()
    prepared = objective.prepare(make_batch(spec, flip=True), gen())
    pred = model(**prepared.model_kwargs, return_dict=False)[0]
    assert pred.shape == prepared.target.shape
    assert prepared.target.dtype == torch.float32
    loss = objective.loss(pred, prepared)
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    if spec.family == "flux":  # tiny-flux is guidance-distilled like flux-dev
        assert torch.equal(prepared.model_kwargs["guidance"], torch.full((2,), 1.0))
        assert prepared.model_kwargs["img_ids"].shape == (LATENT // 2 * LATENT // 2, 3)
        assert torch.equal(prepared.model_kwargs["txt_ids"], torch.zeros(TEXT_TOKENS, 3))
    if spec.family == "unet":
        assert prepared.weights is not None and prepared.weights.shape == (2,)
        assert prepared.model_kwargs["added_cond_kwargs"]["time_ids"].shape == (2, SDXL_TIME_IDS)


def test_model_inputs_take_the_model_dtype():
    spec = resolve_model(ModelConfig(name_or_path="tiny-flux"))
    objective = make_objective(
        spec, FLUX_SCHEDULER, ObjectiveConfig(), RESOLUTION, model_dtype=torch.bfloat16
    )
    kwargs = objective.prepare(make_batch(spec), gen()).model_kwargs
    for key in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        assert kwargs[key].dtype == torch.bfloat16
    for key in ("timestep", "guidance", "img_ids", "txt_ids"):
        assert kwargs[key].dtype == torch.float32


def test_flux_dev_gets_guidance_and_schnell_does_not():
    dev = resolve_model(ModelConfig(name_or_path="flux-dev"))
    assert dev.config["guidance_embeds"]
    objective = make_objective(dev, FLUX_SCHEDULER, ObjectiveConfig(guidance=3.5), 1024)
    assert isinstance(objective, FlowMatching)
    prepared = objective.prepare(make_batch(dev, batch=2, h=8, w=8), gen())
    assert torch.equal(prepared.model_kwargs["guidance"], torch.full((2,), 3.5))
    assert prepared.model_kwargs["hidden_states"].shape == (2, 16, 64)
    schnell = resolve_model(ModelConfig(name_or_path="flux-schnell"))
    schnell_scheduler = {**FLUX_SCHEDULER, "use_dynamic_shifting": False, "shift": 1.0}
    objective = make_objective(schnell, schnell_scheduler, ObjectiveConfig(), 1024)
    assert "guidance" not in objective.prepare(make_batch(schnell, h=8, w=8), gen()).model_kwargs


def test_sd3_timestep_is_sigma_times_1000_and_flux_is_sigma():
    sd3 = resolve_model(ModelConfig(name_or_path="tiny-sd3"))
    flux = resolve_model(ModelConfig(name_or_path="tiny-flux"))
    fixed = ObjectiveConfig(shift=3.0)
    t = sample_flow_timesteps(fixed, 2, _after_posterior(sd3, gen(11)))
    sd3_step = make_objective(sd3, SD3_SCHEDULER, fixed, RESOLUTION).prepare(make_batch(sd3), gen(11))
    torch.testing.assert_close(sd3_step.model_kwargs["timestep"], shift_sigmas(t, 3.0) * 1000)
    flux_step = make_objective(flux, FLUX_SCHEDULER, fixed, RESOLUTION).prepare(make_batch(flux), gen(11))
    t = sample_flow_timesteps(fixed, 2, _after_posterior(flux, gen(11)))
    torch.testing.assert_close(flux_step.model_kwargs["timestep"], shift_sigmas(t, 3.0))


def _after_posterior(spec: ModelSpec, g: torch.Generator, side: int = LATENT) -> torch.Generator:
    """g advanced past prepare()'s posterior draw for a batch of 2 unflipped side x side latents, so
    that its next draw is prepare()'s t."""
    torch.randn((2, spec.latent_channels, side, side), generator=g)
    return g


# ------------------------------------------------------------------------------------------ DDPM


def sdxl(prediction_type: str = "auto", min_snr_gamma: float | None = None) -> DDPM:
    from zerotrain.families.sdxl import SDXL_SCHEDULER as _SDXL_SCHEDULER

    spec = resolve_model(ModelConfig(name_or_path="tiny-sdxl"))
    config = ObjectiveConfig(prediction_type=prediction_type, min_snr_gamma=min_snr_gamma)
    objective = make_objective(spec, _SDXL_SCHEDULER, config, RESOLUTION)
    assert isinstance(objective, DDPM)
    return objective


def test_v_prediction_target_is_the_schedulers_velocity():
    spec = resolve_model(ModelConfig(name_or_path="tiny-sdxl"))
    batch = make_batch(spec, batch=4, std=0.0)
    eps = sdxl().prepare(batch, gen(2))  # the same draws: posterior, timesteps, noise
    v_objective = sdxl("v_prediction")
    v = v_objective.prepare(batch, gen(2))
    timesteps = eps.model_kwargs["timestep"]
    assert timesteps.dtype == torch.int64 and timesteps.shape == (4,)
    assert 0 <= timesteps.min() and timesteps.max() < 1000
    assert torch.equal(v.model_kwargs["timestep"], timesteps)
    x0 = batch["latent_mean"].float()
    torch.testing.assert_close(eps.model_kwargs["sample"], v.model_kwargs["sample"])
    torch.testing.assert_close(v.target, v_objective.scheduler.get_velocity(x0, eps.target, timesteps))
    reference = DDPMScheduler.from_config(v_objective.scheduler.config)
    torch.testing.assert_close(eps.model_kwargs["sample"], reference.add_noise(x0, eps.target, timesteps))


def test_min_snr_weights_match_the_formula():
    objective = sdxl(min_snr_gamma=5.0)
    spec = resolve_model(ModelConfig(name_or_path="tiny-sdxl"))
    prepared = objective.prepare(make_batch(spec, batch=64), gen(4))
    timesteps = prepared.model_kwargs["timestep"]
    alphas = objective.scheduler.alphas_cumprod[timesteps]
    snr = alphas / (1 - alphas)
    assert (snr < 5).any() and (snr > 5).any()
    torch.testing.assert_close(prepared.weights, torch.minimum(snr, torch.tensor(5.0)) / snr)
    torch.testing.assert_close(compute_snr(objective.scheduler, timesteps), snr)
    v = torch.minimum(snr, torch.tensor(5.0)) / (snr + 1)
    torch.testing.assert_close(min_snr_weights(snr, 5.0, "v_prediction"), v)
    assert sdxl().prepare(make_batch(spec), gen()).weights is None


def test_sdxl_time_ids_match_per_image_conditioning():
    spec = resolve_model(ModelConfig(name_or_path="tiny-sdxl"))
    batch = make_batch(spec, batch=3)
    time_ids = sdxl().prepare(batch, gen()).model_kwargs["added_cond_kwargs"]["time_ids"]
    for i in range(3):
        expected = sdxl_time_ids(
            tuple(batch["original_size"][i].tolist()),
            tuple(batch["crop_top_left"][i].tolist()),
            tuple(batch["target_size"][i].tolist()),
        )
        assert torch.equal(time_ids[i], expected)


def test_settings_of_the_other_objective_are_refused():
    flux = resolve_model(ModelConfig(name_or_path="tiny-flux"))
    with pytest.raises(ZerotrainError, match="min_snr_gamma"):
        make_objective(flux, FLUX_SCHEDULER, ObjectiveConfig(min_snr_gamma=5.0), RESOLUTION)
    with pytest.raises(ZerotrainError, match="prediction_type"):
        make_objective(flux, FLUX_SCHEDULER, ObjectiveConfig(prediction_type="epsilon"), RESOLUTION)
    unet = resolve_model(ModelConfig(name_or_path="tiny-sdxl"))
    with pytest.raises(ZerotrainError, match="shift"):
        make_objective(unet, {"num_train_timesteps": 1000}, ObjectiveConfig(shift=3.0), RESOLUTION)
    with pytest.raises(ZerotrainError, match="prediction_type"):
        make_objective(unet, {"prediction_type": "sample"}, ObjectiveConfig(), RESOLUTION)
    with pytest.raises(ZerotrainError, match="resolution"):
        make_objective(flux, FLUX_SCHEDULER, ObjectiveConfig(), 30)
    odd = dataclasses.replace(flux, family="unknown")
    with pytest.raises(ZerotrainError, match="unknown"):
        make_objective(odd, FLUX_SCHEDULER, ObjectiveConfig(), RESOLUTION)


# ------------------------------------------------------------------------------------------ loss


def test_loss_is_a_weighted_per_sample_mean_and_keeps_nan():
    pred = torch.randn(3, 2, 4, generator=gen()).bfloat16()
    target = torch.randn(3, 2, 4, generator=gen(1))
    weights = torch.tensor([1.0, 0.5, 2.0])
    per_sample = ((pred.float() - target) ** 2).mean(dim=(1, 2))
    loss = mse_loss(pred, target, weights)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, (per_sample * weights).mean())
    torch.testing.assert_close(mse_loss(pred, target, None), per_sample.mean())
    pred[1, 0, 0] = float("nan")
    assert torch.isnan(mse_loss(pred, target, weights))
