"""zerotrain.loading's choice of how the ranks load the denoiser, the weights it reads, and the
planner's "model load" host term that follows the same rules (issue 24). The loads themselves,
their host memory and the training after them: tests/distributed/test_loading.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from zerotrain import loading
from zerotrain.config import load_config
from zerotrain.planner.memory import LP, Layout, Sizes, load_bytes

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GPU, CPU = torch.device("cuda", 0), torch.device("cpu")
WEIGHTS = {"w": Path("w.safetensors")}


def run_config(*overrides: str):
    return load_config(EXAMPLES / "tiny-cpu.yaml", list(overrides))


def zero(stage: int, offload_param: str = "none") -> dict:
    return {"zero_optimization": {"stage": stage, "offload_param": {"device": offload_param}}}


@pytest.mark.parametrize("overrides, stage, offload_param, device, weights, how", [
    ((), 3, "none", GPU, WEIGHTS, "partitioned"),
    ((), 3, "cpu", GPU, WEIGHTS, "partitioned"),
    ((), 3, "none", CPU, WEIGHTS, "partitioned"),
    ((), 3, "nvme", GPU, WEIGHTS, "whole"),
    ((), 3, "none", GPU, "no safetensors", "whole"),
    (("training.mode=lora", "training.quantize_base=qint8"), 3, "none", GPU, WEIGHTS, "staggered"),
    ((), 2, "none", GPU, WEIGHTS, "staggered"),
    ((), 0, "none", GPU, WEIGHTS, "staggered"),
    ((), 2, "none", CPU, WEIGHTS, "whole"),
    (("model.load=whole",), 3, "none", GPU, WEIGHTS, "whole"),
    (("model.load=whole",), 2, "none", GPU, WEIGHTS, "whole"),
    (("training.mode=lora", "training.lora.use_dora=true"), 3, "none", GPU, WEIGHTS, "whole"),
])
def test_each_layout_loads_the_way_that_costs_one_copy_per_node(overrides, stage, offload_param, device, weights,
                                                                 how):
    choice = loading.choose(run_config(*overrides), stage, zero(stage, offload_param), device, weights)
    assert choice.how == how, choice
    if isinstance(weights, str) and stage == 3:
        assert weights in choice.why


def test_the_weights_are_found_in_a_single_file_or_a_sharded_index_and_checked_against_the_model(tmp_path):
    from diffusers import FluxTransformer2DModel
    from safetensors.torch import load_file, save_file

    from zerotrain.models.catalog import resolve_model

    spec = resolve_model(run_config().model)
    config = {"patch_size": 1, "in_channels": 8, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 8,
              "num_attention_heads": 2, "joint_attention_dim": 16, "pooled_projection_dim": 8,
              "axes_dims_rope": (2, 2, 4)}
    FluxTransformer2DModel(**config).save_pretrained(tmp_path / "single" / "transformer")
    FluxTransformer2DModel(**config).save_pretrained(tmp_path / "sharded" / "transformer", max_shard_size="20KB")
    single = loading.weight_files(spec, tmp_path / "single")
    sharded = loading.weight_files(spec, tmp_path / "sharded")
    assert isinstance(single, dict) and isinstance(sharded, dict) and single.keys() == sharded.keys()
    assert len(set(sharded.values())) > 1 and len(set(single.values())) == 1
    model = loading.skeleton(spec, tmp_path / "single")
    assert all(p.is_meta and p.dtype == torch.bfloat16 for p in model.parameters())
    assert loading.mismatch(model, single, tmp_path / "single") is None
    assert loading.mismatch(model, sharded, tmp_path / "sharded") is None

    # a renamed weight, and a weight of another shape: one line each, and the run loads whole
    file = tmp_path / "single" / "transformer" / loading.WEIGHTS
    state = load_file(file)
    name = min(state)
    save_file({**{k: v for k, v in state.items() if k != name}, name + "_old": state[name]}, file)
    why = loading.mismatch(model, loading.weight_files(spec, tmp_path / "single"), tmp_path / "single")
    assert why and "1 missing" in why and name in why
    save_file({**state, name: torch.zeros(3, 3)}, file)
    why = loading.mismatch(model, loading.weight_files(spec, tmp_path / "single"), tmp_path / "single")
    assert why and name in why and "shape [3, 3]" in why
    assert "holds no" in loading.weight_files(spec, tmp_path / "nothing")
    (tmp_path / "sharded" / "transformer" / f"{loading.WEIGHTS}.index.json").write_text(json.dumps({}))
    assert "cannot be read" in loading.weight_files(spec, tmp_path / "sharded")


def test_the_planners_model_load_term_follows_the_loading():
    total, largest, gpus = 12_000_000_000, 50_000_000, 8
    sizes = Sizes(trainable_params=total, frozen_bytes=0, frozen_shardable=True, largest_layer_params=largest,
                  buffer_bytes=0, world_size=gpus, gpus_per_node=gpus, total_params=total,
                  param_numels=(largest, 1000))
    copy = LP * total
    assert load_bytes(Layout(3), sizes) == copy + gpus * LP * largest  # partitioned
    assert load_bytes(Layout(2), sizes) == copy  # staggered
    assert load_bytes(Layout(3, offload_param="nvme"), sizes) == gpus * copy  # whole: initialize converts it
    quantized = Sizes(**{**sizes.__dict__, "frozen_shardable": False})
    assert load_bytes(Layout(3), quantized) == copy  # staggered
    whole = Sizes(**{**sizes.__dict__, "load_whole": True})
    assert load_bytes(Layout(3), whole) == load_bytes(Layout(2), whole) == gpus * copy
