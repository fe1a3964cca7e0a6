"""The training run's configuration: a frozen dataclass, validated before anything runs, saved in checkpoints."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, NamedTuple, Optional, Union

from ..errors import ConfigurationError
from ..tasks import MODELS, SHIPPED, TASKS
from .errors import CLIError

__all__ = ["TrainConfig", "Shape", "OPTIMIZERS", "DEVICES", "DTYPES", "DEFAULTS", "DEFAULT_ACCUM_STEPS",
           "DEFAULT_AUTO_BATCH", "DEFAULT_MICRO_BATCH_SIZE", "CHECK_ACCUM_STEPS", "CHECK_MICRO_BATCH_SIZE", "PRECISIONS",
           "SEED_RANGE", "SEED_RANGE_TEXT", "saved_config", "window_shape"]

OPTIMIZERS = ("sgd", "adamw")
DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "float64")
#: MixedPrecision's choices (gradaccum.precision.PRECISIONS, which imports torch: --help does not)
PRECISIONS = ("fp32", "bf16", "fp16")
DEFAULT_MICRO_BATCH_SIZE = 32  # train's M and N when the flags give neither
DEFAULT_ACCUM_STEPS = 4
#: check's split of a built-in task's batch when the flags give none: 4 micro-batches of 8
CHECK_MICRO_BATCH_SIZE = 8
CHECK_ACCUM_STEPS = 4
DEFAULT_AUTO_BATCH = 128  # the window with --micro-batch-size auto and no --batch-size
#: seeds torch's generators take, with room for one more per epoch (seed + epoch, each epoch's order: torch
#: takes seeds up to 2**64-1)
SEED_RANGE = (0, 2**63 - 1)
#: the range in words, for --help and the refusals
SEED_RANGE_TEXT = "0 to 2**63-1"
# per task: model, epochs, optimizer, learning rate
DEFAULTS: Dict[str, Dict[str, Any]] = {
    "digits": {"model": "lenet5", "epochs": 15, "optimizer": "sgd", "lr": 0.02},
    "mnist5k": {"model": "lenet5", "epochs": 10, "optimizer": "sgd", "lr": 0.01},  # seed 000's: Momentum(0.01, 0.9)
    "mnist": {"model": "lenet5", "epochs": 2, "optimizer": "sgd", "lr": 0.05},
    "text": {"model": "transformer", "epochs": 1, "optimizer": "adamw", "lr": 3e-3},
}
# settings that may differ between a run and its --resume: they do not change the trained model
# (epochs may only grow; that is checked where the checkpoint's position is known). How the global
# batch is cut (ranks, micro-batch size, accumulation) changes rounding only, never which items a
# step sees: a run may move to another world size or micro-batch size with the same --batch-size.
RESUMABLE_CHANGES = ("out", "checkpoint_every", "epochs", "device", "world_size", "micro_batch_size",
                     "accum_steps")


class Shape(NamedTuple):
    """A window resolved from the flags: ``items`` (B) per optimizer step across all ranks, cut into
    micro-batches of ``micro_batch_size`` (M, or ``"auto"``), ``accum_steps_per_rank`` (N) per rank
    (None with ``"auto"``, which picks the split itself)."""

    items: int
    micro_batch_size: Union[int, str]
    accum_steps_per_rank: Optional[int]


def window_shape(batch_size: Optional[int], micro_batch_size: Union[int, str, None], accum_steps: Optional[int],
                 world_size: int = 1) -> Shape:
    """Resolve a window from the flags the user gave (None: not given): ``B = M x N x W``.

    Any two of B, M, N give the third; given all three they must agree. One or none given: the
    missing ones default to M = 32 and N = 4. With B and M alone, N = ceil(B / (M x W)) and the last
    micro-batch may be smaller (an exact item-weighted step); with B and N alone, M = B / (N x W),
    which must come out whole.
    """
    from .._maths import ceil_div  # torch: the parser imports this module, and --help imports no torch

    ranks = f" x {world_size} ranks" if world_size > 1 else ""
    if micro_batch_size == "auto":
        if accum_steps is not None:
            raise ConfigurationError(f"--accum-steps {accum_steps} does not apply with --micro-batch-size auto, which "
                             "picks the split of each window itself; drop --accum-steps and give the window "
                             "with --batch-size")
        return Shape(batch_size if batch_size is not None else DEFAULT_AUTO_BATCH, "auto", None)
    if batch_size is not None and accum_steps is not None and micro_batch_size is None:
        m, rest = divmod(batch_size, accum_steps * world_size)
        if rest or m < 1:
            raise ConfigurationError(
                f"--batch-size {batch_size} does not split into --accum-steps {accum_steps} equal micro-batches"
                f"{' on each of ' + str(world_size) + ' ranks' if world_size > 1 else ''}; give --micro-batch-size "
                f"M instead of --accum-steps (the last micro-batch may be smaller), or a --batch-size divisible "
                f"by {accum_steps * world_size}")
        return Shape(batch_size, m, accum_steps)
    m = DEFAULT_MICRO_BATCH_SIZE if micro_batch_size is None else int(micro_batch_size)
    if batch_size is None:
        n = DEFAULT_ACCUM_STEPS if accum_steps is None else accum_steps
        return Shape(m * n * world_size, m, n)
    if accum_steps is None:
        return Shape(batch_size, m, ceil_div(batch_size, m * world_size))
    if batch_size != m * accum_steps * world_size:
        raise ConfigurationError(
            f"--batch-size {batch_size}, --micro-batch-size {m} and --accum-steps {accum_steps} contradict each "
            f"other: a window is micro-batch size x accum steps{ranks} = {m} x {accum_steps}"
            f"{f' x {world_size}' if ranks else ''} = {m * accum_steps * world_size} items, not {batch_size}; "
            f"give two of the three (e.g. drop --accum-steps to cut {batch_size} items into micro-batches of {m})")
    return Shape(batch_size, m, accum_steps)


@dataclass(frozen=True)
class TrainConfig:
    """One ``gradaccum train`` run, as the flags gave it (None: not given). The window is
    ``window_items`` items per optimizer step across all ``world_size`` ranks (the global batch):
    ``batch_size``, or ``micro_batch_size x accum_steps x world_size`` (see :func:`window_shape`)."""

    task: str = "digits"
    data_path: Optional[str] = None
    model: Optional[str] = None
    micro_batch_size: Union[int, str, None] = None
    accum_steps: Optional[int] = None
    batch_size: Optional[int] = None
    epochs: Optional[int] = None
    optimizer: Optional[str] = None
    lr: Optional[float] = None
    precision: str = "fp32"
    max_grad_norm: Optional[float] = None
    seed: int = 0
    out: Optional[str] = None
    checkpoint_every: int = 0
    device: str = "auto"
    dtype: str = "float32"
    shard: bool = False
    world_size: int = 1  # the ranks this launch runs on (torchrun's WORLD_SIZE); may change on --resume
    #: --epochs was on the command line (else the task's default filled it): a --resume without it keeps the run's
    epochs_given: bool = field(default=True, compare=False, repr=False)

    def __post_init__(self) -> None:
        from .._checks import check_int  # torch, as in window_shape

        def bad(flag: str, value: Any, want: str) -> ValueError:
            return ValueError(f"{flag} must be {want}, got {value!r}")

        if self.task not in TASKS:
            raise bad("--task", self.task, f"one of {', '.join(TASKS)}")
        if self.data_path is not None:
            if self.task in SHIPPED:
                raise ConfigurationError(f"--data-path {self.data_path} is not used by --task {self.task} (its data "
                                 f"ships with {SHIPPED[self.task]}); drop --data-path, or pass --task mnist or "
                                 "--task text")
            if not self.data_path.strip():
                raise ConfigurationError(f"--data-path must name a {'folder' if self.task == 'mnist' else 'file'}, "
                                 "got an empty string")
            # stored absolute, so that eval and --resume work from any folder
            object.__setattr__(self, "data_path", os.path.abspath(os.path.expanduser(self.data_path)))
        if self.model is not None and self.model not in MODELS:
            raise bad("--model", self.model, f"one of {', '.join(MODELS)}")
        if self.micro_batch_size not in (None, "auto"):
            check_int("--micro-batch-size", self.micro_batch_size, extra=" or 'auto'")
        for flag, value in (("--accum-steps", self.accum_steps), ("--batch-size", self.batch_size)):
            if value is not None:
                check_int(flag, value)
        check_int("--seed", self.seed, SEED_RANGE[0], maximum=SEED_RANGE[1])
        check_int("WORLD_SIZE", self.world_size, extra=" (torchrun sets it)")
        window_shape(self.batch_size, self.micro_batch_size, self.accum_steps, self.world_size)
        if self.shard and self.micro_batch_size == "auto":
            raise ConfigurationError("--micro-batch-size auto does not work with --shard: FSDP2 reduces gradients only "
                             "inside backward, so the ranks cannot agree on an out-of-memory error first; pass "
                             "an integer --micro-batch-size")
        if self.epochs is not None:
            check_int("--epochs", self.epochs)
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise bad("--optimizer", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise bad("--lr", self.lr, "a positive number")
        if self.precision not in PRECISIONS:
            raise bad("--precision", self.precision, f"one of {', '.join(PRECISIONS)}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise bad("--max-grad-norm", self.max_grad_norm, "a positive number")
        check_int("--checkpoint-every", self.checkpoint_every, 0, extra=" (0: only at the end)")
        if self.dtype not in DTYPES:
            raise bad("--dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if self.dtype == "float64" and self.precision != "fp32":
            raise ConfigurationError(f"--dtype float64 needs --precision fp32, got --precision {self.precision}")
        if self.device not in DEVICES:
            raise bad("--device", self.device, f"one of {', '.join(DEVICES)}")
        defaults = DEFAULTS[self.task]
        for name in ("model", "epochs", "optimizer", "lr"):  # fill the task's defaults
            if getattr(self, name) is None:
                object.__setattr__(self, name, defaults[name])

    @property
    def window(self) -> Shape:
        """B, M and N as resolved from the flags given (see :func:`window_shape`)."""
        return window_shape(self.batch_size, self.micro_batch_size, self.accum_steps, self.world_size)

    @property
    def window_items(self) -> int:
        """The global batch B: items per optimizer step, across all ranks."""
        return self.window.items

    @property
    def accum_steps_per_rank(self) -> Optional[int]:
        """N: micro-batches per window on each rank (the last may be smaller); None with ``"auto"``."""
        return self.window.accum_steps_per_rank

    def training_settings(self) -> Dict[str, Any]:
        """What determines the trained model: the settings with the global batch resolved, without
        how it is cut (``-M 8 -N 4`` on 2 ranks and ``--batch-size 64 -M 16`` on 1 rank match)."""
        d = {k: v for k, v in self.to_dict().items() if k not in RESUMABLE_CHANGES}
        d.update(batch_size=self.window_items)
        return d

    def to_dict(self) -> Dict[str, Any]:
        """The settings, as saved in the checkpoint and summary.json."""
        return {k: v for k, v in asdict(self).items() if k != "epochs_given"}


def saved_config(state: Dict[str, Any], *, where: str, fix: str) -> TrainConfig:
    """The settings a checkpoint was trained with (its ``"config"``), validated as the flags are;
    a one-line CLIError, ``{where} holds settings this version cannot read; {fix}``, when they
    are missing or this version refuses them."""
    try:  # --loss-every (removed, issue 48 item 4) never changed the trained model: an older run's is dropped
        return TrainConfig(**{k: v for k, v in dict(state["config"]).items() if k != "loss_every"})
    except (KeyError, TypeError, ValueError):
        raise CLIError(f"{where} holds settings this version cannot read; {fix}") from None
