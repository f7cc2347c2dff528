"""Weights & Biases logging (logging.wandb, issue 25), offline (WANDB_MODE=offline): a run on two
CPU ranks logs, from rank 0 only, the scalars metrics.jsonl holds, the validation images, the
resolved config and the plan's summary into <output_dir>/wandb; stopped after a checkpoint and
resumed, it continues the same W&B run (the id in <output_dir>/wandb_id). The offline run files
are read back record by record (wandb's LevelDB-style log of protobuf records)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

BLOCK, HEADER = 32768, 7  # the log's block size and record header (crc32, length, type)


def records(path: Path):
    """The protobuf Records of one offline run file (.wandb)."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:8]
    pos, pieces = 7, b""
    while pos + HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + HEADER]) if left >= HEADER else (0, 0, 0)
        if left < HEADER or (kind == 0 and length == 0):  # the rest of a block is padding
            pos += left
            continue
        data = raw[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        pieces = data if kind in (1, 2) else pieces + data  # full, first / middle, last
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record


def logged(run_file: Path) -> tuple[dict[int, dict[str, str]], dict[str, str], dict[str, str]]:
    """step -> the values logged at it, the run's config and its summary updates."""
    history, config, summary = {}, {}, {}
    for record in records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            values = {item.key or "/".join(item.nested_key): item.value_json for item in record.history.item}
            history[int(values["_step"])] = values
        elif kind == "run":
            config.update({item.key: item.value_json for item in record.run.config.update})
        elif kind == "summary":
            summary.update({item.key or "/".join(item.nested_key): item.value_json for item in record.summary.update})
    return history, config, summary


def test_a_run_logs_to_wandb_offline_and_a_resume_continues_the_same_run(train, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    common = ("planner.stages=[2]", "planner.offload=[none]", "training.checkpoint_every=2", "training.resume=auto",
              "logging.wandb={project: zerotrain-test, tags: [ci]}", "validation.prompts=[a red square]",
              "validation.every=2", "validation.steps=2")
    first = train("run", *common, "training.max_steps=2").check()
    run_id = (first.output_dir / "wandb_id").read_text().strip()
    resumed = train("run", *common, "training.max_steps=4").check()
    assert "resumed from" in resumed.log
    assert (resumed.output_dir / "wandb_id").read_text().strip() == run_id
    runs = sorted((resumed.output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(run.name.endswith(f"-{run_id}") for run in runs), runs  # rank 0 only, twice

    steps: dict[int, dict[str, str]] = {}
    config, summary = {}, {}
    for run in runs:
        history, run_config, run_summary = logged(next(run.glob("run-*.wandb")))
        steps.update(history)
        config.update(run_config)
        summary.update(run_summary)
    metrics = resumed.metrics()
    assert sorted(s for s in steps if "train/loss" in steps[s]) == [r["step"] for r in metrics] == [1, 2, 3, 4]
    for record in metrics:
        assert float(steps[record["step"]]["train/loss"]) == pytest.approx(record["loss"], rel=1e-6)
        assert float(steps[record["step"]]["train/lr"]) == pytest.approx(record["lr"], rel=1e-6)
    for step in (0, 2, 4):  # the validation grid, at the start and every 2 steps, as files beside the run
        assert json.loads(steps[step]["validation/grid/_type"]) == "image-file", steps[step]
        assert any((run / "files" / json.loads(steps[step]["validation/grid/path"])).is_file() for run in runs)
    training = json.loads(config["training"])
    assert training.get("value", training)["max_steps"] == 4  # the resumed run's resolved config
    assert json.loads(summary["plan/layout"]).startswith("ZeRO-2") and float(summary["plan/gpus"]) == 2
