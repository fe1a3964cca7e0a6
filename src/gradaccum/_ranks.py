"""When ranks talk about a window, and the reference count R: a window's :class:`Plan` (known, made alone or
asked in one all-gather), then R and the padding from it (:func:`window_setup`), then what the boundary taught
(:meth:`RankAgreement.learn`). When they ask and which R: docs/architecture.md, "The ranks' agreement and R"."""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional, Sequence

import torch
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from ._boundary import Exchanged, InFlight
from ._checks import Count, as_number
from ._maths import count_dtype
from ._state import AccumulatorState
from .batching import Batch
from .errors import RankAgreementError
from .sync import GradSync

__all__ = ["Plan", "Request", "Setup", "CountedFirst", "Rules", "RankAgreement", "padded_count",
           "local_plan", "window_setup"]


class Plan(NamedTuple):
    """What the ranks agreed on as a window opened: this rank's micro-batches, the most and fewest on any rank,
    N where every rank counted up front (else None), and whether they ``asked`` (an all-gather)."""

    micro_batches: int
    most: int
    fewest: int
    items: Optional[float]
    asked: bool = False


class Request(NamedTuple):
    """What a window asks for when it opens."""

    micro_batches: Optional[int]  #: this rank's, flush included (None: a hand-written window without a size)
    items: Optional[Count] = None  #: this rank's items, when known before the first backward
    can_pad: bool = False  #: this rank can run zero-weight micro-batches (:meth:`RankAgreement.can_pad`)
    defer: bool = False  #: the gradient reduction waits for the boundary (the out-of-memory back-off)
    plan: Optional[Plan] = None  #: the plan, when the caller knows it already (``train()``)
    #: zero-weight micro-batches the caller runs first, counted in ``micro_batches`` (the out-of-memory
    #: back-off's first forward under DDP); not the padding the agreement asks for
    flush: int = 0


class Setup(NamedTuple):
    """What a window needs from the ranks as it opens: its plan, R when known up front (else None), this rank's
    zero-weight micro-batches on top of its own, and the count all-reduce where it counts first."""

    plan: Optional[Plan]
    reference: Optional[float]
    padding: int = 0
    counted: Optional["CountedFirst"] = None


class CountedFirst:
    """The window's N, counted first: every rank's up-front count summed in one all-reduce started as the
    window opens and read at the first backward. A rank without a count sends nan: then no rank has N.

    >>> CountedFirst(GradSync(), torch.device("cpu"), 12).wait(), CountedFirst(GradSync(), torch.device("cpu"), None).wait()
    (12.0, None)
    """

    __slots__ = ("sum", "value")

    def __init__(self, sync: GradSync, device: torch.device, items: Optional[Count]) -> None:
        mine = torch.tensor([math.nan if items is None else as_number(items)], dtype=count_dtype(device), device=device)
        self.sum: Optional[InFlight] = InFlight(mine, sync.all_reduce_async(mine))  # None once read
        self.value: Optional[float] = None  # N once read; None before, or where some rank had no count

    def wait(self) -> Optional[float]:
        """N (the first call waits for the all-reduce: one host sync), or None where a rank had no count."""
        if self.sum is not None:
            n = float(self.sum.wait().item())
            self.value, self.sum = (None if math.isnan(n) else n), None
        return self.value


class Rules(NamedTuple):
    """What the configuration says about every window: ranks share it; every rank runs as many micro-batches
    as the busiest (FSDP2, ``reduce_every_micro_batch``); R must be N, known up front (DeepSpeed)."""

    shares_windows: bool
    needs_equal_counts: bool
    reference_is_count: bool = False


def padded_count(count: int, most: int, equal_counts: bool) -> int:
    """How many micro-batches a rank runs when the busiest runs ``most``: as many, or at least one.

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
    if not rules.shares_windows:
        return Plan(n, n, n, None if request.items is None else float(request.items))
    if rules.needs_equal_counts or not request.can_pad or not state.peers_can_pad:
        return None
    return Plan(n, max(n, 1), n, None)  # DDP: at least one forward, a repeat where none


def window_setup(state: AccumulatorState, rules: Rules, request: Request, plan: Optional[Plan]) -> Setup:
    """R and the padding of a window, from inputs the same on every rank; nothing here talks to the ranks.

    >>> alone = Rules(shares_windows=False, needs_equal_counts=False)
    >>> window_setup(AccumulatorState(), alone, Request(2, items=10), Plan(2, 2, 2, 10.0))
    Setup(plan=Plan(micro_batches=2, most=2, fewest=2, items=10.0, asked=False), reference=10.0, padding=0, counted=None)
    """
    padding = 0
    if plan is not None and plan.most != plan.fewest:  # else every rank runs as many: nobody pads
        padding = padded_count(plan.micro_batches, plan.most, rules.needs_equal_counts) - plan.micro_batches
    assert padding == 0 or request.can_pad, "the agreement lets no rank pad that cannot"
    return Setup(plan, _reference(state, rules, plan, request.items), padding)


def _reference(state: AccumulatorState, rules: Rules, plan: Optional[Plan],
               num_items: Optional[Count]) -> Optional[float]:
    """R as the window opens (None: counted first, or the running R); docs/architecture.md tells which."""
    if plan is not None:
        known = plan.items
    else:  # a window without a size: one process's own count
        known = None if num_items is None or rules.shares_windows else as_number(num_items)
    if rules.reference_is_count:
        return None if known is None else (known if known > 0 else 1.0)  # 0 items: every weight is 0 anyway
    if rules.shares_windows and not rules.needs_equal_counts and state.last_window_items is not None \
            and (plan is None or plan.items is None or plan.asked):
        # DDP, N not known up front; also where the ranks were asked (a resumed first window), so that it
        # rounds as the uninterrupted run did
        return state.last_window_items
    if not known:
        return None
    return known * state.count_ratio if plan is not None else known  # a window without a size counts as it says


class RankAgreement:
    """When ranks talk about a window: as it opens, to fix the running R, and what its boundary told them."""

    def __init__(self, sync: GradSync, device: torch.device, state: AccumulatorState, rules: Rules) -> None:
        self.sync, self.device, self.state, self.rules = sync, device, state, rules

    def remember(self, micro_batch: Batch) -> None:
        """The last micro-batch this rank ran, kept (across ranks only) to pad a later window with."""
        if self.rules.shares_windows:
            self.state.padding_batch = micro_batch

    def can_pad(self, will_pad: bool) -> bool:
        """Whether this rank can run a zero-weight micro-batch: its own data to repeat (or pad=True), or a kept one."""
        return will_pad or self.state.padding_batch is not None

    def open(self, request: Request) -> Setup:
        """The one call a window makes as it opens: its plan (known, made alone or asked), then its setup."""
        plan = request.plan
        if plan is None and request.micro_batches is not None:
            plan = (local_plan(self.state, self.rules, request)
                    or self.agree(request.micro_batches, request.items, request.can_pad))
        setup = window_setup(self.state, self.rules, request, plan)
        # N summed across ranks now, read at the first backward: the plan lacks N, and every rank counted up
        # front in the last window
        if (self.rules.shares_windows and plan is not None and not plan.asked and plan.items is None and
                self.state.counts_first and (self.rules.reference_is_count or self.state.last_window_items is None)):
            setup = setup._replace(counted=CountedFirst(self.sync, self.device, request.items))
        return setup

    def reference(self, setup: Setup) -> Optional[float]:
        """R for a window that has opened: the setup's, or, where it counts first, from N read now."""
        if setup.counted is None:
            return setup.reference
        n = setup.counted.wait()
        return None if n is None else _reference(self.state, self.rules, setup.plan._replace(items=n), None)

    def known_plan(self, mine: int, counts: Sequence[int], items: Optional[float]) -> Optional[Plan]:
        """The plan from every rank's micro-batch count, known without asking (a WindowSampler), or None when
        some rank must pad and may not be able to (then the ranks ask, and refuse together)."""
        most, fewest = max(counts), min(counts)
        pads = any(padded_count(c, most, self.rules.needs_equal_counts) > c for c in counts)
        if pads and not self.state.peers_can_pad:
            return None
        return Plan(mine, most, fewest, items)

    def agree(self, micro_batches: int, num_items: Optional[Count], can_pad: bool) -> Plan:
        """Every rank's micro-batch count and up-front item count, from one small all-gather."""
        if not self.rules.shares_windows:
            return local_plan(self.state, self.rules, Request(micro_batches, num_items))  # type: ignore[return-value]
        mine = torch.tensor([float(micro_batches), 0.0 if num_items is None else as_number(num_items),
                             float(num_items is not None), float(can_pad)],
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
                "data yet needs acc.set_padding(micro_batch)")
        return plan

    def equal_shares(self, loader: Any) -> bool:
        """Whether every rank's loader yields as many batches this epoch (a ``DistributedSampler`` under torch's
        own ``BatchSampler``), confirmed by one small all-gather."""
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
        """The largest ``value`` on any rank (one max all-reduce): how the running R is fixed."""
        if not self.rules.shares_windows:
            return float(value)
        return float(self.sync.all_reduce_(torch.tensor([float(value)], device=self.device), "max").item())

    def learn(self, setup: Setup, told: Exchanged) -> None:
        """After a boundary that did not raise: the count ratio, and what the ranks told each other."""
        plan, counted = setup.plan, setup.counted  # N as counted before the first backward, where it was
        upfront = plan.items if plan is not None and plan.items is not None else counted and counted.value
        if upfront and told.num_items > 0:
            self.state.count_ratio = told.num_items / upfront
        if self.rules.shares_windows:
            self.state.counts_first, self.state.peers_can_pad = told.counted_first, told.peers_can_pad
