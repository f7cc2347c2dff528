"""ZeRO++ on several nodes (issue 14): with planner.zeropp=[hpz] and hardware.nodes=2, four CPU
ranks (two "nodes" of two, gloo) train tiny-flux with the hpZ secondary partition that the
planner chose and wrote (zero_hpz_partition_size = the ranks of a node). That the engine built
it is read from inside the ranks (tests/distributed/patched.py, hpz_probe): before the first
backward every parameter holds, besides its ZeRO-3 quarter (ds_tensor), the secondary partition
hpZ gathers from in backward (ds_secondary_tensor): half of the parameter, the half of the rank's
position in its node, equal to the other ranks' quarters. qwZ and qgZ need
DeepSpeed's CUDA QuantizerBuilder, which the CPU accelerator lacks ("This op had not been
implemented on CPU backend"), so on CPU only hpZ trains; their JSON is checked by DeepSpeed's
config class."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import patched

pytestmark = pytest.mark.distributed

WORLD, NODE = 4, 2


def hpz_probe() -> None:
    """Installed in each rank of the hpZ run (patched.py): right before the engine's first
    backward, save this rank's primary and secondary partition of every parameter and the
    engine's and its ZeRO-3 optimizer's hpZ size to <output_dir>/hpz-rank<rank>.pt."""
    import zerotrain.engine

    build = zerotrain.engine.build_engine

    def probed(model, ds_config, run, *args, **kwargs):
        engine = build(model, ds_config, run, *args, **kwargs)
        backward = engine.backward

        def first_backward(loss, *b_args, **b_kwargs):
            engine.backward = backward
            params = {name: {"numel": p.ds_numel, "primary": p.ds_tensor.detach().clone(),
                             "secondary": None if p.ds_secondary_tensor is None else p.ds_secondary_tensor.detach().clone(),
                             "group_size": getattr(p, "ds_secondary_tensor_group_size", None)}
                      for name, p in engine.module.named_parameters()}
            Path(run.output_dir).mkdir(parents=True, exist_ok=True)
            torch.save({"params": params, "engine": engine.zero_hpz_partition_size(),
                        "optimizer": getattr(engine.optimizer, "zero_hpz_partition_size", None)},
                       Path(run.output_dir) / f"hpz-rank{torch.distributed.get_rank()}.pt")
            return backward(loss, *b_args, **b_kwargs)

        engine.backward = first_backward
        return engine

    zerotrain.engine.build_engine = probed


def check_secondary_partitions(output_dir: Path) -> int:
    """Every parameter's secondary partition on every rank is its node position's half of the
    parameter, as the four primary quarters put together say. Returns how many parameters."""
    probes = [torch.load(output_dir / f"hpz-rank{rank}.pt", weights_only=False) for rank in range(WORLD)]
    assert [(p["engine"], p["optimizer"]) for p in probes] == [(NODE, NODE)] * WORLD, \
        [(p["engine"], p["optimizer"]) for p in probes]
    names = list(probes[0]["params"])
    assert names and all(list(p["params"]) == names for p in probes)
    for name in names:
        parts = [p["params"][name] for p in probes]
        quarter = parts[0]["primary"].numel()
        flat = torch.cat([part["primary"].flatten() for part in parts])  # the whole parameter (padded)
        assert flat.numel() == WORLD * quarter >= parts[0]["numel"], name
        for rank, part in enumerate(parts):
            secondary = part["secondary"]
            assert secondary is not None, f"{name} has no hpZ secondary partition on rank {rank}"
            assert part["group_size"] == NODE and secondary.numel() == NODE * quarter, (name, rank, secondary.shape)
            within = rank % NODE
            half = flat[within * secondary.numel():(within + 1) * secondary.numel()]
            assert torch.equal(secondary.flatten(), half), f"{name}: rank {rank}'s secondary partition is not its half"
    return len(names)


def test_hpz_trains_on_two_nodes_of_two_ranks(train, monkeypatch):
    result = patched.run(train, monkeypatch, "tests.distributed.test_zeropp:hpz_probe", "hpz", "planner.stages=[3]",
                         "planner.offload=[none]", "planner.zeropp=[hpz]", "hardware.nodes=2",
                         "training.global_batch_size=4", "training.max_steps=6", "optimizer.lr=1e-3",
                         world=WORLD).check()
    assert check_secondary_partitions(result.output_dir) > 10
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
