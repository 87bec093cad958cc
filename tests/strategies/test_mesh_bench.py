"""``bench strategies`` has a row per ``--mesh`` composition, and ``verify`` takes ``--mesh`` (no processes run here)."""
from __future__ import annotations

import argparse

from scaleloop.bench.strategies import BenchRow, _per_worker_batch, mesh_rows
from scaleloop.commands.cmdline import Parser, add_config_flags
from scaleloop.commands.verify import add_parser, resolve_verify


def test_four_workers_get_every_composition() -> None:
    rows = mesh_rows(4, 1)
    assert [r.strategy for r in rows] == ["mesh:tp=4", "mesh:fsdp=2,tp=2", "mesh:dp=2,fsdp=2", "mesh:dp=2,tp=2",
                                          "mesh:pp=2,dp=2"]
    assert all(r.skip is None and r.processes == 4 for r in rows)


def test_two_workers_keep_the_2d_rows_with_the_reason() -> None:
    rows = mesh_rows(2, 1)
    assert rows[0].skip is None and rows[0].strategy == "mesh:tp=2"
    assert [r.skip for r in rows[1:]] == ["needs an even --workers of 4 or more"] * 4


def test_tp_ranks_share_their_batch_in_the_table() -> None:
    assert _per_worker_batch(BenchRow("tp", "mesh:tp=4", 4, 1), 8, 2) == 8
    assert _per_worker_batch(BenchRow("hsdp", "mesh:dp=2,fsdp=2", 4, 1), 8, 2) == 2
    assert _per_worker_batch(BenchRow("pp x dp", "mesh:pp=2,dp=2", 4, 1), 8, 4) == 4   # a replica's stages share
    assert _per_worker_batch(BenchRow("ddp", "ddp", 4, 1), 8, 2) == 2


def test_verify_takes_the_mesh_and_its_world_size() -> None:
    parser = Parser(prog="scaleloop")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    add_parser(sub, Parser, add_config_flags)
    args = parser.parse_args(["verify", "--mesh", "fsdp=2,tp=2", "--model", "tinygpt", "--data", "tokens",
                              "--batch-size", "8"])
    cfg, _ = resolve_verify(args)
    assert (cfg.parallel.strategy, cfg.parallel.mesh, cfg.launch.nproc) == ("mesh", "fsdp=2,tp=2", 4)
