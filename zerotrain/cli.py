"""zerotrain: `plan` (the memory-plan dry run), `cache` (encode a dataset once) and `export`
(weights diffusers loads, from a run's checkpoint). Training: `deepspeed zerotrain/train.py`.

Bad input prints one line (what, where, what to do) and exits 2; --debug shows the traceback."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

from zerotrain import calibrate, doctor, launch
from zerotrain.config import load_config
from zerotrain.config.flags import add_plan_flags, config_from_args
from zerotrain.errors import ZerotrainError, one_line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerotrain", description=__doc__.splitlines()[0])
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("plan", help="plan memory and write a DeepSpeed config, without a GPU")
    add_plan_flags(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--write-config", type=Path, metavar="PATH", help="write the chosen DeepSpeed JSON here")
    p.add_argument("--no-cache", action="store_true", help="measure the model again instead of using cached or shipped facts")
    p.add_argument("--all", action="store_true", help="list every candidate, not the best per layout")
    c = commands.add_parser("cache", help="decode, bucket and encode the dataset into the latent/text cache; "
                                      "launch with torchrun or srun to share the work across processes")
    c.add_argument("--config", type=Path, help="run config (YAML, JSON or TOML)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field (repeatable)")
    commands.add_parser("train", add_help=False, help="train (the same as `python zerotrain/train.py`; "
                                                    "launch with deepspeed/torchrun for several processes)")
    e = commands.add_parser("export", help="write weights diffusers loads (a model folder, or a LoRA) from a run's "
                                       "checkpoint")
    e.add_argument("run_dir", type=Path, help="the training run folder (output_dir)")
    e.add_argument("--tag", help="checkpoint tag (default: the latest)")
    e.add_argument("--out", type=Path, help="output folder (default: RUN/export)")
    e.add_argument("--ema", action="store_true", help="export the EMA of the weights (runs with ema.enabled)")
    e.add_argument("--comfyui", action="store_true", help="also write a ComfyUI-style LoRA / model file")
    b = commands.add_parser("build-ops", help="compile DeepSpeed's ops that training loads (CPU Adam, fused Adam, "
                                              "...) for this machine now, once, not at a run's first step; async I/O "
                                              "(NVMe offload only) with --all or by name")
    b.add_argument("ops", nargs="*", metavar="OP", help="build only these (cpu_adam, fused_adam, async_io, ...)")
    b.add_argument("--all", action="store_true", help="also the ops only one kind of layout loads (async_io)")
    r = commands.add_parser("presets", help="regenerate the DeepSpeed presets in deepspeed_configs/ (zerotrain plan "
                                            "for each; a test fails when they drift)")
    r.add_argument("--out", type=Path, metavar="DIR", help="write them here instead")
    g = commands.add_parser("regenerate", help="after adding or changing a family: trace the shipped facts of catalog "
                                               "models (all when none is named) into zerotrain/planner/shipped_facts/, "
                                               "then regenerate every preset in deepspeed_configs/")
    g.add_argument("models", nargs="*", metavar="MODEL", help="catalog models (not the tiny- ones)")
    calibrate.add_parser(commands)
    doctor.add_parser(commands)
    launch.add_parser(commands)
    return parser


def run_build_ops(args: argparse.Namespace) -> int:
    """One line as each op's compile starts, one when each is done (built, prebuilt, skipped with DeepSpeed's
    reason, failed), one for each op left to its first use; exit 2 when a build that this machine supports
    failed."""
    from zerotrain.ops import build_ops, requested

    builders, left = requested(args.ops, args.all)
    results = build_ops(builders, say=lambda line: print(line, flush=True))
    for line in left:
        print(line)
    failed = [op.name for op in results if op.status == "failed"]
    if failed:
        print(f"zerotrain: error: {', '.join(failed)} did not compile; `ds_report` shows what DeepSpeed needs, and "
              "a run that uses them would fail the same way", file=sys.stderr)
        return 2
    return 0


def regenerate_presets(folder: Path | None = None) -> list[Path]:
    """Write every preset (planner.presets.PRESETS) into `folder` (deepspeed_configs/ by default) through
    `zerotrain plan`, as a user would; returns the paths."""
    from zerotrain.planner.presets import PRESETS, ROOT

    written = []
    for name, args in PRESETS.items():
        path = (folder or ROOT) / name
        code = main(["plan", *args, "--json", "--write-config", str(path)])
        if code != 0:
            raise ZerotrainError(f"preset {name}: zerotrain plan exited {code}")
        written.append(path)
    return written


def run_presets(args: argparse.Namespace) -> int:
    for path in regenerate_presets(args.out):
        print(path, file=sys.stderr)
    return 0


def run_regenerate(args: argparse.Namespace) -> int:
    """The shipped facts of the named catalog models (all when none), then every preset: what a new or
    changed family needs generated, in one command."""
    from zerotrain.planner import shipped

    unknown = sorted(set(args.models) - set(shipped.shipped_models()))
    if unknown:
        raise ZerotrainError(f"{', '.join(unknown)}: not shipped catalog models; name some of "
                             f"{', '.join(shipped.shipped_models())}, or none for all")
    shipped.main(args.models)
    return run_presets(argparse.Namespace(out=None))


def run_export(args: argparse.Namespace) -> int:
    from zerotrain.export import export, notes

    out = export(args.run_dir, tag=args.tag, out=args.out, comfyui=args.comfyui, ema=args.ema)
    print(f"exported to {out}")
    for line in notes(out):
        print(line)
    return 0


def run_cache(args: argparse.Namespace) -> int:
    import torch

    from zerotrain.data.prepare import prepare
    from zerotrain.distributed import Heartbeat, init_process_group, local_device, topology
    from zerotrain.models.catalog import resolve_model
    from zerotrain.train import BACKSTOP_S

    run = load_config(args.config, args.overrides)
    topo = topology()
    # Under torchrun: the collectives time out as training's do; the long waits (a node's download, the other
    # ranks' share of the build) wait in the store for as long as the ranks' heartbeats move (patient_barrier).
    init_process_group(topo, run.faults.collective_timeout_seconds + BACKSTOP_S)
    heartbeat = Heartbeat(topo, run.faults.lost_rank_seconds)
    device = local_device(topo)
    try:
        prepared = prepare(run, resolve_model(run.model), topo, device)
    except Exception as err:
        heartbeat.post(f"rank {topo.rank} stopped: {one_line(err, 300)}")  # the others stop with it
        raise
    finally:
        heartbeat.stop()
    if topo.is_main:
        for line in prepared.summary():
            print(line)
        try:
            epoch = prepared.epoch(run.training.global_batch_size)
            print(f"epoch: {epoch.steps} steps of {run.training.global_batch_size} images ({epoch.samples} samples; "
                  f"{epoch.dropped} dropped by bucket remainders), whatever the number of GPUs")
        except ZerotrainError as err:  # the cache is still good; training would stop here
            print(f"warning: {err}")
        print(f"cache ready at {run.data.cache_dir}: {len(prepared.index)} images, {len(prepared.samples)} samples "
              "per epoch")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


def reproducible_command(argv: list[str]) -> str:
    """The command that produced a config, without output-only flags, so that it reads the same
    wherever the file was written."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--write-config", "--json", "--all", "--no-cache", "--debug"):
            skip = arg == "--write-config"
        elif not arg.startswith("--write-config="):
            kept.append(arg)
    return "zerotrain " + " ".join(shlex.quote(a) for a in kept)


def run_plan(args: argparse.Namespace, argv: list[str]) -> int:
    from zerotrain import families
    from zerotrain.models.catalog import resolve_model
    from zerotrain.planner.deepspeed_json import validate, write_config
    from zerotrain.planner.entry import plan_for_run
    from zerotrain.planner.report import base_choices, model_document, print_plan, suggestions

    start = time.perf_counter()
    run = config_from_args(args)
    spec = resolve_model(run.model)
    planned = plan_for_run(run, spec, cache=not args.no_cache)
    run, hw, facts, result, config = planned.run, planned.hw, planned.facts, planned.result, planned.config
    kind = families.of(spec).plan_only(spec)
    if kind is not None:
        result.reasons.append(f"{spec.name} is plan-only: zerotrain cannot cache or train {kind}")
    result.reasons += base_choices(spec, facts, hw, run, result)
    if result.chosen is None:
        result.suggestions = suggestions(spec, facts, hw, run)
    for line in planned.notes:
        print(f"zerotrain: warning: {line}", file=sys.stderr)
    if args.write_config and config is not None and result.chosen is not None:
        # DeepSpeed's own check costs a 2 s import; it guards what is written, and tests
        # run it on every preset.
        validate(config)
        # Checkpointing is the run config's, not DeepSpeed's: say what to set beside this file.
        layout = result.chosen.layout
        training = {"gradient_checkpointing": layout.gradient_checkpointing}
        if layout.gradient_checkpointing and result.checkpointed(layout) is not True:
            training["checkpoint_blocks"] = layout.checkpointed_blocks
        if layout.offload_activations:
            training["activation_offload"] = True
        write_config(config, args.write_config, {"command": reproducible_command(argv), "plan": result.reasons,
                                                 "training": training})
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps({"plan": result.to_json(), "deepspeed_config": config,
                          "model": model_document(spec, facts, planned.calibration),
                          "facts_cached": facts.cached, "seconds": round(elapsed, 2)}, indent=2, default=str))
    else:
        print_plan(result, facts, show_all=args.all, seconds=elapsed)
        if args.write_config and config is not None:
            print(f"DeepSpeed config written to {args.write_config}")
        from zerotrain.data.cost import plan_statement

        statement = plan_statement(run, spec)
        if statement:
            print(statement)
    return 0 if result.chosen is not None else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:  # train.py owns its arguments (the launchers append --local_rank)
        from zerotrain.train import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        commands = {"plan": lambda: run_plan(args, argv), "cache": lambda: run_cache(args),
                    "export": lambda: run_export(args), "doctor": lambda: doctor.main(args),
                    "launch": lambda: launch.main(args), "calibrate": lambda: calibrate.main(args),
                    "build-ops": lambda: run_build_ops(args), "presets": lambda: run_presets(args),
                    "regenerate": lambda: run_regenerate(args)}
        return commands[args.command]()
    except ZerotrainError as err:
        if args.debug:
            raise
        print(f"zerotrain: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a library rejecting input zerotrain did not anticipate
        if args.debug:
            raise
        detail = " ".join(str(err).split())[:300]
        print(f"zerotrain: error: {type(err).__name__}: {detail} (run `zerotrain --debug {args.command} ...` "
              "for the traceback)", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
