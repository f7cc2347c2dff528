"""Issue 41: LoKr and LoHa on linear layers without their full delta weight (zerotrain.adapter_forward).
The factored forward's outputs and gradients (input and every adapter parameter) are peft's own, for
LoKr with full and decomposed w1 and w2, factor set and default, and LoHa; peft's delta is not built
where the factored product applies, and peft's forward stays where it does not (rank_dropout while
training, another peft version); the modules, parameters and state dicts are peft's."""

from __future__ import annotations

import copy

import pytest
import torch

from zerotrain import adapter_forward

BATCH, TOKENS = 2, 5


class Two(torch.nn.Module):
    """Two linear layers of unlike widths (96 -> 160 -> 72), both adapted."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(96, 160)
        self.down = torch.nn.Linear(160, 72)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def adapted(config):
    """peft's model and the same with the factored forward, equal weights (every adapter parameter
    random, so no factor is the zero peft starts one at)."""
    from peft import inject_adapter_in_model

    torch.manual_seed(0)
    model = inject_adapter_in_model(config, Two(), adapter_name="default")
    for name, param in model.named_parameters():
        param.requires_grad_(any(p in name for p in ("lokr_", "hada_")))
        if param.requires_grad:
            param.data.normal_(std=0.3)
    fast = copy.deepcopy(model)
    assert adapter_forward.install(fast) == 2
    return model, fast


def outputs_and_grads(model, x):
    x = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    out = model(x)
    (out * torch.linspace(-1, 1, out.shape[-1])).square().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return out.detach(), x.grad, grads


def assert_equal_to_peft(model, fast, x):
    out, x_grad, grads = outputs_and_grads(model, x)
    fast_out, fast_x_grad, fast_grads = outputs_and_grads(fast, x)
    torch.testing.assert_close(fast_out, out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast_x_grad, x_grad, rtol=1e-5, atol=1e-5)
    assert fast_grads.keys() == grads.keys() and grads
    for name in grads:
        torch.testing.assert_close(fast_grads[name], grads[name], rtol=1e-4, atol=1e-5, msg=name)


def no_delta_weight(fast):
    """Make building a full delta an error on every adapted layer of `fast`."""
    def refuse(*args, **kwargs):
        raise AssertionError("the factored forward built a full delta weight")

    for module in fast.modules():
        if hasattr(module, "get_delta_weight"):
            module.get_delta_weight = refuse


LOKR_CASES = {
    # factor -1, r 16: w1 and w2 whole, (10 x 8) and (16 x 12) for 96 -> 160, (8 x 10) and (9 x 16) for
    # 160 -> 72; both apply W2 first
    "full-factors": {"r": 16},
    # r 1 and decompose_both: w1 = w1_a w1_b and w2 = w2_a w2_b
    "decomposed": {"r": 1, "decompose_both": True},
    # factor 4: w1 (4 x 4), w2 = w2_a w2_b (40 x 24) and (18 x 40) at r 2; the first applies W1 first
    "factor-4": {"r": 2, "decompose_factor": 4, "alpha": 5},
}


@pytest.mark.parametrize("case", list(LOKR_CASES))
def test_factored_lokr_equals_peft(case):
    from peft import LoKrConfig

    settings = {"alpha": 3, **LOKR_CASES[case]}
    model, fast = adapted(LoKrConfig(target_modules=["up", "down"], **settings))
    names = {n.split(".")[1] for n, p in fast.named_parameters() if p.requires_grad}
    expected = {"full-factors": {"lokr_w1", "lokr_w2"}, "decomposed": {"lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b"},
                "factor-4": {"lokr_w1", "lokr_w2_a", "lokr_w2_b"}}[case]
    assert names == expected
    no_delta_weight(fast)
    torch.manual_seed(1)
    assert_equal_to_peft(model, fast, torch.randn(BATCH, TOKENS, 96))
    fast.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(fast(torch.ones(96)), model(torch.ones(96)), rtol=1e-5, atol=1e-5)  # one token


def test_factored_loha_equals_peft():
    from peft import LoHaConfig

    model, fast = adapted(LoHaConfig(target_modules=["up", "down"], r=3, alpha=7))
    no_delta_weight(fast)
    torch.manual_seed(1)
    assert_equal_to_peft(model, fast, torch.randn(BATCH, TOKENS, 96))


def test_loha_of_a_rank_whose_square_outgrows_the_layer_builds_peft_delta():
    """r = 16 on these narrow layers: the rank-256 factors multiply more than the delta, so peft's stays."""
    from peft import LoHaConfig

    model, fast = adapted(LoHaConfig(target_modules=["up", "down"], r=16, alpha=4))
    calls = []
    for module in fast.modules():
        if hasattr(module, "get_delta_weight"):
            module.get_delta_weight = lambda *a, _own=module.get_delta_weight, **k: calls.append(1) or _own(*a, **k)
    assert_equal_to_peft(model, fast, torch.randn(BATCH, TOKENS, 96))
    assert len(calls) == 2


def test_rank_dropout_while_training_keeps_peft_forward():
    """rank_dropout masks rows of peft's delta at random: peft's own forward runs, the same draws."""
    from peft import LoKrConfig

    model, fast = adapted(LoKrConfig(target_modules=["up", "down"], r=2, rank_dropout=0.5))
    x = torch.randn(BATCH, TOKENS, 96)
    torch.manual_seed(2)
    expected = model(x)
    torch.manual_seed(2)
    torch.testing.assert_close(fast(x), expected)


def test_modules_names_and_state_dicts_stay_peft():
    """What the exports, init_from and ZeRO-3 read: the same classes, parameter names and values."""
    from peft import LoKrConfig, get_peft_model_state_dict

    model, fast = adapted(LoKrConfig(target_modules=["up", "down"], r=1, decompose_both=True))
    assert [type(m) for m in fast.modules()] == [type(m) for m in model.modules()]
    state, fast_state = model.state_dict(), fast.state_dict()
    assert list(fast_state) == list(state) and all(torch.equal(fast_state[k], state[k]) for k in state)
    adapter, fast_adapter = get_peft_model_state_dict(model), get_peft_model_state_dict(fast)
    assert list(fast_adapter) == list(adapter) and all(torch.equal(fast_adapter[k], adapter[k]) for k in adapter)


def test_another_peft_version_keeps_peft_forward(capsys):
    from peft import LoKrConfig, inject_adapter_in_model

    model = inject_adapter_in_model(LoKrConfig(target_modules=["up", "down"], r=2), Two(), adapter_name="default")
    assert adapter_forward.install(model, version="0.99.0") == 0
    assert "_get_delta_activations" not in vars(model.up)
    assert "peft 0.99.0 is not a version zerotrain's factored LoKr and LoHa forward was checked" in capsys.readouterr().err
    assert adapter_forward.gate() == ""  # the installed peft is the tested one
