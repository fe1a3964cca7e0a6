"""``gradaccum train | eval | check``: the seed experiments end to end.

Every user mistake ends as one line on stderr and a non-zero exit, never a traceback
(``GRADACCUM_DEBUG=1`` shows the traceback of an unexpected error).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, List, NoReturn, Optional, Union

__all__ = ["main"]


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


def _parser() -> argparse.ArgumentParser:
    from .. import __version__

    p = _Parser(prog="gradaccum", description="Gradient accumulation that is exactly one big batch.")
    p.add_argument("--version", action="version", version=f"gradaccum {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    t = sub.add_parser("train", help="train a task's model with accumulation; writes metrics, plots, checkpoints")
    t.add_argument("--task", default="digits", help="digits (default, offline) | mnist | text")
    t.add_argument("--data-path", help="mnist: folder of the IDX files; text: a text file")
    t.add_argument("--model", help="lenet5 | mlp (images), transformer (text)")
    t.add_argument("--micro-batch-size", type=_micro_batch_size, default=32, help="items per forward/backward, or auto")
    t.add_argument("--accum-steps", type=int, default=4, help="micro-batches per optimizer step")
    t.add_argument("--batch-size", type=int, help="items per window (default: micro-batch size x accum steps; 128 with auto)")
    t.add_argument("--epochs", type=int)
    t.add_argument("--optimizer", help="sgd (momentum 0.9) | adamw")
    t.add_argument("--lr", type=float)
    t.add_argument("--precision", default="fp32", help="fp32 | bf16 | fp16")
    t.add_argument("--max-grad-norm", type=float)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--out", default="runs/latest", help="output folder (metrics.jsonl, summary.json, last.pt, loss.png)")
    t.add_argument("--checkpoint-every", type=int, default=0, help="write last.pt every K optimizer steps (and at the end)")
    t.add_argument("--resume", action="store_true", help="continue from OUT/last.pt")
    t.add_argument("--compare", action="store_true", help="also train with the whole window as one batch, and compare")
    t.add_argument("--device", default="auto", help="cpu | cuda | auto")
    t.add_argument("--dtype", default="float32", help="float32 | float64 (float64 shows --compare's equality to ~1e-12)")

    e = sub.add_parser("eval", help="print the test metrics of a saved model")
    e.add_argument("--checkpoint", required=True, help="a last.pt written by gradaccum train")
    e.add_argument("--data-path", help="override the data path saved in the checkpoint")
    e.add_argument("--device", default="auto")

    c = sub.add_parser("check", help="is accumulation equivalent to one big batch on this model?")
    c.add_argument("--task", default="digits")
    c.add_argument("--data-path")
    c.add_argument("--model")
    c.add_argument("--micro-batch-size", type=int, default=8)
    c.add_argument("--accum-steps", type=int, default=4)
    c.add_argument("--rtol", type=float, default=1e-5)
    c.add_argument("--seed", type=int, default=0)
    return p


def _train(args: argparse.Namespace) -> int:
    from .. import sync
    from .checkpoint import CLIError
    from .config import TrainConfig
    from .train import run_training

    cfg = TrainConfig(task=args.task, data_path=args.data_path, model=args.model,
                      micro_batch_size=args.micro_batch_size, accum_steps=args.accum_steps,
                      batch_size=args.batch_size, epochs=args.epochs, optimizer=args.optimizer, lr=args.lr,
                      precision=args.precision, max_grad_norm=args.max_grad_norm, seed=args.seed, out=args.out,
                      checkpoint_every=args.checkpoint_every, device=args.device, dtype=args.dtype)
    out = Path(cfg.out)
    if args.compare and cfg.micro_batch_size == "auto":
        raise CLIError("--compare needs an integer --micro-batch-size (the baseline is one batch of M x N)")
    result = run_training(cfg, out, resume=args.resume, label=f"accumulate {cfg.micro_batch_size} x {cfg.accum_steps}")
    if sync.is_rank_zero():
        s = result.summary
        metric = f"test accuracy {s['test_accuracy']:.4f}" if "test_accuracy" in s else f"test loss {s['test_loss']:.4f}"
        print(f"{cfg.task}/{cfg.model}: {s['steps']} steps of {cfg.window_items} items, {metric}, "
              f"{s['wall_time_seconds']:.1f}s, peak memory {s['peak_memory_bytes'] / 2**20:.2f} MiB -> {out}")
    if args.compare:
        _compare(cfg, out, result)
    return 0


def _compare(cfg: Any, out: Path, accumulated: Any) -> None:
    """Train the same model with the whole window as one batch from the same seed; compare."""
    from dataclasses import replace

    from .. import sync
    from .report import plot_losses
    from .train import run_training

    base_cfg = replace(cfg, micro_batch_size=cfg.window_items, accum_steps=1, batch_size=None,
                       out=str(out / "baseline"), checkpoint_every=0)
    baseline = run_training(base_cfg, out / "baseline", label=f"one batch of {cfg.window_items}")
    diff = max((a - b).abs().max().item() for a, b in
               zip(accumulated.model.state_dict().values(), baseline.model.state_dict().values()))
    a, b = accumulated.summary, baseline.summary
    report = {"max_abs_param_diff": diff,
              "accumulated": {"micro_batch_size": cfg.micro_batch_size, "accum_steps": cfg.accum_steps,
                              "peak_memory_bytes": a["peak_memory_bytes"], "test_loss": a["test_loss"],
                              "test_accuracy": a.get("test_accuracy"), "wall_time_seconds": a["wall_time_seconds"]},
              "one_batch": {"micro_batch_size": cfg.window_items, "accum_steps": 1,
                            "peak_memory_bytes": b["peak_memory_bytes"], "test_loss": b["test_loss"],
                            "test_accuracy": b.get("test_accuracy"), "wall_time_seconds": b["wall_time_seconds"]},
              "peak_memory_source": a["peak_memory_source"]}
    if sync.is_rank_zero():
        (out / "compare.json").write_text(json.dumps(report, indent=2) + "\n")
        plot_losses({f"accumulate {cfg.micro_batch_size} x {cfg.accum_steps}": accumulated.history,
                     f"one batch of {cfg.window_items}": baseline.history}, out / "compare.png")
        mib = 2 ** 20
        print(f"compare: largest parameter difference {diff:.3e}; peak memory "
              f"{a['peak_memory_bytes'] / mib:.2f} MiB accumulated vs {b['peak_memory_bytes'] / mib:.2f} MiB "
              f"one batch ({a['peak_memory_source'].split(':')[0]}) -> {out / 'compare.png'}")
        if cfg.dtype == "float32":
            print("compare: in float32 the two runs round differently and the difference grows over "
                  "training; --dtype float64 shows them equal to ~1e-12")


def _eval(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ..tasks.data import load_task
    from .checkpoint import load_checkpoint
    from .config import TrainConfig
    from .train import build, resolve_device

    state = load_checkpoint(Path(args.checkpoint))
    cfg = TrainConfig(**state["config"])
    if args.data_path:
        cfg = replace(cfg, data_path=args.data_path)
    device = resolve_device(args.device)
    task = load_task(cfg.task, cfg.data_path)
    model = build(cfg, task, device)
    model.load_state_dict(state["model"])
    model.eval()
    metrics = task.evaluate(model, device)
    print(json.dumps({"checkpoint": args.checkpoint, "task": cfg.task, "model": cfg.model, **metrics}))
    return 0


def _check(args: argparse.Namespace) -> int:
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

    args = _parser().parse_args(argv)
    try:
        return {"train": _train, "eval": _eval, "check": _check}[args.command](args)
    except (CLIError, TaskError, ValueError, FileNotFoundError, PermissionError) as e:
        print(f"gradaccum {args.command}: error: {e}", file=sys.stderr)
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
