"""``gradaccum check``: is accumulation equivalent to one big batch on this model?

On a built-in task's model (``--task``, ``--model``) or on the user's own: ``--model pkg.nets:build
--batch pkg.data:sample --loss pkg.train:loss_fn`` (import paths; ``build()`` returns the model,
``sample()`` one batch, ``loss_fn(model, batch)`` the mean loss or ``(mean, count)``; for a loss that
couples the batch's items, ``--encode`` and ``--window-loss`` instead of ``--loss`` check a
:class:`~gradaccum.WindowLoss`). Either way
the library's :func:`~gradaccum.check_equivalence` compares the batch's gradient with the one
accumulated over its micro-batches; a split it refuses (:class:`~gradaccum.checking.SplitError`)
is said here with the flags that fix it. Exit 0: equivalent; 1: not (a model that draws random
numbers, such as dropout, included); 2: a usage error.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import Any, Callable, Sequence, Tuple

from .._maths import ceil_div
from .config import CHECK_ACCUM_STEPS, CHECK_MICRO_BATCH_SIZE
from .errors import CLIError
from ..errors import ConfigurationError

__all__ = ["check_command", "import_object"]


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
    """``fn(*args)``, the user's function: anything it raises becomes one line naming ``flag``."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - the user's code: one line naming where it failed
        raise CLIError(f"{flag} {path} raised {type(e).__name__}: {e}; fix it, or try it in Python first") from None


def _own_model(args: argparse.Namespace) -> Tuple[Any, Any, Any, str]:
    windowed = args.encode is not None or args.window_loss is not None
    needed = (("--batch", args.batch),) + ((("--encode", args.encode), ("--window-loss", args.window_loss))
                                           if windowed else (("--loss", args.loss),))
    missing = [f for f, v in needed if v is None]
    if windowed and args.loss is not None:
        raise CLIError(f"--loss {args.loss} and --encode/--window-loss both give the loss: --loss for a loss per "
                       "item, --encode with --window-loss for one that couples the batch's items; keep one")
    if missing:
        wanted = ("--encode MODULE:FUNCTION (encode(model, batch) -> representations) and --window-loss "
                  "MODULE:FUNCTION (loss(model, representations))" if windowed else
                  "--loss MODULE:FUNCTION (loss_fn(model, batch))")
        raise CLIError(f"--model {args.model} is your own model, so give {' and '.join(missing)} too: "
                       f"--batch MODULE:FUNCTION (one batch) and {wanted}")
    for flag in ("--task", "--data-path"):
        given = getattr(args, flag[2:].replace("-", "_"))
        if given is not None:
            raise CLIError(f"{flag} {given} is for the built-in tasks; with your own --model the batch is "
                           f"--batch's: drop {flag}")
    from torch import nn

    model = _call("--model", args.model, import_object("--model", args.model))
    if not isinstance(model, nn.Module):
        raise CLIError(f"--model {args.model} returned a {type(model).__name__}, not a torch.nn.Module; return the model")
    batch = _call("--batch", args.batch, import_object("--batch", args.batch))
    if windowed:
        from .._cached import WindowLoss

        loss_fn: Any = WindowLoss(import_object("--encode", args.encode), import_object("--window-loss", args.window_loss))
        return model, batch, loss_fn, f"{args.model} with WindowLoss"
    return model, batch, import_object("--loss", args.loss), args.model


def _own_split(args: argparse.Namespace, items: int) -> int:
    """The micro-batch size that splits your --batch of ``items``: ``--micro-batch-size``, or the size
    that makes ``--accum-steps N`` micro-batches of one size (the last one shorter), or half the batch.

    A split of one size into N pieces exists when ceil(items / ceil(items / N)) == N (10 items go into
    4 micro-batches of at most 3, not into 6 of one size): another N is refused with the ones that work."""
    n, m = args.accum_steps, args.micro_batch_size
    if n is None:
        return m or max(1, ceil_div(items, 2))
    if n < 1:
        raise CLIError(f"--accum-steps must be 1 or more (micro-batches to split --batch {args.batch} into), got {n}")
    if n > items:
        raise CLIError(f"--accum-steps {n} is more micro-batches than --batch {args.batch}'s {_count(items, 'item')}; "
                       f"pass --accum-steps {items} or less")
    size = ceil_div(items, n)
    if m is not None and ceil_div(items, m) != n:
        raise CLIError(f"--micro-batch-size {m} and --accum-steps {n} disagree: {_count(items, 'item')} in micro-batches "
                       f"of at most {m} are {ceil_div(items, m)}; give one of the two (your --batch is the batch)")
    if ceil_div(items, size) != n:
        works = sorted({ceil_div(items, k) for k in range(1, items + 1)})
        near = min(works, key=lambda k: (abs(k - n), k))
        raise CLIError(f"--accum-steps {n} does not split {_count(items, 'item')} into {n} micro-batches of one size (at "
                       f"most {size} each makes {ceil_div(items, size)}); pass --accum-steps {near}, or "
                       f"--micro-batch-size")
    return m or size


def _accum_steps(args: argparse.Namespace) -> int:
    return CHECK_ACCUM_STEPS if args.accum_steps is None else int(args.accum_steps)


def _builtin(args: argparse.Namespace) -> Tuple[Any, Any, Any, str, int]:
    import torch

    from ..tasks.data import load_task
    from .config import TrainConfig
    from .run import build

    from ..tasks import MODELS

    if args.model is not None and args.model not in MODELS:
        given = f" (your --batch and --loss name functions as MODULE:FUNCTION: so must --model, e.g. {args.model}:build)" \
            if args.batch is not None or args.loss is not None else ""
        raise CLIError(f"--model must be one of {', '.join(MODELS)} or your own MODULE:FUNCTION (e.g. "
                       f"mypkg.nets:build, with the colon), got {args.model!r}{given}")
    if args.batch is not None or args.loss is not None or args.encode is not None or args.window_loss is not None:
        raise CLIError("--batch, --loss, --encode and --window-loss go with your own --model MODULE:FUNCTION; drop "
                       "them, or name your model")
    m = args.micro_batch_size or CHECK_MICRO_BATCH_SIZE
    n = _accum_steps(args)
    cfg = TrainConfig(task=args.task or "digits", data_path=args.data_path, model=args.model, micro_batch_size=m,
                      accum_steps=n, seed=args.seed, device="cpu")
    task = load_task(cfg.task, cfg.data_path)
    model = build(cfg, task, torch.device("cpu"))
    items = min(cfg.window_items, task.num_train)
    if items < cfg.window_items and ceil_div(items, m) >= 2:
        print(f"gradaccum check: --micro-batch-size {m} x --accum-steps {n} = {cfg.window_items} items is more than "
              f"the {task.num_train} of the training set; checking all {task.num_train}", file=sys.stderr)
    batch = task.gather(list(range(items)))
    return model, batch, task.loss_fn, f"{cfg.task}/{cfg.model}", m


def check_command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .. import check_equivalence
    from ..batching import leading_dim
    from ..checking import SplitError

    if not args.rtol > 0:
        raise ConfigurationError(f"--rtol must be a positive number, got {args.rtol!r}")
    torch_seed(args.seed)
    own = args.model is not None and ":" in args.model
    if own:
        model, batch, loss_fn, name = _own_model(args)
        try:
            items = leading_dim(batch, argument="batch")
        except (TypeError, ValueError) as e:
            raise CLIError(f"--batch {args.batch} returned no batch of items along dim 0 ({e}); return a tensor, "
                           "or a dict or tuple of tensors of the same length") from None
        m = _own_split(args, items)
    else:
        model, batch, loss_fn, name, m = _builtin(args)
        items = leading_dim(batch, argument="batch")
    try:
        report = check_equivalence(model, loss_fn, batch, m, rtol=args.rtol)
    except SplitError as e:
        raise CLIError(_split_refused(e, args, own)) from None
    except Exception as e:  # noqa: BLE001 - the user's code: one line naming where it failed
        if not own:
            raise
        flags = f"--loss {args.loss}" if args.loss else f"--encode {args.encode} or --window-loss {args.window_loss}"
        raise CLIError(f"{flags} raised {type(e).__name__}: {e}; fix it, or try it in Python first") from None
    pieces = ceil_div(items, m)
    fix = _batchnorm_fix(report)
    print(f"{name}, {_count(items, 'item')} in {_count(pieces, 'micro-batch', 'micro-batches')} of at most {m}: "
          f"{report}" + (f"\n  fix: {fix}" if fix else ""))
    return 0 if report.equivalent else 1


#: what makes a model with BatchNorm accumulate exactly (the library's warning says the same)
BATCHNORM_FIX = ("put the BatchNorm layers in eval mode (model.eval(), or .eval() on each of them: they then "
                 "normalize with their running statistics, the same for every split), or replace them with "
                 "GroupNorm or LayerNorm, which normalize each item on its own")


def _batchnorm_fix(report: Any) -> str:
    """The fix for the BatchNorm layers the report names (it names them, not what to do), or ""."""
    named = [reason for _, reason in report.suspects if "BatchNorm" in reason.split(" in training mode", 1)[0]]
    return BATCHNORM_FIX if named else ""


def _split_refused(error: Any, args: argparse.Namespace, own: bool) -> str:
    """The library's refusal of a split, in flags: a split of one micro-batch, with the flag that
    fixes it; a micro-batch the model cannot run, with ``--micro-batch-size``."""
    m, items = error.micro_batch_size, error.items
    if ceil_div(items, m) >= 2:  # the model cannot run one of the micro-batches
        return re.sub(r"micro_batch_size=(\d+)", r"--micro-batch-size \1", str(error))
    if (args.accum_steps if own else _accum_steps(args)) == 1 and items == m:  # one micro-batch: N makes more
        fix = "pass --accum-steps 2 or more"
    elif items < 2:
        fix = f"make --batch {args.batch} return 2 items or more"
    else:
        fix = f"pass --micro-batch-size {items // 2} or less"
    return (f"--micro-batch-size {m} on a batch of {_count(items, 'item')} gives one micro-batch, which is only "
            f"compared with itself; {fix}")


def _count(n: int, noun: str, plural: str = "") -> str:
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def torch_seed(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
