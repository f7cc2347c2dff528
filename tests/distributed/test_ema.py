"""The sharded EMA (zerotrain/ema.py) on real DeepSpeed engines, two ranks on CPU (ema_worker.py).

Each case trains tiny-flux for 4 optimizer steps (decay 0.5, start step 1, so the EMA is a copy
after step 1 and an average after) under one layout: ZeRO-0, ZeRO-2, ZeRO-3, ZeRO-2 with the
optimizer offloaded to the CPU (DeepSpeed's CPU Adam), LoRA under ZeRO-3 with the optimizer and
the parameters offloaded. Under ZeRO-3 some parameters are persistent (kept gathered) and the
others gathered for each forward. For every case:

1. The EMA the ranks hold in fragments, saved and reassembled offline by ema_state_dict, equals a
   reference EMA computed from the full fp32 master weights gathered after each step.
2. Inside ema.applied() the model's output on a fixed input is the output of a model built
   without DeepSpeed holding the reference EMA, and not the trained model's; after it, the output
   is bit for bit the trained one, and the losses of the following steps are bit-identical to
   those of a control engine that never entered applied().
3. A fresh EMA on two ranks of the same layout loads the saved one exactly.

Across layouts: ZeRO-3 on two ranks loads ZeRO-2's EMA (other fragment boundaries), and one
ZeRO-1 rank loads the EMA of every full fine-tune case (2 -> 1, other stages), exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.conftest import run_ranks

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("ema_worker.py")
STEPS, PROBE_AT, DECAY, START_STEP = 4, 2, 0.5, 1
CASES: dict[str, dict[str, Any]] = {
    "zero0": {"stage": 0, "offload": "none", "mode": "full"},
    "zero2": {"stage": 2, "offload": "none", "mode": "full"},
    "zero3": {"stage": 3, "offload": "none", "mode": "full", "load_from": "zero2"},
    "zero2-offload": {"stage": 2, "offload": "cpu", "mode": "full"},
    "zero3-lora-offload": {"stage": 3, "offload": "cpu", "mode": "lora"},
}
FULL = [name for name, case in CASES.items() if case["mode"] == "full"]


def worker(spec: dict[str, Any], folder: Path, world: int) -> dict[str, Any]:
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "spec.json").write_text(json.dumps(spec))
    returncodes, logs, seconds = run_ranks([sys.executable, "-u", str(WORKER), str(folder / "spec.json")],
                                           folder / "logs", "ema", world=world)
    assert all(rc == 0 for rc in returncodes), "\n".join(log.read_text()[-3000:] for log in logs)
    print(f"{folder.name}: {world} rank(s), {seconds:.0f} s")
    return torch.load(spec["result"], weights_only=False)


class Runs:
    """Each case's worker run, once per module, in the order the cases need each other."""

    def __init__(self, root: Path, model_dir: Path):
        self.root, self.model_dir, self.done = root, model_dir, {}

    def __call__(self, name: str) -> dict[str, Any]:
        if name not in self.done:
            case, folder = CASES[name], self.root / name
            loads = []
            if "load_from" in case:
                loads.append([str(self(case["load_from"])["save"]), str(folder / f"from-{case['load_from']}")])
            spec = {"model_dir": str(self.model_dir), "stage": case["stage"], "offload": case["offload"],
                    "mode": case["mode"], "decay": DECAY, "start_step": START_STEP, "steps": STEPS,
                    "probe_at": PROBE_AT, "save": str(folder / "saved"), "reload": str(folder / "reloaded"),
                    "loads": loads, "result": str(folder / "result.pt")}
            result = worker(spec, folder, world=2)
            self.done[name] = {**result, "save": Path(spec["save"]), "reload": Path(spec["reload"]),
                               "loads": [(Path(src), Path(dst)) for src, dst in loads]}
        return self.done[name]


@pytest.fixture(scope="module")
def runs(shared_cache, tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("ema"), shared_cache / "models" / "tiny-flux")


def assert_same(a: dict, b: dict, what: str) -> None:
    import torch

    assert a.keys() == b.keys(), what
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differ, f"{what}: {len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


@pytest.mark.parametrize("name", list(CASES))
def test_saved_ema_equals_the_reference(runs, name):
    import torch

    from zerotrain.ema import ema_state_dict

    result = runs(name)
    saved, reference, masters = ema_state_dict(result["save"]), result["reference"], result["masters"]
    assert saved.keys() == reference.keys() and len(saved) >= 20
    for key, tensor in saved.items():
        assert tensor.dtype == torch.float32 and tensor.shape == reference[key].shape, key
        torch.testing.assert_close(tensor, reference[key], rtol=1e-6, atol=1e-8, msg=key)
    # Not the weights themselves: the average lags the last steps (LoRA's B starts at zero and
    # moves, A moves too).
    lagging = sum(bool((saved[k] - masters[k]).abs().max() > 1e-5) for k in saved)
    assert lagging > len(saved) // 2, f"{name}: the EMA equals the weights for {len(saved) - lagging} tensors"


@pytest.mark.parametrize("name", list(CASES))
def test_applied_renders_the_ema_and_restores_exactly(runs, name):
    import torch

    result = runs(name)
    before, middle, after, plain = result["before"], result["middle"], result["after"], result["plain"]
    assert torch.equal(before, after), "the trained weights did not come back bit for bit after applied()"
    gap, error = (before - plain).abs().mean(), (middle - plain).abs().mean()
    assert gap > 0, "the EMA and the trained weights give the same output: the probe tells nothing"
    assert error <= 0.05 * gap, f"inside applied() the output is {error} from the EMA model's, the trained one {gap}"
    trained, control = result["losses"]
    assert len(trained) == STEPS  # one micro-batch per rank and step (global batch 2, two ranks)
    assert trained == control, f"training after applied() differs from the control: {trained} vs {control}"


@pytest.mark.parametrize("name", list(CASES))
def test_ema_loads_on_the_same_layout(runs, name):
    from zerotrain.ema import ema_state_dict

    result = runs(name)
    assert result["loaded_step"] == STEPS
    assert_same(ema_state_dict(result["reload"]), ema_state_dict(result["save"]), f"{name} reloaded")


def test_ema_loads_across_stages_on_two_ranks(runs):
    from zerotrain.ema import ema_state_dict

    (src, dst), = runs("zero3")["loads"]
    assert_same(ema_state_dict(dst), ema_state_dict(src), "ZeRO-2 EMA loaded by ZeRO-3")


def test_ema_loads_on_one_rank(runs, tmp_path):
    from zerotrain.ema import ema_state_dict

    loads = [[str(runs(name)["save"]), str(tmp_path / name)] for name in FULL]
    spec = {"model_dir": str(runs.model_dir), "stage": 1, "offload": "none", "mode": "full", "decay": DECAY,
            "start_step": START_STEP, "loads": loads, "result": str(tmp_path / "result.pt")}
    assert worker(spec, tmp_path, world=1)["world_size"] == 1
    for src, dst in loads:
        assert_same(ema_state_dict(Path(dst)), ema_state_dict(Path(src)), f"{src} loaded on 1 rank")
