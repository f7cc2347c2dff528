"""A DeepSpeed config given by the user (`deepspeed: path` or inline): read with one-line errors,
completed as DeepSpeed resolves batch numbers, read back as a Layout, and evaluated by the
planner, with a warning when it is predicted not to fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zerotrain.config import load_config
from zerotrain.errors import ZerotrainError
from zerotrain.planner.deepspeed_json import complete_given, given_config, layout_of

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny-cpu.yaml"


def run_with(*overrides: str, global_batch: int = 8):
    return load_config(TINY, [f"training.global_batch_size={global_batch}", *overrides])


@pytest.mark.parametrize(("given", "expected"), [
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, (8, 2, 2)),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1}, (8, 1, 4)),
    ({"train_batch_size": 8, "gradient_accumulation_steps": 4}, (8, 1, 4)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, (8, 2, 2)),
    ({"train_batch_size": 8}, (8, 2, 2)),
    ({"train_micro_batch_size_per_gpu": 4}, (8, 4, 1)),
    ({}, (8, 2, 2)),  # zerotrain's global batch, the planner's micro-batch (2 here)
    ({"gradient_accumulation_steps": 1}, (8, 4, 1)),
    ({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 4},
     (8, 1, 4)),
])
def test_batch_numbers_are_completed(given, expected):
    config = complete_given(given, "deepspeed=x.json", run_with(), world_size=2, default_micro=2)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == expected


@pytest.mark.parametrize(("given", "message"), [
    ({"train_batch_size": 16}, ("16 images per step (micro 1 x accumulation 8 x 2 processes), but "
                                "training.global_batch_size is 8; make them agree")),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 3},
     "train_batch_size=8 is not train_micro_batch_size_per_gpu=3"),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1},
     "is not train_micro_batch_size_per_gpu=2 x gradient_accumulation_steps=1 x 2 processes"),
    ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu must be a positive integer, got 0"),
])
def test_inconsistent_batch_numbers_are_one_line_errors(given, message):
    with pytest.raises(ZerotrainError, match="^deepspeed=x.json: ") as err:
        complete_given(given, "deepspeed=x.json", run_with(), world_size=2, default_micro=1)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("value", [False, 0, "false", "off"])
def test_a_given_config_without_the_bf16_overflow_check_is_refused(value):
    """zerotrain skips a step with non-finite gradients through DeepSpeed's bf16 overflow check
    (tests/distributed/test_bad_gradients.py shows a step applied without it). DeepSpeed reads
    0, "false" and "off" as false too."""
    given = {"train_batch_size": 8, "bf16": {"enabled": True, "check_grad_overflow": value}}
    with pytest.raises(ZerotrainError) as err:
        complete_given(given, "deepspeed=x.json", run_with(), world_size=2, default_micro=1)
    assert str(err.value) == ("deepspeed=x.json: bf16.check_grad_overflow is false, so a NaN or inf gradient would "
                              "be applied to the weights; zerotrain skips such steps through it: remove the setting")


@pytest.mark.parametrize("bf16", [{"enabled": True, "check_grad_overflow": True}, {"enabled": True}])
def test_a_given_config_with_the_bf16_overflow_check_is_kept(bf16):
    config = complete_given({"train_batch_size": 8, "bf16": bf16}, "x", run_with(), world_size=2, default_micro=1)
    assert config["bf16"] == bf16


def test_missing_sections_are_filled_and_given_ones_kept():
    given = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 5e-5}},
             "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    config = complete_given(given, "x", run_with("optimizer.lr=2e-4", "optimizer.grad_clip=0.5"), 2, 1)
    assert config["optimizer"] == given["optimizer"] and config["zero_optimization"] == given["zero_optimization"]
    assert config["gradient_clipping"] == 0.5 and config["bf16"] == {"enabled": True}
    assert complete_given({}, "x", run_with("optimizer.lr=2e-4"), 2, 1)["optimizer"]["params"]["lr"] == 2e-4


def test_layout_of_reads_stage_offload_and_batch():
    config = complete_given({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                   "offload_param": {"device": "nvme"}}}, "x", run_with(), 2, 2)
    layout = layout_of(config, gradient_checkpointing=True)
    assert (layout.stage, layout.offload_optimizer, layout.offload_param, layout.gradient_checkpointing,
            layout.micro_batch, layout.accumulation) == (3, "cpu", "nvme", True, 2, 2)
    assert layout_of(complete_given({}, "x", run_with(), 2, 2), False).stage == 0


def test_the_optimizer_of_a_config_is_read_back_and_a_client_one_filled_in():
    """DeepSpeed's own AdamW has an "optimizer" section (bf16 master flags: adamw-bf16); a client
    optimizer (adamw-8bit, adafactor) has none, zero_allow_untested_optimizer, and its name and
    settings under "_zerotrain", which DeepSpeed's own config class accepts."""
    from zerotrain.planner.deepspeed_json import deepspeed_config, validate
    from zerotrain.planner.memory import Layout

    run = run_with("optimizer.lr=3e-4")
    for name in ("adamw", "adamw-bf16", "adamw-8bit", "adafactor"):
        config = deepspeed_config(Layout(2, micro_batch=1, accumulation=8, optimizer=name), run, 1)
        validate(config)
        assert layout_of(config, False).optimizer == name
        assert ("optimizer" in config) == (name in ("adamw", "adamw-bf16"))
        if name in ("adamw-8bit", "adafactor"):
            assert config["zero_allow_untested_optimizer"] is True
            assert config["_zerotrain"]["optimizer"]["name"] == name
            assert config["_zerotrain"]["optimizer"]["params"]["lr"] == 3e-4
    given = complete_given({"zero_optimization": {"stage": 3}}, "x", run_with("optimizer.name=adamw-8bit"), 2, 1)
    assert "optimizer" not in given and layout_of(given, True).optimizer == "adamw-8bit"
    assert given["bf16"]["bf16_master_weights_and_grads"] is True
    with pytest.raises(ZerotrainError, match="x has an optimizer section, and optimizer.name=adafactor asks for"):
        complete_given({"optimizer": {"type": "Adam"}}, "x", run_with("optimizer.name=adafactor"), 2, 1)


def test_given_config_reads_files_inline_and_auto(tmp_path):
    assert given_config(run_with()) is None
    inline = given_config(run_with('deepspeed={"zero_optimization": {"stage": 2}}'))
    assert inline == ({"zero_optimization": {"stage": 2}}, "deepspeed (inline)")
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8}')
    assert given_config(run_with(f"deepspeed={path}")) == ({"train_batch_size": 8}, f"deepspeed={path}")


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file; give the path of a DeepSpeed JSON config, or auto"),
    ('{"stage": 2,}', "not valid JSON (line 1, column 13"),
    ("[1, 2]", "a DeepSpeed config is a JSON object, this file holds a list"),
])
def test_bad_given_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "ds.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ZerotrainError, match=f"^deepspeed={path}: ") as err:
        given_config(run_with(f"deepspeed={path}"))
    assert message in str(err.value)


@pytest.mark.parametrize(("gpu_memory", "warns"), [("40MiB", True), ("64GiB", False)])
def test_a_given_config_predicted_not_to_fit_warns(tmp_path, gpu_memory, warns):
    from zerotrain.distributed import Topology
    from zerotrain.models.catalog import resolve_model
    from zerotrain.train import plan_run

    given = {"zero_optimization": {"stage": 0}, "train_micro_batch_size_per_gpu": 1}
    run = run_with(f"deepspeed={json.dumps(given)}", f"hardware.gpu_memory={gpu_memory}",
                   f"planner.cache_dir={tmp_path}", global_batch=2)
    planned = plan_run(run, resolve_model(run.model), Topology(0, 1, 0))
    config, result, layout = planned.config, planned.result, planned.layout
    assert (layout.stage, layout.micro_batch, layout.accumulation) == (0, 1, 2)
    assert config["gradient_accumulation_steps"] == 2 and result.given.layout == layout
    assert result.to_json()["given"]["fits"] is not warns
    if warns:
        assert planned.notes[0].startswith("deepspeed (inline) is predicted not to fit: ZeRO-0")
        assert "training with it as given" in planned.notes[0]
    else:
        assert not planned.notes and not layout.gradient_checkpointing  # fits without recomputation


def test_a_written_configs_header_applies_unless_the_run_config_says_otherwise(tmp_path):
    """--write-config records the plan's checkpointing in "_zerotrain": a run given the file trains
    with it; a training field the run config sets itself wins, with one line saying so."""
    from zerotrain.distributed import Topology
    from zerotrain.models.catalog import resolve_model
    from zerotrain.train import plan_run

    given = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 1,
             "_zerotrain": {"training": {"gradient_checkpointing": True, "checkpoint_blocks": 1}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(given))
    run = run_with(f"deepspeed={path}", f"planner.cache_dir={tmp_path}", global_batch=2)
    planned = plan_run(run, resolve_model(run.model), Topology(0, 1, 0))
    assert planned.run.training.checkpoint_blocks == 1 and planned.run.training.gradient_checkpointing is True
    assert planned.layout.gradient_checkpointing and planned.layout.checkpointed_blocks == 1
    assert planned.notes == []
    run = run_with(f"deepspeed={path}", f"planner.cache_dir={tmp_path}", "training.gradient_checkpointing=false",
                   global_batch=2)
    planned = plan_run(run, resolve_model(run.model), Topology(0, 1, 0))
    assert not planned.layout.gradient_checkpointing
    assert planned.notes == [(f"deepspeed={path} was written for training.gradient_checkpointing=True; the run "
                             "config's training.gradient_checkpointing=False is used")]
