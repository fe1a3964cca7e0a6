"""When ranks talk about a window, and the reference count R: the one owner of both.

What a window will do is decided in two steps when it opens: its :class:`Plan` (known, made
alone by :func:`local_plan`, or asked of the ranks: :meth:`RankAgreement.agree`, one all-gather), then
:func:`window_setup`, a pure function of the plan, the request, the :class:`~gradaccum._state.AccumulatorState`
and the :class:`Rules` (R, the padding), testable without any rank.
After the boundary :meth:`RankAgreement.learn` keeps what the window taught in the state.

**Agreement.** Under data parallelism every rank must run a forward in each window (DDP and FSDP2
run collectives in forward), and under FSDP2 (or ``reduce_every_micro_batch``) every rank must run
as many micro-batches as the busiest. When a window opens, the ranks exchange how many micro-batches
and items each holds (one small all-gather): a rank with fewer pads with zero-weight repeats of a
micro-batch it ran before (``AccumulatorState.padding_batch``), or, where it cannot, every rank raises the
same error, so none waits in a collective.

**Asking only when a rank can differ.** The agreement is skipped when every rank can know the
counts without asking: a :class:`~gradaccum.WindowSampler` knows every rank's share of every window
(:meth:`RankAgreement.known_plan`), a ``DistributedSampler`` loader gives every rank as many batches
(:meth:`RankAgreement.equal_shares`; their items are still summed at the boundary); and under DDP, once every rank has a micro-batch to pad with
(learned at the previous boundary, whose one all-reduce carries that flag), a rank decides alone: it
runs its own micro-batches, or one zero-weight repeat when it has none (:func:`local_plan`).
So in the steady state a window costs one small collective (the boundary's) and no host
synchronisation before its first forward. FSDP2, ``reduce_every_micro_batch`` and hand-written
windows opened without ``pad=True`` still ask, since a rank there can differ in a way the others
must know before the first forward.

**R** (see :mod:`gradaccum._maths` for the maths) must be the same on every rank. Where the window's
N is known before its first backward on every rank (one process: its own count; a sampler's shares; an
exact ``MoELoss``'s counting pass),
R = N: the boundary scale is 1 and every backward weighs ``n_k W / N`` as one big batch does. Across
DDP ranks without a sampler, R is the last window's N (``AccumulatorState.last_window_items``, the
same on every rank, saved), and the boundary's one all-reduce, which carries this window's N, rescales
the reduced gradient by ``R / N`` (nothing to do where windows repeat their N): one small collective
per window. Only a window with no N before it (the first) counts first: :meth:`RankAgreement.open`
starts one small all-reduce of the ranks' counts as the window opens, which overlaps its first forward
and is read at its first backward (:class:`CountedFirst`); DeepSpeed, whose gradient sits in the
engine's partitions where no rescale reaches it, counts first in every window. Whether a window counts
first is decided from what every rank shares (every rank counted up front in the last window:
``AccumulatorState.counts_first``), so no rank waits alone in that all-reduce. Where no
count is known at all (a hand-written window without ``num_items``, before any window had items) R is
the running one, fixed once at its first use by a max all-reduce of the first count
(:meth:`gradaccum._maths.WindowWeights.fix_reference`) and kept in ``state_dict``. When ``loss_fn``
counts other items than those counted up front (tokens of sequences), an R from an up-front count is N
times the last window's ratio of the two (``AccumulatorState.count_ratio``, saved), which keeps R near
the count the backward really divides (what fp16's loss scale needs) and the scale near 1. Every R is a
function of the saved state and the window itself, so a resumed process rounds as the uninterrupted one
did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence

import torch
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from ._checks import Count, as_number
from ._maths import count_dtype
from ._state import AccumulatorState
from .batching import Batch, leading_dim
from .errors import RankAgreementError
from .sync import GradSync

if TYPE_CHECKING:
    from ._boundary import Outcome

__all__ = ["Plan", "Request", "Setup", "CountedFirst", "Rules", "RankAgreement", "padded_count",
           "local_plan", "window_setup"]


class Plan(NamedTuple):
    """What every rank agreed on when a window opened.

    Attributes:
        micro_batches: this rank's micro-batches.
        most, fewest: the largest and smallest count on any rank.
        items: the window's global item count when every rank knew its own before the first
            backward (then it is R, and the boundary scale is 1); else None.
        asked: the ranks exchanged counts for this plan (an all-gather), rather than knowing them.
    """

    micro_batches: int
    most: int
    fewest: int
    items: Optional[float]
    asked: bool = False


class Request(NamedTuple):
    """What a window asks for when it opens.

    Attributes:
        micro_batches: this rank's micro-batches, flush included (None for a hand-written window
            opened without a size).
        items: this rank's items, when known before the first backward.
        can_pad: this rank can run zero-weight micro-batches if the agreement asks it to
            (:meth:`RankAgreement.can_pad`).
        defer: the window's gradient reduction waits for its boundary (the out-of-memory back-off:
            no collective before the ranks agree on an error).
        plan: the plan, when the caller knows it already (``train()``: a WindowSampler's shares, or an
            agreement it asked for before deciding to open the window).
        flush: zero-weight micro-batches the caller runs first, counted in ``micro_batches`` (the
            out-of-memory back-off's first forward under DDP). Not padding: padding is what the
            agreement asks of this rank (:attr:`Setup.padding`).
    """

    micro_batches: Optional[int]
    items: Optional[Count] = None
    can_pad: bool = False
    defer: bool = False
    plan: Optional[Plan] = None
    flush: int = 0


class Setup(NamedTuple):
    """Everything a window needs from the ranks, decided once when it opens (:func:`window_setup`).

    Attributes:
        plan: the micro-batch counts (None for a window opened without a size).
        reference: R when it is known up front, else None (fixed at the first backward,
            :meth:`gradaccum._maths.WindowWeights.fix_reference`).
        padding: zero-weight micro-batches the agreement asks this rank to run on top of its own.
        counted: the ranks' count all-reduce started as the window opened, when the plan does not carry
            N but every rank counted its items up front (:meth:`RankAgreement.open`); R is N, read at
            the first backward. Else None.
    """

    plan: Optional[Plan]
    reference: Optional[float]
    padding: int = 0
    counted: Optional["CountedFirst"] = None

    @property
    def items(self) -> Optional[float]:
        """The window's global N as counted before its first backward (by the plan, or by the count
        all-reduce once read), else None."""
        if self.plan is not None and self.plan.items is not None:
            return self.plan.items
        return self.counted.value if self.counted is not None else None

class CountedFirst:
    """The window's global N, counted first: the sum of every rank's up-front count in one small
    all-reduce, started as the window opens (so that it overlaps the first forward) and read on the
    host at the first backward (:meth:`wait`), where the weights need it. A rank without an up-front
    count this time still takes part, with nan: then no rank has N, and the window's R runs. On one
    process: the count.

    >>> CountedFirst(GradSync(), torch.device("cpu"), 12).wait(), CountedFirst(GradSync(), torch.device("cpu"), None).wait()
    (12.0, None)
    """

    __slots__ = ("tensor", "work", "value", "read")

    def __init__(self, sync: GradSync, device: torch.device, items: Optional[Count]) -> None:
        self.tensor = torch.tensor([math.nan if items is None else as_number(items)], dtype=count_dtype(device),
                                   device=device)
        self.work = sync.all_reduce_async(self.tensor)
        #: N once read, the same on every rank; None before :meth:`wait`, or where some rank had no count
        self.value: Optional[float] = None
        self.read = False

    def wait(self) -> Optional[float]:
        """N (the first call waits for the all-reduce: one host sync), or None where a rank had no count."""
        if not self.read:
            if self.work is not None:
                self.work.wait()
            n = float(self.tensor.item())
            self.value, self.read = (None if math.isnan(n) else n), True
        return self.value


@dataclass(frozen=True)
class Rules:
    """What the Accumulator's configuration says about every window, for :func:`window_setup`.

    Attributes:
        shares_windows: several ranks train each window together (:attr:`gradaccum.sync.GradSync.shares_windows`).
        needs_equal_counts: every rank runs as many micro-batches as the busiest (FSDP2,
            ``reduce_every_micro_batch``), else at least one (DDP's forward collectives).
        reference_is_count: R must be the window's own N, known up front (the gradient cannot be
            rescaled at the boundary: :attr:`gradaccum.sync.GradSync.needs_count_first`, DeepSpeed).
    """

    shares_windows: bool
    needs_equal_counts: bool
    reference_is_count: bool = False


def padded_count(count: int, most: int, equal_counts: bool) -> int:
    """How many micro-batches a rank runs when the busiest runs ``most``: as many under syncs with a
    collective in every micro-batch, else at least one (DDP's forward collectives).

    >>> padded_count(0, 3, equal_counts=False), padded_count(1, 3, equal_counts=True), padded_count(0, 0, False)
    (1, 3, 0)
    """
    if equal_counts:
        return most
    return max(count, 1) if most > 0 else 0


def local_plan(state: AccumulatorState, rules: Rules, request: Request) -> Optional[Plan]:
    """A plan this rank can make alone, or None when the ranks must agree first.

    >>> alone = Rules(shares_windows=False, needs_equal_counts=False)
    >>> local_plan(AccumulatorState(), alone, Request(3, items=12))
    Plan(micro_batches=3, most=3, fewest=3, items=12.0, asked=False)
    """
    n = request.micro_batches
    assert n is not None, "a window opened without a size has no plan"
    if not rules.shares_windows:
        return Plan(n, n, n, None if request.items is None else float(request.items))
    if rules.needs_equal_counts or not request.can_pad or not state.peers_can_pad:
        return None
    return Plan(n, max(n, 1), n, None)  # DDP: at least one forward, a repeat where none


def window_setup(state: AccumulatorState, rules: Rules, request: Request,
                 plan: Optional[Plan]) -> Setup:
    """What a window will do, from its plan: R and its padding. Every
    input is the same on every rank, so every rank decides alike; nothing here talks to the ranks.

    >>> alone = Rules(shares_windows=False, needs_equal_counts=False)
    >>> window_setup(AccumulatorState(), alone, Request(2, items=10), Plan(2, 2, 2, 10.0))
    Setup(plan=Plan(micro_batches=2, most=2, fewest=2, items=10.0, asked=False), reference=10.0, padding=0, counted=None)
    """
    reference = _reference(state, rules, plan, request.items)
    padding = 0
    if plan is not None and request.micro_batches is not None and plan.most != plan.fewest:
        padding = max(0, padded_count(plan.micro_batches, plan.most, rules.needs_equal_counts) - plan.micro_batches)
    # the agreement refused, on every rank alike, any window where a rank that must pad cannot
    assert padding == 0 or request.can_pad, "the agreement lets no rank pad that cannot"
    return Setup(plan, reference, padding)


def _reference(state: AccumulatorState, rules: Rules, plan: Optional[Plan],
               num_items: Optional[Count]) -> Optional[float]:
    """R for a window when it opens, the same on every rank: N times ``state.count_ratio`` (1 when
    ``loss_fn`` counts the items counted up front: then R = N exactly), where N is known now (the
    plan's, or one process's own count); None where it is not: R is then N counted first
    (:class:`CountedFirst`, read at the first backward) or, without an up-front count, the running R
    (:meth:`gradaccum._maths.WindowWeights.fix_reference`). Under DeepSpeed (``reference_is_count``)
    R is N itself, or nothing (then the first backward refuses the window)."""
    across = rules.shares_windows
    known = plan.items if plan is not None else (as_number(num_items) if num_items is not None and not across
                                                 else None)
    if rules.reference_is_count:
        return None if known is None else (known if known > 0 else 1.0)  # 0 items: every weight is 0 anyway
    if rules.shares_windows and not rules.needs_equal_counts and state.last_window_items is not None \
            and (plan is None or plan.items is None or plan.asked):
        # DDP, N not known up front (a sampler's, the MoE counting pass's): the last window's N, saved; also
        # where the ranks were asked (a resumed first window), so that it rounds as the uninterrupted run did
        return state.last_window_items
    if not known:
        return None
    return known * state.count_ratio if plan is not None else known  # a window without a size counts as it says


class RankAgreement:
    """When ranks talk about a window: the agreement when it opens, R's first fixing, and what the
    ranks told each other at its boundary, kept in the :class:`~gradaccum._state.AccumulatorState`.

    Args:
        state: the Accumulator's state (read and changed here: R, the counts' source, the padding batch).
        rules: what the configuration says about every window.
    """

    def __init__(self, sync: GradSync, device: torch.device, state: AccumulatorState, rules: Rules) -> None:
        self.sync, self.device, self.state, self.rules = sync, device, state, rules

    def set_padding(self, micro_batch: Batch) -> None:
        leading_dim(micro_batch, argument="micro_batch")
        self.state.padding_batch = micro_batch

    def remember(self, micro_batch: Batch) -> None:
        """The last micro-batch this rank ran, kept (across ranks only) to pad a later window with."""
        if self.rules.shares_windows:
            self.state.padding_batch = micro_batch

    def can_pad(self, will_pad: bool) -> bool:
        """Whether this rank can run a zero-weight micro-batch in a window: the caller will pad itself
        (it has data of its own in the window to repeat, or a hand-written loop opened with ``pad=True``),
        or it holds a micro-batch it ran before or was given (``state.padding_batch``)."""
        return will_pad or self.state.padding_batch is not None

    def open(self, request: Request) -> Setup:
        """The one call a window makes when it opens: its plan (known, made alone, or asked of the
        ranks), then :func:`window_setup`."""
        plan = request.plan
        if plan is None and request.micro_batches is not None:
            plan = (local_plan(self.state, self.rules, request)
                    or self.agree(request.micro_batches, request.items, request.can_pad))
        setup = window_setup(self.state, self.rules, request, plan)
        if self.rules.shares_windows and self.counts_first(plan):  # every rank reads N at its first backward
            setup = setup._replace(counted=CountedFirst(self.sync, self.device, request.items))
        return setup

    def reference(self, setup: Setup) -> Optional[float]:
        """R for a window that has opened: the setup's, or, where the window counts first, N times the
        count ratio, read now (the first backward; :class:`CountedFirst`)."""
        if setup.counted is None:
            return setup.reference
        assert setup.plan is not None, "only a window with a plan counts first"
        n = setup.counted.wait()
        return None if n is None else _reference(self.state, self.rules, setup.plan._replace(items=n), None)

    def counts_first(self, plan: Optional[Plan]) -> bool:
        """Whether the window's N is counted across ranks as it opens: its plan (made alone, over equal
        shares, or a sampler's without its item shares) does not carry N, and in the last window
        every rank had counted its items up front (``state.counts_first``). Every rank
        decides alike, from what every rank shares, so none waits alone in the all-reduce: a rank
        without a count this time sends nan, and the window's R runs on every rank. An asked plan
        already carries N, or says that some rank has no count (then R runs)."""
        return (self.rules.shares_windows and plan is not None and not plan.asked and plan.items is None
                and self.state.counts_first and (self.rules.reference_is_count or self.state.last_window_items is None))

    def known_plan(self, mine: int, counts: Sequence[int], items: Optional[float]) -> Optional[Plan]:
        """The plan from every rank's micro-batch count, known without asking (a WindowSampler), or
        None when some rank must pad and may not be able to (then the ranks ask, and refuse together).
        ``items``, when the items counted are the sampler's."""
        most, fewest = max(counts), min(counts)
        pads = any(padded_count(c, most, self.rules.needs_equal_counts) > c for c in counts)
        if pads and not self.state.peers_can_pad:
            return None
        return Plan(mine, most, fewest, items)

    def agree(self, micro_batches: int, num_items: Optional[Count], can_pad: bool) -> Plan:
        """Every rank's micro-batch count and up-front item count, from one small all-gather."""
        if not self.rules.shares_windows:
            plan = local_plan(self.state, self.rules, Request(micro_batches, num_items))
            assert plan is not None
            return plan
        known = num_items is not None
        mine = torch.tensor([float(micro_batches), 0.0 if num_items is None else as_number(num_items),
                             1.0 if known else 0.0, 1.0 if can_pad else 0.0],
                            dtype=count_dtype(self.device), device=self.device)
        rows = self.sync.all_gather(mine).tolist()  # the agreement's one host synchronisation
        counts = [int(r[0]) for r in rows]
        plan = Plan(micro_batches, max(counts), min(counts),
                          sum(r[1] for r in rows) if all(r[2] for r in rows) else None, asked=True)
        stuck = [r for r, row in enumerate(rows)
                 if padded_count(int(row[0]), plan.most, self.rules.needs_equal_counts) > row[0] and not row[3]]
        if stuck:  # every rank sees the same rows: every rank raises, none waits in a collective
            raise RankAgreementError(
                f"{type(self.sync).__name__} needs every rank to run "
                f"{'as many micro-batches as the busiest' if self.rules.needs_equal_counts else 'a forward'} in "
                f"each window (collectives run in forward), but rank(s) {stuck} run fewer "
                f"({', '.join(str(int(rows[r][0])) for r in stuck)} of up to {plan.most}) and cannot pad: in "
                "a hand-written loop open the window with acc.window(n, pad=True) and run window.padding "
                "zero-weight micro-batches (window.backward_padding); with step()/train(), a rank with no "
                "data yet needs acc.set_padding(micro_batch)"
            )
        return plan

    def equal_shares(self, loader: Any) -> bool:
        """Whether every rank's loader yields as many batches as every other's this epoch, so that no
        window needs an agreement on micro-batch counts: a ``DistributedSampler`` over all the ranks (it
        pads or drops to equal per-rank lengths) batched by torch's own ``BatchSampler``, confirmed once
        per epoch by one small all-gather of the batch count. The items are not assumed equal (a
        collate_fn may drop rows, a rank may hold another dataset): the boundary still sums them."""
        if not self.rules.shares_windows:
            return False
        sampler, batch_sampler = getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)
        fits = (isinstance(sampler, DistributedSampler) and type(batch_sampler) is BatchSampler
                and batch_sampler.sampler is sampler and sampler.num_replicas == self.sync.group_size)
        # every rank gathers, whatever its own loader is, so that no rank waits alone in the collective
        shape = [1.0, float(len(batch_sampler))] if fits and batch_sampler is not None else [0.0, 0.0]
        rows = self.sync.all_gather(torch.tensor(shape, dtype=count_dtype(self.device), device=self.device)).tolist()
        return all(row == rows[0] for row in rows) and rows[0][0] == 1.0

    def largest(self, value: float) -> float:
        """The largest ``value`` on any rank (one host sync and, across ranks, one max all-reduce): how
        the running R is agreed when it is fixed (:meth:`gradaccum._maths.WindowWeights.fix_reference`)."""
        if not self.rules.shares_windows:
            return float(value)
        return float(self.sync.all_reduce_(torch.tensor([float(value)], device=self.device), "max").item())

    def learn(self, setup: Setup, outcome: "Outcome") -> None:
        """After a boundary that did not raise, on every rank: the same global numbers on every rank
        give the same ratio and R. What the ranks told each other (can pad, counts from loss_fn,
        counted first) is kept."""
        state = self.state
        num_items = outcome.num_items
        upfront = setup.items
        if upfront and num_items > 0:
            state.count_ratio = num_items / upfront
        state.counts_from_loss_fn = outcome.counts_from_loss_fn
        if self.rules.shares_windows:
            state.counts_first, state.peers_can_pad = outcome.counted_first, outcome.peers_can_pad
