"""``gradaccum train | eval | check``: the seed experiments end to end.

Every user mistake ends as one line on stderr and exit code 2, never a traceback
(``GRADACCUM_DEBUG=1`` shows the traceback of an unexpected error). What happens to the run folder,
on Ctrl-C and on ``--resume`` is in :mod:`gradaccum.cli.lifecycle`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any, List, NoReturn, Optional, Sequence, Union

__all__ = ["main"]

# the largest parameter difference of `gradaccum train --compare --dtype float64` (digits, LeNet-5,
# 32 x 4, 15 epochs) measured 3e-15 to 7e-15 on the machines we ran it on: rounding order only
FLOAT64_AGREEMENT = "~1e-14"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not usage + message
        self.exit(2, f"{self.prog}: error: {message}\n")


def _micro_batch_size(text: str) -> Union[int, str]:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}") from None


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


def _parser() -> argparse.ArgumentParser:
    from .. import __version__
    from ..precision import PRECISIONS
    from ..tasks.data import TASKS
    from ..tasks.models import MODELS
    from .config import DEFAULT_ACCUM_STEPS, DEFAULT_AUTO_BATCH, DEVICES, DTYPES, OPTIMIZERS

    raw = argparse.RawDescriptionHelpFormatter
    p = _Parser(prog="gradaccum", description="Gradient accumulation that is exactly one big batch.")
    p.add_argument("--version", action="version", version=f"gradaccum {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="{train,eval,check}")

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
               "  1        trained, but the final checkpoint or summary.json could not be written\n"
               "  2        a usage error (one line on stderr)\n"
               "  130/143  stopped by SIGINT (Ctrl-C) / SIGTERM after writing a checkpoint: resume with\n"
               "           --resume (a second signal stops at once, without one)",
        formatter_class=raw, allow_abbrev=False)
    t.add_argument("--task", default="digits", metavar=_choices(TASKS),
                   help="digits: scikit-learn's 8x8 digits, offline; mnist: the IDX files in --data-path; "
                        "text: a byte-level language model (default: digits)")
    t.add_argument("--data-path", metavar="PATH",
                   help="mnist: the folder of the four IDX files (or of train/ and test/); text: one text file "
                        "(default: some of Python's own standard library sources); not used by digits")
    t.add_argument("--model", metavar=_choices(MODELS),
                   help=f"lenet5 or mlp for images, transformer for text (default per task: {_per_task('model')})")
    t.add_argument("--micro-batch-size", type=_micro_batch_size, default=32, metavar="{M,auto}",
                   help="items per forward/backward; auto starts from the whole window and halves on "
                        "out-of-memory (default: 32)")
    t.add_argument("--accum-steps", type=int, metavar="N",
                   help=f"micro-batches per optimizer step on each rank (default: {DEFAULT_ACCUM_STEPS}, or "
                        "B / (M x W) with --batch-size)")
    t.add_argument("--batch-size", type=int, metavar="B",
                   help="the global batch: items per optimizer step across all W ranks; any two of B, M, N "
                        "give the third, all three must agree (default: M x N x W; "
                        f"{DEFAULT_AUTO_BATCH} with --micro-batch-size auto)")
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
    t.add_argument("--seed", type=int, default=0, metavar="S",
                   help="seeds the model's initialisation and the data order (default: 0)")
    t.add_argument("--out", default="runs/latest", metavar="DIR",
                   help="the run folder: metrics.jsonl, summary.json, last.pt, loss.png; a folder holding "
                        "another run is refused unless --resume or --overwrite (default: runs/latest)")
    t.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="also write last.pt every K optimizer steps; 0: only at the end and when stopped by "
                        "Ctrl-C or SIGTERM (default: 0)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last.pt, with the same flags (only --epochs may grow); "
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

    e = sub.add_parser("eval", help="print the test metrics of a saved model (and the step it holds)",
                       description="Print the test metrics of a checkpoint as one JSON line, with the step,\n"
                                   "epoch and window it holds.",
                       epilog="exit codes: 0 done, 2 a usage error (one line)", formatter_class=raw,
                       allow_abbrev=False)
    e.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="a last.pt, or the last.dcp folder of a --shard run, written by gradaccum train (required)")
    e.add_argument("--data-path", metavar="PATH",
                   help="read the data from here instead of the path saved in the checkpoint (default: saved)")
    e.add_argument("--device", default="auto", metavar=_choices(DEVICES),
                   help="auto: cuda when available (default: auto)")

    c = sub.add_parser("check", help="is accumulation equivalent to one big batch on this model?",
                       description="Compare one big batch's gradient with the gradient accumulated over\n"
                                   "micro-batches, from the same start, and name the modules that break the\n"
                                   "equivalence (BatchNorm, dropout, ...).",
                       epilog="exit codes: 0 equivalent, 1 not equivalent, 2 a usage error (one line)",
                       formatter_class=raw, allow_abbrev=False)
    c.add_argument("--task", default="digits", metavar=_choices(TASKS), help="(default: digits)")
    c.add_argument("--data-path", metavar="PATH", help="as for train: mnist's folder or text's file (default: none)")
    c.add_argument("--model", metavar=_choices(MODELS), help=f"(default per task: {_per_task('model')})")
    c.add_argument("--micro-batch-size", type=_check_micro_batch_size, default=8, metavar="M",
                   help="items per micro-batch of the split to check (default: 8)")
    c.add_argument("--accum-steps", type=int, default=4, metavar="N",
                   help="micro-batches: the batch is M x N items (default: 4)")
    c.add_argument("--rtol", type=float, default=1e-5, metavar="R",
                   help="the largest relative gradient difference still called equivalent; float32 splits "
                        "differ by ~1e-6 (default: 1e-05)")
    c.add_argument("--seed", type=int, default=0, metavar="S", help="seeds the model (default: 0)")
    return p


def _resume_command(argv: Sequence[str]) -> str:
    """The command that resumes this run: the user's own words, with --resume and without --overwrite.
    Under torchrun, the same launcher on one node (the run also resumes on any other number of ranks);
    on several nodes the launcher's own flags are the user's to repeat."""
    main_file = os.path.basename(sys.argv[0]) if sys.argv else ""
    prog = [sys.executable, "-m", "gradaccum"] if main_file == "__main__.py" else ["gradaccum"]
    args = [a for a in argv if a != "--overwrite"]
    if "--resume" not in args:
        args.append("--resume")
    world, local = (int(os.environ.get(k, "1") or 1) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"))
    if world > 1:
        launcher = (f"torchrun --standalone --nproc_per_node={world}" if local == world
                    else "torchrun <your --nnodes/--node_rank/--rdzv flags>")
        return f"{launcher} -m gradaccum {shlex.join(args)}"
    return shlex.join([*prog, *args])


def _train(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .. import sync
    from .checkpoint import CLIError
    from .config import TrainConfig
    from .lifecycle import check_out
    from .train import run_training

    world_size = _launch_world_size()
    cfg = TrainConfig(task=args.task, data_path=args.data_path, model=args.model,
                      micro_batch_size=args.micro_batch_size, accum_steps=args.accum_steps,
                      batch_size=args.batch_size, epochs=args.epochs, optimizer=args.optimizer, lr=args.lr,
                      precision=args.precision, max_grad_norm=args.max_grad_norm, seed=args.seed, out=args.out,
                      checkpoint_every=args.checkpoint_every, device=args.device, dtype=args.dtype,
                      shard=args.shard, world_size=world_size)
    if args.compare and cfg.micro_batch_size == "auto":
        raise CLIError("--compare needs an integer --micro-batch-size (the baseline is one batch of M x N)")
    if args.compare and cfg.shard:
        raise CLIError("--compare does not work with --shard: the comparison reads whole parameters; compare "
                       "without --shard (the sharded run is the same maths)")
    out = check_out(args.out)
    result = run_training(cfg, out, resume=args.resume, overwrite=args.overwrite, command=_resume_command(argv))
    if sync.is_rank_zero() and not result.already_complete:
        s = result.summary
        metric = f"test accuracy {s['test_accuracy']:.4f}" if "test_accuracy" in s else f"test loss {s['test_loss']:.4f}"
        memory = (f", peak memory {s['peak_memory_bytes'] / 2**20:.2f} MiB" if s.get("peak_memory_bytes") is not None
                  else "")
        ranks = f" on {s['world_size']} ranks" if s.get("world_size", 1) > 1 else ""
        print(f"{cfg.task}/{cfg.model}: {_steps_phrase(result.history, result.unit, result.window_unit)}{ranks}, "
              f"{metric}, {s['wall_time_seconds']:.1f}s{memory} -> {out}")
    compared = sync.broadcast_object((out / "compare.json").exists() if sync.is_rank_zero() else None)
    if args.compare and not (result.already_complete and compared):
        _compare(cfg, out, result, resume=args.resume, command=_resume_command(argv))
    assert result.lifecycle is not None
    result.lifecycle.raise_if_unsaved()
    return 0


def _launch_world_size() -> int:
    """The ranks of this launch: torchrun's WORLD_SIZE, else 1."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def _sizes_phrase(sizes: List[int], unit: str) -> str:
    k, top = len(sizes), max(sizes)
    full = sum(1 for n in sizes if n == top)
    if full == k:
        return f"{top} {unit}"
    if 2 * full >= k:
        return f"{top} {unit} ({k - full} shorter)"
    return f"{min(sizes)} to {top} {unit}"


def _steps_phrase(history: List[Any], unit: str, window_unit: Optional[str] = None) -> str:
    """``12 steps of 128 images (1 shorter)``, ``1 step of 1438 images``, ``9 steps of 64 sequences,
    221 to 460 tokens each``: what each step really used across all ranks, not the flags."""
    sizes = [int(r["num_items"]) for r in history]
    if not sizes:
        return "0 steps"
    steps = f"{len(sizes)} step{'' if len(sizes) == 1 else 's'}"
    windows = [int(r["window_items"]) for r in history if "window_items" in r]
    if window_unit is None or window_unit == unit or len(windows) != len(sizes):
        return f"{steps} of {_sizes_phrase(sizes, unit)}"
    return f"{steps} of {_sizes_phrase(windows, window_unit)}, {_sizes_phrase(sizes, unit)} each"


def _compare(cfg: Any, out: Path, accumulated: Any, *, resume: bool, command: str) -> None:
    """Train the same model with the whole window as one batch from the same seed; compare."""
    from dataclasses import replace

    from .. import sync
    from .lifecycle import BASELINE, CHECKPOINT
    from .report import plot_compare
    from .train import run_training

    window = int(accumulated.summary["window_items"])  # as trained: at most the training set
    ranks = int(accumulated.summary.get("world_size", 1))
    # one micro-batch per rank: each rank's whole share of the global window at once
    base_cfg = replace(cfg, micro_batch_size=-(-window // ranks), accum_steps=None, batch_size=window,
                       out=str(out / BASELINE), checkpoint_every=0)
    # the baseline is this run's own sub-run: resumed with it, else started over
    base_resume = resume and sync.broadcast_object((out / BASELINE / CHECKPOINT).exists() if sync.is_rank_zero()
                                                   else None)
    baseline = run_training(base_cfg, out / BASELINE, resume=base_resume, overwrite=not base_resume,
                            command=command, label=f"one batch of {window}")
    assert accumulated.model is not None and baseline.model is not None
    diff = max((a - b).abs().max().item() for a, b in
               zip(accumulated.model.state_dict().values(), baseline.model.state_dict().values()))
    a, b = accumulated.summary, baseline.summary
    report = {"max_abs_param_diff": diff,
              "accumulated": {"micro_batch_size": cfg.micro_batch_size, "accum_steps": cfg.micro_batches,
                              "peak_memory_bytes": a.get("peak_memory_bytes"), "test_loss": a["test_loss"],
                              "test_accuracy": a.get("test_accuracy"), "wall_time_seconds": a["wall_time_seconds"]},
              "one_batch": {"micro_batch_size": window, "accum_steps": 1,
                            "peak_memory_bytes": b.get("peak_memory_bytes"), "test_loss": b["test_loss"],
                            "test_accuracy": b.get("test_accuracy"), "wall_time_seconds": b["wall_time_seconds"]},
              "peak_memory_source": a.get("peak_memory_source")}
    if sync.is_rank_zero():
        (out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
        plot_compare(accumulated.history, baseline.history, (accumulated.label, baseline.label),
                     out / "compare.png", title=accumulated.title, max_param_diff=diff, dtype=cfg.dtype,
                     float64_agreement=FLOAT64_AGREEMENT)
        mib = 2 ** 20
        memory = ""
        if a.get("peak_memory_bytes") is not None and b.get("peak_memory_bytes") is not None:
            memory = (f"; peak memory {a['peak_memory_bytes'] / mib:.2f} MiB accumulated vs "
                      f"{b['peak_memory_bytes'] / mib:.2f} MiB one batch ({a['peak_memory_source'].split(':')[0]})")
        print(f"compare: largest parameter difference {diff:.3e}{memory} -> {out / 'compare.png'}")
        if cfg.dtype == "float32":
            print("compare: in float32 the two runs round differently and the difference compounds over "
                  f"training; --dtype float64 shows them equal to {FLOAT64_AGREEMENT}")
    assert baseline.lifecycle is not None
    baseline.lifecycle.raise_if_unsaved()


def _eval(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from dataclasses import replace

    from ..tasks.data import load_task
    from .checkpoint import CLIError, load_checkpoint
    from .config import TrainConfig
    from .train import build, resolve_device

    device = resolve_device(args.device)
    path = Path(args.checkpoint)
    if path.is_dir():  # a --shard run's last.dcp: its gradaccum.pt says what model to build
        from .sharding import META, META_KEYS, sharded_folder

        state = load_checkpoint((sharded_folder(path) or path) / META, required=META_KEYS)
    else:
        state = load_checkpoint(path)
    try:
        cfg = TrainConfig(**state["config"])
    except (TypeError, ValueError):
        raise CLIError(f"--checkpoint {path} holds settings this version cannot read; evaluate it with the "
                       "gradaccum that wrote it") from None
    if args.data_path is not None:
        cfg = replace(cfg, data_path=args.data_path)  # validated, and made absolute, like train's
    task = load_task(cfg.task, cfg.data_path)
    model = build(cfg, task, device)
    if path.is_dir():
        from .sharding import load_sharded_model

        load_sharded_model(model, path)
    else:
        model.load_state_dict(state["model"])
    model.eval()
    metrics = task.evaluate(model, device)
    held = {"step": int(state["accumulator"]["steps"]), "epoch": int(state["epoch"]), "window": int(state["window"])}
    print(json.dumps({"checkpoint": args.checkpoint, "task": cfg.task, "model": cfg.model, **held,
                      "complete": (held["epoch"], held["window"]) == (cfg.epochs, 0), **metrics}))
    return 0


def _check(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from .. import check_equivalence
    from ..tasks.data import load_task
    from .config import TrainConfig
    from .train import build

    cfg = TrainConfig(task=args.task, data_path=args.data_path, model=args.model,
                      micro_batch_size=args.micro_batch_size, accum_steps=args.accum_steps, seed=args.seed,
                      device="cpu")
    if not args.rtol > 0:
        raise ValueError(f"--rtol must be a positive number, got {args.rtol!r}")
    task = load_task(cfg.task, cfg.data_path)
    model = build(cfg, task, __import__("torch").device("cpu"))
    batch = task.gather(list(range(min(cfg.window_items, task.num_train))))
    report = check_equivalence(model, task.loss_fn, batch, args.micro_batch_size, rtol=args.rtol)
    print(f"{cfg.task}/{cfg.model}, {cfg.window_items} items in micro-batches of {args.micro_batch_size}: {report}")
    return 0 if report.equivalent else 1


def main(argv: Optional[List[str]] = None) -> int:
    from ..tasks.data import TaskError
    from .checkpoint import CLIError
    from .lifecycle import Stopped

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand that refuses them, with where to find its flags
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)} (gradaccum {args.command} "
                                     "--help lists its flags)")
    command_argv = argv[argv.index(args.command):] if args.command in argv else [args.command]
    from ..sync import is_rank_zero

    def say(line: str) -> None:  # every rank meets the same stop or usage error: rank 0 says it once
        if is_rank_zero():
            print(line, file=sys.stderr)

    try:
        try:
            return {"train": _train, "eval": _eval, "check": _check}[args.command](args, command_argv)
        finally:
            from .sharding import teardown_distributed

            teardown_distributed()
    except Stopped as e:
        say(f"gradaccum {args.command}: {e}")
        return e.exit_code
    except CLIError as e:
        say(f"gradaccum {args.command}: error: {e}")
        return getattr(e, "exit_code", 2)
    except (TaskError, ValueError, FileNotFoundError, PermissionError) as e:
        say(f"gradaccum {args.command}: error: {e}")
        return 2
    except KeyboardInterrupt:
        print(f"gradaccum {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback
        if os.environ.get("GRADACCUM_DEBUG"):
            raise
        print(f"gradaccum {args.command}: error: {type(e).__name__}: {e} (GRADACCUM_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1
