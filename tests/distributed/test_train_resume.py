"""A run stopped after a checkpoint and continued with resume=auto trains exactly as one that was
never stopped, under ZeRO-1 and under ZeRO-3 with adamw-bf16 (bf16 master weights and moments; the
checkpoint records it and the resume, with optimizer.name auto, keeps it). ZeRO 2 and 3 with fp32
AdamW resume in test_chaos.py's five preemptions, which compare every step's loss with an
uninterrupted run the same way.

For each stage (forced with planner.stages=[S], planner.offload=[none]), a full fine-tune of
tiny-flux on two CPU ranks (gloo), global batch 2 (micro 1 per rank), on the 8 bundled images:

    A   6 steps in one go, checkpoint_every=3
    B   3 steps (max_steps=3, checkpoint at step 3), then the same command with max_steps=6:
        resume=auto finds B/checkpoints/latest and continues; metrics.jsonl appends steps 4-6

The learning rate warms up over 4 steps, then follows a cosine to step 6, so B resumes in the
middle of the warmup (its first part, with max_steps=3, is all warmup, which does not depend on
max_steps): every step's learning rate in metrics.jsonl must be the schedule's (LR_MULTIPLIERS),
in both runs.

The runs render validation images with the EMA weights every 3 steps (swapped in and out of
the engine: the losses must not notice), and keep an EMA of the weights (decay 0.8 from step 1)
and export it: the EMA is saved with
each checkpoint, resumed, and exported instead of the trained weights, so the exported tensors of
A and B are the EMA's and must be equal too; they must also differ from the trained weights.

Half the samples train with the empty caption (data.caption_dropout=0.5): the sampler draws which
from the seed and the epoch, so the resumed run must draw the same ones.

A checkpoint restores DeepSpeed's engine (bf16 weights, fp32 master, Adam moments, step
counters, LR scheduler), the sampler position and every generator, and the run is
deterministic on CPU (single-threaded, same data cache, same partitioning), so the per-step
losses of B must equal A's bit for bit, as must the exported weights. An epoch is 4 steps here
(8 samples, 2 per step), so the resumed half also crosses an epoch boundary (step 4 -> 5), which
reshuffles from the restored sampler state.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.distributed

STEPS, CHECKPOINT_AT = 6, 3
WARMUP = 4
# The multiplier of optimizer.lr at steps 1-6: warmup k/4, then cosine over the remaining 2 steps
# (see tests/unit/test_lr_schedule.py).
LR_MULTIPLIERS = [0.25, 0.5, 0.75, 1.0, 1.0, 0.5]


def exported_tensors_in(folder):
    from safetensors.torch import load_file

    files = sorted(folder.rglob("*.safetensors"))
    assert files, f"{folder} holds no safetensors"
    return {f"{path.relative_to(folder.parent)}:{name}": tensor for path in files
            for name, tensor in load_file(path).items()}


def exported_tensors(run_dir):
    return exported_tensors_in(run_dir / "export")


@pytest.mark.parametrize(("stage", "optimizer"), [(1, "adamw"), (3, "adamw-bf16")], ids=["zero1", "zero3-adamw-bf16"])
def test_resumed_run_matches_uninterrupted_run(train, stage, optimizer):
    common = (f"planner.stages=[{stage}]", "planner.offload=[none]", "training.mode=full", "optimizer.name=auto",
              f"planner.optimizers=[{optimizer}]",
              f"training.checkpoint_every={CHECKPOINT_AT}", "training.resume=auto",
              "ema.enabled=true", "ema.decay=0.8", "ema.start_step=1", "ema.export=true",
              "validation.prompts=[a red square]", f"validation.every={CHECKPOINT_AT}", "validation.steps=2",
              "validation.use_ema=true", f"optimizer.warmup_steps={WARMUP}", "optimizer.schedule=cosine",
              "data.caption_dropout=0.5")
    a = train("A", *common, f"training.max_steps={STEPS}").check()
    b1 = train("B", *common, f"training.max_steps={CHECKPOINT_AT}").check()
    assert "resumed from" not in b1.log
    assert (b1.output_dir / "checkpoints" / "latest").read_text().strip() == f"step-{CHECKPOINT_AT:08d}"
    b2 = train("B", *common, f"training.max_steps={STEPS}").check()
    assert f"resumed from {b2.output_dir / 'checkpoints' / f'step-{CHECKPOINT_AT:08d}'} at step {CHECKPOINT_AT}" \
        in b2.log, b2.tails()

    for run in (a, b2):
        written = json.loads((run.output_dir / "deepspeed.json").read_text())
        zero = written["zero_optimization"]
        assert zero["stage"] == stage and "offload_optimizer" not in zero
        assert written["bf16"].get("bf16_optimizer_states", False) == (optimizer == "adamw-bf16"), written["bf16"]
        saved = json.loads((run.output_dir / "checkpoints" / f"step-{STEPS:08d}" / "zerotrain_state.json").read_text())
        assert saved.get("optimizer") == optimizer, saved
        assert (run.output_dir / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:08d}"

    records_a, records_b = a.metrics(), b2.metrics()
    assert [r["step"] for r in records_a] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records_b] == list(range(1, STEPS + 1)), "metrics.jsonl should hold steps 1-3, then 4-6"
    assert [r["epoch"] for r in records_b] == [r["epoch"] for r in records_a] == [0, 0, 0, 0, 1, 1]
    peak = train.run_config(*common).optimizer.lr
    assert [r["lr"] for r in records_a] == pytest.approx([peak * m for m in LR_MULTIPLIERS], rel=1e-9), \
        "metrics.jsonl must log the learning rate each step used"
    assert [r["lr"] for r in records_b] == [r["lr"] for r in records_a]
    losses_a, losses_b = a.losses(), b2.losses()
    print(f"ZeRO-{stage} losses: uninterrupted {losses_a} resumed {losses_b}; seconds A {a.seconds:.0f} "
          f"B {b1.seconds:.0f}+{b2.seconds:.0f}")
    assert losses_b == losses_a, (
        f"ZeRO-{stage}: losses differ\n  uninterrupted {losses_a}\n  resumed       {losses_b}\n"
        f"  differences   {[lb - la for la, lb in zip(losses_a, losses_b)]}"
    )

    import torch

    assert sorted(p.name for p in (a.output_dir / "validation").iterdir()) == \
        [f"step-{s:08d}" for s in (0, CHECKPOINT_AT, STEPS)]
    for run in (a, b2):  # the export is the EMA, which must differ from the trained weights
        manifest = json.loads((run.output_dir / "export" / "export.json").read_text())
        assert manifest["ema"] is True and manifest["source"].startswith("EMA"), manifest
    from zerotrain.export import export

    trained = exported_tensors_in(export(a.output_dir, out=a.output_dir / "trained"))
    averaged = exported_tensors_in(a.output_dir / "export")
    same = [n for n in averaged if torch.equal(averaged[n], trained[n.replace("export", "trained", 1)])]
    assert len(same) < len(averaged) // 2, f"the EMA export equals the trained weights in {len(same)} tensors"

    weights_a, weights_b = exported_tensors(a.output_dir), exported_tensors(b2.output_dir)
    assert weights_a.keys() == weights_b.keys()
    differ = [name for name in weights_a if not torch.equal(weights_a[name], weights_b[name])]
    assert not differ, f"ZeRO-{stage}: exported weights differ after resuming: {differ[:5]} ({len(differ)} tensors)"
