"""The log rows: a row of ``metrics.csv`` (:class:`Row`), and what the rows learn about a run's
health, riding on the reductions the loop already makes (:func:`check_health` on each log row).

The trainer makes the rows (a log row every ``--log-every`` steps, an evaluation, an epoch's end,
a recovery); rank 0 writes them, and every rank reads a log row's all-reduced totals for a
straggling rank or a loss that is no longer finite.

Each log window already sums the loss over ranks (one all-reduce). The same vector carries one
slot per rank for a few per-rank numbers: each rank fills its own slots and leaves the others
zero, so the sum over ranks is a gather, at the cost of a few more floats in the same call.

- **stragglers**: each rank's own seconds per step (``Step.own_s``: data and forward passes,
  the part of a step that does not wait for the others). A rank consistently slower than the
  rest holds every rank back; :class:`Stragglers` decides when that is worth a line.
- **divergence**: the global loss is read anyway; a rank's first step with a non-finite loss
  (``RunningLoss.first_nonfinite_step()``) says where it began. At an epoch's end and before a
  checkpoint, a slot per rank also says whether its weights are finite, so no checkpoint
  holds non-finite weights (:class:`Diverged`). Only then are that step's samples read again:
  when one of them holds inf or NaN, the data is named as the cause, not the learning rate
  (:func:`stopped_on_nonfinite`).
- **fp16 skipped steps**: the GradScaler's count of skipped steps, kept on the device
  (``Precision.skipped``), copied into the vector without waiting for the device.

A log row's speed beside its samples/s: tokens/s for token data, and MFU where the device's peak is known.

What the figures need is fixed once, when the run is built (:func:`throughput_of`, on the model as
the user made it, before a strategy wraps, shards or cuts it); a log row only divides
(:meth:`Throughput.values`), so the steps between rows pay nothing for them.

- **Tokens** (``tokens_per_s``): token data only, whose samples are sequences of token ids (the
  built-in ``tokens``, token files, token streams, a dataset of task ``lm``), over all ranks.
  Where the data holds no -100 target (the built-in token data, token files) every position of
  every sample counts: samples x sequence length. Where it may (padding, a stream of unknown
  content), the positions whose target enters the loss, as the steps count them anyway to weigh
  the loss (``loop.losses``: summed over the ranks at every step already).
- **MFU** (``mfu``, a fraction): the model FLOPs of those tokens per second over the peak of all
  devices: each rank's datasheet peak in the run's precision (``runtime.devices``) x ranks. Model
  FLOPs per token are 6 N (N: the parameters a token is multiplied by, which is all of them but an
  embedding table that is only looked up, such as positions; a table tied to the output layer
  counts) plus the attention's 12 x layers x width x sequence length, where the model says its
  layers and width (TinyGPT, a transformers model's config, nanoGPT's ``GPTConfig``); 6 N alone
  otherwise. This is PaLM's count, as nanoGPT and torchtitan make it: the half of the scores a
  causal mask skips counts too. MFU is blank where no peak is known (the CPU, MPS, a GPU missing
  from the table) and for data that are not token data (6 N per sample is no estimate for a
  convolution, which uses its weights at every position of an image).
"""
from __future__ import annotations

import math
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from scaleloop.data.batch import split
from scaleloop.data.info import DataInfo
from scaleloop.errors import StoppedOnEveryRank
from scaleloop.models import TinyGPT
from scaleloop.runtime.collectives import sum_over_ranks
from scaleloop.runtime.devices import datasheet_peak
from scaleloop.runtime.dist import DistEnv


if TYPE_CHECKING:   # named in annotations only
    from scaleloop.checkpoint.manager import Checkpointer


class Diverged(StoppedOnEveryRank):
    """The global loss (or the weights) stopped being finite: the run stops, writing no checkpoint of it.

    ``what`` is the first clause of the message ("the training loss became nan at step 12 (epoch
    1) on rank 1"): the run directory's record (``failure.json``) keeps it for ``scaleloop doctor``.
    """

    def __init__(self, message: str, what: str = "", step: Optional[int] = None, epoch: Optional[int] = None,
                 ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.what, self.step, self.epoch, self.ranks = what or message, step, epoch, tuple(ranks)


def per_rank_vector(head: Sequence[float], mine: Sequence[float], env: DistEnv) -> torch.Tensor:
    """``head`` followed by ``len(mine)`` blocks of ``world_size`` slots, this rank's values in its
    own slot of each block (the others zero): summed over ranks, a gather of ``mine``."""
    world = env.world_size
    values = [0.0] * (len(head) + len(mine) * world)
    values[:len(head)] = head
    for j, v in enumerate(mine):
        values[len(head) + j * world + env.rank] = v
    return torch.tensor(values, dtype=torch.float64, device=env.device)


def blocks(total: Sequence[float], head: int, world: int) -> list[list[float]]:
    """The per-rank blocks of a reduced :func:`per_rank_vector` (after its ``head`` values)."""
    rest = list(total[head:])
    return [rest[i:i + world] for i in range(0, len(rest), world)]


# Not frozen: a frozen dataclass sets each field through object.__setattr__, and one is made at
# every log row, inside the timed loop. Treat it as read-only.
@dataclass(slots=True)
class WindowTotals:
    """A log window reduced over ranks: the loss sums and the per-rank health numbers."""

    loss_sum: float                 # loss x samples, all ranks
    samples: float
    own_s: list[float]              # each rank's own seconds in the window
    first_bad: Optional[int]        # the first step with a non-finite loss on any rank
    skipped: int                    # fp16 steps skipped (the most any rank counts; 0 without a scaler)
    bad_ranks: tuple[int, ...] = ()  # the ranks whose loss stopped being finite at first_bad

    @property
    def loss(self) -> float:
        return self.loss_sum / self.samples if self.samples > 0 else float("nan")

    def skew(self, steps: int) -> dict[str, float]:
        """The metrics columns of the ranks' own seconds per step (none for one rank)."""
        if len(self.own_s) < 2 or steps <= 0:
            return {}
        slowest = max(range(len(self.own_s)), key=self.own_s.__getitem__)
        return {"rank_step_s_min": min(self.own_s) / steps, "rank_step_s_max": self.own_s[slowest] / steps,
                "slowest_rank": slowest}


def reduce_window(env: DistEnv, loss_sums: Sequence[float], own_s: float, first_nonfinite: Optional[int],
                  skipped: Optional[torch.Tensor]) -> WindowTotals:
    """The log window's one all-reduce: this rank's loss sums, own seconds, first non-finite step
    and (fp16) the scaler's device-side count of skipped steps, which is copied in on the device
    so that nothing waits for it before the reduction itself."""
    world = env.world_size
    if world == 1:
        # Nothing to reduce: the same numbers as the vector below would give, without building
        # it (a log row of a small model's run comes every few milliseconds).
        return WindowTotals(float(loss_sums[0]), float(loss_sums[1]), [float(own_s)], first_nonfinite or None,
                            int(skipped) if skipped is not None else 0, (0,) if first_nonfinite else ())
    vector = per_rank_vector(loss_sums, [own_s, first_nonfinite or 0, 0.0], env)
    if skipped is not None:
        vector[len(loss_sums) + 2 * world + env.rank] = skipped
    total = sum_over_ranks(vector, env).tolist()
    own, bad, skipped_by_rank = blocks(total, len(loss_sums), world)
    return WindowTotals(total[0], total[1], own, first_bad(bad), int(max(skipped_by_rank)), first_ranks(bad))


def reduce_checked(env: DistEnv, model: nn.Module, head: Sequence[float], first_nonfinite: Optional[int]
                   ) -> tuple[list[float], Optional[int], tuple[int, ...]]:
    """``head`` summed over ranks, in one all-reduce with each rank's first non-finite step and
    whether its weights are finite: (sums, first bad step, the ranks it was first seen on: those
    of the first bad step, else those whose weights are not finite)."""
    vector = per_rank_vector(head, [first_nonfinite or 0, 0.0], env)
    vector[len(head) + env.world_size + env.rank] = nonfinite_weights(model)
    total = sum_over_ranks(vector, env).tolist()
    bad, weights = blocks(total, len(head), env.world_size)
    ranks = first_ranks(bad) or tuple(r for r, w in enumerate(weights) if w > 0)
    return total[:len(head)], first_bad(bad), ranks


def nonfinite_weights(model: nn.Module) -> torch.Tensor:
    """1.0 on the device if any of this rank's parameters (its shards) holds inf/NaN, else 0.0."""
    flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in model.parameters()]
    if not flags:
        return torch.zeros((), dtype=torch.float64)
    return (~torch.stack(flags).all()).double()


def first_bad(slots: Sequence[float]) -> Optional[int]:
    """The earliest step any rank saw a non-finite loss at (slots of 0: none)."""
    steps = [int(s) for s in slots if s > 0]
    return min(steps) if steps else None


def first_ranks(slots: Sequence[float]) -> tuple[int, ...]:
    """The ranks whose first non-finite step is the earliest (slot r: rank r's step, 0: none)."""
    first = first_bad(slots)
    return tuple(r for r, s in enumerate(slots) if first is not None and int(s) == first)


def on_ranks(ranks: Sequence[int], world: int) -> str:
    """" on rank 1", " on ranks 0 and 3", " on every rank"; nothing for one process."""
    if world <= 1 or not ranks:
        return ""
    if len(ranks) == world:
        return " on every rank"
    listed = [str(r) for r in sorted(ranks)]
    return f" on rank {listed[0]}" if len(listed) == 1 else f" on ranks {', '.join(listed[:-1])} and {listed[-1]}"


def continue_line(run_dir: Optional[Path], checkpoint_step: Optional[int]) -> str:
    """Names the newest checkpoint this run wrote or resumed from, and how to go on from it."""
    if run_dir is None or checkpoint_step is None:
        return "no checkpoint was written before it"
    ckpt = run_dir / "checkpoints" / f"step-{checkpoint_step:08d}"
    return f"the newest valid checkpoint is {str(ckpt)!r} (step {checkpoint_step})"


def diverged(what: str, step: int, epoch: int, run_dir: Optional[Path], checkpoint_step: Optional[int],
             ranks: Sequence[int] = (), world: int = 1) -> Diverged:
    """The one line for a run that stopped on a non-finite loss or weights, naming the rank(s)
    it began on."""
    where = f"step {step}" if what.endswith(" after") else f"at step {step}"
    first = f"{what} {where} (epoch {epoch}){on_ranks(ranks, world)}"
    text = (f"the run diverged: {first}; stopped there and wrote no checkpoint "
            f"of it; {continue_line(run_dir, checkpoint_step)}")
    if run_dir is not None and checkpoint_step is not None:
        text += (f"; continue from it with gradient clipping: scaleloop train --out {shlex.quote(str(run_dir))} "
                 "--clip-grad 1.0, or start over with a lower --lr")
    else:
        text += "; start over with a lower --lr or with --clip-grad 1.0"
    return Diverged(text, first, step, epoch, ranks)


def stopped_on_nonfinite(what: str, step: int, epoch: int, run_dir: Optional[Path], checkpoint_step: Optional[int],
                         ranks: Sequence[int], world: int, loader: Any) -> StoppedOnEveryRank:
    """The error that stops a run whose loss (``what``, from step ``step`` on) is not finite: the
    data's fault when a sample of that step holds inf or NaN (:func:`nonfinite_sample`, read only
    now), else :func:`diverged`. Every rank reads the same samples and says the same."""
    cause = nonfinite_sample(loader, step) if what.startswith("the training loss") else None
    if cause is None:
        return diverged(what, step, epoch, run_dir, checkpoint_step, ranks, world)
    return StoppedOnEveryRank(f"the training data is not finite: {cause} (step {step}, epoch {epoch}, where {what}); "
                              "stopped there and wrote no checkpoint of it; "
                              f"{continue_line(run_dir, checkpoint_step)}; repair or leave out that sample "
                              "(a lower --lr or --clip-grad does not help)")


def nonfinite_sample(loader: Any, step: int) -> Optional[str]:
    """"sample 37 has nan in its inputs": the first sample of optimizer step ``step`` (of the run,
    from 1) whose inputs or target hold inf or NaN; None when every one is finite, or when the
    step's samples cannot be read again (a stream)."""
    sampler = loader.sampler
    per_epoch = getattr(sampler, "steps_per_epoch", None)
    if not hasattr(sampler, "step_indices") or not per_epoch or step < 1:
        return None
    epoch, in_epoch = divmod(step - 1, per_epoch)   # every epoch has the same steps (one global batch)
    for index in sampler.step_indices(epoch, in_epoch).tolist():
        try:
            parts = split(loader.dataset[index])
        except Exception:  # noqa: BLE001 - a sample that cannot be read again leaves the plain divergence line
            return None
        for part, name in zip(parts, ("inputs", "target")):
            value = _first_nonfinite(part)
            if value is not None:
                return f"sample {index} has {value} in its {name}"
    return None


def _first_nonfinite(obj: Any) -> Optional[str]:
    """'nan', 'inf' or '-inf': the first non-finite number in ``obj`` (tensors, arrays, numbers, and
    containers of them); None if there is none."""
    if isinstance(obj, np.ndarray) and obj.dtype.kind in "fc":
        obj = torch.from_numpy(obj)
    if isinstance(obj, float):
        obj = torch.tensor(obj)
    if isinstance(obj, torch.Tensor):
        if not (obj.is_floating_point() or obj.is_complex()):
            return None
        bad = obj[~torch.isfinite(obj)]
        return str(bad.flatten()[0].item()) if bad.numel() else None
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    return next((found for found in map(_first_nonfinite, values) if found is not None), None)


@dataclass
class Straggler:
    """The slowest rank of a log window, against the median of the others (seconds per step)."""

    rank: int
    slowest_s: float
    others_s: float
    first_step: int
    last_step: int

    def describe(self) -> str:
        return (f"straggler: rank {self.rank} takes {self.slowest_s * 1e3:.1f} ms per step for its own work "
                f"(data, forward), the other ranks {self.others_s * 1e3:.1f} ms (median): every rank waits "
                f"about {(self.slowest_s - self.others_s) * 1e3:.0f} ms per step for it "
                f"(steps {self.first_step}-{self.last_step})")


class Stragglers:
    """Decides when a slow rank is reported: the same rank slowest by a wide margin in two
    windows in a row, then again only if another rank becomes the slowest or its lead doubles.

    A wide margin: at least ``min_s`` per step and ``share`` of the step's wall time, so a
    healthy run's jitter between ranks is never reported.
    """

    def __init__(self, share: float = 0.1, min_s: float = 0.005) -> None:
        self.share, self.min_s = share, min_s
        self._candidate: Optional[int] = None
        self._reported: Optional[Straggler] = None
        #: The worst straggler seen in the run (for the summary), if any was reported.
        self.worst: Optional[Straggler] = None

    def window(self, own_s: Sequence[float], steps: int, step_s: float, last_step: int) -> Optional[Straggler]:
        """One window's own seconds per rank (over ``steps`` steps of ``step_s`` wall seconds each);
        returns the straggler to report now, if any."""
        if len(own_s) < 2 or steps <= 0:
            return None
        per_step = [s / steps for s in own_s]
        rank = max(range(len(per_step)), key=per_step.__getitem__)
        others = statistics.median(per_step[:rank] + per_step[rank + 1:])
        lead = per_step[rank] - others
        if not (math.isfinite(lead) and lead >= self.min_s and lead >= self.share * step_s):
            self._candidate = None
            return None
        seen_before, self._candidate = self._candidate == rank, rank
        if not seen_before:
            return None
        found = Straggler(rank, per_step[rank], others, last_step - steps + 1, last_step)
        last = self._reported
        if last is not None and last.rank == rank and lead < 2 * (last.slowest_s - last.others_s):
            return None
        self._reported = found
        if self.worst is None or lead > self.worst.slowest_s - self.worst.others_s:
            self.worst = found
        return found


# Not frozen (as WindowTotals): a frozen dataclass is slower to make, and one is made at every log row.
@dataclass(slots=True)
class Row:
    """A row of ``metrics.csv`` (and of the tracker). Read-only."""

    kind: str                        # "step" (a log row), "epoch", "stop" (a run stopped inside an epoch), "recovery",
    #                                  "eval" (an evaluation every --eval-every steps)
    epoch: int                       # counted from 1, as in metrics.csv
    step: int
    samples: int
    values: dict[str, Any]           # the other columns (keys of output.metrics.METRIC_COLUMNS; None: empty)
    totals: Optional[WindowTotals] = None   # a log row's window, reduced over ranks
    steps: int = 0                   # a log row's steps in the window
    step_s: float = 0.0              # ... and their wall seconds per step


def check_health(row: Row, totals: WindowTotals, stragglers: Stragglers, out: Optional[Path],
                 checkpointer: Checkpointer, loader: Any) -> None:
    """On a log row's all-reduced ``totals`` (every rank alike): a straggling rank gets a line
    (``stragglers``, the run's watch); a non-finite loss stops the run on every rank (after rank 0
    wrote the row that shows it), naming the data (``loader``'s) when a sample of the step it began
    at is not finite, and the run directory ``out``."""
    straggler = stragglers.window(totals.own_s, row.steps, row.step_s, row.step)
    if straggler is not None:
        checkpointer.say(straggler.describe())
    if totals.samples > 0 and not math.isfinite(totals.loss):
        raise stopped_on_nonfinite(f"the training loss became {totals.loss}", totals.first_bad or row.step, row.epoch,
                                   out, checkpointer.last_step, totals.bad_ranks, len(totals.own_s), loader)


# --- a log row's tokens/s and MFU -----------------------------------------------------------------

@dataclass(frozen=True)
class Throughput:
    """What a run's speed columns are computed from (see the module docstring); None: not known."""

    tokens_per_sample: Optional[int] = None     # token data: the positions of a sample; None: not token data
    flops_per_token: Optional[float] = None     # the model's training FLOPs of one token
    peak_flops_per_s: Optional[float] = None    # of all devices together

    def tokens(self, samples: int, counted: Optional[float] = None) -> Optional[float]:
        """The tokens in ``samples`` trained samples: ``counted`` (the steps' count of positions
        whose target enters the loss) where given, else every position; None: not token data."""
        if self.tokens_per_sample is None:
            return None
        return counted if counted is not None else float(samples * self.tokens_per_sample)

    def values(self, tokens: Optional[float], seconds: float) -> dict[str, Optional[float]]:
        """A log row's ``tokens_per_s`` and ``mfu`` (None: left blank) for ``tokens`` trained in
        ``seconds``; nothing for data that are not tokens."""
        if tokens is None:
            return {}
        rate = tokens / max(seconds, 1e-9)
        known = self.flops_per_token is not None and self.peak_flops_per_s is not None
        return {"tokens_per_s": rate,
                "mfu": rate * self.flops_per_token / self.peak_flops_per_s if known else None}


def throughput_of(model: nn.Module, info: DataInfo, precision: str, env: DistEnv) -> Throughput:
    """The run's :class:`Throughput`: ``model`` as built (whole, unwrapped) for data ``info``,
    trained in ``precision`` on every rank of ``env``."""
    if info.task != "lm" or len(info.input_shape) != 1:
        return Throughput()
    positions = int(info.input_shape[0])
    peak = datasheet_peak(env.device, precision)
    return Throughput(tokens_per_sample=positions, flops_per_token=flops_per_token(model, positions),
                      peak_flops_per_s=peak.flops_per_s * env.world_size if peak is not None else None)


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs (forward and backward) of one token of a sequence of ``seq_len``: 6 N plus the
    attention's 12 x layers x width x ``seq_len`` where the model says its shape (module docstring)."""
    attention = attention_shape(model)
    scores = 12.0 * attention[0] * attention[1] * seq_len if attention is not None else 0.0
    return 6.0 * multiplied_parameters(model) + scores


def multiplied_parameters(model: nn.Module) -> int:
    """The parameter elements a token is multiplied by: all distinct ones but the tables of
    ``nn.Embedding`` layers that nothing else uses (a lookup is no multiplication; a table tied to
    the output layer is one)."""
    looked_up = {id(m.weight): m.weight for m in model.modules() if isinstance(m, nn.Embedding)}
    for module in model.modules():
        if not isinstance(module, nn.Embedding):
            for p in module.parameters(recurse=False):
                looked_up.pop(id(p), None)
    return sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in looked_up.values())


def attention_shape(model: nn.Module) -> Optional[tuple[int, int]]:
    """``(layers, attention width)`` of a transformer that says them: TinyGPT, a transformers
    model (its ``config``: heads x head size), nanoGPT's GPT (``config.n_layer``, ``n_embd``); else None."""
    if isinstance(model, TinyGPT):
        return len(model.blocks), model.tok_emb.embedding_dim
    config = getattr(model, "config", None)
    layers = _int_attr(config, "num_hidden_layers", "n_layer")
    heads = _int_attr(config, "num_attention_heads", "n_head")
    width = _int_attr(config, "hidden_size", "n_embd")
    if layers is None or width is None:
        return None
    head_dim = _int_attr(config, "head_dim")   # where it is not width / heads (Gemma's)
    return layers, heads * head_dim if heads is not None and head_dim is not None else width


def _int_attr(config: Any, *names: str) -> Optional[int]:
    """The first of ``names`` that ``config`` holds as a positive int."""
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
