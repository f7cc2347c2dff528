"""zerotrain.optimizers is the registry of optimizer.name: the config takes its names, the planner
its bytes, doctor its checkpoint size, and no other module compares an optimizer's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from zerotrain import optimizers
from zerotrain.config import load_config
from zerotrain.errors import ZerotrainError

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("name", "training", "checkpoint"), [
    ("adamw", 16, 14),  # bf16 weights and gradients, fp32 master, two fp32 moments
    ("adamw-bf16", 10, 8),  # the master and moments in bf16
    ("adafactor", 10, 8),  # a bf16 master, one fp32 second moment
])
def test_bytes_per_parameter(name, training, checkpoint):
    kind = optimizers.get(name)
    assert kind.training_bytes_per_param() == training
    assert kind.checkpoint_bytes_per_param() == checkpoint


def test_8bit_moments_cost_a_byte_each_and_absmax_above_the_threshold():
    kind = optimizers.get("adamw-8bit")
    assert kind.state_bytes(4095) == 8 * 4095  # below min_8bit_size: fp32 moments
    assert kind.state_bytes(2**20) == 2 * (2**20 + 4 * 2**20 // 256 + 256 * 4)
    assert 8 < kind.training_bytes_per_param() < 8.1


def test_the_config_takes_the_registrys_names():
    assert load_config(None, ["optimizer.name=adamw-8bit"]).optimizer.name == "adamw-8bit"
    assert load_config(None, []).planner.optimizers == list(optimizers.OPTIMIZERS)
    with pytest.raises(ZerotrainError, match="optimizer.name"):
        load_config(None, ["optimizer.name=sgd"])


def test_client_optimizers_are_those_zerotrain_builds():
    assert optimizers.CLIENT_OPTIMIZERS == ("adamw-8bit", "adafactor")
    assert optimizers.deepspeed_adamw(bf16_masters=True) == "adamw-bf16"
    assert optimizers.deepspeed_adamw(bf16_masters=False) == "adamw"


def name_comparisons(root: Path, names: set[str]) -> list[str]:
    """Comparisons (==, !=, in) of a value with an optimizer's name, outside optimizers.py."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "optimizers.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            constants = [c.value for o in operands for c in ast.walk(o) if isinstance(c, ast.Constant)]
            if any(isinstance(c, str) and c in names for c in constants):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_no_other_module_compares_optimizer_names():
    offenders = name_comparisons(REPO / "zerotrain", set(optimizers.OPTIMIZERS))
    assert not offenders, offenders


def test_the_name_check_sees_a_comparison(tmp_path):
    (tmp_path / "memory.py").write_text("def f(layout):\n    return layout.optimizer in ('adamw-8bit', 'x')\n")
    assert name_comparisons(tmp_path, set(optimizers.OPTIMIZERS)) == ["memory.py:2"]


def test_adafactor_resumes_its_fp32_state_over_bf16_masters_bit_for_bit():
    """torch's Optimizer.load_state_dict casts floating state to the parameter's dtype: a resumed Adafactor over
    bf16 masters got a bf16 second moment and left the uninterrupted run from its first step. zerotrain's keeps
    the saved dtypes, so the next steps are the uninterrupted ones exactly."""
    import torch

    from zerotrain.config import RunConfig

    settings = optimizers.client_settings("adafactor", RunConfig(optimizer={"name": "adafactor", "lr": 1e-2}))
    grads = [torch.randn(64, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(4)]

    def stepped(optimizer, param, steps):
        for grad in steps:
            param.grad = grad.clone()
            optimizer.step()

    param = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(9)).bfloat16())
    straight = optimizers.build(settings, [param])
    stepped(straight, param, grads[:2])
    saved, resumed_param = straight.state_dict(), torch.nn.Parameter(param.detach().clone())
    resumed = optimizers.build(settings, [resumed_param])
    resumed.load_state_dict(saved)
    assert optimizers.name_of(resumed) == "adafactor"  # zerotrain_state.json's name, which a resume checks
    assert {k: v.dtype for k, v in resumed.state[resumed_param].items() if torch.is_tensor(v)} == {
        "exp_avg_sq": torch.float32, "RMS": torch.float32}
    stepped(straight, param, grads[2:])
    stepped(resumed, resumed_param, grads[2:])
    assert torch.equal(param, resumed_param)
    assert torch.equal(straight.state[param]["exp_avg_sq"], resumed.state[resumed_param]["exp_avg_sq"])
