"""Issue 23, edit and reference training: zerotrain's training forward gives the transformer exactly what
the family's own edit pipeline gives it (FluxKontextPipeline, Flux2Pipeline), the cached references are
what the pipeline encodes, and the data rules for control images hold.

The proof is a forward pre-hook on the pipeline's transformer: the pipeline renders one step from the
noisy latents and sigma that zerotrain's objective drew (its scheduler unshifted, so that its one sigma
is that sigma), and every argument it passes is compared with zerotrain's: the noisy and reference
tokens, the position ids, the timestep, guidance and text. zerotrain's references and text come from
its cache, stored in bf16, so they equal the pipeline's rounded to bf16 (within one bf16 step, since
the two encode in float32 a little differently)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from zerotrain import families
from zerotrain.config.loader import load_config
from zerotrain.data.cache import CachedDataset, reference_images
from zerotrain.data.prepare import make_loader, prepare
from zerotrain.distributed import Topology
from zerotrain.errors import ZerotrainError
from zerotrain.models.catalog import resolve_model
from zerotrain.models.conditioning import encode_latent_moments, load_encoders
from zerotrain.models.tiny import build_tiny_pipeline
from zerotrain.objectives import make_objective

SINGLE = Topology(0, 1, 0)
BF16 = {"rtol": 2 ** -7, "atol": 2e-3}  # one bf16 step


def picture(size, seed) -> Image.Image:
    rng = np.random.default_rng(seed)
    base = Image.linear_gradient("L").resize(size).convert("RGB")
    noise = rng.integers(0, 60, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(np.clip(np.asarray(base, dtype=np.int16) + noise, 0, 255).astype(np.uint8))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: build_tiny_pipeline(name, root / name) for name in ("tiny-flux-kontext", "tiny-flux2")}


def edit_data(root, references, target=(64, 64), control=(64, 64), pairs=2):
    """A target folder and `references` control folders matched by stem."""
    targets = root / "targets"
    targets.mkdir()
    folders = []
    for r in range(references):
        folder = root / f"control{r}"
        folder.mkdir()
        folders.append(folder)
    for n in range(pairs):
        picture(target, n).save(targets / f"pair{n}.png")
        (targets / f"pair{n}.txt").write_text(f"make picture {n} brighter")
        for r, folder in enumerate(folders):
            picture(control if r == 0 else control[::-1], 100 + 10 * n + r).save(folder / f"pair{n}.jpg")
    return targets, folders


def run_for(model, targets, controls, tmp_path, *extra):
    dataset = {"path": str(targets), "controls": [str(c) for c in controls]}
    return load_config(None, [
        f"model.name_or_path={model}", f"data.datasets=[{json.dumps(dataset)}]", "data.resolution=64",
        "data.bucket_step=16", "data.min_image_size=16", f"data.cache_dir={tmp_path / 'cache'}",
        "data.num_workers=0", "training.global_batch_size=1", *extra])


def first_batch(run, spec):
    prepared = prepare(run, spec, SINGLE)
    loader, _ = make_loader(prepared, run, 1, SINGLE)
    return prepared, next(iter(loader))


def pipeline_call(pipeline, run, prepared_batch, kwargs, controls, **call):
    """The transformer's arguments in the pipeline's first (and only) step, rendering from zerotrain's
    noisy latents at zerotrain's sigma."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    captured = {}
    pipeline.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        pipeline.scheduler.config, use_dynamic_shifting=False, shift=1.0)
    hook = pipeline.transformer.register_forward_pre_hook(
        lambda module, args, given: captured.update(given), with_kwargs=True)
    sigma = float(kwargs["timestep"][0])
    try:
        pipeline(prompt=prepared_batch.item.caption, image=controls, num_inference_steps=1, sigmas=[sigma],
                 generator=torch.Generator().manual_seed(0), output_type="latent",
                 max_sequence_length=run.data.text_tokens or 512, **call)
    finally:
        hook.remove()
    return captured


def test_kontext_training_forward_is_flux_kontext_pipelines(models, tmp_path):
    from diffusers import FluxKontextPipeline

    targets, controls = edit_data(tmp_path, 1)
    run = run_for("tiny-flux-kontext", targets, controls, tmp_path)
    spec = resolve_model(run.model)
    assert spec.pipeline_class == "FluxKontextPipeline"
    prepared, batch = first_batch(run, spec)
    planned = prepared.planned[prepared.samples[0]]
    assert [crop.bucket for crop in planned.reference_crops] == [planned.crop.bucket]  # Kontext: the target's size
    objective = make_objective(spec, json.loads((models["tiny-flux-kontext"] / "scheduler" / "scheduler_config.json")
                                                .read_text()), run.objective, 64)
    ours = objective.prepare(batch, torch.Generator().manual_seed(3)).model_kwargs
    tokens = planned.crop.bucket[0] * planned.crop.bucket[1] // 16
    assert ours["hidden_states"].shape[1] == 2 * tokens

    pipeline = FluxKontextPipeline.from_pretrained(models["tiny-flux-kontext"])
    control = Image.open(planned.item.controls[0]).convert("RGB")
    theirs = pipeline_call(pipeline, run, planned, ours, control, latents=ours["hidden_states"][:, :tokens],
                           height=planned.crop.bucket[1], width=planned.crop.bucket[0], guidance_scale=float(ours["guidance"][0]),
                           _auto_resize=False, max_area=planned.crop.bucket[0] * planned.crop.bucket[1])
    assert set(theirs) - {"joint_attention_kwargs", "return_dict"} == set(ours)
    # The noisy tokens are zerotrain's by construction; the reference tokens are the pipeline's encode.
    torch.testing.assert_close(ours["hidden_states"], theirs["hidden_states"].to(torch.bfloat16).float(), **BF16)
    torch.testing.assert_close(ours["hidden_states"][:, :tokens], theirs["hidden_states"][:, :tokens], rtol=0, atol=0)
    for name in ("img_ids", "txt_ids", "guidance"):
        torch.testing.assert_close(ours[name], theirs[name].to(ours[name].dtype), rtol=0, atol=0, msg=name)
    assert ours["img_ids"][tokens:, 0].eq(1).all() and ours["img_ids"][:tokens, 0].eq(0).all()
    torch.testing.assert_close(ours["timestep"], theirs["timestep"], rtol=0, atol=1e-6)
    for name in ("encoder_hidden_states", "pooled_projections"):
        torch.testing.assert_close(ours[name], theirs[name].to(torch.bfloat16).float(), **BF16, msg=name)


def test_flux2_training_forward_with_two_references_is_flux2_pipelines(models, tmp_path):
    from diffusers import Flux2Pipeline

    targets, controls = edit_data(tmp_path, 2, target=(64, 64), control=(64, 96))
    run = run_for("tiny-flux2", targets, controls, tmp_path, "data.text_tokens=16")
    spec = resolve_model(run.model)
    prepared, batch = first_batch(run, spec)
    planned = prepared.planned[prepared.samples[0]]
    # FLUX.2 sizes each reference at its own aspect (here below 1024 x 1024: its own size).
    assert [crop.bucket for crop in planned.reference_crops] == [(64, 96), (96, 64)]
    objective = make_objective(spec, json.loads((models["tiny-flux2"] / "scheduler" / "scheduler_config.json")
                                                .read_text()), run.objective, 64)
    ours = objective.prepare(batch, torch.Generator().manual_seed(5)).model_kwargs
    factor = spec.vae_scale_factor
    tokens = planned.crop.bucket[0] * planned.crop.bucket[1] // factor ** 2
    assert ours["hidden_states"].shape[1] == tokens + 2 * (64 * 96) // factor ** 2

    pipeline = Flux2Pipeline.from_pretrained(models["tiny-flux2"])
    images = [Image.open(path).convert("RGB") for path in planned.item.controls]
    theirs = pipeline_call(pipeline, run, planned, ours, images, latents=unpack(ours, tokens, planned, factor),
                           height=planned.crop.bucket[1], width=planned.crop.bucket[0], guidance_scale=float(ours["guidance"][0]),
)
    assert set(theirs) - {"joint_attention_kwargs", "return_dict"} == set(ours)
    torch.testing.assert_close(ours["hidden_states"], theirs["hidden_states"].to(torch.bfloat16).float(), **BF16)
    for name in ("img_ids", "txt_ids", "guidance"):
        torch.testing.assert_close(ours[name], theirs[name].to(ours[name].dtype), rtol=0, atol=0, msg=name)
    assert sorted(set(ours["img_ids"][0, tokens:, 0].tolist())) == [10, 20]
    torch.testing.assert_close(ours["timestep"], theirs["timestep"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["encoder_hidden_states"],
                               theirs["encoder_hidden_states"].to(torch.bfloat16).float(), **BF16)


def unpack(kwargs, tokens, planned, factor):
    """Flux2Pipeline takes latents (B, C, h, w) before packing: zerotrain's noisy tokens unpacked."""
    width, height = planned.crop.bucket
    packed = kwargs["hidden_states"][:, :tokens]
    return packed.transpose(1, 2).reshape(1, packed.shape[2], height // factor, width // factor)


def test_the_loss_scores_only_the_target_tokens(models, tmp_path):
    targets, controls = edit_data(tmp_path, 1)
    run = run_for("tiny-flux-kontext", targets, controls, tmp_path)
    spec = resolve_model(run.model)
    _, batch = first_batch(run, spec)
    objective = make_objective(spec, {"use_dynamic_shifting": True}, run.objective, 64)
    prepared = objective.prepare(batch, torch.Generator().manual_seed(0))
    tokens = prepared.target.shape[1]
    pred = torch.zeros_like(prepared.model_kwargs["hidden_states"])
    base = objective.loss(pred, prepared)
    pred[:, tokens:] = 1000.0  # the reference tokens' output is not scored
    assert torch.equal(objective.loss(pred, prepared), base)
    pred[:, :tokens] += 1.0
    assert objective.loss(pred, prepared) > base

    # A loss mask is laid out as the target alone: masked-out target tokens are not scored either.
    mask = torch.ones(batch["latent_mean"].shape[0], *batch["latent_mean"].shape[2:])
    mask[:, :, : mask.shape[2] // 2] = 0.0  # the left half of the latent grid
    masked = objective.prepare({**batch, "loss_mask": mask}, torch.Generator().manual_seed(0))
    assert masked.mask.shape == masked.target.shape and masked.references == 1
    pred = torch.zeros_like(masked.model_kwargs["hidden_states"])
    base = objective.loss(pred, masked)
    left = masked.mask[0, :, 0] == 0  # the packed tokens of the masked-out half
    assert 0 < int(left.sum()) < tokens
    pred[:, :tokens][:, left] = 100.0
    pred[:, tokens:] = 100.0
    assert torch.equal(objective.loss(pred, masked), base)
    pred[:, :tokens][:, ~left] = 100.0
    assert objective.loss(pred, masked) > base


# ------------------------------------------------------------------------------- the cache


def test_references_are_cached_beside_their_targets_and_a_changed_control_reencodes_only_its_sample(models, tmp_path):
    targets, controls = edit_data(tmp_path, 1, pairs=3)
    run = run_for(models["tiny-flux-kontext"], targets, controls, tmp_path, "data.flip=true")
    spec = resolve_model(run.model)
    assert spec.pipeline_class == "FluxKontextPipeline"
    first = prepare(run, spec, SINGLE)
    assert first.report.latents_encoded == 3
    dataset = CachedDataset(first.planned, run.data.cache_dir, flip=True)
    sample, planned = dataset[0], first.planned[0]
    assert sample["reference_0"].shape == sample["latent_mean"].shape
    # The normalized posterior mean of the control (at the target's size here) and of its mirror image.
    encoders = load_encoders(spec, models["tiny-flux-kontext"])
    pixels = np.asarray(Image.open(planned.item.controls[0]).convert("RGB"), dtype=np.float32)
    x = torch.from_numpy(pixels).permute(2, 0, 1)[None] / 127.5 - 1
    for name, image in (("reference_0", x), ("reference_0_flip", torch.flip(x, dims=[3]))):
        torch.testing.assert_close(sample[name].float(), encode_latent_moments(encoders, image).mean[0], **BF16,
                                   msg=name)
    picture((64, 64), 999).save(controls[0] / "pair1.jpg")
    again = prepare(run, spec, SINGLE)
    assert (again.report.latents_encoded, again.report.latents_cached) == (1, 2)


# ------------------------------------------------------------------------------- data rules


def test_missing_and_miscounted_controls_are_reported_with_their_paths(tmp_path):
    from zerotrain.config.sections import DataConfig
    from zerotrain.data.dataset import discover

    targets, controls = edit_data(tmp_path, 1, pairs=3)
    (controls[0] / "pair2.jpg").unlink()
    found = discover(DataConfig(datasets=[{"path": targets, "controls": controls}], min_image_size=8))
    assert [item.image.name for item in found.items] == ["pair0.png", "pair1.png"]
    assert [(v.path.name, v.reason) for v in found.rejected] == [
        ("pair2.png", f"control missing: no {controls[0] / 'pair2'}.* in control folder {controls[0]}")]
    # A manifest: "control" or musubi-tuner's control_path_N; a count that differs is reported.
    lines = [{"image": "targets/pair0.png", "caption": "c", "control": "control0/pair0.jpg"},
             {"image": "targets/pair1.png", "caption": "c", "control_path_0": "control0/pair1.jpg"},
             {"image": "targets/pair2.png", "caption": "c", "control": ["control0/pair0.jpg", "control0/pair1.jpg"]},
             {"image": "targets/pair0.png", "caption": "c", "control": "control0/broken.jpg"}]
    (controls[0] / "broken.jpg").write_bytes(b"not a jpeg")
    manifest = tmp_path / "edits.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    found = discover(DataConfig(datasets=[{"path": manifest}], min_image_size=8, max_rejected_fraction=0.9))
    assert [(item.image.name, [c.name for c in item.controls]) for item in found.items] == [
        ("pair0.png", ["pair0.jpg"]), ("pair1.png", ["pair1.jpg"])]
    reasons = sorted(v.reason for v in found.rejected)
    assert reasons[0] == "2 control images where the other images of data.datasets[0] have 1", reasons
    assert reasons[1].startswith(f"control {controls[0] / 'broken.jpg'}: "), reasons


def test_bad_control_input_gets_one_line(models, tmp_path):
    targets, controls = edit_data(tmp_path, 2)
    with pytest.raises(ZerotrainError, match=r"control folder .*absent does not exist"):
        run_for("tiny-flux", targets, [tmp_path / "absent"], tmp_path)
    flux = run_for("tiny-flux", targets, controls[:1], tmp_path)
    with pytest.raises(ZerotrainError, match=r"data.datasets\[0\]: 1 control image\(s\) per target, but tiny-flux "
                                             r"\(FluxPipeline\) takes no reference images"):
        prepare(flux, resolve_model(flux.model), SINGLE)
    kontext = run_for("tiny-flux-kontext", targets, controls, tmp_path)
    with pytest.raises(ZerotrainError, match=r"2 control images per target, but FluxKontextPipeline takes at most 1"):
        prepare(kontext, resolve_model(kontext.model), SINGLE)


def test_the_planner_refuses_references_a_model_cannot_take(capsys, tmp_path):
    from zerotrain.cli import main

    facts = f"planner.cache_dir={tmp_path}"
    assert main(["plan", "--model", "flux-dev", "--references", "1", "--gpus", "1xH100-80GB", "--set", facts]) == 2
    assert "data.references: 1 reference images, but flux-dev (FluxPipeline) takes no reference images" in capsys.readouterr().err
    assert main(["plan", "--model", "flux-kontext-dev", "--references", "2", "--gpus", "1xH100-80GB", "--set", facts]) == 2
    assert "data.references: 2 reference images, but FluxKontextPipeline takes at most 1" in capsys.readouterr().err


@pytest.fixture(scope="module")
def qwen_edits(tmp_path_factory):
    """tiny-qwen-image-edit-2511 (QwenImageEditPlusPipeline, zero_cond_t), and the same folder as Qwen-Image-Edit
    (QwenImageEditPipeline, one reference, no zero_cond_t)."""
    import shutil

    root = tmp_path_factory.mktemp("qwen-edit")
    plus = build_tiny_pipeline("tiny-qwen-image-edit-2511", root / "2511")
    edit = root / "edit"
    shutil.copytree(plus, edit)
    for path, change in ((edit / "model_index.json", {"_class_name": "QwenImageEditPipeline"}),
                         (edit / "transformer" / "config.json", {"zero_cond_t": False})):
        path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    return {"plus": plus, "edit": edit}


def qwen_forward(folder, pipeline_class, run, spec, batch, planned, seed, images):
    """zerotrain's training forward from the real cache, and the transformer's arguments in the edit pipeline's
    first (and only) step from zerotrain's noisy tokens and sigma, the pipeline encoding the caption with the
    control images itself (its own processor where torchvision is installed, else load_processor's)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from zerotrain.families.runtime.parts.qwen_image_edit import load_processor

    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    ours = make_objective(spec, scheduler, run.objective, 64).prepare(batch, torch.Generator().manual_seed(seed)).model_kwargs
    width, height = planned.crop.bucket
    tokens = (width // 16) * (height // 16)
    pipeline = pipeline_class.from_pretrained(folder, processor=load_processor(folder))
    pipeline.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        pipeline.scheduler.config, use_dynamic_shifting=False, shift=1.0, shift_terminal=None)
    captured = {}
    hook = pipeline.transformer.register_forward_pre_hook(lambda m, a, given: captured.update(given), with_kwargs=True)
    try:
        pipeline(image=images, prompt=planned.item.caption, height=height, width=width, num_inference_steps=1,
                 sigmas=[float(ours["timestep"][0])], latents=ours["hidden_states"][:, :tokens], true_cfg_scale=1.0,
                 output_type="latent")
    finally:
        hook.remove()
    assert set(captured) - {"attention_kwargs", "return_dict", "guidance"} == set(ours)
    assert captured["img_shapes"] == ours["img_shapes"] and captured["guidance"] is None
    torch.testing.assert_close(ours["hidden_states"][:, :tokens], captured["hidden_states"][:, :tokens], rtol=0, atol=0)
    # The references' tokens come from the cache (bf16); the text rows too, the images' rows among them.
    torch.testing.assert_close(ours["hidden_states"], captured["hidden_states"].to(torch.bfloat16).float(), **BF16)
    torch.testing.assert_close(ours["timestep"], captured["timestep"], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours["encoder_hidden_states"],
                               captured["encoder_hidden_states"].to(torch.bfloat16).float(), **BF16)
    assert ours["encoder_hidden_states_mask"] is None and captured["encoder_hidden_states_mask"] is None
    return ours, tokens


def test_qwen_image_edit_2511_training_forward_with_two_references_is_the_plus_pipelines(qwen_edits, tmp_path,
                                                                                        monkeypatch):
    """Qwen-Image-Edit-2511 with two references, from the cache: the target's then each reference's tokens,
    img_shapes in that order (from which zero_cond_t gives the references t = 0), the timestep, and the text as
    QwenImageEditPlusPipeline encodes the caption with the references (each read at 384 x 384 pixels of area,
    its rows kept among the caption's). The pipeline encodes references at 1024 x 1024 pixels of area: here
    64 x 64, set alike on both sides."""
    from diffusers import QwenImageEditPlusPipeline
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 64 * 64)
    targets, controls = edit_data(tmp_path, 2, control=(64, 96))
    run = run_for(qwen_edits["plus"], targets, controls, tmp_path)
    spec = resolve_model(run.model)
    assert spec.pipeline_class == "QwenImageEditPlusPipeline" and spec.config["zero_cond_t"]
    prepared, batch = first_batch(run, spec)
    planned = prepared.planned[prepared.samples[0]]
    assert [crop.bucket for crop in planned.reference_crops] == [(64, 64), (64, 64)]  # 64^2 of area, rounded to 32
    # Each reference's 384 x 384 image is 14 x 14 rows of the text encoder (28 px each, after its resize to 392).
    assert int(batch["image_pad_mask"].sum()) == batch["image_rows"].shape[1] == 2 * 196
    # The pipeline is handed the references as zerotrain sized them, as validation hands them (it keeps their size).
    images = reference_images(planned, run.data.background)
    ours, _ = qwen_forward(qwen_edits["plus"], QwenImageEditPlusPipeline, run, spec, batch, planned, 2, images)
    assert ours["img_shapes"] == [[(1, 4, 4), (1, 4, 4), (1, 4, 4)]]
    assert ours["encoder_hidden_states"].shape[1] == int(batch["prompt_embeds_mask"].sum()) + 2 * 196


def test_qwen_image_edit_training_forward_with_one_reference_is_the_edit_pipelines(qwen_edits, tmp_path):
    """Qwen-Image-Edit (QwenImageEditPipeline): its one reference at 1024 x 1024 pixels of area, which its text
    encoder reads as it is (37 x 37 rows after the processor's resize to 1036), and no zero_cond_t."""
    from diffusers import QwenImageEditPipeline

    targets, controls = edit_data(tmp_path, 1)
    run = run_for(qwen_edits["edit"], targets, controls, tmp_path)
    spec = resolve_model(run.model)
    assert spec.pipeline_class == "QwenImageEditPipeline" and families.of(spec).max_references(spec) == 1
    prepared, batch = first_batch(run, spec)
    planned = prepared.planned[prepared.samples[0]]
    assert [crop.bucket for crop in planned.reference_crops] == [(1024, 1024)]
    assert batch["image_rows"].shape[1] == 37 * 37 == families.of(spec).reference_text_rows(spec, [(1024, 1024)])
    ours, _ = qwen_forward(qwen_edits["edit"], QwenImageEditPipeline, run, spec, batch, planned, 4,
                           reference_images(planned, run.data.background)[0])
    assert ours["img_shapes"] == [[(1, 4, 4), (1, 64, 64)]]


def test_a_changed_control_reencodes_its_qwen_edit_caption_and_latents_and_nothing_else(qwen_edits, tmp_path,
                                                                                       monkeypatch):
    """The text encoder reads the references, so an edit caption's cache key holds them: a changed control
    re-encodes its sample's caption and latents, and leaves the other samples' cached."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus

    monkeypatch.setattr(pipeline_qwenimage_edit_plus, "VAE_IMAGE_SIZE", 64 * 64)
    targets, controls = edit_data(tmp_path, 1, pairs=3)
    run = run_for(qwen_edits["plus"], targets, controls, tmp_path)
    spec = resolve_model(run.model)
    first = prepare(run, spec, SINGLE).report
    assert (first.latents_encoded, first.texts_encoded) == (3, 3)
    picture((64, 64), 999).save(controls[0] / "pair1.jpg")
    again = prepare(run, spec, SINGLE).report
    assert (again.latents_encoded, again.latents_cached, again.texts_encoded, again.texts_cached) == (1, 2, 1, 2)


def test_qwen_image_edit_models_train_with_their_references():
    from zerotrain.config.sections import ModelConfig
    from zerotrain.models.catalog import check_trainable

    for name, most in (("qwen-image-edit", 1), ("qwen-image-edit-2509", 3), ("qwen-image-edit-2511", 3)):
        spec = resolve_model(ModelConfig(name_or_path=name))
        assert families.of(spec).max_references(spec) == most
        check_trainable(spec)
