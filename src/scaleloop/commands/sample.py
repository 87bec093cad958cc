"""``scaleloop sample RUN_DIR --prompt TEXT``: text from the language model a finished run trained.

Flags only: the model, its weights and its vocabulary come from the run directory
(``scaleloop.sampling``, which is also ``scaleloop.sample``). Torch is imported inside
:func:`run`, so that ``scaleloop --help`` stays fast.
"""
from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    """Add ``sample RUN_DIR --prompt TEXT`` to the CLI's subparsers."""
    parser = subparsers.add_parser(
        "sample", help="text from a trained language model: a run's model continues a prompt",
        description="Continue a prompt with the language model a finished run trained: the model is rebuilt from "
                    "the run's config.toml and its model.pt loaded weights-only. Text is encoded with --tokenizer "
                    "DIR, else the run's nanoGPT meta.pkl (--data-dir), else the prompt is token ids.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (the --out of a finished run)")
    parser.add_argument("--prompt", required=True, help="the text the samples start from (token ids separated by "
                        "spaces when the run has no vocabulary)")
    parser.add_argument("--max-new-tokens", type=int, default=200, metavar="N",
                        help="tokens to generate after the prompt (default: 200)")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T",
                        help="divides the logits: below 1 surer, above 1 more varied, 0 the likeliest token "
                             "(default: 1.0)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K",
                        help="draw from the K likeliest tokens only (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="the same seed gives the same samples (default: 0)")
    parser.add_argument("--num-samples", type=int, default=1, metavar="N", help="samples to print (default: 1)")
    parser.add_argument("--tokenizer", metavar="DIR", default=None,
                        help="a transformers tokenizer saved in DIR (local files only) to encode and decode with")
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, cuda, cuda:N, mps "
                        "(default: cpu)")


def run(args: argparse.Namespace) -> int:
    from scaleloop.sampling import sample

    texts = sample(args.run_dir, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                   top_k=args.top_k, seed=args.seed, num_samples=args.num_samples, tokenizer=args.tokenizer,
                   device=args.device)
    for i, text in enumerate(texts):
        if i:
            print("-" * 40)   # between samples, as nanoGPT's sample.py separates them
        print(text)
    return 0
