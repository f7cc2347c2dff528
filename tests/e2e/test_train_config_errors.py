"""Config mistakes stop `zerotrain/train.py` before any model loads, with one line naming the field."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("override,expected", [
    ("data.datasets=[{path: /no/such/folder}]", "data.datasets.0.path: /no/such/folder does not exist"),
    ("training.lora.rank=8", "training: lora options are set but mode=full"),
    ("training.quantize_base=qint4", "quantize_base=qint4 needs mode=lora"),
    ("training.resume=/tmp", "training.resume=/tmp: holds no zerotrain checkpoint"),
    ("data.resolution=1002", "data.resolution=1002 is not a multiple of 4"),
    ("deepspeed=/no/such/ds.json", "deepspeed=/no/such/ds.json: no such file"),
    ("deepspeed={train_batch_size: 3}", "deepspeed (inline): 3 images per step"),
])
def test_config_mistakes_fail_before_loading(override, expected, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "zerotrain" / "train.py"), "--config", str(ROOT / "examples" / "tiny-cpu.yaml"),
         "--set", override, "--set", f"output_dir={tmp_path / 'run'}"],
        check=False, capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert result.returncode == 2, result.stderr[-2000:]
    assert expected in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()  # nothing was written: it stopped before planning


def test_zerotrain_train_is_the_same_entry_point(tmp_path):
    from zerotrain.cli import main

    code = main(["train", "--config", str(ROOT / "examples" / "tiny-cpu.yaml"), "--set", "training.resume=/tmp",
                 "--set", f"output_dir={tmp_path / 'run'}"])
    assert code == 2 and not (tmp_path / "run").exists()
