"""When ranks talk about a window, and the reference count R: the one owner of both.

**Agreement.** Under data parallelism every rank must run a forward in each window (DDP and FSDP2
run collectives in forward), and under FSDP2 (or ``reduce_every_micro_batch``) every rank must run
as many micro-batches as the busiest. When a window opens, the ranks exchange how many micro-batches
and items each holds (one small all-gather): a rank with fewer pads with zero-weight repeats of a
micro-batch it ran before (:attr:`RankAgreement.replay`), or, where it cannot, every rank raises the
same error, so none waits in a collective.

**Asking only when a rank can differ.** The agreement is skipped when every rank can know the
counts without asking: a :class:`~gradaccum.WindowSampler` knows every rank's share of every window
(:meth:`RankAgreement.known_plan`), a ``DistributedSampler`` loader gives every rank as many batches
(``gradaccum._training.equal_shares``; their items are still summed at the boundary); and under DDP, once every rank has a micro-batch to pad with
(learned at the previous boundary, whose one all-reduce carries that flag), a rank decides alone: it
runs its own micro-batches, or one zero-weight repeat when it has none (:meth:`RankAgreement.local_plan`).
So in the steady state a window costs one small collective (the boundary's) and no host
synchronisation before its first forward. FSDP2, ``reduce_every_micro_batch`` and hand-written
windows opened without ``pad=True`` still ask, since a rank there can differ in a way the others
must know before the first forward.

**R** (see :mod:`gradaccum._maths` for the maths) must be the same on every rank. When every
rank knew its items before the first backward, R = N, the window's global count, from the
sampler's shares or (the first window) from the agreement. Other windows use the previous window's
global count (every rank learned it at that boundary), whether they asked or not, so a resumed
process rounds as the uninterrupted one did: equal windows get R = N and no scaling pass, others an
exact correction. Otherwise R is fixed once, at its first use, by a max
all-reduce of the first count, and kept in ``state_dict``. When ``loss_fn`` counts other items than those counted up front (tokens
of sequences), the last window's ratio of the two (:attr:`RankAgreement.count_ratio`) keeps R near
the count the backward really divides, which is what fp16's loss scale needs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

import torch

from ._checks import Count, as_number
from ._exchange import Tally
from ._gradients import WindowGradients
from ._maths import first_reference
from .batching import Batch, leading_dim
from .sync import GradSync
from .errors import RankAgreementError

if TYPE_CHECKING:
    from ._boundary import Outcome

__all__ = ["WindowPlan", "WindowRequest", "WindowSetup", "RankAgreement", "padded_count"]


@dataclass(frozen=True)
class WindowPlan:
    """What every rank agreed on when a window opened.

    Attributes:
        micro_batches: this rank's micro-batches.
        most, fewest: the largest and smallest count on any rank.
        items: the window's global item count when every rank knew its own before the first
            backward (then it is R, and the boundary scale is 1); else None.
        asked: the ranks exchanged counts for this plan (an all-gather), rather than knowing them.
        share: this rank's item count as every rank knows it (a WindowSampler's share), when
            ``items`` is known to all without asking; a window may then exchange nothing at its
            boundary (see :meth:`gradaccum._ranks.RankAgreement.should_exchange`). Else None.
    """

    micro_batches: int
    most: int
    fewest: int
    items: Optional[float]
    asked: bool = False
    share: Optional[float] = None


@dataclass(frozen=True)
class WindowRequest:
    """What a window asks for when it opens.

    Attributes:
        micro_batches: this rank's micro-batches (None for a hand-written window opened without a size).
        items: this rank's items, when known before the first backward.
        can_pad: this rank can run zero-weight micro-batches if the agreement asks it to.
        defer: the window's gradient reduction waits for its boundary (the out-of-memory back-off:
            no collective before the ranks agree on an error), so it always exchanges.
        plan: the plan, when the caller knows it already (``train()``: a WindowSampler's shares, or an
            agreement it asked for before deciding to open the window).
        zero_weight: zero-weight micro-batches the caller runs first, counted in ``micro_batches``
            (the out-of-memory back-off's first forward under DDP).
    """

    micro_batches: Optional[int]
    items: Optional[Count] = None
    can_pad: bool = False
    defer: bool = False
    plan: Optional[WindowPlan] = None
    zero_weight: int = 0


@dataclass(frozen=True)
class WindowSetup:
    """Everything a window needs from the ranks, decided once when it opens (:meth:`RankAgreement.setup`).

    Attributes:
        plan: the micro-batch counts (None for a window opened without a size).
        reference: R when it is known up front, else None (fixed at the first backward,
            :meth:`RankAgreement.reference_for`).
        exchanges: the boundary all-reduces the window's totals across ranks.
        padding: zero-weight micro-batches this rank runs on top of its own.
    """

    plan: Optional[WindowPlan]
    reference: Optional[float]
    exchanges: bool
    padding: int = 0

    @property
    def share(self) -> Optional[float]:
        """This rank's items as every rank knows them, in a window that exchanges nothing."""
        return None if self.exchanges or self.plan is None else self.plan.share

    @property
    def known_items(self) -> Optional[float]:
        """The window's global N as every rank knew it up front, in a window that exchanges nothing."""
        return None if self.exchanges or self.plan is None else self.plan.items


def padded_count(count: int, most: int, equal_counts: bool) -> int:
    """How many micro-batches a rank runs when the busiest runs ``most``: as many under syncs with a
    collective in every micro-batch, else at least one (DDP's forward collectives).

    >>> padded_count(0, 3, equal_counts=False), padded_count(1, 3, equal_counts=True), padded_count(0, 0, False)
    (1, 3, 0)
    """
    if equal_counts:
        return most
    return max(count, 1) if most > 0 else 0


class RankAgreement:
    """When ranks talk about a window: the agreement when it opens, whether its boundary exchanges,
    the reference count R and the padding micro-batch.

    Args:
        grads: the window's gradient (its probe carries a loss check through DDP's reduction).
        loss_every: a window that could exchange nothing still exchanges every ``loss_every``-th time.
        steps_on_loss: a ReduceLROnPlateau needs every window's loss, so every window exchanges.
    """

    def __init__(self, sync: GradSync, device: torch.device, grads: WindowGradients, *, loss_every: int = 1,
                 steps_on_loss: bool = False) -> None:
        self.sync, self.device, self.grads = sync, device, grads
        self.loss_every, self.steps_on_loss = loss_every, steps_on_loss
        #: windows that reached their boundary, the same on every rank (all run every window); not the
        #: Accumulator's steps, which a checkpoint may restore on one rank alone and a user may set
        self.windows = 0
        #: some rank's loss_fn returned its own counts in the last exchanged window (the same on every rank)
        self.loss_fn_counts = False
        #: R for windows whose item count is not known up front
        self.fallback_reference: Optional[float] = None
        #: items loss_fn counted per item counted up front, in the last window (1.0 when they agree)
        self.count_ratio = 1.0
        #: the last micro-batch this rank ran, repeated with zero weight where it has none
        self.replay: Optional[Batch] = None
        #: the previous window's global item count (the same on every rank): R for unasked windows
        self.last_items: Optional[float] = None
        #: every rank could pad at the last boundary: a DDP rank may then plan its window alone
        self.peers_can_pad = False

    def set_replay(self, micro_batch: Batch) -> None:
        leading_dim(micro_batch, argument="micro_batch")
        self.replay = micro_batch

    def remember(self, micro_batch: Batch) -> None:
        """The last micro-batch this rank ran, kept (across ranks only) to pad a later window with."""
        if self.sync.distributed:
            self.replay = micro_batch

    def setup(self, request: WindowRequest) -> WindowSetup:
        """The one call a window makes when it opens: its plan (known, made alone, or asked of the
        ranks), R, whether its boundary exchanges, and its padding."""
        plan = request.plan
        if plan is None and request.micro_batches is not None:
            plan = (self.local_plan(request.micro_batches, request.items, can_pad=request.can_pad)
                    or self.agree(request.micro_batches, request.items, request.can_pad))
        reference = self.window_reference(plan, request.items)
        known = plan.items if plan is not None and plan.share is not None else None
        exchanges = request.defer or self.should_exchange(known)
        padding = 0 if plan is None or request.micro_batches is None else self.padding(plan)
        # the agreement refused, on every rank alike, any window where a rank that must pad cannot
        assert padding == 0 or request.can_pad, "the agreement lets no rank pad that cannot"
        return WindowSetup(plan, reference, exchanges, padding)

    def should_exchange(self, known_items: Optional[float]) -> bool:
        """Whether a window's boundary all-reduces its totals across ranks (always, on one process:
        there it costs nothing). Every input is the same on every rank, so every rank decides alike.
        A window may skip it when the reduced gradient carries every rank's loss check
        (:meth:`gradaccum.sync.GradSync.plain_reduction`: DDP's own average, no
        ``find_unused_parameters``, no comm hook, which could keep or lose the check,
        :func:`gradaccum._maths.loss_check_term`) on a trainable parameter the wrapper reduces
        (``grads.probe``: one that had a gradient in the window whose replicas were compared, so never
        before that window), every rank knows the global N up front (``known_items``: a
        WindowSampler's shares), in the last exchanged window every rank's ``loss_fn`` returned bare
        means weighed by those very counts (no own counts, :attr:`count_ratio` 1), no
        ReduceLROnPlateau needs the loss, and the window is not a ``loss_every``-th one, counted by
        :attr:`windows`."""
        probe = self.grads.probe
        if probe is None or not probe.requires_grad or known_items is None or self.count_ratio != 1.0 \
                or self.loss_fn_counts or not self.sync.plain_reduction():
            return True
        return self.steps_on_loss or self.windows % self.loss_every == 0

    def local_plan(self, num_micro_batches: int, num_items: Optional[Count], *, can_pad: bool) -> Optional[WindowPlan]:
        """A plan this rank can make alone, or None when the ranks must agree first."""
        n = num_micro_batches
        if not self.sync.distributed:
            return WindowPlan(n, n, n, None if num_items is None else as_number(num_items))
        if self.sync.needs_equal_counts or not can_pad or not self.peers_can_pad:
            return None
        return WindowPlan(n, max(n, 1), n, None)  # DDP: at least one forward, a repeat where none

    def known_plan(self, mine: int, counts: Sequence[int], items: Optional[float],
                   share: Optional[float] = None) -> Optional[WindowPlan]:
        """The plan from every rank's micro-batch count, known without asking (a WindowSampler), or
        None when some rank must pad and may not be able to (then the ranks ask, and refuse together).
        ``items`` and this rank's ``share`` of them, when the items counted are the sampler's."""
        most, fewest = max(counts), min(counts)
        pads = any(padded_count(c, most, self.sync.needs_equal_counts) > c for c in counts)
        if pads and not self.peers_can_pad:
            return None
        return WindowPlan(mine, most, fewest, items, share=share if items is not None else None)

    def agree(self, num_micro_batches: int, num_items: Optional[Count], can_pad: bool) -> WindowPlan:
        """Every rank's micro-batch count and up-front item count, from one small all-gather."""
        if not self.sync.distributed:
            items = None if num_items is None else as_number(num_items)
            return WindowPlan(num_micro_batches, num_micro_batches, num_micro_batches, items)
        known = num_items is not None
        mine = torch.tensor([float(num_micro_batches), 0.0 if num_items is None else as_number(num_items),
                             1.0 if known else 0.0, 1.0 if can_pad else 0.0],
                            dtype=torch.float64 if self.device.type != "mps" else torch.float32,
                            device=self.device)
        rows = self.sync.all_gather(mine).tolist()  # the agreement's one host synchronisation
        counts = [int(r[0]) for r in rows]
        plan = WindowPlan(num_micro_batches, max(counts), min(counts),
                          sum(r[1] for r in rows) if all(r[2] for r in rows) else None, asked=True)
        stuck = [r for r, row in enumerate(rows)
                 if padded_count(int(row[0]), plan.most, self.sync.needs_equal_counts) > row[0] and not row[3]]
        if stuck:  # every rank sees the same rows: every rank raises, none waits in a collective
            raise RankAgreementError(
                f"{type(self.sync).__name__} needs every rank to run "
                f"{'as many micro-batches as the busiest' if self.sync.needs_equal_counts else 'a forward'} in "
                f"each window (collectives run in forward), but rank(s) {stuck} run fewer "
                f"({', '.join(str(int(rows[r][0])) for r in stuck)} of up to {plan.most}) and cannot pad: in "
                "a hand-written loop open the window with acc.window(n, pad=True) and run window.padding "
                "zero-weight micro-batches (window.backward_padding); with step()/train(), a rank with no "
                "data yet needs acc.set_padding(micro_batch)"
            )
        return plan

    def padding(self, plan: WindowPlan) -> int:
        """Zero-weight micro-batches this rank runs on top of its own, by the agreement."""
        if plan.most == plan.fewest:
            return 0
        return max(0, padded_count(plan.micro_batches, plan.most, self.sync.needs_equal_counts) - plan.micro_batches)

    def window_reference(self, plan: Optional[WindowPlan], num_items: Optional[Count]) -> Optional[float]:
        """R for a window, the same on every rank, chosen in this order:

        1. across ranks, a window whose plan was asked for once a previous window's global count is
           known: that count (as an unasked window would take; so whether a window asked, which a
           fresh process always does first, never changes the rounding, and a resume is bit-identical);
        2. the window's global count known up front (the sampler's shares, the first agreement, or
           one process's own count): N, times the last window's ratio of the items ``loss_fn``
           counted to those counted up front (1 when they are the same items: then R = N exactly);
        3. across ranks, a window planned alone: the previous window's global count;
        4. None: R is fixed at the first backward (:meth:`reference_for`).
        """
        across = self.sync.distributed
        if plan is None:  # a window opened without a size: only one process knows its count
            return as_number(num_items) if num_items is not None and not across else None
        if across and self.last_items and (plan.asked or plan.items is None):  # cases 1 and 3
            return self.last_items
        if plan.items is not None and plan.items > 0:  # case 2
            return plan.items * self.count_ratio
        return None

    def reference_for(self, items: Count) -> float:
        """R for windows whose count is not known up front, fixed at its first use (one host sync
        and, across ranks, one max all-reduce, once)."""
        if self.fallback_reference is None:
            ref = first_reference(as_number(items))
            if self.sync.distributed:
                ref = float(self.sync.all_reduce_(torch.tensor([ref], device=self.device), "max").item())
            self.fallback_reference = ref
        return self.fallback_reference

    def observe(self, setup: WindowSetup, tally: Tally, outcome: Optional["Outcome"]) -> None:
        """After the boundary, on every rank (``outcome`` is None when the boundary raised: the window
        still counts): the same global numbers on every rank give the same ratio and R. What the ranks
        told each other (can pad, own counts) is kept from windows that exchanged it."""
        self.windows += 1
        share = setup.share
        if share is not None and tally.device_items is None and tally.host_items != share:
            warnings.warn(  # said now that every rank has left the window's collectives: as an error
                # before the reducing backward it would have left the other ranks in the reduction
                f"this rank counted {tally.host_items:g} items in a window where its WindowSampler share is "
                f"{share:g} (a collate_fn that drops rows, or a loss_fn that returns its own count): the "
                "window's global item count is not the one every rank assumed, so it is dropped on every "
                "rank (as a non-finite window). Windows that exchange their loss (Accumulator(loss_every=1)) "
                "sum the real counts instead", stacklevel=5)
        if outcome is None:
            return
        num_items = outcome.num_items
        upfront = setup.plan.items if setup.plan is not None else None
        if upfront and num_items > 0:
            self.count_ratio = num_items / upfront
        if outcome.loss_fn_counts is not None:
            self.loss_fn_counts = outcome.loss_fn_counts
        if self.sync.distributed:
            if num_items > 0:
                self.last_items = num_items
            if outcome.peers_can_pad is not None:
                self.peers_can_pad = outcome.peers_can_pad

    def state_dict(self) -> Dict[str, Any]:
        return {"reference_items": self.fallback_reference, "count_ratio": self.count_ratio,
                "last_items": self.last_items}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.fallback_reference = state.get("reference_items")
        self.count_ratio = float(state.get("count_ratio", 1.0))
        self.last_items = state.get("last_items")
