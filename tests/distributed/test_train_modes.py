"""The modes of training that no row of test_train_table.py's family table runs, each once, on two CPU ranks
(gloo) through zerotrain/train.py (global batch 2, micro 1 per rank, 64 px buckets, constant LR, no warmup):

    flux full ZeRO-3 with the optimizer and the parameters offloaded to the CPU and adamw-bf16
        (DeepSpeedCPUAdam stepping bf16 masters and moments: the plan for one 24 GB card; ZeRO-3
        adamw-bf16 on the GPU trains in test_train_resume.py)

The table's rows run the other modes, each once, on a family case: no ZeRO (FLUX.1's LoRA), adamw-8bit
(bitsandbytes; SD3's LoRA, ZeRO-2) and Adafactor (transformers; SDXL's LoRA, ZeRO-3), a quantized base at ZeRO-3
and ZeRO-2 (Qwen-Image's LoRAs), partial checkpointing (SDXL's full run).

The case renders validation images through the family's diffusers pipeline with the model being trained (3
prompts on 2 ranks, so one rank pads; at steps 0, 6 and 10), checked by check_validation_images, prints
zerotrain's lines without the library noise (quiet_output.py), leaves the run folder check_run_folder checks,
and its loss goes down by 5% (family_runs.py's rule; measured -21% over 10 steps, printed with pytest -s).

The planner never chooses an offload it does not need (planner.offload lists what it may use, and "none" is
always a candidate), so the case passes a DeepSpeed JSON of its own through `deepspeed: path`: zerotrain's own
config for ZeRO-3 with offload_optimizer and offload_param {device: cpu}.
"""

from __future__ import annotations

import pytest

from tests.distributed.family_runs import (
    Case,
    assert_loss_drops,
    check_run_folder,
    check_validation_images,
    offload_config,
)
from tests.distributed.quiet_output import assert_quiet

pytestmark = pytest.mark.distributed

CASES = [
    Case("flux-full-zero3-offload-adamw-bf16", "tiny-flux", "full", 3, 1e-3, 10, offload=True, optimizer="adamw-bf16"),
]


def stepped_by_cpu_adam(checkpoint) -> bool:
    """Whether the ZeRO-3 checkpoint's basic optimizer is DeepSpeedCPUAdam, which DeepSpeed builds
    for an offloaded AdamW: its param groups carry its defaults amsgrad and bias_correction, where
    DeepSpeed's FusedAdam (not offloaded) has no amsgrad and torch's AdamW has maximize."""
    import torch

    states = torch.load(checkpoint / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", map_location="cpu",
                        weights_only=False)
    group = states["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][0]
    assert {"amsgrad", "bias_correction"} <= group.keys() and "maximize" not in group, \
        f"not DeepSpeedCPUAdam's param groups: {sorted(group)}"
    return True


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_loss_goes_down(train, tmp_path, case):
    overrides = case.overrides()
    if case.offload:
        overrides.append(f"deepspeed={offload_config(train, case, overrides, tmp_path / 'offload.json')}")
    result = train(case.id, *overrides).check()
    assert_quiet(result)
    check_run_folder(result, case)
    if case.offload:
        assert stepped_by_cpu_adam(result.output_dir / "checkpoints" / f"step-{case.steps:08d}")
    check_validation_images(result.output_dir, case)
    assert_loss_drops(case.id, result.losses(), result.seconds, case.min_drop, case.steps)
