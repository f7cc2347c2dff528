"""A fine-tune trained over its base pipeline's encoders (model.denoiser), on two ranks under ZeRO-3 (the
partitioned load reads the weights one by one from the folder models.fine_tune writes): the ComfyUI file a
run exported (FLUX.2's Black Forest Labs layout, converted once per node) trains again with exactly the losses
of the same run's diffusers export given as a folder, for the same steps, seed and data, and not those of the
base it was trained from."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed

RUN = ("model.name_or_path=tiny-flux2", "planner.stages=[3]", "planner.offload=[none]", "training.max_steps=2",
       "training.checkpoint_every=1000", "optimizer.lr=1e-3")


def test_a_runs_comfyui_export_trains_again_as_its_diffusers_export_does(train, shared_cache, tmp_path):
    from zerotrain.export import export

    first = train("first", *RUN).check()
    (comfy,) = (export(first.output_dir, out=tmp_path / "comfy", comfyui=True) / "comfyui").iterdir()
    exported = first.output_dir / "export" / "transformer"
    from_file = train("from-file", *RUN, f"model.denoiser={comfy}").check()
    from_folder = train("from-folder", *RUN, f"model.denoiser={exported}").check()

    assert from_file.losses() == from_folder.losses()  # bit for bit: the same weights, steps, seed and data
    assert from_file.losses()[0] != first.losses()[0]  # the fine-tune trains, not the base's own denoiser
    assert f"zerotrain: reading {comfy} as tiny-flux2's Flux2Transformer2DModel" in from_file.log
    written = sorted(p.name for p in (shared_cache / "models").glob("fine-tune-*"))
    assert len(written) == 2, written  # one folder each (per node), the two sources apart
    config = json.loads(json.dumps(__import__("yaml").safe_load((from_file.output_dir / "config.yaml").read_text())))
    assert config["model"]["denoiser"] == str(comfy)
