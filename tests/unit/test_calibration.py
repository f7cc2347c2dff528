"""Calibrations (zerotrain/planner/calibration.py) applied to plans, and the pieces of `zerotrain
calibrate` that need no engine: the grid around the plan's choice and the reduced-depth model."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from zerotrain import families
from zerotrain.calibrate import grid
from zerotrain.config import RunConfig, load_config
from zerotrain.errors import ZerotrainError
from zerotrain.families.base import share_blocks
from zerotrain.hardware import hardware_facts
from zerotrain.models.tiny import TINY_NAMES
from zerotrain.planner import calibration
from zerotrain.planner.facts import ModelFacts


def write(path, constants, device="NVIDIA H100 80GB HBM3", lane=None, **fields):
    """A calibration document as calibrate writes it; without `lane`, one older than lanes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lane = {"lane": lane} if lane else {}
    path.write_text(json.dumps({"version": 1, "device": device, "profile": "H100-80GB", "date": "2026-11-24",
                                **lane, **fields, "constants": constants, "defaults": [], "measurements": []}))
    return path


# The lane of a plan of flux-dev with the default run config (a full fine-tune at 1024 px).
FLUX_FULL = {"family": "flux", "mode": "full", "checkpointing": "auto", "resolution": 1024}


def test_a_calibration_replaces_the_defaults_the_config_leaves_unset(tmp_path):
    path = write(tmp_path / "cal.json", {"fragmentation": 0.03, "cuda_context_bytes": 500 * 2**20,
                                         "assumed_mfu": {"flux": 0.31, "sd3": 0.2}, "host_to_device_bandwidth": 2.1e10},
                 lane=FLUX_FULL)
    run = load_config(None, ["hardware.gpus=1xH100-80GB", f"planner.calibration={path}", "planner.fragmentation=0.2"])
    hw = hardware_facts(run.hardware)
    calibrated, hw2, note, _ = calibration.apply(run, hw, "flux")
    assert calibrated.planner.fragmentation == 0.2  # the config's own value wins
    assert calibrated.planner.cuda_context_bytes == 500 * 2**20 and calibrated.planner.assumed_mfu == 0.31
    assert hw2.host_to_device_bandwidth == 2.1e10
    assert note.startswith("Calibrated on NVIDIA H100 80GB HBM3, 2026-11-24") and "fragmentation" not in note


def test_the_default_calibration_is_the_planned_gpu_profiles(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    write(calibration.default_path("H100-80GB"), {"cpu_adam_params_per_second": 3e9})
    for gpus, expected in (("1xH100-80GB", 3e9), ("1xA100-80GB", 2e9)):
        run = load_config(None, [f"hardware.gpus={gpus}"])
        calibrated, _, note, _ = calibration.apply(run, hardware_facts(run.hardware), "flux")
        assert calibrated.planner.cpu_adam_params_per_second == expected
        assert (note is not None) == (expected == 3e9)


def test_a_calibration_cut_off_never_replaces_the_complete_one_plans_read(tmp_path, monkeypatch):
    """calibrate writes the layouts measured so far beside the calibration (.partial.json) and only the
    complete document in its place: a run stopped halfway leaves the GPU profile's calibration as it was.
    A plan given the partial file says that it is one."""
    from zerotrain.calibrate import partial_path, write_progress

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    out = write(calibration.default_path("H100-80GB"), {"cpu_adam_params_per_second": 3e9})
    good = out.read_text()
    document = {**json.loads(good), "constants": {"cpu_adam_params_per_second": 1e9}, "complete": False,
                "measurements": [{"config": "ZeRO-0"}]}
    write_progress(out, document)
    assert out.read_text() == good and json.loads(partial_path(out).read_text()) == document
    run = load_config(None, ["hardware.gpus=1xH100-80GB"])
    assert calibration.apply(run, hardware_facts(run.hardware), "flux")[0].planner.cpu_adam_params_per_second == 3e9
    given = load_config(None, ["hardware.gpus=1xH100-80GB", f"planner.calibration={partial_path(out)}"])
    _, _, note, _ = calibration.apply(given, hardware_facts(given.hardware), "flux")
    assert "a run cut off after 1 layouts" in note
    write_progress(out, {**document, "complete": True})
    assert json.loads(out.read_text())["complete"] and not partial_path(out).exists()


def test_a_broken_calibration_is_one_line_naming_the_field(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text("{not json")
    run = load_config(None, [f"planner.calibration={path}", "hardware.gpus=1xH100-80GB"])
    with pytest.raises(ZerotrainError, match=r"planner.calibration=.*cal.json: cannot read it"):
        calibration.apply(run, hardware_facts(run.hardware), "flux")
    path.write_text(json.dumps({"version": 99}))
    with pytest.raises(ZerotrainError, match="run zerotrain calibrate again"):
        calibration.apply(run, hardware_facts(run.hardware), "flux")


# A 2-block Flux LoRA measured at 1024 px: its workload constants (activation_margin, fragmentation, the
# family's MFU), and constants of the GPU and its host.
LORA_LANE = {"family": "flux", "mode": "lora", "checkpointing": "auto", "resolution": 1024}
WORKLOAD = {"activation_margin": 0.02, "fragmentation": 0.05, "assumed_mfu": {"flux": 0.31}}
HARDWARE = {"nccl_workspace_bytes": 2**30, "cuda_context_bytes": 500 * 2**20, "stage3_fetch_latency": 1e-3,
            "host_to_device_bandwidth": 2.1e10}


def applied(path, *overrides, family="flux"):
    run = load_config(None, ["hardware.gpus=1xH100-80GB", f"planner.calibration={path}", *overrides])
    return calibration.apply(run, hardware_facts(run.hardware), family)


@pytest.mark.parametrize(("overrides", "family"), [
    (["training.mode=lora"], "flux"),
    (["training.mode=lora", "data.resolution=768"], "flux"),  # 768 px is in 1024's band
])
def test_a_calibration_applies_its_workload_constants_to_its_lane(tmp_path, overrides, family):
    path = write(tmp_path / "cal.json", {**WORKLOAD, **HARDWARE}, lane=LORA_LANE)
    run, hw, note, margin_from = applied(path, *overrides, family=family)
    assert (run.planner.activation_margin, run.planner.fragmentation, run.planner.assumed_mfu) == (0.02, 0.05, 0.31)
    assert run.planner.nccl_workspace_bytes == 2**30 and hw.host_to_device_bandwidth == 2.1e10
    assert "activation_margin, assumed_mfu, fragmentation (this plan's lane: flux lora at 1024 px (up to 1024²), " \
           "checkpointing left to the planner)" in note and "not used" not in note
    assert margin_from == "NVIDIA H100 80GB HBM3 for flux lora at 1024 px (up to 1024²), checkpointing left to the planner"


@pytest.mark.parametrize(("overrides", "family", "why"), [
    # The case: a 2-block Flux LoRA's margin for a full fine-tune of another family
    (["training.mode=full"], "qwen_image", "(another family, mode)"),
    (["training.mode=lora", "data.resolution=2048"], "flux", "(another resolution band)"),
    (["training.mode=lora", "data.resolution=512"], "flux", "(another resolution band)"),
    (["training.mode=lora", "training.gradient_checkpointing=true"], "flux", "(another checkpointing)"),
    (["training.mode=lora", "training.gradient_checkpointing=false"], "flux", "(another checkpointing)"),
    (["training.mode=lora", "training.checkpoint_blocks=4"], "flux", "(another checkpointing)"),
    (["training.mode=lora", "training.quantize_base=qint8"], "flux", "(another mode)"),
    (["training.mode=lora", "training.lora.type=lokr"], "flux", "(another mode)"),
])
def test_a_plan_outside_the_lane_keeps_the_workload_defaults_and_says_why(tmp_path, overrides, family, why):
    """Only the constants of the GPU and its host transfer; the plan line names the calibration, what it
    used, what it did not and why."""
    path = write(tmp_path / "cal.json", {**WORKLOAD, **HARDWARE}, lane=LORA_LANE)
    run, hw, note, margin_from = applied(path, *overrides, family=family)
    defaults = RunConfig().planner
    assert (run.planner.activation_margin, run.planner.fragmentation, run.planner.assumed_mfu) == \
        (defaults.activation_margin, defaults.fragmentation, defaults.assumed_mfu) and margin_from is None
    assert (run.planner.nccl_workspace_bytes, run.planner.cuda_context_bytes, run.planner.stage3_fetch_latency) == \
        (2**30, 500 * 2**20, 1e-3) and hw.host_to_device_bandwidth == 2.1e10, "hardware constants transfer"
    assert note.startswith(f"Calibrated on NVIDIA H100 80GB HBM3, 2026-11-24 ({path}): cuda_context_bytes, "
                           "host_to_device_bandwidth, nccl_workspace_bytes, stage3_fetch_latency (the GPU profile's); "
                           "activation_margin, assumed_mfu, fragmentation not used: measured for flux lora at 1024 px "
                           "(up to 1024²), checkpointing left to the planner; this plan is "), note
    assert note.endswith(why), note


def test_the_config_still_wins_outside_the_lane_and_in_it(tmp_path):
    path = write(tmp_path / "cal.json", {**WORKLOAD, **HARDWARE}, lane=LORA_LANE)
    run, _, note, _ = applied(path, "training.mode=full", "planner.activation_margin=0.1", "planner.fragmentation=0.2")
    assert run.planner.activation_margin == 0.1 and "; assumed_mfu not used: measured for flux lora" in note
    run, _, note, margin_from = applied(path, "training.mode=lora", "planner.activation_margin=0.1")
    assert run.planner.activation_margin == 0.1 and run.planner.fragmentation == 0.05 and margin_from is None


def test_a_calibration_older_than_lanes_transfers_only_its_hardware_constants(tmp_path):
    """The first GPU's calibration (no lane): its fragmentation, MFU and margin of a 2-block Flux LoRA
    apply to no plan, even Flux LoRA's; its CUDA context, NCCL and bandwidth to every plan on an H200."""
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    path = results / "h200-2026-11-28-flux-dev-2b-lora.calibration.json"
    constants = json.loads(path.read_text())["constants"]
    run = load_config(None, ["hardware.gpus=1xH200-141GB", "training.mode=lora", f"planner.calibration={path}"])
    calibrated, hw, note, margin_from = calibration.apply(run, hardware_facts(run.hardware), "flux")
    assert calibrated.planner.activation_margin == 0.43 and calibrated.planner.fragmentation == 0.10
    assert calibrated.planner.nccl_workspace_bytes == constants["nccl_workspace_bytes"] and margin_from is None
    assert hw.host_to_device_bandwidth == constants["host_to_device_bandwidth"]
    assert note.endswith("activation_margin, assumed_mfu, fragmentation not used: the calibration records no lane "
                         "(family, mode, checkpointing, resolution) that they hold for; zerotrain calibrate records it")


def test_the_first_gpus_calibration_keeps_its_margin_from_another_familys_full_fine_tune(tmp_path):
    """Issue 48 §7, through plan_for_run: the first GPU's calibration with the lane calibrate records
    for it (flux-dev LoRA at 1024 px, checkpointing left to the planner) gives Flux LoRA plans its margin
    of 0.33, and a Qwen-Image full fine-tune (60 blocks) the default 0.43, each plan saying so."""
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.entry import plan_for_run

    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    document = json.loads((results / "h200-2026-11-28-flux-dev-2b-lora.calibration.json").read_text())
    path = tmp_path / "h200.json"
    path.write_text(json.dumps({**document, "lane": LORA_LANE}))
    margins = {}
    for model, mode in (("flux-dev", "lora"), ("qwen-image", "full")):
        run = load_config(None, [f"model.name_or_path={model}", f"training.mode={mode}", "hardware.gpus=1xH200-141GB",
                                 f"planner.calibration={path}", f"planner.cache_dir={tmp_path}"])
        planned = plan_for_run(run, resolve_model(run.model))
        margins[model] = planned.run.planner.activation_margin
        assert planned.calibration in planned.result.reasons
        assert planned.run.planner.nccl_workspace_bytes == document["constants"]["nccl_workspace_bytes"]
        margin_line = next(line for line in planned.result.reasons if line.startswith(("Activation margin",
                                                                                         "Activations traced, not")))
        if model == "flux-dev":
            assert margin_line.startswith("Activation margin 33% of the activations of uncheckpointed blocks, measured "
                                          "on NVIDIA H200 for flux lora at 1024 px")
        else:
            assert "not used: measured for flux lora at 1024 px" in planned.calibration
            assert planned.calibration.endswith("this plan is qwen_image full at 1024 px (up to 1024²), checkpointing "
                                                "left to the planner (another family, mode)")
            assert "not yet measured on this GPU in this plan's lane" in margin_line
    assert margins == {"flux-dev": 0.33, "qwen-image": 0.43}


def test_a_calibration_keeps_the_lanes_it_replaces_and_a_plan_picks_its_own(tmp_path):
    """calibrate writes its lane over the GPU profile's calibration and keeps the other lanes of the
    one it replaces (calibration.kept_lanes; the new one's hardware constants win); a plan takes the
    workload constants of the lane that is its own, wherever it is in the file."""
    old = write(tmp_path / "cal.json", {**WORKLOAD, **HARDWARE}, lane=LORA_LANE, model="flux-dev (2 blocks)")
    qwen = calibration.Lane("qwen_image", "full", "auto", 1024)
    [kept] = calibration.kept_lanes(old, qwen, "H100-80GB")
    assert kept == {"lane": LORA_LANE, "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-24",
                    "model": "flux-dev (2 blocks)", "constants": WORKLOAD}
    assert calibration.kept_lanes(old, calibration.Lane("flux", "lora", "auto", 896), "H100-80GB") == [], \
        "the same lane is replaced"
    assert calibration.kept_lanes(old, qwen, "A100-80GB") == [], "another GPU profile's calibration keeps nothing"
    assert calibration.kept_lanes(tmp_path / "none.json", qwen, "H100-80GB") == []
    new = write(tmp_path / "new.json", {"activation_margin": 0.3, "nccl_workspace_bytes": 3 * 2**30},
                lane=dataclasses.asdict(qwen), lanes=[kept])
    new_doc = json.loads(new.read_text())
    new_doc["date"] = "2026-12-01"
    new.write_text(json.dumps(new_doc))
    assert [dataclasses.asdict(qwen)] == [e["lane"] for e in calibration.kept_lanes(new, calibration.Lane(
        "flux", "lora", "auto", 1024), "H100-80GB")]
    run, _, note, _ = applied(new, "training.mode=lora")
    assert run.planner.activation_margin == 0.02 and run.planner.nccl_workspace_bytes == 3 * 2**30
    assert "(this plan's lane: flux lora at 1024 px (up to 1024²), checkpointing left to the planner, measured " \
           "2026-11-24)" in note
    run, _, note, _ = applied(new, "training.mode=full", family="qwen_image")
    assert run.planner.activation_margin == 0.3 and "measured 2026" not in note
    run, _, note, _ = applied(new, "training.mode=full", family="flux")
    assert run.planner.activation_margin == 0.43
    assert "not used: measured for qwen_image full at 1024 px (up to 1024²), checkpointing left to the planner " \
           "and 1 other lane; this plan is flux full" in note


def test_calibrate_records_the_lane_it_measured_and_keeps_the_others(tmp_path, monkeypatch, capsys):
    """The document calibrate writes names its lane, from the run it measured, and carries the other lanes
    of the calibration at --out (its layouts' measurement is left out here: it needs DeepSpeed)."""
    import argparse

    import zerotrain.calibrate as calibrate_module

    out = write(tmp_path / "cal.json", WORKLOAD, lane=LORA_LANE)
    written = {}

    def measure_layouts(args, run, spec, facts, result, hw, layouts, head, rows, ranks, on_gpu, out):
        written.update(head)
        return {**head, "device": "cpu", "complete": True, "constants": {}, "defaults": [], "measurements": []}

    monkeypatch.setattr(calibrate_module, "measure_layouts", measure_layouts)
    monkeypatch.setattr(calibrate_module, "accelerator_type", lambda: "cuda")
    run = load_config(None, ["model.name_or_path=tiny-flux", "training.mode=lora", "data.resolution=64",
                             "training.gradient_checkpointing=false", "hardware.gpus=1xH100-80GB",
                             f"planner.cache_dir={tmp_path}"])
    args = argparse.Namespace(ranks=1, blocks=None, grid="chosen", repeat=1, out=out, json=True)
    assert calibrate_module.calibrate(args, run) == 0
    assert written["lane"] == {"family": "flux", "mode": "lora", "checkpointing": "none", "resolution": 64}
    assert [e["lane"] for e in written["lanes"]] == [LORA_LANE]
    assert json.loads(capsys.readouterr().out)["lane"] == written["lane"]


def test_the_nccl_default_is_the_first_gpus_measurement():
    """planner.nccl_workspace_bytes follows the one GPU measurement (1.07 GiB on one H200), not the
    400 MiB it was guessed at, within a MiB."""
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    measured = json.loads((results / "h200-2026-11-28-flux-dev-2b-lora.calibration.json").read_text())
    assert RunConfig().planner.nccl_workspace_bytes == pytest.approx(measured["constants"]["nccl_workspace_bytes"],
                                                                     abs=2**20)


def test_blocks_are_shared_in_proportion_at_full_width():
    assert share_blocks({"num_layers": 19, "num_single_layers": 38}, 3) == {"num_layers": 1, "num_single_layers": 2}
    assert share_blocks({"num_layers": 19, "num_single_layers": 38}, 1) == {"num_layers": 0, "num_single_layers": 1}
    assert share_blocks({"n_layers": 30}, 100) == {"n_layers": 30}
    from zerotrain.config.sections import ModelConfig
    from zerotrain.models.catalog import resolve_model

    flux = resolve_model(ModelConfig(name_or_path="flux-dev"))
    reduced = families.of(flux).with_blocks(flux.config, 4)
    assert (reduced["num_layers"], reduced["num_single_layers"]) == (1, 3)
    assert reduced["num_attention_heads"] == flux.config["num_attention_heads"]
    sdxl = resolve_model(ModelConfig(name_or_path="sdxl-base"))
    assert families.of(sdxl).with_blocks(sdxl.config, 3)["transformer_layers_per_block"] == [1, 1, 2]


def star_layouts() -> list:
    """The star grid around the plan of a 100M-parameter Flux-like model on one H100."""
    from zerotrain.planner.facts import ActivationFacts, ModelFacts
    from zerotrain.planner.search import plan

    acts = ActivationFacts(saved_bytes=10**8, forward_peak_bytes=10**8, backward_peak_bytes=2 * 10**8, flops=1e12)
    facts = ModelFacts(model="m", class_name="FluxTransformer2DModel", family="flux", resolution=512, mode="full",
                       quantize="none", lora_rank=None, total_params=10**8, trainable_params=10**8, frozen_params=0,
                       frozen_bytes=0, buffer_bytes=0, largest_layer_params=10**7, block_params={},
                       param_numels=[10**7] * 10, largest_trainable_param=10**7, image_tokens=1024, text_tokens=512,
                       input_bytes=10**6, no_checkpointing=acts, checkpointing=acts)
    run = load_config(None, ["hardware.gpus=1xH100-80GB", "training.global_batch_size=2"])
    return grid(plan(facts, hardware_facts(run.hardware), run), "star")


def test_the_star_grid_changes_one_thing_at_a_time_and_reaches_offload():
    layouts = star_layouts()
    center = layouts[0]
    assert all(layout.accumulation == 1 for layout in layouts)
    assert center.stage == 0 and center.offload_optimizer == "none"
    assert {layout.stage for layout in layouts} == {0, 1, 2, 3}
    assert any(layout.offload_optimizer == "cpu" and layout.stage == 1 for layout in layouts)
    assert any(layout.micro_batch != center.micro_batch for layout in layouts)
    assert any(layout.gradient_checkpointing != center.gradient_checkpointing for layout in layouts)


def test_the_star_grid_has_one_order_in_every_process():
    """Every rank measures the layouts in the same order, or the ranks wait in different
    collectives. (Built from a set of strings, the order followed each process's hash seed, and a
    2-rank calibrate run stalled one time in two.)"""
    script = "from tests.unit.test_calibration import star_layouts; print(star_layouts())"
    orders = {subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2], env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
              for seed in range(4)}
    assert len(orders) == 1, orders


def test_plan_and_doctor_agree_with_a_calibration_present(tmp_path, monkeypatch, capsys):
    """One planning path (planner.entry.plan_for_run): `zerotrain plan` and `zerotrain doctor` make
    the same plan from the same config with the GPU profile's calibration, and the calibration
    changes it (so the agreement is not the uncalibrated plan twice)."""
    from zerotrain import doctor
    from zerotrain.cli import main

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = ["--model", "flux-dev", "--resolution", "1024", "--gpus", "1xH100-80GB", "--mode", "lora",
             "--global-batch", "8"]
    assert main(["plan", *flags, "--json"]) == 0
    before = json.loads(capsys.readouterr().out)["plan"]["chosen"]
    write(calibration.default_path("H100-80GB"), {"fragmentation": 0.45, "cuda_context_bytes": 3 * 2**30})
    assert main(["plan", *flags, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["plan"]
    assert any(line.startswith("Calibrated on") for line in planned["reasons"])
    chosen = planned["chosen"]
    assert chosen["layout"] != before["layout"] or chosen["memory"] != before["memory"]
    run = load_config(None, ["model.name_or_path=flux-dev", "data.resolution=1024", "hardware.gpus=1xH100-80GB",
                             "training.mode=lora", "training.global_batch_size=8"])
    from_doctor = doctor.Context(run, environ={}).plan
    assert from_doctor.chosen.to_json()["layout"] == chosen["layout"]
    assert from_doctor.chosen.memory.device_total == chosen["memory"]["device_total"]


def h200() -> tuple[list[dict], ModelFacts]:
    """The first GPU's rows (one H200: 2-block Flux-dev LoRA at 1024 px) and the facts they were planned with."""
    results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    rows = json.loads((results / "h200-2026-11-28-flux-dev-2b-lora.calibration.json").read_text())["measurements"]
    facts = ModelFacts.from_json(json.loads((results / "h200-2026-11-28-flux-dev-2b-lora.facts.json").read_text()))
    return rows, facts


def test_the_fetch_latency_fit_gives_the_default_back_from_the_rows_it_came_from():
    """2-block Flux-dev fetches 34 modules (checked against DeepSpeed 0.19.8's hooks), twice a step."""
    rows, facts = h200()
    assert facts.fetched_modules(100_000) == 34
    fitted = calibration.fit_fetch_latency(rows, facts, 100_000)
    assert fitted == pytest.approx(RunConfig().planner.stage3_fetch_latency, rel=0.01)


def test_the_fetch_latency_fit_needs_a_zero3_row_and_a_companion_at_a_lower_stage():
    rows, facts = h200()
    assert calibration.fit_fetch_latency([r for r in rows if r["layout"]["stage"] < 3], facts, 100_000) is None
    # ZeRO-3 with no layout at a lower stage that runs the same micro-batch: its compute is unknown
    alone = [r for r in rows if r["layout"]["stage"] == 3 or r["layout"]["micro_batch"] > 1]
    assert calibration.fit_fetch_latency(alone, facts, 100_000) is None
    broken = [{**r, "status": "crashed"} if r["layout"]["stage"] == 3 else r for r in rows]
    assert calibration.fit_fetch_latency(broken, facts, 100_000) is None


def test_the_fit_uses_only_clean_rows():
    """calibrate's fit (calibrate.fit) on the first GPU's rows: a layout that crashed, timed out or ran
    out of memory measured nothing and changes no constant; the family's MFU comes from ZeRO 0-2
    (ZeRO-3 also waits on its fetches); the CPU Adam rate leaves out a row whose step was skipped."""
    from zerotrain.calibrate import fit

    rows, facts = h200()
    run = load_config(None, ["hardware.gpus=1xH200-141GB"])
    hw = hardware_facts(run.hardware)
    constants, _ = fit(rows, hw, facts, "flux", run.planner, True)
    failed = [{**rows[0], "status": status, "measured": None, "error": ["..."]}
              for status in ("crashed: killed by SIGABRT", "timeout: not finished after 900 s (--layout-timeout)")]
    assert fit(rows + failed, hw, facts, "flux", run.planner, True)[0] == constants
    clean = [r for r in rows if r["layout"]["stage"] < 3]
    mfu = [r["flops_per_step"] / (hw.peak_bf16_flops * r["measured"]["forward_backward_s"]) for r in clean]
    assert len(clean) == 6 and constants["assumed_mfu"]["flux"] == pytest.approx(statistics.median(mfu), abs=1e-4)
    assert constants["stage3_fetch_latency"] == pytest.approx(RunConfig().planner.stage3_fetch_latency, rel=0.01)

    def offloaded(row, optimizer_s, skipped):
        return {**row, "layout": {**row["layout"], "offload_optimizer": "cpu"},
                "measured": {**row["measured"], "optimizer_s": optimizer_s, "skipped_steps": skipped}}

    base = rows[0]
    steady = fit([offloaded(base, 1.0, 0)], hw, facts, "flux", run.planner, True)[0]["cpu_adam_params_per_second"]
    both = [offloaded(base, 1.0, 0), offloaded(base, 0.01, 2)]  # a skipped step did no optimizer's work
    assert fit(both, hw, facts, "flux", run.planner, True)[0]["cpu_adam_params_per_second"] == steady


@pytest.mark.parametrize("name", TINY_NAMES)
def test_calibrate_random_model_and_feed_give_finite_gradients(name):
    """calibrate's random model (build_model: the denoiser from its config, bf16, every block
    checkpointed) and its feed (RandomFeed: the family's example inputs, an MSE against a random
    target) give a finite loss and finite, non-zero gradients, so DeepSpeed's overflow check skips
    none of calibrate's steps. (At full width, once on CPU: flux-dev with 2 blocks at 1024 px, with
    and without checkpointing, gives a loss of 1.34, a gradient norm of 1.09 and no gradient element
    above 0.012, no activation above 6: bf16 overflows at 3.4e38.) Every family's tiny model: its
    example inputs are what calibrate feeds the model (Ideogram 4's fp32 timestep failed every layout)."""
    import math

    import torch

    from zerotrain.calibrate import RandomFeed, build_model
    from zerotrain.models.catalog import resolve_model

    run = load_config(None, [f"model.name_or_path={name}", "training.mode=full"])
    spec = resolve_model(run.model)
    model = build_model(spec, run, True).train()
    torch.manual_seed(0)
    kwargs, loss_of = RandomFeed(families.of(spec), spec, 2, 64, 16, torch.device("cpu"))(0)
    loss = loss_of(model(**kwargs, return_dict=False)[0])
    loss.backward()
    # (none for what a text-to-image step does not reach: FLUX.3's edit-mode blocks, the text stream of
    # Qwen-Image's last block, whose output nothing reads)
    grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
    assert math.isfinite(loss.item()) and grads
    assert all(torch.isfinite(g).all() for g in grads)
    assert math.sqrt(sum(g.float().pow(2).sum().item() for g in grads)) > 0


def test_calibrate_feeds_the_references_the_planner_plans_for(tmp_path):
    """With data.references, calibrate's feed appends the references' tokens (and Qwen-Image-Edit's text rows
    of them) as the planner's trace does, so a layout's measured peak is the planned run's: the same token
    counts as the facts, and the model runs on them."""
    import torch

    from zerotrain.calibrate import RandomFeed, build_model
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.measure import measure_model
    from zerotrain.planner.references import plan_references

    run = load_config(None, ["model.name_or_path=tiny-qwen-image-edit-2511", "training.mode=lora", "data.resolution=64",
                             "data.references=1", "data.control_resolution=64", "data.text_tokens=16",
                             f"planner.cache_dir={tmp_path}"])
    spec = resolve_model(run.model)
    facts = measure_model(spec, run)
    assert facts.reference_tokens == 16 and facts.text_tokens == 16 + 196  # one 64 px reference read at 384^2
    feed = RandomFeed(families.of(spec), spec, 1, 64, 16, torch.device("cpu"), plan_references(spec, run))
    kwargs, loss_of = feed(0)
    assert kwargs["hidden_states"].shape[1] == facts.image_tokens + facts.reference_tokens
    assert kwargs["encoder_hidden_states"].shape[1] == facts.text_tokens
    assert kwargs["img_shapes"] == [[(1, 4, 4), (1, 4, 4)]]
    model = build_model(spec, run, False)
    assert torch.isfinite(loss_of(model(**kwargs, return_dict=False)[0]))
