"""DDP or FSDP inside each replica group, torchft between the groups (``--replica-groups N``).

Each group is an ordinary DDP job of its own processes (torchrun's group), or an FSDP job that
shards over them (:class:`FaultTolerantFSDP`: HSDP, whose replicas are the groups). Between the
groups, torchft's ``Manager`` takes a quorum of the groups that are alive before every step
(:meth:`FaultTolerant.begin_step`), averages the gradients over those groups
(:meth:`sync_gradients`) and lets the optimizer step only where the step succeeded in every group of
the quorum (:meth:`commit`). A group that was lost and restarted joins the next quorum and takes
the weights, optimizer state, schedule and place in the data from a live group (:meth:`join`), so it
rejoins at a step boundary without a checkpoint.

The data rule: a step's global batch is split over the processes of all N groups (group ``g``'s
rank ``r`` trains share ``g x P + r`` of ``N x P``), as ``--nproc N x P`` DDP would split it. A
group missing from a step's quorum trains nothing of it: its shares of that step are not trained,
and the step averages the gradients of the groups present (the mean over the samples trained).
A step during which a group failed is not committed (torchft's ``should_commit``): the groups
still present drop its gradients, take a new quorum and train the same step again
(``loop.step.train_step``), so that no step is lost. Steps trained by fewer groups are written to
``replica-steps.jsonl`` in each group's run directory and said on the console. docs/fault-tolerance.md.

With FSDP, rank r of every group holds the same shard r of each parameter (the groups have the
same number of processes): FSDP reduce-scatters the gradients in the group, and torchft's
all-reduce then averages each rank's gradient shards with rank r's of the other groups (its
Manager joins the same rank of every group), as HSDP's replica dimension would. A rejoining
group's rank r takes rank r's shards of the weights and optimizer state, as local tensors.
torchft 0.2.0 ships no managed device mesh for this (``torchft.device_mesh`` and its
``ft_init_device_mesh``, of earlier releases, are not in it): the mesh is the group's own
(:class:`_GroupShards`), and the replica dimension is torchft's Manager.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn

from scaleloop.checkpoint.manager import Progress
from scaleloop.data.loader import Batch, ShardedLoader
from scaleloop.data.streaming import StreamingLoader
from scaleloop.errors import UsageError
from scaleloop.runtime.dist import DistEnv, restart_count
from scaleloop.runtime.mesh import MeshSpec
from scaleloop.strategies.ddp import DDP
from scaleloop.strategies.fsdp import FSDP
from scaleloop.strategies.parallelize import Parallelism
from scaleloop.strategies.precision import Precision

if TYPE_CHECKING:
    from torchft import Manager

    from scaleloop.strategies.registry import ParallelSettings

#: Where each group's rank 0 records the steps trained by fewer than all groups (one JSON per line).
REPLICA_STEPS_FILE = "replica-steps.jsonl"

#: A step not committed this many times in a row ends the group (its launcher restarts it, and it
#: rejoins from a live group): a fault that each new quorum meets again is not retried for ever.
MAX_ATTEMPTS = 5


@dataclass(frozen=True)
class ReplicaGroup:
    """This process's replica group: its index among ``groups``, where the groups meet (the
    lighthouse, and its gate: ``scaleloop.launching.lighthouse``), and how long to wait."""

    index: int
    groups: int
    lighthouse: str            # http://HOST:PORT
    gate: str                  # http://HOST:PORT+1: the first quorum of a fresh start waits there for all groups
    timeout_s: float           # --timeout: a quorum, and the gate, wait this long


def requests_to_log(transport: Any) -> None:
    """torchft's checkpoint server (``http.server``, in ``HTTPTransport``) writes a line to stderr for
    each request it serves (``::ffff:127.0.0.1 - - [...] "GET /checkpoint/0/full HTTP/1.1" 200 -``):
    on rank 0, whose stderr is the console too, a rejoin would print them among the run's lines. A
    request served goes to this rank's log only (``launching.worker``); one answered with an error
    (400 and above, and ``log_error``'s line) is still said on stderr."""
    from http.server import BaseHTTPRequestHandler

    handler = getattr(getattr(transport, "_server", None), "RequestHandlerClass", None)
    if handler is None:   # another torchft: its requests are said as it says them
        return

    def log_request(self: BaseHTTPRequestHandler, code: Any = "-", size: Any = "-") -> None:
        status = getattr(code, "value", code)
        if isinstance(status, int) and status >= 400:
            BaseHTTPRequestHandler.log_request(self, code, size)
            return
        line = f"torchft checkpoint server: {self.address_string()} \"{self.requestline}\" {status} {size}\n"
        # Rank 0's stderr writes to the console and its log; another rank's is its log already.
        getattr(sys.stderr, "log_only", sys.stderr.write)(line)

    handler.log_request = log_request   # the class is this server's own (made in HTTPTransport.__init__)


class FellBehind(RuntimeError):
    """A live group found itself behind the others' step (it was left out of their quorums): it
    cannot take their state in the middle of its loop, so it ends and its launcher restarts it."""


def build_for(settings: "ParallelSettings", env: DistEnv, group: ReplicaGroup) -> "FaultTolerant":
    """The strategy of checked ``settings`` on one process of ``group``: FSDP inside the group for
    ``--strategy fsdp``, else DDP; torchft between the groups."""
    settings.check_layout(env.world_size)
    kind = FaultTolerantFSDP if settings.strategy == "fsdp" else FaultTolerantDDP
    return kind(env, Precision(settings.precision, env.device), settings, group)


class _GroupShards(Parallelism):
    """The job's layout for FSDP in replica groups: ``dp`` the groups, ``fsdp`` a group's processes
    (rank r of group g trains data share g x P + r of N x P), but the device mesh of this group
    alone: FSDP shards over the group's processes, and torchft, not a mesh dimension, replicates
    between the groups."""

    def device_mesh(self, env: DistEnv, dims: tuple[str, ...]) -> Any:
        if self._mesh is None:
            self._mesh = MeshSpec(fsdp=self.spec.fsdp).build(env.device.type, dims, timeout=env.group_timeout)
        return self._mesh

    def data_mesh(self, mesh: Any) -> Any:
        return mesh["fsdp"]


class FaultTolerant:
    """Gradients averaged between replica groups and steps committed by torchft, around the
    strategy inside each group (this class comes first in the bases, before DDP or FSDP)."""

    batch_split = "split evenly over the processes of every replica group present"
    group: ReplicaGroup
    env: DistEnv

    def _init_replicas(self, group: ReplicaGroup) -> None:
        self.group = group
        self.manager: Optional["Manager"] = None
        self._loader: Optional[Union[ShardedLoader, StreamingLoader]] = None
        self._state: Optional[Callable[[], dict[str, Any]]] = None   # the live state a healing peer takes
        self._place = Progress()          # where this group stands: the next step to take
        self._quorum_taken = False        # the next step's quorum is taken already (join's)
        self._running = False             # the loop has begun: a peer's state can no longer be taken
        self._healed: Optional[dict[str, Any]] = None
        self._present = group.groups      # groups in the last quorum
        self._attempts = 0                # tries of the step in hand that were not committed
        self._step_samples = 0            # the step in hand's global batch
        #: When fewer than all groups began to train (the step, the wall time), sent to a rejoining group.
        self._short_since: Optional[tuple[int, float]] = None
        self._record: Optional[Path] = None
        self._averaged: list[nn.Parameter] = []   # whose gradients torchft averages between the groups
        self._say: Callable[[str], None] = lambda _line: None

    # --- the state a rejoining group takes (HTTP, torchft's transport) ------------------------
    def _shared(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's live state as sent to the same rank of a rejoining group."""
        return state

    def _load_taken(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Load the model and optimizer state taken from a live group's same rank."""
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    # --- set-up ---------------------------------------------------------------------------
    def loader(self, *args: Any, **kwargs: Any) -> Union[ShardedLoader, StreamingLoader]:
        # Kept: its epoch is part of the place a rejoining group takes.
        self._loader = super().loader(*args, **kwargs)  # type: ignore[misc]
        return self._loader

    def _check_stream(self) -> None:
        raise UsageError(f"--replica-groups {self.group.groups} needs a dataset of known length (a rejoining group "
                         "takes its place in the data from a live one); a stream has none")

    def describe(self) -> str:
        inside = super().describe()  # type: ignore[misc]
        return f"{inside} x {self.group.groups} replica groups (torchft; this is group {self.group.index})"

    def join(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, at: Progress) -> Optional[Progress]:
        """Meet the other groups before the first step (every rank of the group calls it, after any
        checkpoint was restored, ``at`` its place). A fresh start waits at the gate until every
        group is there, so that no-fault training is plain DDP over all of them; a restarted group
        goes straight to the quorum. Returns the place taken from a live group when this group
        was behind (its weights, optimizer and schedule are loaded then), else None."""
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.http_transport import HTTPTransport

        self._place = Progress(**asdict(at))
        self._state = lambda: self._shared({"model": self.unwrap(model).state_dict(),
                                            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                                            "place": asdict(self._place), "short_since": self._short_since})

        def take(state: dict[str, Any]) -> None:
            if self._running:
                raise FellBehind(f"replica group {self.group.index} fell behind the others (they left it out of "
                                 f"their quorum): it restarts to rejoin them")
            self._load_taken(self.unwrap(model), optimizer, state)
            scheduler.load_state_dict(state["scheduler"])
            self._healed = state

        # torchft logs each collective a lost group broke with its traceback, and every HTTP transfer
        # of a state; the loop says what matters in one line (a step not committed, the groups present).
        logging.getLogger("torchft").setLevel(logging.CRITICAL)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")   # torchft's transfer
        timeout = timedelta(seconds=self.group.timeout_s)
        os.environ.setdefault("TORCHFT_LIGHTHOUSE", self.group.lighthouse)
        if restart_count() > 0 and self.env.world_size > 1:
            self._forget_dead_manager(timeout)
        # torchft's own transport of a live group's state (its default), its requests kept off the console.
        transport: HTTPTransport[dict[str, Any]] = HTTPTransport(timeout=timeout, num_chunks=0)
        requests_to_log(transport)
        self.manager = Manager(pg=ProcessGroupGloo(timeout=timeout), min_replica_size=1, load_state_dict=take,
                               state_dict=self._live_state, replica_id=f"group{self.group.index}",
                               checkpoint_transport=transport,
                               lighthouse_addr=self.group.lighthouse, use_async_quorum=False,
                               timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
        # The group with the most steps is the one the others take their state from: its steps are
        # the loop's (a checkpoint's on resume), not the new manager's zero.
        self.manager.load_state_dict({"step": at.global_step, "batches_committed": 0})
        if restart_count() == 0 and self.env.rank == 0:
            self._wait_at_gate()
        self._quorum()
        self._quorum_taken = True
        if restart_count() > 0 and self.manager.num_participants() < 2:
            # Restarted, and no live group to take the state from (the others finished, or are lost
            # too): training on alone from this group's own start would be another run, not this one.
            raise UsageError(f"replica group {self.group.index} restarted and found no live group to rejoin (the "
                             "others have finished or are lost too); their run directories hold the run")
        healed, self._healed = self._healed, None
        if healed is None:
            return None
        self._short_since = healed.get("short_since")
        self._place = Progress(**healed["place"])
        return self._place

    def _forget_dead_manager(self, timeout: timedelta) -> None:
        """torchft's Manager finds its group's manager (rank 0's) through the store at MASTER_ADDR:
        MASTER_PORT, under keys of its own; torchrun keeps that store, and so those keys, across its
        restarts. A restarted rank other than 0 could read the address of the manager that died with
        the last attempt and wait on it for --timeout: rank 0 removes the keys, and every rank waits
        for that before it builds its Manager."""
        import torch.distributed as torch_dist
        from torchft.manager import MANAGER_ADDR_KEY, REPLICA_ID_KEY

        if self.env.rank == 0:
            store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        wait_for_workers=False, timeout=timeout)
            for key in (MANAGER_ADDR_KEY, REPLICA_ID_KEY):
                store.delete_key(key)
        torch_dist.barrier()

    def _live_state(self) -> dict[str, Any]:
        assert self._state is not None
        return self._state()

    def _wait_at_gate(self) -> None:
        """Block until every group's rank 0 has come here (the gate lighthouse's quorum of all N)."""
        from torchft.coordination import LighthouseClient

        client = LighthouseClient(self.group.gate, connect_timeout=timedelta(seconds=self.group.timeout_s))
        try:
            client.quorum(replica_id=f"group{self.group.index}", timeout=timedelta(seconds=self.group.timeout_s))
        except TimeoutError:
            self._say(f"scaleloop: not every replica group came within {self.group.timeout_s:g} s (--timeout): "
                      "training with those present")

    @property
    def left_since(self) -> Optional[int]:
        """The first step that fewer than all groups trained, as the live group this one took its state
        from said (None: not known, or all were present)."""
        return int(self._short_since[0]) if self._short_since else None

    def attach(self, run_dir: Optional[Path], say: Callable[[str], None]) -> None:
        """Where rank 0 records the steps trained by fewer groups (None elsewhere), and its console."""
        self._record = run_dir / REPLICA_STEPS_FILE if run_dir is not None else None
        self._say = say

    # --- one step (loop.step.train_step) ---------------------------------------------------
    def begin_step(self, batch: Batch) -> None:
        """Before the step's first forward, and again before each new try of a step not committed:
        the quorum of the groups alive (it waits for them; a group that fell behind takes a live
        one's state in it)."""
        place, self._running = batch.place, True
        epoch = self._loader.epoch if isinstance(self._loader, ShardedLoader) else self._place.epoch
        self._place = Progress(epoch, place.step, self._place.global_step, self._place.samples)
        if not self._quorum_taken:
            self._quorum()
        self._quorum_taken = False
        self._step_samples = place.step_samples
        self._note_groups(self._place.global_step + 1, place.step_samples)
        self._place.global_step += 1
        self._place.samples += place.step_samples

    def sync_gradients(self) -> None:
        super().sync_gradients()  # type: ignore[misc]  # DDP's or FSDP's, inside the group
        assert self.manager is not None
        # FSDP's are this rank's shards (DTensors): averaged in place with the same rank's of the other groups.
        grads = [_local(p.grad) for p in self._averaged if p.grad is not None]
        # The mean over the groups in the quorum; torchft swallows a failed peer's error here and
        # has the step not committed (commit).
        for work in [self.manager.allreduce(g) for g in grads]:
            work.wait()

    def setup(self, model: nn.Module, optimizer: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
        placed, optim = super().setup(model, optimizer)  # type: ignore[misc]
        self._averaged = [p for p in placed.parameters() if p.requires_grad]
        return placed, optim

    def commit(self) -> bool:
        """Whether the optimizer steps: this group finished the step without an error (torchft's
        ``should_commit``; a peer lost during the step's gradient average is this group's error).
        False: the step is taken again (``loop.step.train_step``), from this step's place, with
        the next quorum; the schedule and the place did not move."""
        assert self.manager is not None
        step, present, of = self._place.global_step, self._present, self.group.groups
        if self.manager.should_commit():
            self._attempts = 0
            if present < of:
                self._write({"step": step, "committed": True, "groups": present, "of": of,
                             "global_batch": self._step_samples * present // of})
            return True
        # Back to the place before this step: a group that rejoins in the next quorum takes it.
        self._place.global_step -= 1
        self._place.samples -= self._step_samples
        self._attempts += 1
        if self._attempts >= MAX_ATTEMPTS:
            raise RuntimeError(f"replica group {self.group.index}: step {step} was not committed {self._attempts} "
                               "times in a row: this group stops (with --max-restarts, to rejoin the others)")
        self._say(f"scaleloop: step {step} was not committed: a replica group failed during it; the groups "
                  "present take it again")
        return False

    def close(self) -> None:
        super().close()  # type: ignore[misc]
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # --- the record ------------------------------------------------------------------------
    def _quorum(self) -> None:
        assert self.manager is not None, ("the loop did not join the replica groups before the first step "
                                          "(loop.training.join_replica_groups: any FaultTolerant strategy)")
        self.manager.start_quorum()
        if self.manager.errored() is not None:
            raise RuntimeError(f"replica group {self.group.index} could not form a quorum with the others "
                               f"({self.manager.errored()})")

    def _note_groups(self, step: int, step_samples: int) -> None:
        """Say when the groups in the quorum change (a step that fewer than all train is recorded
        once it is committed: :meth:`commit`)."""
        assert self.manager is not None
        present, of = self.manager.num_participants(), self.group.groups
        trained = step_samples * present // of
        if present != self._present:
            if present < of:
                self._say(f"scaleloop: replica groups: {present} of {of} train from step {step} (global batch "
                          f"{trained} of {step_samples}; the missing groups' shares are not trained)")
            else:
                self._say(f"scaleloop: replica groups: all {of} train again from step {step}")
            self._present = present
        if present < of:
            if self._short_since is None:
                self._short_since = (step, time.time())
        else:
            self._short_since = None

    def _write(self, entry: dict[str, Any]) -> None:
        if self._record is None:
            return
        try:
            with open(self._record, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as exc:
            self._say(f"warning: {self._record} could not be written: {exc}")


class FaultTolerantDDP(FaultTolerant, DDP):
    """DDP in the group; gradients averaged between replica groups and steps committed by torchft."""

    def __init__(self, env: DistEnv, precision: Precision, settings: "ParallelSettings", group: ReplicaGroup) -> None:
        # Data ranks over all groups: group g's rank r trains share g * P + r of each global batch.
        parallelism = Parallelism(MeshSpec(dp=env.world_size * group.groups), group.index * env.world_size + env.rank,
                                  recompute=settings.activation_checkpointing)
        DDP.__init__(self, env, precision, settings.accumulate, settings.sync_batchnorm, parallelism=parallelism,
                     find_unused_parameters=settings.find_unused_parameters, static_graph=settings.static_graph)
        self._init_replicas(group)


class FaultTolerantFSDP(FaultTolerant, FSDP):
    """FSDP over the group's processes (each rank a shard); torchft averages each rank's gradient
    shards with the same rank's of the other groups and commits the steps: HSDP, the groups its replicas."""

    def __init__(self, env: DistEnv, precision: Precision, settings: "ParallelSettings", group: ReplicaGroup) -> None:
        parallelism = _GroupShards(MeshSpec(dp=group.groups, fsdp=env.world_size),
                                   group.index * env.world_size + env.rank, recompute=settings.activation_checkpointing)
        FSDP.__init__(self, env, precision, settings.accumulate, settings.sync_batchnorm, parallelism=parallelism,
                      cpu_offload=settings.cpu_offload)
        self._init_replicas(group)

    def _shared(self, state: dict[str, Any]) -> dict[str, Any]:
        # This rank's shards as plain tensors: the rejoining rank puts them into its own DTensors
        # (a DTensor sent whole would carry this process's device mesh).
        from torch.utils._pytree import tree_map

        return tree_map(_local, state)

    def _load_taken(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for name, mine in model.state_dict().items():   # the parameters' own storage (FSDP2's shards)
                _local(mine).copy_(state["model"][name])
        params = [p for group in optimizer.param_groups for p in group["params"]]
        taken = state["optimizer"]
        for index, entry in taken["state"].items():
            param = params[int(index)]
            if not isinstance(param, DTensor):
                continue
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == param.to_local().shape:
                    entry[key] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                    shape=param.shape, stride=param.stride())
        optimizer.load_state_dict(taken)


def _local(t: Any) -> Any:
    """This rank's shard of a DTensor; anything else as it is."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "device_mesh") else t
