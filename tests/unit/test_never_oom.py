"""The planner's side of "never out of memory": the activation margin until a calibration measures
it (planner.activation_margin), the rungs a run climbs after running out of memory anyway
(planner/ladder.py), the margin `zerotrain calibrate` fits, and the memory line's warning."""

from __future__ import annotations

import json

import pytest
import torch

from zerotrain.config import ModelConfig, RunConfig, load_config
from zerotrain.distributed import Topology
from zerotrain.hardware import hardware_facts
from zerotrain.models.catalog import resolve_model
from zerotrain.monitor import Monitor
from zerotrain.planner import calibration, ladder
from zerotrain.planner.measure import measure_model
from zerotrain.planner.memory import Layout, MemoryEstimate
from zerotrain.planner.search import plan

GiB = 2**30


def qwen_lora(tmp_path, *overrides: str) -> tuple[RunConfig, object, object]:
    """Qwen-Image LoRA at 1024 px, global batch 1, on one H100 (the shipped facts: no tracing)."""
    run = load_config(None, ["model.name_or_path=qwen-image", "data.resolution=1024", "training.mode=lora",
                             "training.global_batch_size=1", "hardware.gpus=1xH100-80GB",
                             f"planner.cache_dir={tmp_path}", *overrides])
    facts = measure_model(resolve_model(ModelConfig(name_or_path="qwen-image")), run)
    return run, facts, hardware_facts(run.hardware)


def test_uncheckpointed_activations_leave_a_margin_until_measured(tmp_path):
    # 73.4 GiB per GPU without checkpointing (with the measured 1.07 GiB of NCCL workspace): 7% headroom
    # leaves 74.0 GiB, so that the trace alone fits it
    run, facts, hw = qwen_lora(tmp_path, "planner.headroom=0.07")
    trusting = plan(facts, hw, run.model_copy(update={"planner": run.planner.model_copy(
        update={"activation_margin": 0.0})}))
    assert not trusting.chosen.layout.gradient_checkpointing, "without a margin the trace alone decides"
    result = plan(facts, hw, run)
    chosen = result.chosen
    assert chosen.layout.gradient_checkpointing and 0 < chosen.layout.checkpointed_blocks < facts.checkpoint_blocks
    assert chosen.memory.device_total + chosen.margin_bytes <= result.gpu_budget_bytes < \
        chosen.memory.device_total + 2 * chosen.margin_bytes, "the fewest blocks that leave the margin free"
    plain = next(c for c in result.candidates if c.layout == trusting.chosen.layout)
    assert not plain.fits and "activation margin >" in plain.rejected
    assert plain.margin_bytes == pytest.approx(0.43 * (facts.no_checkpointing.peak_bytes
                                                       - facts.checkpointing.peak_bytes), abs=1)
    every = [c for c in result.candidates if c.layout.gradient_checkpointing and c.layout.checkpointed_blocks is None]
    assert every and all(c.margin_bytes == 0 for c in every), "checkpointed activations matched measured peaks"
    assert any("traced, not yet measured on this GPU" in line and "planner.activation_margin" in line
               for line in result.reasons)


def test_a_calibrated_margin_replaces_the_default(tmp_path):
    """In the calibration's lane (Qwen-Image LoRA at 1024 px; tests/unit/test_calibration.py: not outside it)."""
    path = tmp_path / "cal.json"
    lane = {"family": "qwen_image", "mode": "lora", "checkpointing": "auto", "resolution": 1024}
    path.write_text(json.dumps({"version": 1, "device": "NVIDIA H100 80GB HBM3", "profile": "H100-80GB",
                                "date": "2026-11-26", "lane": lane, "constants": {"activation_margin": 0.04},
                                "defaults": [], "measurements": []}))
    run, facts, hw = qwen_lora(tmp_path, f"planner.calibration={path}")
    calibrated, hw, note, measured_on = calibration.apply(run, hw, "qwen_image")
    assert "activation_margin" in note
    assert calibrated.planner.activation_margin == 0.04 and measured_on.startswith("NVIDIA H100 80GB HBM3 for ")
    result = plan(facts, hw, calibrated, measured_on)
    assert any(line.startswith("Activation margin 4% of the activations of uncheckpointed blocks, measured on "
                               "NVIDIA H100 80GB HBM3 for qwen_image lora at 1024 px") for line in result.reasons)
    _, _, _, none = calibration.apply(run.model_copy(update={"planner": run.planner.model_copy(
        update={"activation_margin": 0.2})}), hw, "qwen_image")
    assert none is None, "a margin the config sets itself is not the calibration's"


def test_the_rungs_halve_the_uncheckpointed_blocks_then_offload(tmp_path):
    run, facts, hw = qwen_lora(tmp_path)
    n = facts.checkpoint_blocks
    used = Layout(2, "none", "none", gradient_checkpointing=False, micro_batch=1, accumulation=1)
    more, offload = ladder.left_to_planner(run)
    assert more and offload
    rungs = ladder.rungs(used, facts, hw, run, offload)
    counts = [ladder.checkpointed_count(c.layout, facts) for c in rungs]
    assert counts[0] == (n + 1) // 2 and counts[-2] == n and counts == sorted(counts)
    assert all(b - a >= 1 and n - b <= (n - a) // 2 + 1 for a, b in zip([0, *counts], counts[:-1]))
    assert rungs[-1].layout.offload_activations and rungs[-2].layout.checkpointed_blocks is None
    totals = [c.memory.device_total for c in rungs]
    assert totals == sorted(totals, reverse=True), "every rung needs less GPU memory"
    assert all((c.layout.stage, c.layout.micro_batch, c.layout.offload_optimizer) == (2, 1, "none") for c in rungs)
    assert ladder.config_fields(rungs[0].layout, facts) == {"checkpoint_blocks": counts[0]}
    assert ladder.config_fields(rungs[-1].layout, facts) == {"activation_offload": True}
    small_host = run.model_copy(update={"hardware": run.hardware.model_copy(update={"host_memory": "40GiB"})})
    assert not any(c.layout.offload_activations for c in
                   ladder.rungs(used, facts, hardware_facts(small_host.hardware), small_host, offload)), \
        "activation offload only where host RAM allows it"


def test_a_fixed_checkpointing_leaves_no_rung_and_a_resume_keeps_the_last_move(tmp_path):
    for fixed in ("training.gradient_checkpointing=false", "training.checkpoint_blocks=4"):
        assert ladder.left_to_planner(load_config(None, [fixed]))[0] is False
    assert ladder.left_to_planner(load_config(None, ["training.activation_offload=false"])) == (True, False)
    moves = [{"step": 2, "to": "ZeRO-2, checkpointing 30 blocks", "training": {"checkpoint_blocks": 30}},
             {"step": 3, "to": "ZeRO-2, checkpointing 45 blocks", "training": {"checkpoint_blocks": 45}}]
    kept, line = ladder.keep_adjustment(load_config(None, []), moves)
    assert kept.training.checkpoint_blocks == 45 and "at step 3" in line and "training.checkpoint_blocks=45" in line
    unchanged, none = ladder.keep_adjustment(load_config(None, ["training.gradient_checkpointing=false"]), moves)
    assert unchanged.training.checkpoint_blocks is None and none is None


def test_calibrate_fits_the_margin_from_measured_peaks_and_out_of_memory_rows():
    from zerotrain.calibrate import MARGIN_SLACK, fit_margin

    hw = hardware_facts(load_config(None, ["hardware.gpus=1xH100-80GB"]).hardware)

    def row(status, allocated, predicted, basis, total=0):
        return {"status": status, "measured": {"allocated": allocated} if status == "ok" else None,
                "predicted": {"allocated": predicted, "device_total": total, "uncheckpointed_bytes": basis}}

    rows = [row("ok", 30 * GiB, 28 * GiB, 10 * GiB), row("ok", 20 * GiB, 20 * GiB, 0)]
    assert fit_margin(rows, hw) == pytest.approx(0.2 + MARGIN_SLACK)
    rows.append(row("oom: CUDA out of memory", None, 0, 20 * GiB, total=hw.gpu_memory_bytes - 8 * GiB))
    assert fit_margin(rows, hw) == pytest.approx(0.4 + MARGIN_SLACK), "a measured 'does not fit' bounds it below"
    assert fit_margin([row("ok", 10 * GiB, 11 * GiB, 10 * GiB)], hw) == pytest.approx(MARGIN_SLACK)
    assert fit_margin([row("ok", 10 * GiB, 9 * GiB, 0)], hw) is None, "only uncheckpointed layouts measure it"


PREDICTED = MemoryEstimate(phases={"backward": 10 * GiB}, terms={"activations": 6 * GiB}, peak_phase="backward",
                           allocated=10 * GiB, reserved=11 * GiB, device_total=12 * GiB, host_per_node=0,
                           nvme_per_node=0)


@pytest.mark.parametrize(("measured", "margin", "warns"), [(10.4, 0, False), (10.6, 0, True),
                                                           (11.5, 2 * GiB, False), (12.5, 2 * GiB, True)])
def test_the_memory_line_warns_beyond_the_margin(tmp_path, monkeypatch, measured, margin, warns):
    import zerotrain.monitor as monitor_module

    # The measurement a GPU would give (this machine has none): the line's rule is what is tested.
    monkeypatch.setattr(monitor_module, "measured_peaks", lambda device: {
        "max_allocated": int(measured * GiB), "max_reserved": int(measured * GiB) + GiB})
    lines: list[str] = []
    monitor = Monitor(tmp_path, Topology(0, 1, 0), torch.device("cpu"), max_steps=4, start_step=0, images_per_step=1,
                      predicted=PREDICTED, layout_text="ZeRO-2", flops_per_image=1e12, peak_flops_per_gpu=None,
                      tensorboard=False, progress_bar="never", memory_check_step=1, margin_bytes=margin,
                      print_fn=lines.append)
    line = monitor.memory_check(1)
    monitor.close()
    assert ("warning: more than the" in line and "run zerotrain calibrate" in line) is warns, line
