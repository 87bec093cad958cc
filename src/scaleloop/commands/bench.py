"""The ``scaleloop bench`` subcommand: flags, presets (normal and ``--quick``), and dispatch.

``scaleloop.cli`` registers it with :func:`add_parser` and calls :func:`run`. Nothing here
imports torch at module level, so ``scaleloop --help`` stays instant.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from scaleloop.errors import UsageError

COMMANDS = ("devices", "scaling", "strategies", "overhead", "mfu", "index")

# Defaults of each command, for a normal run and for --quick (CI-sized: seconds, not minutes).
# A flag given on the command line always wins over both.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "devices": {
        "normal": dict(model="biggernet", data="random", input_dim=256, hidden_dim=512, n_samples=20_000,
                       batch_size=256, epochs=3, repeats=3),
        "quick": dict(model="simplenet", data="random", input_dim=32, hidden_dim=64, n_samples=1024,
                      batch_size=128, epochs=1, repeats=1),
    },
    "scaling": {
        # Compute-bound on purpose; why, with measurements: docs/benchmarking.md, "Why this default".
        "normal": dict(model="convnet", data="images", image_size=32, n_samples=4096,
                       batch_size=256, steps=15, warmup=3, allreduce_reps=10, repeats=3),
        "quick": dict(model="biggernet", data="images", image_size=8, hidden_dim=128, n_samples=256,
                      batch_size=16, steps=6, warmup=2, allreduce_reps=3, repeats=1),
    },
    "strategies": {
        "normal": dict(model="biggernet", data="images", image_size=32, hidden_dim=1024, n_samples=4096,
                       batch_size=128, steps=40, warmup=5, allreduce_reps=10),
        "quick": dict(model="biggernet", data="images", image_size=8, hidden_dim=128, n_samples=256,
                      batch_size=32, steps=6, warmup=2, allreduce_reps=3),
    },
    "overhead": {
        "normal": dict(model="simplenet", data="digits", hidden_dim=128, batch_size=64, epochs=5, repeats=31),
        "quick": dict(model="simplenet", data="digits", hidden_dim=128, batch_size=64, epochs=1, repeats=3),
    },
    "mfu": {
        "normal": dict(hidden_dim=1024, image_size=32, seq_len=64, n_samples=2048, batch_size=64, steps=20,
                       warmup=3),
        "quick": dict(hidden_dim=64, image_size=8, seq_len=16, n_samples=128, batch_size=16, steps=3, warmup=1),
    },
}

# Flags that build the Workload, with their type; every command has them (defaults: presets).
_WORKLOAD_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("model", str, "model: simplenet, biggernet, convnet, tinygpt, or package.module:factory"),
    ("data", str, "dataset: digits, random, images, tokens, or package.module:factory"),
    ("hidden_dim", int, "hidden width of simplenet/biggernet"),
    ("image_size", int, "image side for --data images"),
    ("input_dim", int, "features per sample for --data random"),
    ("seq_len", int, "tokens per sample for --data tokens"),
    ("vocab_size", int, "vocabulary for --data tokens"),
    ("n_samples", int, "samples in the generated training set"),
    ("seed", int, "random seed"),
)


def add_parser(subparsers: Any, parser_class: type[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register ``bench`` and its commands on ``subparsers`` (the ``scaleloop`` command's)."""
    bench = subparsers.add_parser(
        "bench", help="benchmarks: devices, scaling, strategies, overhead, mfu (JSON + markdown + PNG)",
        description="Measure this machine: the same training on each device, scaling over workers with a "
                    "step-time breakdown and a cost-model projection to large clusters, the strategies side "
                    "by side, scaleloop's overhead against a raw PyTorch loop, and MFU. Each command writes "
                    "<date>_<hardware>_<what>.{json,md,png} into --out.")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", parser_class=parser_class, required=True)

    for add in (_add_devices, _add_scaling, _add_strategies, _add_overhead, _add_mfu, _add_index):
        add(sub)
    return bench


def _add_devices(sub: Any) -> None:
    """``bench devices``: one training per device."""
    devices = sub.add_parser("devices", help="the same short training on CPU, CUDA and MPS (whatever exists)",
                             description="Time the same short training (scaleloop train, one process) on every "
                                         "device this machine has.")
    _common(devices, "devices", device=False)   # it runs on every device there is
    devices.add_argument("--epochs", type=int, help="epochs per timed run")
    devices.add_argument("--repeats", type=int, help="timed runs per device (after one warm-up run)")
    devices.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: torch's)")


def _add_scaling(sub: Any) -> None:
    """``bench scaling``: the workload at 1, 2, 4 ... workers."""
    scaling = sub.add_parser("scaling", help="samples/s and efficiency at 1, 2, 4 ... workers; breakdown; projection",
                             description="Run the same workload at each worker count (processes on CPU, GPUs "
                                         "where present): throughput, scaling efficiency, step-time breakdown, "
                                         "gradient bytes and communication time, MFU, and a ring all-reduce "
                                         "cost-model projection to 8-1024 GPUs, checked against the measured points.")
    _common(scaling, "scaling")
    scaling.add_argument("--workers", help="worker counts, comma-separated, starting at 1 (default: 1 and powers "
                                           "of two up to the GPUs, or the CPU cores)")
    scaling.add_argument("--strategy", default="ddp", help="ddp (default) or allreduce")
    scaling.add_argument("--strong", action="store_true",
                         help="strong scaling: keep --batch-size as the global batch and split it over the "
                              "workers (default: weak scaling, --batch-size per worker)")
    scaling.add_argument("--threads", type=int, default=None, help="torch threads per worker on CPU (default: 1)")
    scaling.add_argument("--compute-ms", type=float, default=None,
                         help="projection only: assume this compute time per step on the target GPU (default: "
                              "measured on a GPU; on a CPU, estimated from the model's FLOPs, --target-gpu and "
                              "--target-mfu)")
    scaling.add_argument("--target-gpu", default=None, choices=("h100", "h200", "a100"),
                         help="projection only: the GPU projected to (default: h100)")
    scaling.add_argument("--target-mfu", type=float, default=None,
                         help="projection only: the MFU assumed where the GPU's compute time is estimated from "
                              "FLOPs (default: 0.4)")
    scaling.add_argument("--repeats", type=int,
                         help="interleaved repetitions of every worker count (default: 3; --quick: 1)")
    scaling.add_argument("--target-efficiency", type=float, default=0.9, dest="target_efficiency",
                         help="the report says whether each worker count reaches this scaling efficiency, and "
                              "if not, what cost the most (default: 0.9)")
    _steps(scaling)


def _add_strategies(sub: Any) -> None:
    """``bench strategies``: every strategy on one workload."""
    strategies = sub.add_parser("strategies", help="single vs dp vs ddp vs allreduce vs fsdp, one table",
                                description="Train the same workload with the same global batch under every "
                                            "strategy the hardware allows; the others are listed with the reason.")
    _common(strategies, "strategies")
    strategies.add_argument("--workers", type=int, help="processes for ddp/allreduce (default: GPUs, or CPU cores)")
    _steps(strategies)


def _add_overhead(sub: Any) -> None:
    """``bench overhead``: scaleloop's loop against a hand-written one."""
    overhead = sub.add_parser("overhead", help="scaleloop's loop vs a hand-written PyTorch loop, interleaved",
                              description="Train the same model, data, seed and batch with a raw PyTorch loop "
                                          "and with scaleloop's loop, in one process, repetitions interleaved; "
                                          "the headline is the ratio of median training times.")
    _common(overhead, "overhead")
    overhead.add_argument("--epochs", type=int, help="epochs per repetition")
    overhead.add_argument("--repeats", type=int, help="repetitions of each loop")
    overhead.add_argument("--threads", type=int, default=None,
                          help="torch threads on CPU for both loops (default: torch's)")
    overhead.add_argument("--mode", choices=("loop", "datapath", "startup"), default="loop",
                          help="loop: scaleloop's loop vs the same loop by hand, same data path (default); "
                               "datapath: vs the tutorial's DataLoader(shuffle=True) loop, and the batches alone; "
                               "startup: import scaleloop and scaleloop --help in fresh interpreters")
    overhead.add_argument("--fused-optimizer", action="store_true",
                          help="scaleloop's run uses the one-kernel optimizer (train --fused-optimizer); the hand-"
                               "written loop uses it too in --mode loop, and stays as the tutorial writes it "
                               "(PyTorch's default) in --mode datapath")
    overhead.add_argument("--channels-last", action="store_true", dest="channels_last",
                          help="both loops: channels-last weights and image inputs (train --channels-last)")
    overhead.add_argument("--compile", action="store_true",
                          help="both loops: the model compiled with torch.compile (train --compile)")


def _add_mfu(sub: Any) -> None:
    """``bench mfu``: model FLOPs utilisation."""
    mfu = sub.add_parser("mfu", help="model FLOPs utilisation of the built-in models",
                         description="FLOPs per sample counted with torch.utils.flop_counter, throughput measured, "
                                     "divided by the peak: datasheet for known GPUs, a measured matmul on CPU. "
                                     "Without --model, every built-in model is measured.")
    _common(mfu, "mfu")
    mfu.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: all cores)")
    mfu.add_argument("--compile", action="store_true",
                     help="torch.compile the model (train --compile); --warmup steps pay the compilation")
    _steps(mfu)


def _add_index(sub: Any) -> None:
    """``bench index``: a results directory's README.md."""
    index = sub.add_parser("index", help="rebuild <out>/README.md: an index of the results there",
                           description="Rebuild the README.md of a results directory from its JSON files "
                                       "and its dated markdown-only results (quick results are left out); "
                                       "where <out>/history/ holds superseded runs, its README.md too.")
    index.add_argument("--out", default="benchmarks", metavar="DIR", help="results directory (default: benchmarks)")


def _common(parser: argparse.ArgumentParser, command: str, device: bool = True) -> None:
    normal = PRESETS[command]["normal"]
    parser.add_argument("--out", default="benchmarks", metavar="DIR",
                        help="directory for <date>_<hardware>_<what>.{json,md,png} (default: benchmarks)")
    parser.add_argument("--quick", action="store_true", help="CI-sized run: small model, few steps (seconds)")
    parser.add_argument("--tag", default="", help="appended to the file names, to keep several runs of one "
                                                  "command apart (e.g. --tag convnet)")
    if device:
        parser.add_argument("--device", default="auto", help="auto (CUDA > MPS > CPU), cpu, cuda, mps")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"), help="numeric precision")
    parser.add_argument("--batch-size", type=int, dest="batch_size",
                        help=f"batch size (default: {normal['batch_size']}; --help of each command says whose)")
    group = parser.add_argument_group("workload")
    for name, kind, text in _WORKLOAD_FLAGS:
        default = normal.get(name)
        group.add_argument("--" + name.replace("_", "-"), dest=name, type=kind, default=None,
                           help=text + (f" (default: {default})" if default is not None else ""))


def _steps(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, help="untimed steps before them")


def _value(args: argparse.Namespace, name: str) -> Any:
    """The flag's value if given, else the preset of the command (quick or normal)."""
    given = getattr(args, name, None)
    if given is not None:
        return given
    return PRESETS[args.bench_command]["quick" if args.quick else "normal"].get(name)


def _positive(args: argparse.Namespace, *names: str) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be a positive integer, got {value}")


def resolve_device(spec: str, multiprocess: bool) -> str:
    """The device type a bench runs on; multi-process benches cannot run on MPS."""
    from scaleloop.runtime.devices import resolve_device as resolve

    device = resolve(spec).type
    if multiprocess and device == "mps":
        if spec.strip().lower() == "auto":
            return "cpu"
        raise UsageError("multi-process benchmarks need CUDA or the CPU (Gloo cannot use MPS tensors); "
                         "use --device cpu")
    return device


def fit_workers_to_gpus(spec: str, device: str, most_workers: int, gpus: int, say: Any) -> str:
    """``auto`` on CUDA falls back to the CPU when the bench needs more workers than GPUs.

    NCCL needs one GPU per process, so ``auto`` with 2 workers on a 1-GPU machine would fail in
    ``init_process_group``; an explicit ``--device cuda`` is refused in one line instead.
    """
    if device != "cuda" or most_workers <= gpus:
        return device
    if spec.strip().lower() == "auto":
        say(f"--device auto: {most_workers} workers but {gpus} GPU(s), and NCCL needs one GPU per worker; "
            "benchmarking on the CPU with Gloo")
        return "cpu"
    raise UsageError(f"--device {spec}: {most_workers} workers but {gpus} GPU(s), and NCCL needs one GPU per "
                     f"worker; use --workers with at most {gpus}, or --device cpu")


def _gpu_count(device: str) -> int:
    if device != "cuda":
        return 0
    import torch

    return torch.cuda.device_count()


def _workload(args: argparse.Namespace, device: str) -> Any:
    from scaleloop.bench.workload import Workload

    _positive(args, "hidden_dim", "image_size", "input_dim", "seq_len", "vocab_size", "n_samples", "batch_size",
              "steps", "epochs", "repeats", "threads")
    if getattr(args, "warmup", None) is not None and args.warmup < 0:
        raise UsageError(f"--warmup must be zero or positive, got {args.warmup}")
    values: dict[str, Any] = {"device": device, "precision": args.precision}
    for name, _kind, _text in _WORKLOAD_FLAGS:
        value = _value(args, name)
        if value is not None:
            values[name] = value
    for name in ("steps", "warmup"):
        value = _value(args, name)
        if value is not None:
            values[name] = value
    workload = Workload(**values)
    _check_names(workload)
    return workload


def _check_names(workload: Any) -> None:
    """Unknown model or dataset names fail here, in one line, before any process starts."""
    from scaleloop.launching.preflight import preflight

    preflight(workload.to_config())


def default_workers(device: str) -> int:
    """The machine's parallelism: its GPUs on CUDA, its usable cores on the CPU."""
    if device == "cuda":
        import torch

        return torch.cuda.device_count()
    from scaleloop.bench.hardware import usable_cores

    return usable_cores()


def parse_workers(text: Optional[str], device: str) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); default: 1 and powers of two up to the GPUs (or CPU cores)."""
    if text is None:
        limit = default_workers(device)
        if device == "cuda" and limit < 2:
            raise UsageError(f"scaling over GPUs needs at least 2 and this machine has {limit}; "
                             "use --device cpu to scale processes on the CPU")
        counts, n = [1], 2
        while n <= limit:
            counts.append(n)
            n *= 2
        if len(counts) == 1:
            counts.append(2)   # a scaling table needs two points, even if they share a core
        return tuple(counts)
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise UsageError(f"--workers {text!r}: give worker counts separated by commas, e.g. 1,2,4") from None
    if not counts or counts[0] < 1:
        raise UsageError(f"--workers {text!r}: worker counts must be positive integers")
    if counts[0] != 1:
        raise UsageError(f"--workers {text!r} must include 1: efficiency is measured against one worker")
    if len(counts) < 2:
        raise UsageError(f"--workers {text!r}: give at least two counts, e.g. 1,2")
    return tuple(counts)


def command_line(args: argparse.Namespace) -> str:
    """The command as it would be typed, with the flags that were given (for the report header)."""
    parts = ["scaleloop", "bench", args.bench_command]
    skip = {"command", "bench_command", "version"}
    defaults = {"out": "benchmarks", "device": "auto", "precision": "fp32", "strategy": "ddp", "tag": "",
                "target_efficiency": 0.9, "mode": "loop"}
    for name, value in vars(args).items():
        if name in skip or value is None or value is False or defaults.get(name) == value:
            continue
        flag = "--" + name.replace("_", "-")
        parts += [flag] if value is True else [flag, str(value)]
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    """Run the ``bench`` command that ``args`` names; write its files; print its tables."""
    from scaleloop.bench.launcher import BenchFailure

    if args.bench_command == "index":
        from scaleloop.bench.index import write_index

        directory = Path(args.out)
        if not directory.is_dir():
            raise UsageError(f"--out {str(directory)!r} is not a directory")
        print(f"wrote {write_index(directory)}")
        return 0
    say = _say
    try:
        report, plot = _dispatch(args, say)
    except BenchFailure as exc:
        print(f"scaleloop: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Here or in the workers: nothing is written before the end (the report), nothing is kept.
        from scaleloop.launching.launcher import Interrupted

        raise Interrupted(None, kept=None) from None
    from scaleloop.bench.report import write_report

    report.tag = args.tag
    paths = write_report(report, Path(args.out), plot)
    print(report.terminal())
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _say(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def _dispatch(args: argparse.Namespace, say: Callable[[str], None]) -> tuple[Any, Any]:
    from scaleloop.bench import plots

    if args.tag and not re.fullmatch(r"[A-Za-z0-9._-]+", args.tag):
        raise UsageError(f"--tag {args.tag!r}: use letters, digits, '.', '_' and '-' (it becomes part of file names)")
    command = args.bench_command
    quick = bool(args.quick)
    line = command_line(args)
    if command == "devices":
        from scaleloop.bench.devices import DevicesOptions, run_devices

        workload = _workload(args, "cpu")
        opts = DevicesOptions(workload, batch_size=_value(args, "batch_size"), epochs=_value(args, "epochs"),
                              repeats=_value(args, "repeats"), threads=args.threads, quick=quick, command=line)
        return run_devices(opts, say), plots.plot_devices
    if command == "scaling":
        from scaleloop.bench.scaling import ScalingOptions, run_scaling

        device = resolve_device(args.device, multiprocess=True)
        if device == "cuda" and args.device.strip().lower() == "auto" and args.workers is None \
                and _gpu_count(device) < 2:
            device = fit_workers_to_gpus(args.device, device, 2, _gpu_count(device), say)
        counts = parse_workers(args.workers, device)
        device = fit_workers_to_gpus(args.device, device, max(counts), _gpu_count(device), say)
        workload = _workload(args, device)
        if args.compute_ms is not None and args.compute_ms <= 0:
            raise UsageError(f"--compute-ms must be positive, got {args.compute_ms}")
        if not 0 < args.target_efficiency <= 1:
            raise UsageError(f"--target-efficiency must be in (0, 1], got {args.target_efficiency}")
        target_mfu = 0.4 if args.target_mfu is None else args.target_mfu
        if not 0 < target_mfu <= 1:
            raise UsageError(f"--target-mfu must be in (0, 1], got {target_mfu} (0.4 is 40%)")
        opts = ScalingOptions(workload, counts, strategy=args.strategy,
                              strong=args.strong, batch_size=_value(args, "batch_size"),
                              threads=args.threads if args.threads is not None else 1,
                              compute_ms=args.compute_ms, target_gpu=args.target_gpu or "h100", target_mfu=target_mfu,
                              allreduce_reps=_value(args, "allreduce_reps"),
                              repeats=_value(args, "repeats"), target_efficiency=args.target_efficiency,
                              quick=quick, command=line)
        return run_scaling(opts, say), plots.plot_scaling
    if command == "strategies":
        from scaleloop.bench.strategies import StrategiesOptions, run_strategies

        device = resolve_device(args.device, multiprocess=True)
        workers = args.workers if args.workers is not None else max(1, default_workers(device))
        device = fit_workers_to_gpus(args.device, device, workers, _gpu_count(device), say)
        workload = _workload(args, device)
        opts = StrategiesOptions(workload, workers=workers, batch_size=_value(args, "batch_size"), quick=quick,
                                 allreduce_reps=_value(args, "allreduce_reps"), command=line)
        return run_strategies(opts, say), plots.plot_strategies
    if command == "overhead":
        from scaleloop.bench.overhead import OverheadOptions, run_overhead

        workload = _workload(args, resolve_device(args.device, multiprocess=False))
        opts = OverheadOptions(workload, batch_size=_value(args, "batch_size"), epochs=_value(args, "epochs"),
                               repeats=_value(args, "repeats"), threads=args.threads, quick=quick,
                               command=line, mode=args.mode, fused_optimizer=args.fused_optimizer,
                               channels_last=args.channels_last, compile=args.compile)
        return run_overhead(opts, say), (plots.plot_overhead if args.mode != "startup" else None)
    from scaleloop.bench.mfu import MODEL_DATA, MfuOptions, run_mfu

    workload = _workload(args, resolve_device(args.device, multiprocess=False))
    if args.compile:
        import dataclasses

        workload = dataclasses.replace(workload, compile=True)
    if args.model:
        models = ((args.model, args.data or MODEL_DATA.get(args.model, workload.data)),)
    else:
        models = tuple(MODEL_DATA.items())
    opts = MfuOptions(workload, models=models, batch_size=_value(args, "batch_size"), threads=args.threads,
                      quick=quick, command=line)
    return run_mfu(opts, say), plots.plot_mfu


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m scaleloop.bench``: the ``bench`` command on its own, exactly as ``scaleloop bench``."""
    from scaleloop.commands.cmdline import EXIT_USAGE, Parser

    parser = Parser(prog="scaleloop")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser, required=True)
    add_parser(sub, Parser)
    try:
        args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
        return run(args)
    except UsageError as exc:
        print(f"scaleloop: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def register(subparsers: Any) -> None:
    """Add ``bench`` and its commands to the CLI's subparsers (created with ``Parser``)."""
    from scaleloop.commands.cmdline import Parser

    add_parser(subparsers, Parser)
