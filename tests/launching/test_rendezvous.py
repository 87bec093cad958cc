"""The c10d rendezvous settings scaleloop hands torchrun: MIN:MAX, the host and this machine's address."""
from __future__ import annotations

from pathlib import Path

import pytest

from scaleloop.config import TrainConfig, resolve
from scaleloop.errors import UsageError
from scaleloop.commands.cmdline import EXIT_USAGE
from scaleloop.launching.rendezvous import is_this_machine, rdzv_conf, route_address, split_endpoint
from scaleloop.launching.torchrun import torchrun_command, workers_env


def test_this_machine_and_the_route_come_from_the_network() -> None:
    assert is_this_machine("127.0.0.1")
    assert not is_this_machine("192.0.2.1")          # TEST-NET-1: never an address of this machine
    assert route_address("127.0.0.1", 29400) == "127.0.0.1"
    assert split_endpoint("10.0.0.1:29400") == ("10.0.0.1", 29400)
    assert split_endpoint("[::1]:29400") == ("::1", 29400)
    for bad in ("10.0.0.1", "host:", ":29400", "h:99999"):
        with pytest.raises(UsageError, match="expected HOST:PORT"):
            split_endpoint(bad)


def test_rdzv_conf_adds_is_host_unless_given_or_loopback() -> None:
    assert rdzv_conf("last_call_timeout=5", "192.0.2.1") == "last_call_timeout=5,is_host=false"
    assert rdzv_conf(None, "192.0.2.1") == "is_host=false"
    assert rdzv_conf("is_host=1", "192.0.2.1") == "is_host=1"
    # Several "machines" on one host all match a loopback endpoint: torchrun picks the first to bind.
    assert rdzv_conf(None, "127.0.0.1") == ""
    with pytest.raises(UsageError, match="expected KEY=VALUE"):
        rdzv_conf("last_call_timeout", "192.0.2.1")


def test_nnodes_min_max_is_an_elastic_c10d_job() -> None:
    cfg = resolve({}, {"nnodes": "1:3", "rdzv_endpoint": "192.0.2.1:29400", "strategy": "ddp",
                       "rdzv_conf": "last_call_timeout=2"})
    assert (cfg.launch.min_nnodes, cfg.launch.nnodes, cfg.elastic) == (1, 3, True)
    cmd = torchrun_command(cfg, ["train"], python="py")
    assert {"--nnodes=1:3", "--rdzv-backend=c10d", "--rdzv-endpoint=192.0.2.1:29400",
            "--rdzv-conf=last_call_timeout=2,is_host=false"} <= set(cmd)
    assert any(c.startswith("--local-addr=") for c in cmd)
    # The store is not shared with the workers: after rank 0's machine is lost, the new rank 0 hosts one.
    assert workers_env(cfg, Path("/tmp"), {})["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    fixed = resolve({"nnodes": "1:3"}, {"nnodes": 2, "rdzv_endpoint": "192.0.2.1:29400"})
    assert (fixed.min_nnodes, fixed.elastic) == (0, False)   # --nnodes N on the command line wins
    assert "--nnodes=2" in torchrun_command(fixed, ["train"], python="py")


@pytest.mark.parametrize("flags, message", [
    ({"nnodes": "1:3", "strategy": "ddp"}, "needs where to meet"),
    ({"nnodes": "1:3", "master_addr": "h", "strategy": "ddp"}, "needs the c10d rendezvous"),
    ({"nnodes": "1:2", "rdzv_endpoint": "h:1", "strategy": "pipeline", "nproc": 2}, "needs a fixed number"),
    ({"nnodes": "1:2", "rdzv_endpoint": "h:1", "mesh": "dp=2,tp=2", "nproc": 2}, "needs a fixed number"),
    ({"nnodes": "1:4", "rdzv_endpoint": "h:1", "strategy": "ddp", "batch_size": 2}, "use at least 4"),
])
def test_elastic_refusals_say_what_to_do(flags: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        resolve({}, flags)


def test_an_uneven_batch_is_allowed_only_when_elastic() -> None:
    assert resolve({}, {"nnodes": "2:3", "rdzv_endpoint": "h:1", "strategy": "ddp", "batch_size": 64}).batch_size == 64
    with pytest.raises(UsageError, match="does not split into 3"):
        TrainConfig(nnodes=3, rdzv_endpoint="h:1", strategy="ddp", batch_size=64).validate()


@pytest.mark.parametrize("value", ["3:1", "0:2", "a:b", "1:2:3"])
def test_bad_min_max_is_one_line(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from scaleloop.cli import main

    assert main(["train", "--nnodes", value]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "MIN:MAX" in err[0], err


def test_a_group_smaller_than_the_elastic_minimum_is_refused_not_trained() -> None:
    """torchrun's rendezvous once gave a worker of ``--nnodes 2:3`` a group of one machine (it
    dropped the other, whose heartbeats were late, from the round it had just closed): the worker
    stops before its first collective, so that the agents meet again, instead of training alone."""
    from scaleloop.launching.launcher import check_group_size

    cfg = resolve({}, {"nnodes": "2:3", "nproc": 2, "rdzv_endpoint": "192.0.2.1:29400", "strategy": "ddp"})
    for world_size in (4, 5, 6):
        check_group_size(cfg, world_size)
    with pytest.raises(RuntimeError, match=r"a group of 2 process\(es\), fewer than --nnodes 2:3 allows "
                                           r"\(2 machine\(s\) x --nproc 2 = 4\).*keep_alive_max_attempt"):
        check_group_size(cfg, 2)
    check_group_size(resolve({}, {"nproc": 2}), 1)   # not elastic: nothing to check here
