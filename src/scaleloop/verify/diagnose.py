"""Name the reason a distributed run differs from one process, from the evidence verify gathered.

Each rule looks at one kind of evidence (the probes on the model and loss, the data the ranks
recorded, a failed run's error, the gradients each rank did or did not get) and, where it
applies, names the cause and says what to change. Order: what certainly breaks equality first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from scaleloop.config import TrainConfig
from scaleloop.data.sampler import split_sizes
from scaleloop.verify.probes import LossSplit, PaddedLoss, Probes


@dataclass(frozen=True)
class Cause:
    """One named reason, with what was seen and what to do."""

    title: str
    detail: str

    def lines(self) -> list[str]:
        return [f"  - {self.title}: {self.detail}"]


def piece_groups(step_samples: int, world: int, accumulate: int, ref_accumulate: int) -> list[list[int]]:
    """Sizes of the distributed pieces (micro-step x rank), grouped by the reference's pieces.

    The loader cuts a step into ``accumulate`` contiguous micro-steps and each into ``world``
    contiguous rank blocks; the reference cuts it into ``ref_accumulate`` (1, or the same).
    """
    pieces = [split_sizes(m, world) for m in split_sizes(step_samples, accumulate)]
    if ref_accumulate == accumulate:
        return pieces
    return [[s for p in pieces for s in p]]


def _names(items: Sequence[str], k: int = 4) -> str:
    return ", ".join(items[:k]) + (f" and {len(items) - k} more" if len(items) > k else "")


def name_causes(cfg: TrainConfig, *, world: int, accumulate: int, step_samples: int,
                probes: Optional[Probes], step_problems: Sequence[str] = (),
                content_problems: Sequence[str] = (), no_grad: Sequence[str] = (),
                data_draws: Optional[str] = None) -> list[Cause]:
    """Every cause that applies, most certain first (empty: none of the known ones).

    ``data_draws``: ``probes.sample_draws`` of a sample whose data differed ("global",
    "private"), when reading a sample draws random numbers.
    """
    causes: list[Cause] = []
    if content_problems:
        seen = f"{content_problems[0]}{' (and more)' if len(content_problems) > 1 else ''}"
        causes.append(_augmented(seen, data_draws) if data_draws else Cause(
            "ranks loaded different data",
            f"{seen}; every process must build the same dataset: seed any randomness in the dataset factory, "
            "sort file lists"))
    if step_problems:
        causes.append(Cause(
            "padded, duplicated or missing samples",
            f"{step_problems[0]}{' (and more)' if len(step_problems) > 1 else ''}; a sampler that pads "
            "(torch's DistributedSampler) repeats samples so that every rank gets as many: those count twice"))
    if probes is not None:
        causes += _model_causes(cfg, probes, world, accumulate, step_samples)
    unused = list(no_grad) or (probes.unused if probes is not None and probes.unused else [])
    # Only DDP without its options mistrains them; every other strategy trains them as one process.
    if unused and cfg.parallel.strategy == "ddp" and not (cfg.parallel.find_unused_parameters or cfg.parallel.static_graph):
        causes.append(Cause(
            "unused parameters",
            f"{_names(unused)} got no gradient; DDP without --find-unused-parameters never all-reduces them "
            "(scaleloop stops the run at the first step where a rank gets none): add --find-unused-parameters "
            "(--static-graph if the same ones are unused every step), or remove or freeze them"))
    if (probes is not None and not probes.batchnorm and probes.coupling is not None
            and probes.coupling > 1e-4 and world > 1):
        causes.append(Cause(
            "a layer couples the samples of a batch",
            f"the model's outputs for the whole batch and for its per-rank pieces differ by "
            f"{probes.coupling:.2e} of the largest output, and it has no BatchNorm: a layer uses statistics "
            "of its batch; make it synchronise them over ranks, as --sync-batchnorm does for BatchNorm"))
    return causes


def _model_causes(cfg: TrainConfig, probes: Probes, world: int, accumulate: int, step_samples: int) -> list[Cause]:
    """What the probes on the model and its loss name: BatchNorm, randomness, the loss's normalisation."""
    causes: list[Cause] = []
    per_rank = step_samples // max(1, world * accumulate)
    if probes.batchnorm and not cfg.parallel.sync_batchnorm and world > 1:
        fix = ("nn.DataParallel runs BatchNorm on each GPU's chunk and cannot synchronise it; use "
               "--strategy ddp --sync-batchnorm" if cfg.parallel.strategy == "dp" else
               "run with --sync-batchnorm (torch.nn.SyncBatchNorm on CUDA, scaleloop's GlobalBatchNorm on CPU)")
        causes.append(Cause(
            "BatchNorm without SyncBatchNorm",
            f"{_names(probes.batchnorm)} normalise each rank's {per_rank} samples with their own mean and "
            f"variance, while one process normalises all {step_samples // accumulate}; {fix}"))
    own = probes.randomness
    if own is not None and (own.reseeds or own.private):
        causes.append(_own_randomness(own.reseeds))
    elif probes.random or (probes.random is None and probes.dropout):
        what = ("random layers " + _names(probes.dropout) if probes.dropout
                else "the forward pass draws random numbers")
        causes.append(Cause(
            "dropout or RNG differs per rank",
            f"{what}; each rank seeds its generator with seed + rank, so its random masks are not those one "
            "process draws for the same samples: exact equality cannot hold; verify with dropout set to 0 "
            "(the same code path then proves the rest)"))
    if world * accumulate > 1:
        pieces = f"pieces that {world} ranks x {accumulate} micro-step(s) compute"
        causes += _loss_causes(probes.loss, pieces, world * accumulate)
        causes += _own_padded_causes(probes.own_padded, pieces)
    return causes


def _loss_causes(split: Optional[LossSplit], pieces: str, n: int) -> list[Cause]:
    """A loss whose batch value is the sum of its pieces', normalised per piece, or holding a term of the batch."""
    if split is None:
        return []
    pieces = f"the {split.pieces} {pieces}"
    if split.kind == "sum":
        return [Cause(
            "loss summed over samples, not averaged",
            f"a batch's loss ({split.whole:.6g}) is the sum of the losses of {pieces} ({split.total:.6g}), not "
            "their sample-weighted mean; scaleloop weights each micro-batch's loss by its share of the step, "
            f"as a mean needs, so the distributed gradient is 1/{n} of one process's; "
            "return the mean over the batch")]
    differs = (f"a batch's loss ({split.whole:.6g}) is not the sample-weighted mean ({split.weighted_mean:.6g}) of "
               f"the losses of {pieces}")
    if split.kind == "count":
        return [Cause(
            "loss normalised per micro-batch instead of per global batch",
            f"{differs}, but a mean weighted by counts that come from the targets alone: the loss divides by a "
            "count of its own piece (valid tokens, unmasked samples, ignore_index, per-batch weights), so each "
            "piece gets an equal say whatever its count; divide the summed loss by the count over the whole "
            "global batch (all ranks and micro-steps) instead, or weight every sample equally")]
    if split.kind == "batch":
        return [Cause(
            "the loss holds a term of the whole batch that is not a mean over its samples",
            f"{differs}, and no count of each piece's targets weighs them into it (the weight of two halves in "
            "their union moves when only the outputs change): the loss adds a term computed from the batch as a "
            "whole (a penalty on the batch's mean output or logit, its variance or norm), which each rank "
            "computes from its own piece only, and the pieces' terms do not add up to the whole batch's: "
            "exact equality cannot hold with it; make the term a mean of per-sample terms (e.g. "
            "out.mean(dim=1).pow(2).mean() for out.mean().pow(2)), or compute the batch statistic over all ranks "
            "(all-reduced) before the penalty, or verify without the term (the same code path then proves the rest)")]
    if split.kind == "other":
        return [Cause(
            "the loss is not a per-sample mean",
            f"{differs}: it divides by a count of its own piece (valid tokens, ignore_index, per-batch weights), "
            "or it holds a term of the whole batch (a penalty on a batch statistic), which could not be told apart "
            "here; divide by the count over the whole global batch, and make every term a mean over samples")]
    return []


def _own_padded_causes(padded: Optional[PaddedLoss], pieces: str) -> list[Cause]:
    """A model's own loss over -100 padding that the run could not make exact."""
    if padded is None or padded.split.kind == "mean":
        return []
    split = padded.split
    pieces = f"the {split.pieces} {pieces}"
    each = set(padded.positions)
    counts = (f"{_names([str(r) for r in padded.real], 8)} real targets (labels other than -100) of "
              + (f"{each.pop()} labels each" if len(each) == 1 else _names([str(p) for p in padded.positions], 8)))
    if any(r < p for r, p in zip(padded.real, padded.positions)) and len(set(padded.real)) > 1:
        return [Cause(
            "the model's own loss is a mean over each micro-batch's real tokens, and the micro-batches hold "
            "different counts of -100 padding",
            f"the model's own loss of a batch ({split.whole:.6g}) is not the sample-weighted mean "
            f"({split.weighted_mean:.6g}) of the losses of {pieces}, which hold {counts}: the model divides "
            "by its own micro-batch's count, so a micro-batch with more padding weighs more, and scaleloop cannot "
            "tell this model the step's count (it tells a Hugging Face causal "
            "LM, as num_items_in_batch); exact equality cannot hold with this loss: return the logits without "
            "the loss and let scaleloop compute it over the whole step's real targets (labels that are each "
            "position's target, -100 where there is none), or verify on data without padding (the same code "
            "path then proves the rest)")]
    return [Cause(
        "loss normalised per micro-batch instead of per global batch",
        f"the model's own loss of a batch ({split.whole:.6g}) is not the sample-weighted mean "
        f"({split.weighted_mean:.6g}) of the losses of {pieces}: it divides by a count of its own piece; "
        "compute it as the mean over the batch's samples, or return the logits and let scaleloop compute it")]


def _augmented(seen: str, draws: str) -> Cause:
    """Samples read with random augmentation: the advice that makes every process read a sample alike."""
    source = ("the global generator, which each rank seeds with seed + rank" if draws == "global" else
              "a generator of its own (numpy, random, or a torch.Generator) that no seed makes the same on every rank")
    return Cause(
        "samples are augmented at random per rank",
        f"{seen}; reading a sample (the dataset's __getitem__) draws random numbers from {source}, so a sample "
        "read on a rank is not the sample one process reads; seeding the dataset factory does not help, as the "
        "draws happen at every read: draw the augmentation from a generator seeded by the sample's index "
        "(and the epoch), e.g. g = torch.Generator().manual_seed(seed * 1_000_003 + index) in __getitem__, so "
        "that any process reads sample i the same way")


def _own_randomness(reseeds: bool) -> Cause:
    """The forward draws randomness the global generator's per-rank seeding does not explain."""
    if reseeds:
        return Cause(
            "the forward pass re-seeds the random generator",
            "its random state after a pass does not depend on the state before: the forward calls "
            "torch.manual_seed (or torch.random.set_rng_state) itself; seeded from the rank, every rank "
            "draws its own masks, and seeded alike, every step draws the same ones: exact equality cannot "
            "hold; remove the seeding from forward (scaleloop seeds every process once, from --seed)")
    return Cause(
        "randomness from a generator of the model's own",
        "two forward passes from the same global random state give different outputs: the model draws "
        "from a generator of its own (a torch.Generator it keeps, numpy or random), which differs per rank "
        "(seeded from the rank, or not at all) and is outside what --seed controls: exact equality cannot "
        "hold; draw from the global generator (torch.rand/randn without generator=), or verify with the "
        "noise turned off")


def rank_code_cause(ranks: Sequence[int], probes: Optional[Probes]) -> Optional[Cause]:
    """Ranks whose output for the same inputs, weights and seed differs from rank 0's, when no
    randomness of the model's own explains it: code that depends on the rank."""
    own = probes.randomness if probes is not None else None
    if not ranks or (own is not None and (own.private or own.reseeds)):
        return None
    return Cause(
        "rank-dependent code",
        f"with the same weights, the same inputs and the same random seed, rank(s) "
        f"{', '.join(str(r) for r in ranks)} compute another output than rank 0 (before any step): the "
        "forward pass depends on the rank (a branch on dist.get_rank() or the RANK/LOCAL_RANK variables, a "
        "per-rank device, file or table); make every rank compute the same function")


def fallback(cfg: TrainConfig, first_failure: Optional[str]) -> Cause:
    """When no rule applies: where the runs part, and what else to look at."""
    where = f"the runs part at {first_failure}" if first_failure else "the runs part"
    hint = (f"; under {cfg.parallel.precision} rounding differs with the batch split: compare with --precision fp32"
            if cfg.parallel.precision != "fp32" else
            "; look for state that differs per rank (rank-dependent code, per-rank buffers) and run --check sync")
    return Cause("no known cause found", where + hint)


def failure_cause(failures: Sequence[dict[str, Any]]) -> Cause:
    """The distributed run stopped: its first error, by step, then time and rank.

    A rank's own error comes before the others' lost connections (``communication``, recorded
    by ``Recorder.fail``): those are its consequences, whatever their step or time.
    """
    first = min(failures, key=lambda f: (bool(f.get("communication")), f["step"], f.get("time") or 0.0, f["rank"]))
    error = (first.get("error") or "?").splitlines()[0]
    if len(error) > 240:
        error = error[:240].rstrip() + " ..."
    where = f" (raised at {first['frame']})" if first.get("frame") else ""
    if first.get("timed_out"):
        waited = ", ".join(str(r) for r in sorted(f["rank"] for f in failures if f.get("timed_out")))
        return Cause("the distributed run stalled",
                     f"rank(s) {waited} gave up at step {first['step']} after --timeout, waiting in "
                     f"{first.get('waiting_in') or 'a collective'}: a rank without an error of its own stopped "
                     "taking part (its output is in torchrun.log); raise --timeout if it was only slow")
    return Cause("the distributed run failed", f"rank {first['rank']} at step {first['step']}: {error}{where}")


def initial_cause(ref_differs: Optional[str], per_rank: Sequence[dict[str, Any]]) -> Optional[Cause]:
    """The models were built differently: rank 0's from the reference's (``ref_differs``: the
    worst tensor), or another rank's from rank 0's (``per_rank``: ``{"rank", "names"}`` each)."""
    if not ref_differs and not per_rank:
        return None
    seen = []
    if ref_differs:
        seen.append(f"rank 0's model as built differs from the one process's ({ref_differs} first)")
    for entry in per_rank[:3]:
        seen.append(f"rank {entry['rank']}'s differs from rank 0's ({_names(entry['names'], 3)})")
    return Cause(
        "initial weights differ per rank",
        "; ".join(seen) + ", before any step: the model factory draws its initial weights from a generator "
        "that is not seeded the same way in every process (its own torch.Generator, numpy or random unseeded, "
        "a seed from the rank, the time or the process id); build the model identically on every rank: "
        "seed before building it (scaleloop seeds torch, numpy and random with --seed just before calling "
        "the factory: use those generators), or load the same initial checkpoint everywhere")


def scale_cause(ratio: Optional[float], *, world: int, accumulate: int,
                probes: Optional[Probes]) -> Optional[Cause]:
    """Step 1's gradients of N processes are exactly ``ratio`` times one process's (see
    ``compare.gradient_ratio``): name the factor, unless the summed-loss probe explains it."""
    if ratio is None:
        return None
    if probes is not None and probes.loss is not None and probes.loss.kind == "sum":
        return None   # a summed loss gives 1/(N x A): named by its own rule
    close = lambda factor: abs(ratio - factor) <= 1e-3 * factor   # noqa: E731
    seen = f"the gradients of the first step are exactly {ratio:.4g} x one process's (same weights, same samples)"
    if world > 1 and (close(1 / world) or close(world)):
        way = "divided" if ratio < 1 else "multiplied"
        return Cause(
            "a manual division (or multiplication) of the loss or gradients by the world size",
            f"{seen}: {world} processes, so the loss or the gradients are {way} by the world size somewhere "
            "(loss / dist.get_world_size(), or gradients scaled after backward); scaleloop already averages "
            "the gradients over the ranks: remove the extra factor")
    if accumulate > 1 and (close(1 / accumulate) or close(accumulate)):
        return Cause(
            "a manual division (or multiplication) of the loss by the accumulation steps",
            f"{seen}: --accumulate {accumulate}; scaleloop already weights each micro-batch's loss by its share "
            "of the step: remove the extra factor")
    return Cause(
        "the loss or gradients are scaled by a constant",
        f"{seen}: something multiplies the loss or the gradients by a factor that depends on the run "
        "(its ranks, its batch per rank); compute the loss as the mean over the batch, unscaled")


def buffer_cause(names: Sequence[str], between_ranks: bool) -> Optional[Cause]:
    """Buffers (saved state that is no parameter) differ from one process's, or between ranks."""
    if not names:
        return None
    where = ("saved state that differs between the ranks at the end" if between_ranks
             else "saved state that differs from the one process's while the parameters agree")
    return Cause(
        "a buffer updated per rank without synchronisation",
        f"{_names(list(names))}: {where}: each rank updates such a buffer from its own share of the batch (an "
        "EMA of the features, a running statistic, a count of samples seen), and rank 0's is what is saved; "
        "compute the update from the whole global batch (all-reduce the batch's statistic over the ranks "
        "before updating), or register it with persistent=False if it need not be saved")
