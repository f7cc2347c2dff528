"""ZeRO++ on several nodes (issue 14): with planner.zeropp=[hpz] and hardware.nodes=2, four CPU
ranks (two "nodes" of two, gloo) train tiny-flux with the hpZ secondary partition that the
planner chose and wrote (zero_hpz_partition_size = the ranks of a node). qwZ and qgZ need
DeepSpeed's CUDA QuantizerBuilder, which the CPU accelerator lacks ("This op had not been
implemented on CPU backend"), so on CPU only hpZ trains; their JSON is checked by DeepSpeed's
config class."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed


def test_hpz_trains_on_two_nodes_of_two_ranks(train):
    result = train("hpz", "planner.stages=[3]", "planner.offload=[none]", "planner.zeropp=[hpz]",
                   "hardware.nodes=2", "training.global_batch_size=4", "training.max_steps=6",
                   "optimizer.lr=1e-3", world=4).check()
    zero = json.loads((result.output_dir / "deepspeed.json").read_text())["zero_optimization"]
    assert zero["stage"] == 3 and zero["zero_hpz_partition_size"] == 2, zero
    chosen = json.loads((result.output_dir / "plan.json").read_text())["chosen"]
    assert chosen["layout"]["zeropp"] == "hpz"
    assert {"communication (inter-node)", "communication (intra-node)"} <= set(chosen["time_terms"])
    losses = result.losses()
    assert len(losses) == 6 and losses[-1] < losses[0], losses


def test_quantized_zeropp_config_is_accepted_by_deepspeed():
    from zerotrain.config import load_config
    from zerotrain.planner.deepspeed_json import deepspeed_config, validate
    from zerotrain.planner.memory import Layout

    run = load_config(None, ["hardware.gpus=8xH100-80GB", "hardware.nodes=2", "training.global_batch_size=16"])
    config = deepspeed_config(Layout(3, zeropp="hpz-qwz-qgz"), run, 16)
    assert config["zero_optimization"]["zero_hpz_partition_size"] == 8
    assert config["zero_optimization"]["zero_quantized_weights"] and config["zero_optimization"]["zero_quantized_gradients"]
    validate(config)
