"""benchmarks/gpu_suite.py's verdict (summary, markdown) on rows as a GPU run writes them: the worst
memory prediction errors and the configurations judged wrongly, which a CPU run of the suite never
produces (no GPU memory measured; tests/distributed/test_gpu_suite.py runs the rest on CPU)."""

from __future__ import annotations

from benchmarks import gpu_suite


def test_the_verdict_on_gpu_measurements():
    gib = 2**30

    def row(config: str, fits: bool, status: str, predicted: float, measured: float | None) -> dict:
        return {"config": config, "fits": fits, "rejected": None if fits else "needs 90 GiB", "status": status,
                "predicted": {"allocated": predicted * gib, "reserved": predicted * 1.1 * gib,
                              "device_total": predicted * 1.2 * gib, "step_seconds": 1.0},
                "measured": None if measured is None else {
                    "allocated": measured * gib, "reserved": measured * 1.1 * gib, "forward_backward_s": 0.8,
                    "optimizer_s": 0.2, "images_per_second": 1.0, "mfu": 0.4}}

    results = [{"name": "flux-dev 2 blocks full", "error": None, "calibration": {"measurements": [
        row("ZeRO-0", True, "ok", 10, 10.5),           # -4.8%
        row("ZeRO-1", True, "oom: CUDA out of memory", 20, None),  # predicted to fit: judged wrongly
        row("ZeRO-2", False, "ok", 30, 20),            # +50%, and it ran although refused
    ]}}, {"name": "chroma 2 blocks lora", "error": "did not finish within 150 s"}]
    totals = gpu_suite.summary(results)
    assert [(e["where"], e["what"]) for e in totals["worst_errors"][:2]] == [
        ("flux-dev 2 blocks full: ZeRO-2", "allocated"), ("flux-dev 2 blocks full: ZeRO-2", "reserved")]
    assert totals["worst_errors"][0]["error"] == 0.5 and len(totals["worst_errors"]) == 4
    assert totals["wrongly_judged"] == [
        "flux-dev 2 blocks full: ZeRO-1: out of memory although predicted to fit (24.00 GiB)",
        "flux-dev 2 blocks full: ZeRO-2: ran although the plan refused it (needs 90 GiB)"]
    table = gpu_suite.markdown(results, "NVIDIA H100 80GB HBM3", totals)
    assert "| flux-dev 2 blocks full | ZeRO-0 | ok | 10.00 / 10.50 | 11.00 / 11.55 | 1 / 1 | 1 | 40.0% |" in table
    assert "| chroma 2 blocks lora | | did not finish within 150 s | | | | | |" in table
    assert "- flux-dev 2 blocks full: ZeRO-2 allocated: +50.0%" in table
