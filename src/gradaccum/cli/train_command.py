"""``gradaccum train``: flags -> settings -> the data -> the run folder -> training (and ``--compare``) -> one line.

Exit codes: 0 done (or already complete), 1 a final write failed (or an unexpected error, named in
its one line), 2 a usage error, 3 the run diverged (its last loss is not finite, or most windows, or
the last 3, were skipped), 130/143 stopped by a signal.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .. import sync
from .errors import CLIError
from .launch import launch
from .signals import EXIT_CODES, Stopped

__all__ = ["Diverged", "resume_command", "steps_phrase", "train_command"]


class Diverged(CLIError):
    """Training ran to its end, but the model is not trained: exit 3."""

    exit_code = 3


def resume_command(argv: Sequence[str], out: Optional[str] = None) -> str:
    """The command that resumes this run: the user's own words, with --resume (and the --out chosen
    when none was given) and without --overwrite.
    Under torchrun, the same launcher on one node (the run also resumes on any other number of ranks);
    on several nodes the launcher's own flags are the user's to repeat."""
    main_file = os.path.basename(sys.argv[0]) if sys.argv else ""
    prog = [sys.executable, "-m", "gradaccum"] if main_file == "__main__.py" else ["gradaccum"]
    args = [a for a in argv if a != "--overwrite"]
    if out is not None and "--out" not in args and not any(a.startswith("--out=") for a in args):
        args += ["--out", out]  # the folder this run chose for itself
    if "--resume" not in args:
        args.append("--resume")
    started = launch()
    if started.several:
        torchrun = _torchrun()
        launcher = (f"{torchrun} --standalone --nproc_per_node={started.world_size}" if started.single_node
                    else f"{torchrun} <your --nnodes/--node_rank/--rdzv flags>")
        return f"{launcher} -m gradaccum {shlex.join(args)}"
    return shlex.join([*prog, *args])


def _torchrun() -> str:
    """``torchrun`` when the shell finds this Python's, else the path of this Python's (a virtual
    environment not activated, as after ``make demo``, or another torchrun first on PATH)."""
    beside = Path(sys.executable).parent / "torchrun"
    found = shutil.which("torchrun")
    if beside.exists() and (found is None or Path(found).resolve() != beside.resolve()):
        return shlex.quote(str(beside))
    return "torchrun"


def _settings(args: argparse.Namespace) -> Any:
    from .config import TrainConfig

    if args.resume and args.overwrite:
        raise CLIError("--resume and --overwrite contradict each other: --resume continues the run in "
                       "--out, --overwrite deletes it; pass one of them")
    if args.out is None and (args.resume or args.overwrite):
        flag = "--resume" if args.resume else "--overwrite"
        raise CLIError(f"{flag} needs --out, the run folder to {'continue' if args.resume else 'replace'} "
                       f"(e.g. {flag} --out runs/version_0); a plain run gets a new folder of its own")
    return TrainConfig(task=args.task, data_path=args.data_path, model=args.model,
                       micro_batch_size=args.micro_batch_size, accum_steps=args.accum_steps,
                       batch_size=args.batch_size, epochs=args.epochs, epochs_given=args.epochs is not None,
                       optimizer=args.optimizer, lr=args.lr,
                       precision=args.precision, max_grad_norm=args.max_grad_norm, seed=args.seed, out=args.out,
                       checkpoint_every=args.checkpoint_every, device=args.device,
                       dtype=args.dtype, shard=args.shard, world_size=launch().world_size)


def train_command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Settings, the data (checked before any folder is claimed), the run folder (locked), the run,
    ``--compare``; a signal outside the run's own handling stops it with one line."""
    from dataclasses import replace

    from ..tasks.data import load_task
    from .folder import RunFolder, check_out
    from .outdir import claim_run_folder, release_if_empty
    from .run import resolve_device, run_training
    from .sharding import setup_distributed

    cfg = _settings(args)
    if args.compare and cfg.window[1] == "auto":
        raise CLIError("--compare needs an integer --micro-batch-size (the baseline is one batch of M x N)")
    if args.compare and cfg.shard:
        raise CLIError("--compare does not work with --shard: the comparison reads whole parameters; compare "
                       "without --shard (the sharded run is the same maths)")
    try:
        setup_distributed(resolve_device(cfg.device), shard=cfg.shard)
        task = load_task(cfg.task, cfg.data_path)  # a bad file or label is refused before any folder is made
    except KeyboardInterrupt:
        raise _interrupted("before training started: nothing was written; run the same command again") from None
    claimed = None
    if args.out is None:  # a new runs/version_K, the same on every rank
        claimed = claim_run_folder()
        cfg = replace(cfg, out=str(claimed))
    out = check_out(str(cfg.out))
    command = resume_command(argv, None if claimed is None else str(claimed))
    trained = False
    try:
        with RunFolder(out, resume=args.resume, overwrite=args.overwrite, sharded=cfg.shard, say=_say) as folder:
            result = run_training(cfg, folder, task, command=command)
            trained = True
            _finish(args, result, folder, task, command)
    except KeyboardInterrupt:  # outside the run's own signal handling: before it, or after its files
        release_if_empty(claimed)
        if not trained:
            raise _interrupted("before training started: nothing was trained; run the same command again") from None
        rest = f"; the comparison is not complete: {command} finishes it" if args.compare else ""
        raise _interrupted(f"after the run finished: {out} is complete{rest}") from None
    except BaseException:
        release_if_empty(claimed)
        raise
    return 0


def _interrupted(when: str) -> Stopped:
    """A Ctrl-C outside the run's own handling: one line, exit 130; a second one is ignored now."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return Stopped(f"SIGINT: stopped {when}", EXIT_CODES[signal.SIGINT])


def _say(line: str) -> None:
    if sync.is_rank_zero():
        print(f"gradaccum train: {line}", file=sys.stderr, flush=True)


def _finish(args: argparse.Namespace, result: Any, folder: Any, task: Any, command: str) -> None:
    """After the run: its line, ``--compare``, then the exit: a failed write (1), a signal that came
    at the run's end (130/143), a diverged run (3)."""
    out, life = folder.out, result.lifecycle
    assert life is not None, "run_training returns the run's life cycle"
    if sync.is_rank_zero():  # a finished run resumed says it too: what is on disk is whole
        print(_outcome_line(result.config, result, out))
    compared = folder.has("compare.json")
    if result.stopped_by is None and args.compare and not (result.already_complete and compared):
        from .compare import run_compare

        run_compare(result.config, folder, result, task, resume=args.resume, command=command)
    elif compared and args.resume and not result.already_complete:
        _say("note: compare.json, compare.png and baseline/ are from before this --resume and compare the run as "
             "it was then; resume with --compare to bring them up to date")
    life.raise_if_unsaved()
    if result.stopped_by is not None:
        name = signal.Signals(result.stopped_by).name
        held = life.saved
        then = (f"--compare's baseline did not run: {command} runs it" if args.compare and not compared
                else "nothing to resume")
        raise Stopped(f"{name}: received at the run's end, which it finished first: {out} is complete "
                      f"({folder.checkpoint.name} holds {held}; summary.json and loss.png are written); {then}",
                      EXIT_CODES.get(signal.Signals(result.stopped_by), 143))
    _raise_if_diverged(result.summary, result.config, out)


def _outcome_line(cfg: Any, result: Any, out: Path) -> str:
    s = result.summary
    if "test_accuracy" in s:
        metric = f"test accuracy {s['test_accuracy']:.4f}"
    else:
        metric = f"test loss {_number(s.get('test_loss'))}"
    memory = (f", peak memory {s['peak_memory_bytes'] / 2**20:.2f} MiB" if s.get("peak_memory_bytes") is not None
              else "")
    ranks = f" on {s['world_size']} ranks" if s.get("world_size", 1) > 1 else ""
    return (f"{cfg.task}/{cfg.model}: {steps_phrase(result.history, result.unit, result.window_unit)}{ranks}, "
            f"{metric}, {s.get('wall_time_seconds', 0.0):.1f}s{memory} -> {out}")


def _number(value: Any) -> str:
    return "not finite" if value is None or not math.isfinite(value) else f"{value:.4f}"


#: a run whose last this many windows were all skipped ended stuck (fp16's loss scaler skips one
#: window per overflow and then steps again)
STUCK_WINDOWS = 3


def _raise_if_diverged(summary: Dict[str, Any], cfg: Any, out: Path) -> None:
    """Exit 3 when the run ended with a non-finite loss, with its last windows all skipped, or with
    most of its windows skipped."""
    windows = summary.get("windows")
    skipped = summary.get("skipped", summary.get("skipped_windows"))  # an older summary: skipped_windows
    if not windows or skipped is None:
        return  # a summary written before these counts existed
    last = summary.get("last_loss")
    bad_end = last is None or not math.isfinite(last)
    at_end = int(summary.get("skipped_at_end") or 0)
    stuck = at_end >= min(STUCK_WINDOWS, windows)
    if not bad_end and not stuck and 2 * skipped <= windows:
        return
    why = [f"{skipped} of {windows} windows were skipped (non-finite loss or gradient: no optimizer step)"]
    if stuck:
        why.append(f"the last {at_end} were all skipped, so training had stopped")
    if bad_end:
        why.append("the last loss is not finite")
    fix = f"lower --lr (now {cfg.lr:g})" + ("" if cfg.max_grad_norm else " or clip with --max-grad-norm 1.0")
    raise Diverged(f"the run diverged: {' and '.join(why)}; its files in {out} describe a model that is not "
                   f"trained; {fix}, and train again with --overwrite")


def _sizes_phrase(sizes: List[int], unit: str) -> str:
    k, top = len(sizes), max(sizes)
    full = sum(1 for n in sizes if n == top)
    if full == k:
        return _units(top, unit)
    if 2 * full >= k:
        return f"{_units(top, unit)} ({k - full} shorter)"
    return f"{min(sizes)} to {top} {unit}"


def _units(n: int, unit: str) -> str:
    """``1 image``, ``128 images``: ``unit`` is plural (images, tokens, sequences, items)."""
    return f"{n} {unit[:-1] if n == 1 and unit.endswith('s') else unit}"


def steps_phrase(history: List[Any], unit: str, window_unit: Optional[str] = None) -> str:
    """``12 steps of 128 images (1 shorter)``, ``1 step of 1438 images``, ``9 steps of 64 sequences,
    221 to 460 tokens per step (all ranks)``: what each step really used across all ranks, not the
    flags, and how many windows were skipped."""
    trained = [r for r in history if r.get("kind", "train") == "train"]
    rows = [r for r in trained if not r.get("skipped")]
    skipped = len(trained) - len(rows)
    tail = f" ({skipped} of {len(trained)} windows skipped: non-finite loss or gradient, no step)" if skipped else ""
    sizes = [int(r["num_items"]) for r in rows]
    if not sizes:
        return "0 steps" + tail
    steps = f"{len(sizes)} step{'' if len(sizes) == 1 else 's'}"
    windows = [int(r["window_items"]) for r in rows if "window_items" in r]
    if window_unit is None or window_unit == unit or len(windows) != len(sizes):
        return f"{steps} of {_sizes_phrase(sizes, unit)}{tail}"
    return (f"{steps} of {_sizes_phrase(windows, window_unit)}, {_sizes_phrase(sizes, unit)} per step "
            f"(all ranks){tail}")
