"""Data order that depends on the seed alone: global windows, cut into each rank's micro-batches.

Each epoch is a seeded permutation of the dataset, cut into global windows of B items (one optimizer
step across all ranks); rank r of W takes a contiguous share of every window and cuts it into
micro-batches of at most m items::

    window g of epoch e   = perm(seed + e)[g * B : (g + 1) * B]
    rank r's share        = window[r * b // W : (r + 1) * b // W]        (b = len(window))

A window's items do not depend on W, so the same seed and B train the same model on any number of
ranks, and a checkpoint (epoch, window) resumes on any (docs/guides/torchrun.md).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import Sampler

from . import sync
from ._checks import non_negative_int, positive_int
from ._maths import ceil_div
from .errors import ConfigurationError

__all__ = ["WindowSampler"]

#: what fixes the data order: a state saved under other values is for another run
_ORDER = ("seed", "global_batch_size", "dataset_size", "shuffle", "drop_last")


class WindowSampler(Sampler[List[int]]):
    """A batch sampler over global windows of ``global_batch_size`` items.

    Args:
        dataset_size: items in the dataset.
        global_batch_size: B, items per optimizer step across all ranks.
        micro_batch_size: m, the most items one forward/backward of one rank takes.
        seed: the permutation of epoch e is drawn from ``seed + e``.
        shuffle: ``False`` keeps the dataset order.
        rank: defaults to torch.distributed's (0 without a process group).
        world_size: defaults to torch.distributed's (1 without a process group).
        drop_last: drop the short last window of each epoch on every rank.

    Example::

        sampler = WindowSampler(len(dataset), global_batch_size=256, micro_batch_size=16, seed=0)
        loader = DataLoader(dataset, batch_sampler=sampler, num_workers=2)
        for result in acc.train(loader, loss_fn, epochs=3):   # windows come from the sampler
            if result.step % 100 == 0:
                save({"model": ..., "sampler": sampler.state_dict()})   # resumes on any world size
    """

    def __init__(self, dataset_size: int, global_batch_size: int, micro_batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, rank: Optional[int] = None, world_size: Optional[int] = None,
                 drop_last: bool = False) -> None:
        positive_int("dataset_size", dataset_size)
        positive_int("global_batch_size", global_batch_size)
        positive_int("micro_batch_size", micro_batch_size)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigurationError(f"seed must be an int, got {seed!r}")
        launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if (rank is None or world_size is None) and launched > 1 and not sync.is_distributed():
            raise ConfigurationError(
                f"WindowSampler(rank={rank!r}, world_size={world_size!r}) under a launcher of WORLD_SIZE="
                f"{launched} before the process group exists would read this rank as the only one: create "
                "it after torch.distributed.init_process_group, or pass rank= and world_size=")
        world = positive_int("world_size", sync.world_size() if world_size is None else world_size)
        here = sync.rank() if rank is None else rank
        if isinstance(here, bool) or not isinstance(here, int) or not 0 <= here < world:
            raise ConfigurationError(f"rank must be an int in [0, {world}), got {here!r}")
        if drop_last and dataset_size < global_batch_size:
            raise ConfigurationError(f"drop_last=True with dataset_size={dataset_size} < global_batch_size="
                             f"{global_batch_size} leaves no window: lower global_batch_size or keep the short window")
        self.dataset_size, self.global_batch_size, self.seed = dataset_size, global_batch_size, seed
        self.micro_batch_size, self.shuffle, self.drop_last = micro_batch_size, shuffle, drop_last
        self.rank, self.world_size = here, world
        #: the epoch being (or about to be) iterated
        self.epoch = 0
        #: the first window of ``epoch`` that the next iteration yields: windows before it are done
        self.start_window = 0
        self._cached_order: Tuple[int, List[int]] = (-1, [])

    # -- where the windows are ------------------------------------------------------------

    @property
    def num_windows(self) -> int:
        """Global windows per epoch, the same on every rank: the optimizer steps of one epoch."""
        full, rest = divmod(self.dataset_size, self.global_batch_size)
        return full if self.drop_last or rest == 0 else full + 1

    def _order(self, epoch: int) -> List[int]:
        """The epoch's permutation as a list (cutting windows reads no tensor on the host), cached for the last one."""
        if self._cached_order[0] != epoch:
            n, g = self.dataset_size, torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=g).tolist() if self.shuffle else range(n)
            self._cached_order = (epoch, list(order))
        return self._cached_order[1]

    def _bounds(self, window: int, rank: Optional[int] = None) -> range:
        """Positions in the epoch's order of ``rank``'s (default: this rank's) share of ``window``."""
        start = window * self.global_batch_size
        b = min(self.global_batch_size, self.dataset_size - start)
        w, r = self.world_size, self.rank if rank is None else rank
        return range(start + r * b // w, start + (r + 1) * b // w)

    def shares(self, window: int) -> List[int]:
        """How many items every rank (in rank order) has in global window ``window`` of this epoch: what each rank
        knows of the others without asking (``Accumulator.train`` needs no agreement)."""
        return [len(self._bounds(window, r)) for r in range(self.world_size)]

    def window_items(self, window: int, *, epoch: Optional[int] = None) -> List[int]:
        """The dataset indices of global window ``window`` (all ranks' items)."""
        if not 0 <= window < self.num_windows:
            raise IndexError(f"window {window} is outside [0, {self.num_windows})")
        order = self._order(self.epoch if epoch is None else epoch)
        return order[window * self.global_batch_size:(window + 1) * self.global_batch_size]

    def windows(self) -> Iterator[List[List[int]]]:
        """This rank's micro-batches (lists of dataset indices), one list per remaining window of the epoch, from
        ``start_window`` on. A window may be empty on some ranks when B < W."""
        order, m = self._order(self.epoch), self.micro_batch_size
        for w in range(self.start_window, self.num_windows):
            span = self._bounds(w)
            mine = order[span.start:span.stop]
            yield [mine[i:i + m] for i in range(0, len(mine), m)]

    def window_sizes(self) -> List[int]:
        """How many micro-batches this rank has in each remaining window of the epoch."""
        m = self.micro_batch_size
        return [ceil_div(len(self._bounds(w)), m) for w in range(self.start_window, self.num_windows)]

    def __iter__(self) -> Iterator[List[int]]:
        windows = list(self.windows())  # fixed now: the position may advance while workers prefetch
        return (mb for mbs in windows for mb in mbs)

    def __len__(self) -> int:
        """Micro-batches this rank yields in one iteration (from ``start_window``)."""
        return sum(self.window_sizes())

    # -- position -------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``; a new epoch starts at its first window, the current one stays put."""
        if non_negative_int("epoch", epoch) != self.epoch:
            self.epoch, self.start_window = epoch, 0

    def advance(self, windows: int = 1) -> None:
        """Mark ``windows`` more windows of the epoch as done (``Accumulator.train`` calls it after every step; a
        hand-written loop calls it after each ``window.step()``)."""
        self.start_window = min(self.start_window + windows, self.num_windows)

    def state_dict(self) -> Dict[str, Any]:
        """The position to resume from and what fixes the data order; no rank or world size."""
        return {"epoch": self.epoch, "window": self.start_window, **{k: getattr(self, k) for k in _ORDER}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume at ``state``'s position, on any rank of any world size and micro-batch size.

        Raises:
            ValueError: the state was written for another data order (seed, global batch size, dataset size,
                shuffle or drop_last differ), naming what differs.
        """
        missing = [k for k in ("epoch", "window") if k not in state]
        if missing:
            raise ConfigurationError(f"WindowSampler.load_state_dict: the state lacks {', '.join(missing)}; "
                             "pass what WindowSampler.state_dict() returned")
        differs = [f"{k}={state[k]!r} (here {getattr(self, k)!r})" for k in _ORDER
                   if k in state and state[k] != getattr(self, k)]
        if differs:
            raise ConfigurationError("the saved sampler state is for another data order: " + ", ".join(differs)
                             + "; construct the WindowSampler with the saved values to continue that run")
        epoch, window = int(state["epoch"]), int(state["window"])
        if epoch < 0 or not 0 <= window <= self.num_windows:
            raise ConfigurationError(f"the saved position (epoch {epoch}, window {window}) is outside this "
                             f"sampler's {self.num_windows} windows per epoch")
        self.epoch, self.start_window = epoch, window
