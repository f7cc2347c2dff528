"""`zerotrain doctor`: one command to run before a long job. Each check prints a verdict (ok, warn,
fail, skip) and, for anything but ok, what to do: versions of torch, CUDA, the driver and DeepSpeed
and its ops; the GPUs NVML, CUDA_VISIBLE_DEVICES and torch see; NCCL peer-to-peer; free GPU memory,
host RAM and NVMe space against the plan; /dev/shm; the output folder; and whether the model's
weights can be had.

Exit codes: 0 when every check is ok or skipped, 1 when some warn and none fail, 2 when any fails.
On a machine without GPUs or NVML the GPU checks are skipped with the reason, and the plan uses the
profile hardware.gpus names (or is skipped with gpus=auto).

Every check is a small function of a `Context` (base.py), which measures each fact once. No check
raises: an unexpected exception becomes a warning that carries its text. The checks, by subject:
software.py (config, versions, libraries, DeepSpeed's ops), gpus.py (GPUs, NCCL p2p, free GPU memory),
model.py (the weights, the plan) and host.py (host RAM, NVMe, /dev/shm, the output folder).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from zerotrain.config import RunConfig
from zerotrain.config.flags import add_plan_flags, config_from_args
from zerotrain.doctor.base import EXIT_CODES, Check, CheckFunction, Context, Finding, exit_code
from zerotrain.doctor.gpus import check_gpu_memory, check_gpus, check_p2p
from zerotrain.doctor.host import check_host_ram, check_nvme, check_output, check_shm
from zerotrain.doctor.model import check_denoiser, check_model, check_plan
from zerotrain.doctor.software import check_config, check_deepspeed, check_libraries, check_versions
from zerotrain.errors import ZerotrainError, one_line

__all__ = ["CHECKS", "EXIT_CODES", "Check", "Context", "Finding", "add_parser", "check_config", "check_deepspeed",
           "check_denoiser", "check_gpu_memory", "check_gpus", "check_host_ram", "check_libraries", "check_model", "check_nvme",
           "check_output", "check_p2p", "check_plan", "check_shm", "check_versions", "exit_code", "main", "run_checks",
           "to_json"]

# Every check, in the order they run and print.
CHECKS: list[tuple[str, CheckFunction]] = [
    ("config", check_config),
    ("versions", check_versions),
    ("libraries", check_libraries),
    ("deepspeed ops", check_deepspeed),
    ("gpus", check_gpus),
    ("nccl p2p", check_p2p),
    ("model", check_model),
    ("denoiser", check_denoiser),
    ("plan", check_plan),
    ("gpu memory", check_gpu_memory),
    ("host ram", check_host_ram),
    ("nvme", check_nvme),
    ("shm", check_shm),
    ("output", check_output),
]


def run_checks(run: RunConfig, *, config_path: Path | None = None, debug: bool = False) -> list[Check]:
    """Every check, in order. An exception inside a check becomes a warning with its text (debug
    lets it through, for the traceback)."""
    ctx = Context(run, config_path)
    checks = []
    for name, function in CHECKS:
        try:
            finding = function(ctx)
        except Exception as err:  # a check must never stop the others
            if debug:
                raise
            finding = Finding("warn", f"the check itself failed: {type(err).__name__}: {one_line(err, 300)}",
                              "run `zerotrain --debug doctor ...` for the traceback, and report it")
        checks.append(Check(name, finding.verdict, finding.detail, finding.advice))
    return checks


def add_parser(commands: Any) -> None:
    """Register `doctor` on an argparse subparsers object, with `zerotrain plan`'s shorthand flags
    (config.flags.config_from_args maps them to config fields through PLAN_FLAGS)."""
    d = commands.add_parser("doctor", help="check this machine before a long job: versions, GPUs, NCCL, memory, "
                                           "disk, model (exit 0 ok, 1 warnings, 2 failures)")
    add_plan_flags(d)
    d.add_argument("--json", action="store_true", help="print the checks as JSON")


def to_json(checks: list[Check]) -> dict[str, Any]:
    counts = {verdict: sum(c.verdict == verdict for c in checks) for verdict in EXIT_CODES}
    return {"checks": [dataclasses.asdict(c) for c in checks], "summary": {**counts, "exit_code": exit_code(checks)}}


STYLES = {"ok": "bold green", "warn": "bold yellow", "fail": "bold red", "skip": "dim"}


def print_checks(checks: list[Check]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(soft_wrap=False, width=None if sys.stdout.isatty() else 160)
    table = Table(title="zerotrain doctor", title_justify="left", show_lines=True)
    table.add_column("check", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    table.add_column("detail", ratio=3)
    table.add_column("what to do", ratio=2)
    for c in checks:
        # Text, not markup: details hold square brackets ("[nvml]") that rich would take for tags.
        table.add_row(c.name, Text(c.verdict, style=STYLES[c.verdict]), Text(c.detail), Text(c.advice or ""))
    console.print(table)
    summary = to_json(checks)["summary"]
    console.print(f"{summary['ok']} ok, {summary['warn']} warning(s), {summary['fail']} failure(s), "
                  f"{summary['skip']} skipped: exit {summary['exit_code']}")


def main(args: argparse.Namespace) -> int:
    """Run the checks, print them (a table, or JSON with --json) and return exit_code."""
    try:
        run = config_from_args(args)
    except ZerotrainError as err:
        checks = [Check("config", "fail", str(err), "fix the config file or the --set / flag values")]
    else:
        with contextlib.redirect_stdout(sys.stderr):  # library chatter must not mix into the report
            checks = run_checks(run, config_path=args.config, debug=getattr(args, "debug", False))
    if args.json:
        print(json.dumps(to_json(checks), indent=2))
    else:
        print_checks(checks)
    return exit_code(checks)
