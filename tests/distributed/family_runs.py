"""What the distributed training tests share (no test file imports another): a LoRA or full-fine-tune
case (Case) and its overrides, the loss-drop rule, the check of what a run leaves in its folder, the
validation images' check, the edit data of examples/tiny-edit-data, the SIGTERM-and-rerun check, and the
DeepSpeed JSON of an offloaded ZeRO-3 run.

"The loss goes down": the mean of the last WINDOW (3) step losses below the mean of the first WINDOW by a
margin (5% unless a case says otherwise). A step's loss is the mean over 2 images of a random timestep and
noise each, so single steps are noisy; every check prints its losses (pytest -s) and a failure names them."""

from __future__ import annotations

import json
import signal
from dataclasses import dataclass

import yaml

from tests.distributed.conftest import REPO, WORLD, Trainer, TrainResult, interrupted, logged_steps

WINDOW = 3
PROMPTS = ["a red square", "a blue circle", "a green square"]  # 3 images on 2 ranks: one pads
VALIDATE_EVERY = 6

EDITS = REPO / "examples" / "tiny-edit-data"
CONTROLS = [EDITS / "control" / f"{name}.png" for name in ("00-red-square", "01-green-circle", "02-blue-square")]
SWATCHES = [EDITS / "swatch" / path.name for path in CONTROLS]
RUN_FILES = ("config.yaml", "plan.json", "deepspeed.json", "checkpoints/latest", "metrics.jsonl", "export")


@dataclass(frozen=True)
class Case:
    id: str
    model: str
    mode: str
    stage: int
    lr: float
    steps: int
    offload: bool = False
    quantize: str = "none"
    min_drop: float = 0.05
    """Required relative drop of the mean of the last WINDOW losses against the first WINDOW."""
    checkpoint_blocks: int | None = None
    """training.checkpoint_blocks: partial checkpointing of that many blocks."""
    optimizer: str = "adamw"
    validate: bool = True
    """Render validation images (PROMPTS, every VALIDATE_EVERY steps and at the end)."""

    def overrides(self) -> list[str]:
        out = [f"model.name_or_path={self.model}", f"training.mode={self.mode}", f"training.max_steps={self.steps}",
               f"planner.stages=[{self.stage}]", "planner.offload=[none]", f"optimizer.lr={self.lr}"]
        if self.validate:
            out += [f"validation.prompts={json.dumps(PROMPTS)}", f"validation.every={VALIDATE_EVERY}",
                    "validation.steps=2", "validation.seeds=[7]"]
        if self.mode == "lora":
            out.append("training.lora.rank=4")
        if self.quantize != "none":
            out.append(f"training.quantize_base={self.quantize}")
        if self.checkpoint_blocks is not None:
            out.append(f"training.checkpoint_blocks={self.checkpoint_blocks}")
        if self.optimizer != "adamw":
            out.append(f"optimizer.name={self.optimizer}")
        return out


def assert_loss_drops(name: str, losses: list[float], seconds: float | None = None, min_drop: float = 0.05,
                      steps: int | None = None) -> None:
    """The loss went down by min_drop (and, given steps, over that many logged steps)."""
    first, last = sum(losses[:WINDOW]) / WINDOW, sum(losses[-WINDOW:]) / WINDOW
    took = f" in {seconds:.0f} s" if seconds is not None else ""
    print(f"{name}: first {first:.4f} last {last:.4f} drop {1 - last / first:.1%}{took}; "
          f"losses {[round(x, 4) for x in losses]}")
    assert steps is None or len(losses) == steps, f"{name}: {len(losses)} losses, not {steps}: {losses}"
    assert last < (1 - min_drop) * first, f"{name}: the loss did not go down by {min_drop:.0%}: {losses}"


def check_run_folder(result: TrainResult, case: Case) -> None:
    """What the finished run of `case` left in its folder: config.yaml (its model and mode), plan.json, the
    DeepSpeed JSON of its ZeRO stage (bf16 master weights and optimizer states for every optimizer but adamw; a
    client optimizer (bitsandbytes, transformers) named in zerotrain's section, DeepSpeed's own in its optimizer
    section; the offload the case asks for, or none), every step's metrics, the last step's checkpoint saying
    which optimizer stepped it, the planned and logged checkpointed blocks of a partially checkpointed run, and
    the export's manifest."""
    run_dir = result.output_dir
    missing = [name for name in RUN_FILES if not (run_dir / name).exists()]
    assert not missing, f"{run_dir} lacks {missing}"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert (config["model"]["name_or_path"], config["training"]["mode"]) == (case.model, case.mode)
    written = json.loads((run_dir / "deepspeed.json").read_text())
    zero = written["zero_optimization"]
    assert zero["stage"] == case.stage
    bf16_states = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert (written["bf16"].items() >= bf16_states.items()) == (case.optimizer != "adamw"), written["bf16"]
    client = case.optimizer in ("adamw-8bit", "adafactor")
    assert ("optimizer" in written) != client and written.get("zero_allow_untested_optimizer", False) == client
    if client:
        assert written["_zerotrain"]["optimizer"]["name"] == case.optimizer, written["_zerotrain"]
    if case.offload:
        assert zero.get("offload_optimizer", {}).get("device") == zero.get("offload_param", {}).get("device") \
            == "cpu", zero
    else:
        assert "offload_optimizer" not in zero, zero
    assert [r["step"] for r in result.metrics()] == list(range(1, case.steps + 1))
    tag = f"step-{case.steps:08d}"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == tag
    saved = json.loads((run_dir / "checkpoints" / tag / "zerotrain_state.json").read_text())
    assert saved["optimizer"] == case.optimizer, saved
    if case.checkpoint_blocks is not None:
        # The plan names the blocks, and the engine checkpointed those (UNet down/mid/up blocks).
        planned = json.loads((run_dir / "plan.json").read_text())
        blocks = planned["checkpoint_order"][:case.checkpoint_blocks]
        assert planned["chosen"]["layout"]["checkpointed_blocks"] == case.checkpoint_blocks, planned["chosen"]
        assert f"gradient checkpointing of {case.checkpoint_blocks} blocks ({', '.join(blocks)})" in result.log, \
            result.tails()
    manifest = json.loads((run_dir / "export" / "export.json").read_text())
    assert (manifest["mode"], manifest["step"]) == (case.mode, case.steps), manifest


def check_validation_images(run_dir, case: Case) -> None:
    """The validation images train.py rendered at the start, every VALIDATE_EVERY steps and at the
    end: real PNGs of data.resolution, not blank, carrying their prompt, and changing as it trains."""
    import numpy as np
    from PIL import Image

    steps = sorted({0, *range(VALIDATE_EVERY, case.steps + 1, VALIDATE_EVERY), case.steps})
    folders = sorted((run_dir / "validation").iterdir())
    assert [f.name for f in folders] == [f"step-{s:08d}" for s in steps], folders
    pixels = []
    for folder in folders:
        files = sorted(folder.glob("[0-9][0-9]-seed7.png"))
        assert len(files) == len(PROMPTS) and (folder / "grid.png").is_file(), sorted(folder.iterdir())
        for index, path in enumerate(files):
            with Image.open(path) as image:
                assert image.size == (64, 64) and image.text["prompt"] == PROMPTS[index], (path, image.size)
                array = np.asarray(image.convert("RGB"), dtype=np.float32)
            assert array.std() > 2, f"{path} is blank"
        pixels.append(array)
    assert np.abs(pixels[0] - pixels[-1]).mean() > 0.5, "the images did not change while the model trained"


def dataset(*controls: str) -> str:
    """data.datasets for the edit targets with these control folders (control, swatch) as references."""
    entry = {"path": str(EDITS / "targets"), "controls": [str(EDITS / c) for c in controls], "repeats": 1}
    return f"data.datasets=[{json.dumps(entry)}]"


def validation(*per_prompt: list) -> str:
    """validation.controls: each validation prompt's reference images."""
    return f"validation.controls={json.dumps([[str(p) for p in images] for images in per_prompt])}"


def check_sigterm_rerun(trainer: Trainer, name: str, overrides: tuple[str, ...], straight: TrainResult,
                        stop_after: int, steps: int) -> None:
    """`overrides` stopped by SIGTERM on every rank after stop_after steps exits 0 saying so, and the same command
    run again resumes from the checkpoint of the step it stopped at and logs `straight`'s losses bit for bit."""
    from zerotrain.checkpoint import tag_for

    stopped, _ = interrupted(trainer, name, *overrides, after_steps=stop_after,
                             signals={rank: signal.SIGTERM for rank in range(WORLD)})
    assert stopped.returncodes == [0] * WORLD, stopped.tails()
    done = logged_steps(stopped.output_dir)
    assert stop_after <= done < steps, f"stopped after {done} steps"
    assert f"stopped by SIGTERM during step {done + 1}" in stopped.log, stopped.tails()
    resumed = trainer(name, *overrides).check()
    checkpoint = stopped.output_dir / "checkpoints" / tag_for(done)
    assert f"resumed from {checkpoint} at step {done}" in resumed.log, resumed.tails()
    assert [r["step"] for r in resumed.metrics()] == list(range(1, steps + 1))
    assert resumed.losses() == straight.losses(), f"resumed {resumed.losses()}\nstraight {straight.losses()}"


def offload_config(train, case: Case, overrides: list[str], path):
    """zerotrain's DeepSpeed JSON for ZeRO-3 with the optimizer and the parameters on the CPU, for
    this run's settings, as a file for `deepspeed: path`."""
    from zerotrain.planner.deepspeed_json import deepspeed_config
    from zerotrain.planner.memory import Layout

    run = train.run_config(*overrides)
    micro = 1
    layout = Layout(case.stage, offload_optimizer="cpu", offload_param="cpu", micro_batch=micro,
                    accumulation=run.training.global_batch_size // (micro * train.world), optimizer=case.optimizer)
    path.write_text(json.dumps(deepspeed_config(layout, run, train.world), indent=2))
    return path
