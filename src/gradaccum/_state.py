"""What one window teaches the next, in one object: :class:`AccumulatorState`. ``state_dict()`` is derived
from the fields marked *saved*, each with its converter, so no field is left out of a checkpoint or read
back unchecked; the others start afresh in a new process."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .errors import ConfigurationError

__all__ = ["AccumulatorState", "SAVED_KEYS", "READ_KEYS"]


def _saved(default: Any, convert: Callable[[Any], Any], old: Tuple[str, ...] = ()) -> Any:
    """A field kept in ``state_dict`` under its own name, read back through ``convert`` (a None kept where it is
    the default); ``old``: the keys earlier gradaccum versions wrote it under, still read from their checkpoints."""
    return field(default=default, metadata={"saved": True, "old": old, "convert": convert})


class _Seen(weakref.WeakValueDictionary):  # type: ignore[type-arg]
    """Objects seen, held weakly by their id (a user's object need be neither hashable nor kept alive)."""

    def add(self, obj: Any) -> None:
        self[id(obj)] = obj

    def __contains__(self, obj: Any) -> bool:
        return self.get(id(obj)) is obj


@dataclass(eq=False)
class AccumulatorState:
    """Everything a window learns for the next, owned by the ``Accumulator`` (``acc.state``) and handed to each
    window (``Parts.state``); ``ExactTrainer`` and Lightning's ``ExactAccumulation`` keep theirs in one too
    (``trainer.accumulator_state``, ``callback.state``), saved with their framework's checkpoint.

    Saved in ``state_dict`` (a resumed run continues bit-identically):

    Attributes:
        steps: optimizer steps taken. ``WindowWeights.record``, at a step taken (before the scheduler's step).
        skipped: windows that took no step (non-finite, fp16 overflow, 0 items). ``WindowWeights.record``.
        epoch: epochs ``train()`` finished: set when an epoch's loop ends (over a WindowSampler, already at its last
            window, so that a checkpoint taken there says the epoch is done).
        reference: the running R, for windows whose item count is not known before their first backward (a
            hand-written window without ``num_items``, Lightning's automatic loop), fixed once by
            ``WindowWeights.fix_reference`` (:func:`gradaccum._weights.running_reference`) and kept. (Saved as
            ``reference_items`` before.)
        count_ratio: items ``loss_fn`` counted per item counted up front, in the last window with an up-front count
            (1.0 when they are the same items). ``RankAgreement.learn``, at the boundary.
        last_window_items: the previous window with items' global count N (the same on every rank), for the drivers'
            reports (``ExactTrainer.last_window_items``). ``WindowWeights.record``. (Saved as ``last_items`` before.)
        auto_micro_batch_size: the micro-batch size that last worked under ``micro_batch_size="auto"``.
            ``AutoMicroBatch.step``, after the first window and after any that backed off.
        counts_first: every rank counted its items up front in the last window, so the next counts first
            (:meth:`gradaccum._ranks.RankAgreement.open`); saved, so that a resumed process counts where
            the uninterrupted one did.

    Start afresh in a new process:

    Attributes:
        peers_can_pad: every rank had a micro-batch to pad with at the last boundary, so a DDP rank may plan a
            window alone. ``learn``.
        padding_batch: the micro-batch this rank repeats with zero weight in a window where it has none: the last it
            ran (across ranks; ``RankAgreement.remember``, as a window runs), or the one ``acc.set_padding`` gave.
        scheduler_at: the scheduler's ``last_epoch`` after the Accumulator last stepped it; None until a window
            opens and reads it (``Boundary.check_scheduler``). Saved: a resumed scheduler must stand there.
        scheduler_at_restored: ``scheduler_at`` came from ``load_state_dict`` and no window has checked it yet.
        replicas_checked: the ranks compared their first reduced gradient (DDP; FSDP2's plain gradients), since the
            Accumulator was built or a ``requires_grad`` changed. The first boundary after either.
        stop_requests: ``acc.request_stop()`` calls, at any time (a signal handler too).
        stops_carried: requests already carried to the ranks by a boundary's all-reduce. ``Boundary``.
        checked_replays: the :class:`~gradaccum.WindowLoss` objects whose second forward was compared with the
            first, held weakly by identity. The end of their first window (``_cached``).
        warned: the one-time warnings already given (BatchNorm in training when a window opens; an empty or
            non-finite window at the boundary).
        trainable: each model parameter's ``requires_grad`` when the last window opened (the Accumulator's
            construction before the first): a change under DDP is refused. ``OpenWindow.enter``.
        norms: the model's BatchNorm layers, and InstanceNorm layers tracking running statistics, by name,
            found at the first window in training mode and watched until one trains (none: nothing to watch).
            ``OpenWindow.enter``.
    """

    steps: int = _saved(0, int)
    skipped: int = _saved(0, int)
    epoch: int = _saved(0, int)
    reference: Optional[float] = _saved(None, float, old=("reference_items",))
    count_ratio: float = _saved(1.0, float)
    last_window_items: Optional[float] = _saved(None, float, old=("last_items",))
    auto_micro_batch_size: Optional[int] = _saved(None, int)
    counts_first: bool = _saved(False, bool)
    scheduler_at: Optional[int] = _saved(None, int)

    peers_can_pad: bool = False
    padding_batch: Any = field(default=None, repr=False)
    scheduler_at_restored: bool = False
    replicas_checked: bool = False
    stop_requests: int = 0
    stops_carried: int = 0
    checked_replays: _Seen = field(default_factory=_Seen, repr=False)
    warned: Set[str] = field(default_factory=set)
    trainable: Tuple[bool, ...] = ()
    norms: Optional[List[Tuple[str, Any]]] = field(default=None, repr=False)

    def saved(self) -> Dict[str, Any]:
        """The saved fields, by their ``state_dict`` key (the field's name)."""
        return {name: getattr(self, name) for name in SAVED_KEYS}

    def read_saved(self, state: Dict[str, Any]) -> Dict[str, Any]:
        """The saved fields' values from a ``state_dict`` (one written by an earlier gradaccum too: a key
        it did not write gives the default), each checked; nothing is set."""
        values = {}
        for f in _SAVED_FIELDS:
            key = next((k for k in (f.name, *f.metadata["old"]) if k in state), f.name)
            raw = state.get(key, f.default)
            try:
                values[f.name] = None if raw is None and f.default is None else f.metadata["convert"](raw)
            except (TypeError, ValueError):
                raise ConfigurationError(f"Accumulator.load_state_dict: {key}={raw!r} is not a number; pass "
                                         "what Accumulator.state_dict() returned") from None
        return values

    def load_saved(self, values: Dict[str, Any]) -> None:
        """Set what :meth:`read_saved` returned; the next window checks the scheduler stands where it was saved."""
        for name, value in values.items():
            setattr(self, name, value)
        self.scheduler_at_restored = self.scheduler_at is not None

    def warn_once(self, key: str) -> bool:
        """True the first time ``key`` is asked for (then the caller warns), False after."""
        first = key not in self.warned
        self.warned.add(key)
        return first


_SAVED_FIELDS = [f for f in fields(AccumulatorState) if f.metadata.get("saved")]
#: the keys ``state_dict`` writes for the state (the saved fields' names), in field order
SAVED_KEYS: List[str] = [f.name for f in _SAVED_FIELDS]
#: the keys a ``state_dict`` may hold for the state: :data:`SAVED_KEYS` and the names earlier gradaccums wrote
READ_KEYS: List[str] = SAVED_KEYS + [old for f in _SAVED_FIELDS for old in f.metadata["old"]]
