"""The candidate layouts, and the train lines they give: real flags that TrainConfig accepts."""
from __future__ import annotations

import pytest

from scaleloop.cli import build_parser
from scaleloop.commands.cmdline import flag_values
from scaleloop.config import resolve
from scaleloop.plan.layouts import Layout, candidates


def test_eight_gpus_on_two_nodes_give_every_family() -> None:
    found = candidates(8, 4, 2, batch_size=32, heads=8, pipeline_layers=10, with_checkpointing=True)
    labels = {layout.label for layout in found}
    assert {"dp dp=8", "fsdp fsdp=8", "fsdp fsdp=8 +offload", "hsdp dp=2,fsdp=4", "fsdp x tp fsdp=4,tp=2",
            "fsdp x tp fsdp=2,tp=4", "pp x dp pp=2,dp=4", "dp dp=8 +ac", "fsdp fsdp=8 +ac"} <= labels
    # tp stays inside a node (4 GPUs), and a pipeline is never checkpointed (not offered).
    assert all(layout.tp <= 4 for layout in found)
    assert not any(layout.pp > 1 and layout.checkpointing for layout in found)
    assert all(layout.world == 8 for layout in found)


def test_tensor_parallelism_needs_the_heads_to_divide() -> None:
    found = candidates(8, 8, 1, batch_size=8, heads=6, pipeline_layers=0, with_checkpointing=False)
    assert {layout.tp for layout in found} == {1, 2}


@pytest.mark.parametrize("layout", [Layout("dp", dp=8, checkpointing=True), Layout("fsdp", fsdp=8, offload=True),
                                    Layout("hsdp", dp=2, fsdp=4), Layout("fsdp x tp", fsdp=4, tp=2),
                                    Layout("pp x dp", pp=4, dp=2, microbatches=8), Layout("pp x dp", pp=8, microbatches=8)])
def test_every_layout_gives_a_train_line_that_scaleloop_train_accepts(layout: Layout) -> None:
    argv = ["train", "--model", "tinygpt", "--data", "tokens", "--batch-size", "64",
            *layout.train_flags(per_node=4, nodes=2)]
    args = build_parser().parse_args(argv)
    cfg = resolve({}, flag_values(args)).validate()
    assert cfg.launch.nproc * cfg.launch.nnodes == 8
