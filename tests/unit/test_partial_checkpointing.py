"""Partial checkpointing as the engine applies it (engine.apply_mode with Plan.checkpointed's list of
block names): in a real CPU forward and backward, exactly the named blocks run their forward a
second time (their recomputation in backward), and every other block runs it once. Counted by
forward pre-hooks on every module inside each checkpoint unit (recompute.checkpoint_units), so it
holds whether the family checkpoints the block itself (Flux, through diffusers'
enable_gradient_checkpointing), its own wrapped forward (Chroma) or the resnets and attentions
inside it (a UNet's down, mid and up blocks)."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.unit.test_facts import cpu_inputs, real_model, spec_of
from zerotrain import recompute
from zerotrain.config import load_config
from zerotrain.engine import apply_mode
from zerotrain.families import of

MODELS = [
    ("tiny-flux", {"num_layers": 2, "num_single_layers": 3}),
    ("tiny-chroma", {"num_layers": 2, "num_single_layers": 2}),
    ("tiny-sdxl", {}),
]


def forward_runs(name: str, depth: dict, checkpointing: bool | list[str]) -> tuple[dict[str, int], dict[str, int], list[str]]:
    """Forward calls of the modules inside each checkpoint unit, in the forward and in the backward
    (the recomputation), under apply_mode's checkpointing; and apply_mode's log."""
    spec = spec_of(name, **depth)
    model = real_model(spec)
    run = load_config(None, [f"model.name_or_path={name}", "training.mode=full"])
    done = apply_mode(model, spec, run, checkpointing)
    units = recompute.checkpoint_units(model)
    calls: Counter[str] = Counter()
    for unit_name, unit in units.items():
        for module in unit.modules():
            module.register_forward_pre_hook(lambda m, args, unit_name=unit_name: calls.update([unit_name]))
    prediction = of(spec).prediction(model(**cpu_inputs(spec), return_dict=False)[0])
    forward = {unit_name: calls[unit_name] for unit_name in units}
    prediction.float().square().mean().backward()
    return forward, {unit_name: calls[unit_name] - forward[unit_name] for unit_name in units}, done


@pytest.mark.parametrize(("name", "depth"), MODELS, ids=[name for name, _ in MODELS])
def test_exactly_the_named_blocks_recompute(name, depth):
    units = list(recompute.checkpoint_units(real_model(spec_of(name, **depth))))
    assert len(units) >= 4, units
    named = units[1::2]  # every other unit: some of each block list (Plan.checkpointed gives any subset)
    forward, backward, done = forward_runs(name, depth, named)
    assert all(forward.values()), forward
    assert {unit for unit, runs in backward.items() if runs} == set(named), backward
    # Each named block runs again once: all of it in a DiT (but the block's own call where the family
    # checkpoints its wrapped forward: Chroma); in a UNet block its resnets and attentions
    # (diffusers checkpoints those, not the down- and upsamplers).
    least = {"tiny-flux": 0, "tiny-chroma": 1}.get(name)
    assert all(forward[unit] - least <= backward[unit] <= forward[unit] if least is not None
               else 0 < backward[unit] < forward[unit] for unit in named), (forward, backward)
    assert done[-1].endswith(f"gradient checkpointing of {len(named)} blocks ({', '.join(named[:3])}"
                             f"{', ...' if len(named) > 3 else ''})"), done


@pytest.mark.parametrize(("name", "depth"), MODELS[:1], ids=[MODELS[0][0]])
@pytest.mark.parametrize("checkpointing", [True, False, []], ids=["every", "false", "none"])
def test_every_block_or_none_recomputes(name, depth, checkpointing):
    forward, backward, _ = forward_runs(name, depth, checkpointing)
    assert backward == (forward if checkpointing else dict.fromkeys(forward, 0)), (forward, backward)
