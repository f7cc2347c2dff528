"""plan() on synthetic model facts: it is a pure function, so its rules can be tested directly."""

import dataclasses
import json
from pathlib import Path

import pytest

from zerotrain.config import load_config
from zerotrain.errors import ZerotrainError
from zerotrain.hardware import hardware_facts
from zerotrain.planner.facts import ActivationFacts, ModelFacts
from zerotrain.planner.memory import Layout
from zerotrain.planner.search import activations, evaluate, plan, suggest_more_gpus

GiB = 2**30


def facts(params=2 * 10**9, trainable=None, act_gib=8.0, act_gc_gib=1.0, quantize="none", frozen_bytes=0):
    trainable = params if trainable is None else trainable
    return ModelFacts(
        model="synthetic", class_name="FluxTransformer2DModel", family="flux", resolution=1024,
        mode="full" if trainable == params else "lora", quantize=quantize, lora_rank=None,
        total_params=params, trainable_params=trainable, frozen_params=params - trainable,
        frozen_bytes=frozen_bytes, buffer_bytes=0, largest_layer_params=params // 100, block_params={},
        param_numels=[params // 100] * 100, largest_trainable_param=trainable // 100, image_tokens=4096, text_tokens=512, input_bytes=10**6,
        no_checkpointing=ActivationFacts(int(act_gib * GiB), int(act_gib * GiB), int(act_gib * GiB), 6.0 * params * 4608),
        checkpointing=ActivationFacts(int(act_gc_gib * GiB) // 2, int(act_gc_gib * GiB), int(act_gc_gib * GiB),
                                      8.0 * params * 4608),
    )


def run_with(*overrides):
    return load_config(None, list(overrides))


def hw(spec, *extra):
    return hardware_facts(run_with(f"hardware.gpus={spec}", *extra).hardware)


def test_every_candidate_keeps_the_batch_invariant():
    run = run_with("training.global_batch_size=32")
    result = plan(facts(), hw("4xA100-80GB"), run)
    assert result.candidates
    for c in result.candidates:
        assert c.layout.micro_batch * c.layout.accumulation * 4 == 32


def test_global_batch_not_divisible_by_world_is_one_line():
    with pytest.raises(ZerotrainError, match=r"global_batch_size=10 is not divisible by the world size 4"):
        plan(facts(), hw("4xA100-80GB"), run_with("training.global_batch_size=10"))
    with pytest.raises(ZerotrainError, match=r"micro_batch_size=3 does not divide the 4 images per GPU"):
        plan(facts(), hw("2xA100-80GB"), run_with("training.global_batch_size=8", "training.micro_batch_size=3"))


def test_chosen_is_the_fastest_that_fits():
    result = plan(facts(), hw("8xA100-80GB"), run_with())
    fitting = [c for c in result.candidates if c.fits]
    assert result.chosen is fitting[0]
    assert all(result.chosen.images_per_second >= c.images_per_second for c in fitting)
    assert all(c.memory.device_total <= result.gpu_budget_bytes for c in fitting)
    assert all(c.memory.device_total > result.gpu_budget_bytes or c.memory.host_per_node > result.host_budget_bytes
               for c in result.candidates if not c.fits)


def test_small_model_prefers_no_sharding_and_no_checkpointing():
    result = plan(facts(params=10**8, act_gib=2.0), hw("1xA100-80GB"), run_with("training.global_batch_size=4"))
    assert result.chosen.layout.stage in (0, 1, 2)
    assert not result.chosen.layout.gradient_checkpointing
    assert result.chosen.layout.offload_optimizer == "none"


def test_checkpointing_when_activations_do_not_fit():
    result = plan(facts(params=10**8, act_gib=100.0), hw("1xA100-80GB"), run_with("training.global_batch_size=1"))
    assert result.chosen.layout.gradient_checkpointing
    assert any("Gradient checkpointing is needed" in r for r in result.reasons)


def test_sharding_when_model_states_do_not_fit_one_gpu():
    # 12B params full: 2+16 bytes/param replicated is 200 GiB; on 8x80GB only a sharded layout fits
    # (ZeRO-2's 2 + 14/8 bytes per parameter with checkpointing, ZeRO-3 without, or offload).
    result = plan(facts(params=12 * 10**9, act_gib=40, act_gc_gib=2.4), hw("8xA100-80GB"), run_with())
    assert result.chosen.layout.stage > 0
    assert not any(c.fits for c in result.candidates if c.layout.stage == 0)


def test_nothing_fits_says_so_and_more_gpus_would():
    big = facts(params=12 * 10**9, act_gib=40, act_gc_gib=2.4)
    run = run_with("planner.offload=[none]")
    result = plan(big, hw("1xRTX4090-24GB"), run)
    assert result.chosen is None
    assert any(r.startswith("Nothing fits") for r in result.reasons)
    more = suggest_more_gpus(big, dataclasses.replace(hw("8xRTX4090-24GB"), nodes=1), run_with("planner.offload=[none]"))
    assert more and "nodes of 8 GPUs" in more


def test_quantized_base_is_not_sharded_by_zero3():
    q = facts(params=12 * 10**9, trainable=4 * 10**7, quantize="qint8", frozen_bytes=12 * 10**9)
    result = plan(q, hw("8xA100-80GB"), run_with("training.mode=lora", "training.quantize_base=qint8"))
    zero3 = [c for c in result.candidates if c.layout.stage == 3]
    assert all(c.memory.phases["init"] >= 12 * 10**9 for c in zero3)
    assert any("cannot shard the quantized base" in r for r in result.reasons)


def test_nvme_only_with_a_path(tmp_path):
    without = plan(facts(), hw("2xA100-80GB"), run_with("training.global_batch_size=2"))
    assert not any("nvme" in (c.layout.offload_optimizer, c.layout.offload_param) for c in without.candidates)
    with_path = plan(facts(), hw("2xA100-80GB", f"hardware.nvme_path={tmp_path}"),
                     run_with("training.global_batch_size=2", f"hardware.nvme_path={tmp_path}"))
    assert any(c.layout.offload_optimizer == "nvme" for c in with_path.candidates)


def test_host_ram_limits_offload():
    tight = plan(facts(params=12 * 10**9, act_gib=40, act_gc_gib=2.4), hw("1xA100-80GB", "hardware.host_memory=64GiB"),
                 run_with("training.global_batch_size=1", "hardware.host_memory=64GiB"))
    offloaded = [c for c in tight.candidates if c.layout.offload_optimizer == "cpu"]
    assert offloaded and not any(c.fits for c in offloaded)
    assert all("host RAM" in c.rejected for c in offloaded
               if c.memory.device_total + c.margin_bytes <= tight.gpu_budget_bytes)


def test_fixed_micro_batch_and_checkpointing_are_respected():
    result = plan(facts(), hw("2xA100-80GB"), run_with("training.global_batch_size=8", "training.micro_batch_size=2",
                                                      "training.gradient_checkpointing=true"))
    assert {c.layout.micro_batch for c in result.candidates} == {2}
    assert all(c.layout.gradient_checkpointing and c.layout.accumulation == 2 for c in result.candidates)


def test_offload_list_is_what_the_search_may_choose():
    result = plan(facts(), hw("2xA100-80GB"), run_with("training.global_batch_size=2", "planner.offload=[cpu]"))
    assert result.candidates
    assert all(c.layout.offload_optimizer == "cpu" for c in result.candidates)


def test_a_nvme_path_holding_auto_is_a_concrete_value():
    """An automount path (/mnt/auto/nvme0) holds the text "auto": the DeepSpeed config is checked
    value by value, so it plans and writes the path, where a check on the JSON text failed."""
    from zerotrain.planner.deepspeed_json import deepspeed_config

    settings = ("training.global_batch_size=2", "hardware.nvme_path=/mnt/auto/nvme0", "hardware.nvme_space=1TB",
                "planner.offload=[nvme]")
    result = plan(facts(), hw("2xA100-80GB", *settings), run_with(*settings))
    assert result.chosen.layout.offload_optimizer == "nvme"
    config = deepspeed_config(result.chosen.layout, run_with(*settings), 2)
    assert config["zero_optimization"]["offload_optimizer"]["nvme_path"] == "/mnt/auto/nvme0"


def test_nvme_offload_without_a_path_is_one_line():
    from zerotrain.planner.deepspeed_json import deepspeed_config

    settings = ("training.global_batch_size=2", "hardware.nvme_space=1TB", "planner.offload=[nvme]")
    result = plan(facts(), hw("2xA100-80GB", *settings), run_with(*settings))
    with pytest.raises(ZerotrainError, match=r"^hardware.nvme_path is unset, but the layout offloads to NVMe "
                                             r"\(ZeRO-3 opt->nvme.*set hardware.nvme_path to a folder"):
        deepspeed_config(result.chosen.layout, run_with(*settings), 2)


def test_no_layout_to_plan_is_one_line():
    with pytest.raises(ZerotrainError, match=r"^planner.stages=\[0\] with planner.offload=\[cpu\] and "
                                             r"optimizer.name=adamw leave no layout to plan"):
        plan(facts(), hw("1xA100-80GB"), run_with("training.global_batch_size=2", "planner.stages=[0]",
                                                  "planner.offload=[cpu]"))


def test_more_gpus_keeps_a_fixed_micro_batch():
    """A fixed micro-batch of 8 with a global batch of 8: on 2 GPUs 8 images per GPU need a global
    batch of 16, so the suggestion plans that one instead of failing on 4 images per GPU."""
    big = facts(params=12 * 10**9, act_gib=4, act_gc_gib=1)
    settings = ("training.global_batch_size=8", "training.micro_batch_size=8", "planner.offload=[none]")
    assert plan(big, hw("1xA100-80GB"), run_with(*settings)).chosen is None
    more = suggest_more_gpus(big, hw("1xA100-80GB"), run_with(*settings))
    assert more is not None and more.endswith(f"(global batch {8 * int(more.split()[0])})")


def test_activation_offload_true_with_checkpointing_auto_checkpoints_every_block_and_offloads():
    """training.activation_offload=true alone is not ignored: every candidate checkpoints every block
    with its inputs offloaded (there was a no-checkpointing option beside them, which won)."""
    from zerotrain.config import load_config
    from zerotrain.hardware import hardware_facts
    from zerotrain.planner.search import layouts

    run = load_config(None, ["hardware.gpus=1xH100-80GB", "training.activation_offload=true"])
    found = layouts(run, hardware_facts(run.hardware), run.training.global_batch_size)
    assert found and all(l.gradient_checkpointing and l.offload_activations for l in found)


# The first GPU's figures (one H200, 2026-11-28): calibrate's rows of 2-block Flux-dev LoRA at 1024 px,
# and the model facts that run planned with (the tracer's output for that model, copied beside them).
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
H200_ROWS = RESULTS / "h200-2026-11-28-flux-dev-2b-lora.calibration.json"
H200_FACTS = RESULTS / "h200-2026-11-28-flux-dev-2b-lora.facts.json"


def test_regression_guard_h200_flux_dev_2_blocks_lora_step_time_within_1_5x_at_every_stage():
    """A regression guard, not evidence: the planner's step time against the rows its defaults were
    derived from (planner.assumed_mfu, planner.stage3_fetch_latency). With the H200 profile and the
    shipped defaults, every layout's predicted step is within 1.5x of the measured forward, backward
    and optimizer step (it was 13x at ZeRO-3 without the fetch term, and up to 2.3x at ZeRO-0)."""
    data = json.loads(H200_ROWS.read_text())
    model = ModelFacts.from_json(json.loads(H200_FACTS.read_text()))
    device = hw("1xH200-141GB")
    stages = set()
    for row in data["measurements"]:
        layout = Layout(**row["layout"])
        # the facts are those the H200 run planned with
        assert activations(layout, model).flops * layout.micro_batch == row["flops_per_step"]
        run = run_with("training.mode=lora", f"training.global_batch_size={layout.micro_batch}")
        predicted = evaluate(layout, model, device, run).step_seconds
        measured = row["measured"]["forward_backward_s"] + row["measured"]["optimizer_s"]
        assert 1 / 1.5 < measured / predicted < 1.5, (row["config"], predicted, measured)
        stages.add(layout.stage)
    assert stages == {0, 1, 2, 3}


def test_one_gpu_considers_zero3_only_with_its_parameters_offloaded():
    """Issue 50 §3: on one GPU a ZeRO-3 partition is the whole tensor, so ZeRO-3 without parameter offload saves
    nothing over ZeRO 0-2 and only adds fetches: it is no candidate there, unless planner.stages asks for it
    alone. On two GPUs it stays one."""
    def zero3(gpus: str, *overrides: str) -> dict[tuple[str, str], set[str | None]]:
        found: dict[tuple[str, str], set[str | None]] = {}
        for c in plan(facts(), hw(gpus), run_with("hardware.host_memory=1TiB", *overrides)).candidates:
            if c.layout.stage == 3:
                found.setdefault((c.layout.offload_optimizer, c.layout.offload_param), set()).add(
                    c.rejected and c.rejected.split(":")[0])
        return found

    one = zero3("1xA100-80GB")  # still candidates, rejected: calibrate measures them
    for unoffloaded in (("none", "none"), ("cpu", "none")):  # none fits; those that would are rejected for it
        assert None not in one[unoffloaded] and "one GPU" in one[unoffloaded], one
    assert None in one[("cpu", "cpu")]
    assert None in zero3("1xA100-80GB", "planner.stages=[3]")[("none", "none")]
    assert None in zero3("2xA100-80GB")[("none", "none")]
