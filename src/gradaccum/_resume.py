"""Where training stands and what resuming needs, read from ``acc.state``: nothing here keeps a value of its own."""

from __future__ import annotations

from typing import Any, Dict, Optional

from ._state import READ_KEYS, SAVED_KEYS, AccumulatorState
from .errors import ConfigurationError
from .precision import MixedPrecision

__all__ = ["Resumable"]


class Resumable:
    """The :class:`~gradaccum.Accumulator`'s counters and checkpoint, read from and restored to ``acc.state``."""

    #: what one window teaches the next (see :class:`~gradaccum._state.AccumulatorState`)
    state: AccumulatorState
    #: autocast and the fp16 loss scaler, whose state is saved beside ``acc.state``'s
    precision: MixedPrecision

    @property
    def steps(self) -> int:
        """Optimizer steps taken (``acc.state.steps``)."""
        return self.state.steps

    @steps.setter
    def steps(self, value: int) -> None:
        self.state.steps = int(value)

    @property
    def skipped(self) -> int:
        """Windows that took no step (non-finite loss or gradient, fp16 overflow, no item)."""
        return self.state.skipped

    @property
    def epoch(self) -> int:
        """Epochs ``train()`` finished (the next one it runs, without a WindowSampler)."""
        return self.state.epoch

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.state.epoch = int(value)

    @property
    def auto_micro_batch_size(self) -> Optional[int]:
        """The micro-batch size that last worked under ``micro_batch_size="auto"``."""
        return self.state.auto_micro_batch_size

    @auto_micro_batch_size.setter
    def auto_micro_batch_size(self, value: Optional[int]) -> None:
        self.state.auto_micro_batch_size = value

    def state_dict(self) -> Dict[str, Any]:
        """What resuming needs beyond the model, optimizer and scheduler: the saved fields of ``acc.state``
        (counters, R, the count ratio, the auto size, where the scheduler stood: a resumed scheduler standing
        elsewhere is refused at the first window; :data:`gradaccum._state.SAVED_KEYS`) and the scaler."""
        return {**self.state.saved(), "precision": self.precision.state_dict()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (also one written by an earlier gradaccum).

        Raises:
            ConfigurationError: ``state`` lacks ``steps`` or ``precision``, holds a key no Accumulator state
                holds (a whole checkpoint, a misspelt key), or a value that is not a number; nothing is loaded.
        """
        if not isinstance(state, dict):
            raise TypeError(f"Accumulator.load_state_dict takes the dict Accumulator.state_dict() returned, got "
                            f"{type(state).__name__}; pass checkpoint['accumulator'] (or what you saved it as)")
        missing = [k for k in ("steps", "precision") if k not in state]
        unknown = [k for k in state if k not in READ_KEYS and k != "precision"]
        if missing or unknown:
            said = [f"lacks {', '.join(map(repr, missing))}" if missing else "",
                    f"holds {', '.join(map(repr, unknown))}, which no Accumulator state holds" if unknown else ""]
            raise ConfigurationError(
                f"Accumulator.load_state_dict: the state {' and '.join(s for s in said if s)}; an Accumulator's state "
                f"holds {', '.join(SAVED_KEYS)} and precision: pass what Accumulator.state_dict() returned (e.g. "
                "checkpoint['accumulator'], not the whole checkpoint)")
        values = self.state.read_saved(state)  # every field checked before anything is set
        self.precision.load_state_dict(state["precision"])
        self.state.load_saved(values)
