"""Progress of a training run on stderr.

On a terminal: a tqdm bar. Elsewhere (CI, nohup, a pipe): a plain line every ``every`` steps and
whenever ``interval`` seconds have passed since the last line, and one at the last step::

    gradaccum train: step 36/120 (30%), loss 0.4127, 5,210 images/s, ETA 0:00:02

The clock is a parameter, so tests drive the time trigger without waiting.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional, TextIO

from .._maths import ceil_div

__all__ = ["Progress"]


def _clock_text(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Report steps ``initial+1 .. total``. ``every`` defaults to a tenth of the run (at least 1)."""

    def __init__(self, total: int, initial: int = 0, *, label: str = "train", unit: str = "items",
                 prefix: str = "gradaccum train:", stream: Optional[TextIO] = None, enabled: bool = True,
                 every: Optional[int] = None, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, terminal: Optional[bool] = None) -> None:
        self.total, self.unit, self.prefix = total, unit, prefix
        self.stream = stream if stream is not None else sys.stderr
        self.every = every if every is not None else max(1, ceil_div(total, 10))
        self.interval, self.clock = interval, clock
        self.enabled = enabled
        self._items = 0.0
        self._seconds = 0.0
        self._steps = 0
        self._last_line = clock()
        self._bar: Any = None
        if terminal is None:
            terminal = bool(getattr(self.stream, "isatty", lambda: False)())
        if enabled and terminal:
            try:
                from tqdm import tqdm
            except ImportError:  # pragma: no cover - the cli extra brings it
                pass
            else:
                self._bar = tqdm(total=total, initial=initial, desc=label, unit="step", leave=False, file=self.stream)

    def update(self, step: int, loss: float, items: float, seconds: float) -> None:
        """One optimizer step: ``items`` trained in ``seconds`` (of this process, so rates stay true
        after a resume)."""
        if not self.enabled:
            return
        self._items += items
        self._seconds += seconds
        self._steps += 1
        shown = f"{loss:.4f}"
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=shown)
            return
        now = self.clock()
        if step % self.every == 0 or step >= self.total or now - self._last_line >= self.interval:
            self._last_line = now
            rate = self._items / self._seconds if self._seconds > 0 else float("nan")
            left = (self.total - step) * self._seconds / self._steps
            pct = 100 * step / self.total if self.total else 100.0
            print(f"{self.prefix} step {step}/{self.total} ({pct:.0f}%), loss {shown}, "
                  f"{rate:,.0f} {self.unit}/s, ETA {_clock_text(left)}", file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

