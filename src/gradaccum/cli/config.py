"""The training run's configuration: a frozen dataclass, validated before anything runs, saved in checkpoints."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional, Union

from ..precision import PRECISIONS
from ..tasks.data import TASKS
from ..tasks.models import MODELS

__all__ = ["TrainConfig", "OPTIMIZERS", "DEVICES", "DEFAULTS"]

OPTIMIZERS = ("sgd", "adamw")
DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "float64")
# per task: model, epochs, optimizer, learning rate
DEFAULTS: Dict[str, Dict[str, Any]] = {
    "digits": {"model": "lenet5", "epochs": 15, "optimizer": "sgd", "lr": 0.02},
    "mnist": {"model": "lenet5", "epochs": 2, "optimizer": "sgd", "lr": 0.05},
    "text": {"model": "transformer", "epochs": 1, "optimizer": "adamw", "lr": 3e-3},
}


@dataclass(frozen=True)
class TrainConfig:
    """One ``gradaccum train`` run. The window is ``micro_batch_size * accum_steps`` items per rank
    (or ``batch_size`` with ``micro_batch_size="auto"``)."""

    task: str = "digits"
    data_path: Optional[str] = None
    model: Optional[str] = None
    micro_batch_size: Union[int, str] = 32
    accum_steps: int = 4
    batch_size: Optional[int] = None
    epochs: Optional[int] = None
    optimizer: Optional[str] = None
    lr: Optional[float] = None
    precision: str = "fp32"
    max_grad_norm: Optional[float] = None
    seed: int = 0
    out: str = "runs/latest"
    checkpoint_every: int = 0
    device: str = "auto"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        def bad(flag: str, value: Any, want: str) -> ValueError:
            return ValueError(f"{flag} must be {want}, got {value!r}")

        if self.task not in TASKS:
            raise bad("--task", self.task, f"one of {', '.join(TASKS)}")
        if self.model is not None and self.model not in MODELS:
            raise bad("--model", self.model, f"one of {', '.join(MODELS)}")
        if self.micro_batch_size != "auto" and (not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1):
            raise bad("--micro-batch-size", self.micro_batch_size, "an integer >= 1 or 'auto'")
        if not isinstance(self.accum_steps, int) or self.accum_steps < 1:
            raise bad("--accum-steps", self.accum_steps, "an integer >= 1")
        if self.batch_size is not None and self.batch_size < 1:
            raise bad("--batch-size", self.batch_size, "an integer >= 1")
        if self.epochs is not None and self.epochs < 1:
            raise bad("--epochs", self.epochs, "an integer >= 1")
        if self.optimizer is not None and self.optimizer not in OPTIMIZERS:
            raise bad("--optimizer", self.optimizer, f"one of {', '.join(OPTIMIZERS)}")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise bad("--lr", self.lr, "a positive number")
        if self.precision not in PRECISIONS:
            raise bad("--precision", self.precision, f"one of {', '.join(PRECISIONS)}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise bad("--max-grad-norm", self.max_grad_norm, "a positive number")
        if self.checkpoint_every < 0:
            raise bad("--checkpoint-every", self.checkpoint_every, "an integer >= 0 (0: only at the end)")
        if self.dtype not in DTYPES:
            raise bad("--dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if self.dtype == "float64" and self.precision != "fp32":
            raise ValueError(f"--dtype float64 needs --precision fp32, got --precision {self.precision}")
        if self.device not in DEVICES:
            raise bad("--device", self.device, f"one of {', '.join(DEVICES)}")
        defaults = DEFAULTS[self.task]
        for name in ("model", "epochs", "optimizer", "lr"):  # fill the task's defaults
            if getattr(self, name) is None:
                object.__setattr__(self, name, defaults[name])

    @property
    def window_items(self) -> int:
        """Items per window on each rank."""
        if self.batch_size is not None:
            return self.batch_size
        if self.micro_batch_size == "auto":
            return 128
        return int(self.micro_batch_size) * self.accum_steps

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)
