"""``gradaccum check``: is accumulation equivalent to one big batch on this model?

On a built-in task's model (``--task``, ``--model``) or on the user's own: ``--model pkg.nets:build
--batch pkg.data:sample --loss pkg.train:loss_fn`` (import paths; ``build()`` returns the model,
``sample()`` one batch, ``loss_fn(model, batch)`` the mean loss or ``(mean, count)``). Either way
the library's :func:`~gradaccum.check_equivalence` compares the batch's gradient with the one
accumulated over its micro-batches. Exit 0: equivalent; 1: not; 2: a usage error.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from typing import Any, Callable, Sequence, Tuple

from .errors import CLIError

__all__ = ["check_command", "import_object"]

DEFAULT_MICRO_BATCH_SIZE = 8
DEFAULT_ACCUM_STEPS = 4


def import_object(flag: str, path: str) -> Any:
    """``module:attr`` imported (the current folder first, as ``python -m`` does), or a one-line CLIError."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise CLIError(f"{flag} {path!r} is not an import path; write MODULE:FUNCTION, e.g. {flag} pkg.nets:build")
    if "" not in sys.path:
        sys.path.insert(0, "")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise CLIError(f"{flag} {path}: cannot import {module_name} ({e}); run from the folder that holds it or add "
                       "that folder to PYTHONPATH") from None
    try:
        found = getattr(module, attr)
    except AttributeError:
        raise CLIError(f"{flag} {path}: {module_name} has no {attr!r}; name a function defined in it") from None
    if not callable(found):
        raise CLIError(f"{flag} {path}: {attr} is a {type(found).__name__}, not a function; name a function")
    return found


def _call(flag: str, path: str, fn: Callable[..., Any], *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the user's code: one line naming where it failed
        raise CLIError(f"{flag} {path} raised {type(e).__name__}: {e}; fix it, or try it in Python first") from None


def _own_model(args: argparse.Namespace) -> Tuple[Any, Any, Any, str]:
    missing = [f for f, v in (("--batch", args.batch), ("--loss", args.loss)) if v is None]
    if missing:
        raise CLIError(f"--model {args.model} is your own model, so give {' and '.join(missing)} too: "
                       "--batch MODULE:FUNCTION (one batch) and --loss MODULE:FUNCTION (loss_fn(model, batch))")
    for flag in ("--task", "--data-path", "--accum-steps"):
        given = getattr(args, flag[2:].replace("-", "_"))
        if given is not None:
            raise CLIError(f"{flag} {given} is for the built-in tasks; with your own --model the batch is "
                           f"--batch's: drop {flag}")
    from torch import nn

    model = _call("--model", args.model, import_object("--model", args.model))
    if not isinstance(model, nn.Module):
        raise CLIError(f"--model {args.model} returned a {type(model).__name__}, not a torch.nn.Module; return the model")
    batch = _call("--batch", args.batch, import_object("--batch", args.batch))
    loss_fn = import_object("--loss", args.loss)
    return model, batch, loss_fn, args.model


def _accum_steps(args: argparse.Namespace) -> int:
    return DEFAULT_ACCUM_STEPS if args.accum_steps is None else int(args.accum_steps)


def _builtin(args: argparse.Namespace) -> Tuple[Any, Any, Any, str, int]:
    import torch

    from ..tasks.data import load_task
    from .config import TrainConfig
    from .run import build

    if args.batch is not None or args.loss is not None:
        raise CLIError("--batch and --loss go with your own --model MODULE:FUNCTION; drop them, or name your model")
    from .config import MODELS

    if args.model is not None and args.model not in MODELS:
        raise CLIError(f"--model must be one of {', '.join(MODELS)} or your own MODULE:FUNCTION (e.g. "
                       f"mypkg.nets:build, with the colon), got {args.model!r}")
    m = args.micro_batch_size or DEFAULT_MICRO_BATCH_SIZE
    n = _accum_steps(args)
    cfg = TrainConfig(task=args.task or "digits", data_path=args.data_path, model=args.model, micro_batch_size=m,
                      accum_steps=n, seed=args.seed, device="cpu")
    task = load_task(cfg.task, cfg.data_path)
    model = build(cfg, task, torch.device("cpu"))
    items = min(cfg.window_items, task.num_train)
    if items < cfg.window_items and math.ceil(items / m) >= 2:
        print(f"gradaccum check: --micro-batch-size {m} x --accum-steps {n} = {cfg.window_items} items is more than "
              f"the {task.num_train} of the training set; checking all {task.num_train}", file=sys.stderr)
    batch = task.gather(list(range(items)))
    return model, batch, task.loss_fn, f"{cfg.task}/{cfg.model}", m


def check_command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .. import check_equivalence
    from ..batching import leading_dim

    if not args.rtol > 0:
        raise ValueError(f"--rtol must be a positive number, got {args.rtol!r}")
    torch_seed(args.seed)
    own = args.model is not None and ":" in args.model
    if own:
        model, batch, loss_fn, name = _own_model(args)
        try:
            items = leading_dim(batch, argument="batch")
        except (TypeError, ValueError) as e:
            raise CLIError(f"--batch {args.batch} returned no batch of items along dim 0 ({e}); return a tensor, "
                           "or a dict or tuple of tensors of the same length") from None
        m = args.micro_batch_size or max(1, math.ceil(items / 2))
    else:
        model, batch, loss_fn, name, m = _builtin(args)
        items = leading_dim(batch, argument="batch")
    pieces = math.ceil(items / m)
    if pieces < 2:
        if not own and _accum_steps(args) == 1 and items == m:  # a window of M x 1 items: N makes it more than one
            fix = "pass --accum-steps 2 or more"
        elif items < 2:
            fix = f"make --batch {args.batch} return 2 items or more"
        else:
            fix = f"pass --micro-batch-size {items // 2} or less"
        raise CLIError(f"--micro-batch-size {m} on a batch of {items} item{'s' if items != 1 else ''} gives one "
                       f"micro-batch, which is only compared with itself; {fix}")
    def compare() -> Any:
        return check_equivalence(model, loss_fn, batch, m, rtol=args.rtol)

    report = _call("--loss", args.loss, compare) if own else compare()
    print(f"{name}, {items} items in {pieces} micro-batches of at most {m}: {report}")
    return 0 if report.equivalent else 1


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
