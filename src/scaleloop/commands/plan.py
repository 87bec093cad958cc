"""``scaleloop plan``: will a model fit on N GPUs, and which layout trains it fastest."""
from __future__ import annotations

import argparse
from typing import Any

from scaleloop.errors import UsageError


def register(subparsers: Any) -> None:
    """Add ``plan`` and its flags to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "plan", help="will the model fit on N GPUs, and which layout is fastest (an estimate, on the CPU)",
        description="Estimate, without allocating the model (meta device and fake tensors), each layout's "
                    "per-GPU peak memory and step time on N GPUs (dp, fsdp, hsdp, fsdp x tp, pp x dp, with and "
                    "without activation checkpointing, CPU offload), rank them, and print the scaleloop train "
                    "line of the best. How and how well: docs/planning.md.")
    parser.add_argument("--model", default="tinygpt",
                        help="tinygpt (sized by the flags below), a transformers config.json of a causal LM (or its "
                             "directory; built as train builds it, no download), or package.module:factory "
                             "(default: tinygpt)")
    parser.add_argument("--data", default=None,
                        help="the dataset the train line names (default: your token files, --data tokenfile "
                             "--data-dir YOUR_DATA_DIR)")
    parser.add_argument("--data-dir", default=None, metavar="DIR",
                        help="the directory of --data tokenfile for the train line (default: YOUR_DATA_DIR, to fill in)")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in all (over --nodes machines)")
    parser.add_argument("--gpu", required=True, help="h100, h200, a100, or the memory of each GPU in GB (e.g. 48)")
    parser.add_argument("--nodes", type=int, default=1, help="machines the GPUs are in (default: 1)")
    parser.add_argument("--batch-size", type=int, default=None, help="GLOBAL batch size (default: 4 per GPU)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default: 64)")
    parser.add_argument("--vocab-size", type=int, default=256,
                        help="vocabulary size of tinygpt and of a factory's data; a config.json has its own "
                             "(default: 256)")
    parser.add_argument("--d-model", type=int, default=128, help="tinygpt: width (default: 128)")
    parser.add_argument("--n-layers", type=int, default=2, help="tinygpt: transformer blocks (default: 2)")
    parser.add_argument("--n-heads", type=int, default=4, help="tinygpt: attention heads (default: 4)")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"), help="(default: bf16)")
    parser.add_argument("--optimizer", default="adam", choices=("adam", "adamw", "sgd"), help="(default: adam)")
    parser.add_argument("--mfu", type=float, default=0.4,
                        help="model FLOPs utilisation the compute time assumes (default: 0.4)")
    parser.add_argument("--measure-host", action="store_true",
                        help="also measure each layout's host work (FSDP's hooks, DTensor's dispatch) on this CPU, "
                             "at tiny widths on a fake process group: a few seconds more; tinygpt only")


def run(args: argparse.Namespace) -> int:
    """Print the plan."""
    from scaleloop.plan.memory import Options
    from scaleloop.plan.planner import plan
    from scaleloop.plan.profile import ModelSpec
    from scaleloop.plan.report import TOKEN_FILES
    from scaleloop.plan.target import parse_target

    target = parse_target(args.gpu, args.gpus, args.nodes)
    for flag in ("seq_len", "vocab_size", "d_model", "n_layers", "n_heads"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be a positive integer, not {getattr(args, flag)}")
    if args.data_dir is not None and args.data not in (None, *TOKEN_FILES):
        raise UsageError(f"--data-dir is the directory of --data tokenfile (or tokenfile-seq), and --data {args.data} "
                         "reads none: drop --data-dir, or use --data tokenfile")
    spec = ModelSpec(args.model, args.seq_len, args.vocab_size, args.d_model, args.n_layers, args.n_heads)
    batch = args.batch_size if args.batch_size is not None else 4 * args.gpus
    options = Options(batch, args.precision, args.optimizer, foreach_optimizer=True)
    try:
        print(plan(spec, target, options, args.mfu, args.data, measure_host=args.measure_host, data_dir=args.data_dir))
    except KeyboardInterrupt:
        # Here, or in --measure-host's worker: a plan writes nothing, so nothing is kept.
        from scaleloop.launching.launcher import Interrupted

        raise Interrupted(None, kept=None) from None
    return 0
