"""benchmarks/gpu_suite.py on CPU, for what a CPU can show of it.

- End to end on tiny-flux (DeepSpeed's CPU accelerator): the suite runs its calibrate case, and
  writes the JSON and markdown results with the planner's predictions, the CPU's measurements and
  the verdict.
- --plan-only on the real cases, for one H100: every case can run (its arguments are accepted and
  its model plans), every layout it would measure has its predictions, and together they cover
  the layouts the suite is for (flux-dev and SDXL over ZeRO 0-3 x checkpointing x micro-batch,
  each newer family's LoRA with and without checkpointing, the memory floor's settings).
(The verdict on rows only a GPU produces: tests/unit/test_gpu_suite_verdict.py.)"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

from conftest import REPO, process_env

from benchmarks import gpu_suite

PREDICTED = ("allocated", "reserved", "device_total", "step_seconds")


def suite(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_suite.py"), *flags, "--out", str(tmp_path)],
                          check=False, capture_output=True, text=True, env=process_env(), cwd=REPO, timeout=600)


def test_gpu_suite_runs_end_to_end_on_cpu(tmp_path):
    done = suite(tmp_path, "--tiny", "--gpus", "1", "--gpu-memory", "8GiB")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    [result] = tmp_path.glob("gpu-*.json")
    document = json.loads(result.read_text())
    assert set(document) == {"device", "date", "seconds", "summary", "cases"}
    assert document["device"].startswith("cpu-") and document["seconds"] > 0
    [case] = document["cases"]
    assert case["name"] == "tiny-flux full" and case["error"] is None and case["seconds"] > 0
    assert case["command"].startswith("-m zerotrain.cli calibrate --model tiny-flux")
    calibration = case["calibration"]
    assert calibration["model"] == "tiny-flux" and calibration["mode"] == "full" and calibration["resolution"] == 64
    rows = calibration["measurements"]
    assert len(rows) >= 5 and all(r["status"] == "ok" for r in rows)
    # The star around the plan: its choice first, then one change at a time (stage, checkpointing, micro-batch).
    layouts = [r["layout"] for r in rows]
    assert len({r["config"] for r in rows}) == len(rows)
    assert len({layout["stage"] for layout in layouts}) >= 2
    assert {layout["gradient_checkpointing"] for layout in layouts} == {False, True}
    assert {layout["micro_batch"] for layout in layouts} >= {1, 2}
    for row in rows:
        predicted = row["predicted"]
        assert all(predicted[key] > 0 for key in PREDICTED), (row["config"], predicted)
        assert predicted["allocated"] <= predicted["reserved"] <= predicted["device_total"], predicted
        # tiny-flux in 8 GiB; on one rank the plan rejects ZeRO-3 without parameter offload (and calibrate measures it)
        assert (row["fits"] and row["rejected"] is None) or (row["rejected"] or "").startswith("one GPU:"), row
        assert row["flops_per_step"] > 0
        measured = row["measured"]
        assert measured["images_per_second"] > 0 and measured["forward_backward_s"] > 0 and measured["optimizer_s"] > 0
        assert measured["allocated"] == 0 and measured["mfu"] is None  # no GPU memory and no MFU on a CPU
    checkpointing = [r for r in rows if r["layout"]["gradient_checkpointing"]]
    plain = next(r for r in rows if not r["layout"]["gradient_checkpointing"]
                 and r["layout"]["micro_batch"] == checkpointing[0]["layout"]["micro_batch"]
                 and r["layout"]["stage"] == checkpointing[0]["layout"]["stage"])
    assert checkpointing[0]["flops_per_step"] > plain["flops_per_step"]  # the recomputation costs FLOPs
    assert document["summary"] == {"worst_errors": [], "wrongly_judged": []}  # no GPU memory to compare on a CPU
    table = result.with_suffix(".md").read_text().splitlines()
    assert table[0].startswith(f"# GPU suite on {document['device']}, {document['date']}")
    lines = [line for line in table if line.startswith("| tiny-flux full |")]
    assert [line.split(" | ")[1] for line in lines] == [r["config"] for r in rows]
    assert all(line.count("|") == 9 and " / n/a |" in line for line in lines)  # predicted / measured (none on CPU)
    assert "- none measured" in table and "- none" in table and any("Judged wrongly" in line for line in table)


def test_every_case_plans_and_covers_the_suites_layouts(tmp_path):
    done = suite(tmp_path, "--plan-only", "--gpus", "1xH100-80GB", "--host-memory", "256GiB")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [result] = tmp_path.glob("plan-*.json")
    document = json.loads(result.read_text())
    cases = {case["name"]: case for case in document["cases"]}
    assert list(cases) == [case["name"] for case in gpu_suite.cases(False)]
    for name, case in cases.items():
        assert case["error"] is None, (name, case["error"])
        assert case["chosen"] is not None and case["planned"], name
        assert case["planned"][0]["fits"], (name, case["planned"][0])  # what the case is for fits one H100
        for row in case["planned"]:
            assert all(row["predicted"][key] > 0 for key in PREDICTED), (name, row["config"], row["predicted"])

    def layouts(name: str) -> list[dict]:
        return [row["layout"] for row in cases[name]["planned"]]

    def checkpointed(name: str) -> list:
        return [row["checkpointed"] for row in cases[name]["planned"]]

    for model, mode in itertools.product(("flux-dev 2 blocks", "sdxl-base 3 blocks"), ("full", "lora")):
        grid = {(a["stage"], a["gradient_checkpointing"], a["micro_batch"]) for a in layouts(f"{model} {mode}")}
        assert grid >= set(itertools.product(range(4), (False, True), (1, 2, 4))), (model, mode, grid)
    # Each newer family's LoRA, with and without checkpointing (issue 13: Qwen-Image LoRA unchecked).
    for model in ("qwen-image", "flux2-dev", "z-image", "chroma", "krea-2-raw", "ideogram-4", "flux3-klein-base", "qwen-image-2.1"):
        assert {a["gradient_checkpointing"] for a in layouts(f"{model} 2 blocks lora")} == {False, True}, model
        assert "--mode lora" in cases[f"{model} 2 blocks lora"]["command"]
    # The memory floor: 0, 2, 4 and 8 of 8 blocks checkpointed, activation offload, each optimizer, compiled.
    floor = "flux-dev 8 blocks full"
    floor_checkpointed = [checkpointed(f"{floor}, {k}/8 checkpointed") for k in (0, 2, 4, 8)]
    assert [[c if isinstance(c, bool) else len(c) for c in one] for one in floor_checkpointed] == \
        [[0], [2], [4], [True]], floor_checkpointed  # True: every block
    assert [a["offload_activations"] for a in layouts(f"{floor}, activation offload")] == [True]
    for optimizer in ("adamw-bf16", "adamw-8bit", "adafactor"):
        assert [(a["optimizer"], a["stage"]) for a in layouts(f"{floor}, {optimizer}")] == [(optimizer, 2)]
    assert "training.compile=true" in cases[f"{floor}, compiled blocks"]["command"]
    offloaded = layouts("flux-dev 4 blocks full, adamw-bf16 at ZeRO-3 offloaded")
    assert {(a["stage"], a["optimizer"], a["offload_optimizer"]) for a in offloaded} == {(3, "adamw-bf16", "cpu")}
    assert {a["offload_param"] for a in offloaded} == {"none", "cpu"}
    assert len(layouts("flux-dev lora (full depth)")) == len(layouts("sdxl-base full (full depth)")) == 1

