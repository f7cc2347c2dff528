"""What `zerotrain plan` suggests when nothing fits (planner/report.py), on catalog models whose
facts are shipped, so that each plan takes a fraction of a second."""

from __future__ import annotations

import re

import pytest

from zerotrain.config import load_config
from zerotrain.hardware import hardware_facts
from zerotrain.models.catalog import resolve_model
from zerotrain.planner.measure import measure_model
from zerotrain.planner.report import suggestions
from zerotrain.planner.search import plan


@pytest.fixture(autouse=True)
def no_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no calibration or cached facts of the user's


def suggested(*overrides: str) -> list[str]:
    run = load_config(None, list(overrides))
    hw = hardware_facts(run.hardware)
    spec = resolve_model(run.model)
    facts = measure_model(spec, run)
    assert facts.cached
    assert plan(facts, hw, run).chosen is None
    return suggestions(spec, facts, hw, run)


def test_a_fixed_micro_batch_skips_what_cannot_apply():
    """Nothing fits at micro-batch 8 without checkpointing; more GPUs would have re-planned 2 GPUs
    with 4 images each, which micro-batch 8 does not divide, and failed."""
    found = suggested("model.name_or_path=sdxl-base", "data.resolution=1024", "hardware.gpus=1xRTX4090-24GB",
                      "training.mode=full", "training.global_batch_size=8", "training.micro_batch_size=8",
                      "planner.stages=[2]", "planner.offload=[cpu]", "training.gradient_checkpointing=false")
    assert found and not any("does not divide" in line for line in found)


def test_a_lower_memory_optimizer_is_suggested():
    base = ("model.name_or_path=flux-dev", "data.resolution=1024", "hardware.gpus=1xA100-80GB", "training.mode=full")
    found = suggested(*base)
    assert ("a lower-memory optimizer (bf16 master weights and moments instead of fp32): "
            "--set optimizer.name=adamw-bf16") in found
    run = load_config(None, [*base, "optimizer.name=adamw-bf16"])
    assert plan(measure_model(resolve_model(run.model), run), hardware_facts(run.hardware), run).chosen is not None
    # optimizer.name auto has tried every listed optimizer already
    assert not any("optimizer.name" in line for line in suggested(*base, "optimizer.name=auto",
                                                                  "hardware.host_memory=32GiB"))


FLUX_24GB = ("model.name_or_path=flux-dev", "data.resolution=1024", "hardware.gpus=1xRTX4090-24GB")
# (the run that does not fit, the suggestion's line, the config change it stands for)
EVERY_WAY_OUT = {
    "more GPUs in a node": ((*FLUX_24GB, "training.mode=lora", "planner.offload=[none]", "training.global_batch_size=8"),
                            re.escape("more GPUs in a node: --gpus 2xRTX4090-24GB (global batch 8)"),
                            {"hardware.gpus": "2xRTX4090-24GB"}),
    "more nodes": ((*FLUX_24GB, "training.mode=lora", "planner.offload=[none]", "training.global_batch_size=8"),
                   re.escape("more nodes: 2 nodes of 1 GPU (global batch 8)"), {"hardware.nodes": 2}),
    "GPU memory": ((*FLUX_24GB, "training.mode=lora", "planner.offload=[none]"),
                   r"GPUs with at least (31\.\d) GiB each", {"hardware.gpus": "1", "hardware.gpu_memory": "{0}GiB"}),
    "host RAM": (("model.name_or_path=flux-dev", "data.resolution=1024", "hardware.gpus=1xA100-80GB",
                  "training.mode=full", "hardware.host_memory=32GiB", "planner.stages=[2,3]"),
                 r"host RAM of at least \d+\.\d GiB per node: --host-memory (\d+)GiB", {"hardware.host_memory": "{0}GiB"}),
    "CPU offload": ((*FLUX_24GB, "training.mode=lora", "planner.offload=[none]"),
                    re.escape("allow CPU offload: --set 'planner.offload=[none,cpu]'"), {"planner.offload": ["none", "cpu"]}),
    "optimizer": (("model.name_or_path=flux-dev", "data.resolution=1024", "hardware.gpus=1xA100-80GB",
                   "training.mode=full"),
                  r"a lower-memory optimizer \(.*\): --set optimizer.name=adamw-bf16", {"optimizer.name": "adamw-bf16"}),
    "LoRA": (("model.name_or_path=flux-dev", "data.resolution=1024", "hardware.gpus=1xA100-80GB", "training.mode=full",
              "hardware.host_memory=32GiB", "planner.stages=[2,3]"),
             r"LoRA instead of a full fine-tune: --mode lora \(rank 16\)", {"training.mode": "lora"}),
    "LoRA over a quantized base": ((*FLUX_24GB, "training.mode=full", "planner.offload=[none]"),
                                   re.escape("LoRA over a qint8-quantized base: --mode lora --quantize qint8"),
                                   {"training.mode": "lora", "training.quantize_base": "qint8"}),
    "quantized base": (("model.name_or_path=qwen-image", "data.resolution=1024", "hardware.gpus=1xRTX4090-24GB",
                        "training.mode=lora", "training.quantize_base=qint8", "training.global_batch_size=4"),
                       re.escape("quantize the frozen base: --quantize qint4"), {"training.quantize_base": "qint4"}),
    "checkpointing": ((*FLUX_24GB, "training.mode=lora", "training.quantize_base=qint8",
                       "training.gradient_checkpointing=false"),
                      re.escape("gradient checkpointing where needed: --set training.gradient_checkpointing=auto"),
                      {"training.gradient_checkpointing": "auto"}),
    "micro-batch": (("model.name_or_path=sd3.5-medium", "data.resolution=1024", "hardware.gpus=1xRTX4090-24GB",
                     "training.mode=lora", "training.micro_batch_size=4", "training.global_batch_size=4",
                     "training.gradient_checkpointing=false"),
                    re.escape("a smaller micro-batch: --set training.micro_batch_size=auto"), {"training.micro_batch_size": "auto"}),
    "resolution": (("model.name_or_path=sd3.5-medium", "data.resolution=1024", "hardware.gpus=1xRTX4090-24GB",
                    "training.mode=lora", "training.micro_batch_size=4", "training.global_batch_size=4",
                    "training.gradient_checkpointing=false"),
                   re.escape("a lower resolution: --resolution 512"), {"data.resolution": 512}),
    "activation offload": (("model.name_or_path=flux2-dev", "data.resolution=1024", "hardware.gpus=1xH100-80GB",
                            "training.mode=lora", "training.global_batch_size=4", "training.activation_offload=false",
                            "planner.stages=[0,1,2]"),
                           re.escape("activation offload where needed: --set training.activation_offload=auto"),
                           {"training.activation_offload": "auto"}),
}


@pytest.mark.parametrize("way", list(EVERY_WAY_OUT))
def test_every_way_out_is_suggested_and_fits_when_planned_again(way):
    """Each kind of change the suggestions offer, on a run it rescues: the line is there, and the
    change it names, applied alone, plans a layout that fits (the check suggestions make too, here
    done again from the line)."""
    from zerotrain.planner.report import _fits_with

    overrides, expected, change = EVERY_WAY_OUT[way]
    found = suggested(*overrides)
    match = next((m for m in (re.fullmatch(expected, line) for line in found) if m), None)
    assert match, f"{way}: {expected!r} not in {found}"
    applied = {key: value.format(*match.groups()) if isinstance(value, str) else value for key, value in change.items()}
    run = load_config(None, list(overrides))
    assert _fits_with(resolve_model(run.model), hardware_facts(load_config(None, [
        *overrides, *(f"{k}={v}" for k, v in applied.items() if k.startswith("hardware."))]).hardware), run,
        {k: v for k, v in applied.items() if not k.startswith("hardware.")}), f"{way}: {applied} does not fit"
