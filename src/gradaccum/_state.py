"""What one window teaches the next, in one object: :class:`AccumulatorState`.

A window starts from the state, reads what it needs (R, what the ranks agreed, the scheduler's
position, the auto micro-batch size, ...) and leaves it changed at two points: when it opens
(:mod:`gradaccum._ranks` may fix R at the first backward) and at its boundary (:mod:`gradaccum._boundary`
counts the step, :meth:`gradaccum._ranks.RankAgreement.learn` keeps what the ranks told each other).
Nothing that outlives a window lives anywhere else: not on the parts the Accumulator builds, not on
the user's objects (a :class:`~gradaccum.WindowLoss` whose replay was checked is remembered here).

``Accumulator.state_dict()`` is derived from the fields marked *saved*, so a new field cannot be left
out of a checkpoint by accident; the others are learned again by the first window after a restart.
Each field says which part changes it and when.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Set

import torch

from .errors import ConfigurationError

__all__ = ["AccumulatorState", "SAVED_KEYS"]


def _saved(default: Any, key: Optional[str] = None) -> Any:
    """A field kept in ``state_dict`` (under ``key``, the name earlier gradaccum versions wrote)."""
    return field(default=default, metadata={"saved": True, "key": key})


@dataclass
class AccumulatorState:
    """Everything a window learns for the next, owned by the ``Accumulator`` and passed to each window.

    Saved in ``state_dict`` (a resumed run continues bit-identically):

    Attributes:
        steps: optimizer steps taken. The boundary adds one per step (``Boundary.finish``).
        skipped: windows that took no step (non-finite, fp16 overflow, 0 items). The boundary.
        epoch: epochs ``train()`` finished. ``train()``, at an epoch's last window.
        reference: R for windows whose item count is not known before their first backward, fixed once
            at the first such backward (``RankAgreement.fix_reference``) and then kept.
        count_ratio: items ``loss_fn`` counted per item counted up front, in the last window with an
            up-front count (1.0 when they are the same items). ``RankAgreement.learn``, at each boundary.
        last_window_items: the previous window's global item count N (the same on every rank; across
            ranks only): R for windows planned without asking. ``RankAgreement.learn``.
        auto_micro_batch_size: the micro-batch size that last worked under ``micro_batch_size="auto"``.
            The out-of-memory back-off (``AutoMicroBatch.step``), after a window that backed off or the first.

    Learned again after a restart (not saved):

    Attributes:
        windows: boundaries reached, the same on every rank (the ``loss_every`` count).
            ``RankAgreement.learn``.
        counts_from_loss_fn: some rank's ``loss_fn`` returned its own counts (a ``(mean, count)`` pair)
            in the last window that exchanged. ``RankAgreement.learn``.
        peers_can_pad: every rank had a micro-batch to pad with at the last exchange, so a DDP rank may
            plan a window alone. ``RankAgreement.learn``.
        replay: the last micro-batch this rank ran (across ranks), repeated with zero weight in a window
            where it has none; or the one ``acc.set_padding`` gave. ``RankAgreement.remember``.
        scheduler_at: the scheduler's ``last_epoch`` after the Accumulator last stepped it (None: read
            when the next window opens). The boundary; cleared by ``load_state_dict``.
        replicas_checked: the ranks compared their first reduced gradient (DDP). The first boundary.
        probe: the smallest reduced parameter that had a gradient in that compared window; a window
            that exchanges nothing carries every rank's loss check in its gradient. The first boundary.
        stop_requests: ``request_stop()`` calls (maybe from a signal handler). ``Accumulator.request_stop``.
        stops_carried: requests already carried to the ranks by a boundary's all-reduce. The boundary.
        checked_replays: the :class:`~gradaccum.WindowLoss` objects whose second forward was compared with
            the first (weakly held: the user's object is neither changed nor kept alive). Their first window.
        warned: the one-time warnings already given (BatchNorm in training, an empty or non-finite window).
    """

    steps: int = _saved(0)
    skipped: int = _saved(0)
    epoch: int = _saved(0)
    reference: Optional[float] = _saved(None, key="reference_items")
    count_ratio: float = _saved(1.0)
    last_window_items: Optional[float] = _saved(None, key="last_items")
    auto_micro_batch_size: Optional[int] = _saved(None)

    windows: int = 0
    counts_from_loss_fn: bool = False
    peers_can_pad: bool = False
    replay: Any = None
    scheduler_at: Optional[int] = None
    replicas_checked: bool = False
    probe: Optional[torch.nn.Parameter] = None
    stop_requests: int = 0
    stops_carried: int = 0
    checked_replays: "weakref.WeakSet[Any]" = field(default_factory=weakref.WeakSet)
    warned: Set[str] = field(default_factory=set)

    def saved(self) -> Dict[str, Any]:
        """The saved fields, by their ``state_dict`` key."""
        return {_key(f): getattr(self, f.name) for f in fields(self) if f.metadata.get("saved")}

    def load_saved(self, state: Dict[str, Any]) -> None:
        """The saved fields from a ``state_dict`` (one written by an earlier gradaccum too: a key it did
        not write keeps its default), each checked before any is set."""
        values = {}
        for f in fields(self):
            if f.metadata.get("saved"):
                values[f.name] = _checked(f.name, state.get(_key(f), f.default))
        for name, value in values.items():
            setattr(self, name, value)
        self.scheduler_at = None  # a resumed scheduler is read when the next window opens

    def warn_once(self, key: str) -> bool:
        """True the first time ``key`` is asked for (then the caller warns), False after."""
        first = key not in self.warned
        self.warned.add(key)
        return first


#: the keys ``state_dict`` writes for the state, in field order
SAVED_KEYS: List[str] = []


def _key(f: Any) -> str:
    return f.metadata.get("key") or f.name


SAVED_KEYS.extend(_key(f) for f in fields(AccumulatorState) if f.metadata.get("saved"))

_INTS = ("steps", "skipped", "epoch")
_OPTIONAL_NUMBERS = ("reference", "last_window_items")


def _checked(name: str, value: Any) -> Any:
    """A saved value as the field holds it, or a ConfigurationError naming the field."""
    try:
        if name in _INTS:
            return int(value)
        if name == "count_ratio":
            return float(value)
        if name in _OPTIONAL_NUMBERS:
            return None if value is None else float(value)
        if name == "auto_micro_batch_size":
            return None if value is None else int(value)
    except (TypeError, ValueError):
        pass
    else:
        return value
    raise ConfigurationError(f"Accumulator.load_state_dict: {name}={value!r} is not a number; pass what "
                             "Accumulator.state_dict() returned")
