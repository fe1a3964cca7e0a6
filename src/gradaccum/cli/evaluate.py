"""``gradaccum eval``: the test metrics of a saved model, as one JSON line with the step it holds."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple

from .checkpoint import EVAL_FIX, load_checkpoint
from .errors import CLIError
from .jsonfile import strict_json

__all__ = ["eval_command", "find_checkpoint"]


def find_checkpoint(text: str) -> Tuple[Path, bool]:
    """``--checkpoint``: a last.pt, a --shard run's last.dcp folder, or a run folder holding either;
    returns the checkpoint and whether it is sharded."""
    from .folder import CHECKPOINT, SHARDED_CHECKPOINT
    from .sharding import sharded_folder

    path = Path(text)
    if not path.is_dir():
        return path, False
    if sharded_folder(path) is not None:
        return path, True
    for name, sharded in ((CHECKPOINT, False), (SHARDED_CHECKPOINT, True)):
        if (path / name).exists():
            return path / name, sharded
    raise CLIError(f"--checkpoint {text} is a folder without {CHECKPOINT} or {SHARDED_CHECKPOINT}; pass a run folder "
                   "that gradaccum train wrote (it has a checkpoint once a run ends or is stopped), or the file itself")


def _settings(state: Dict[str, Any], path: Path, data_path: Any) -> Any:
    from ..tasks import SHIPPED
    from .config import saved_config

    cfg = saved_config(state, where=f"--checkpoint {path}", fix="evaluate it with the gradaccum that wrote it")
    if data_path is None:
        if cfg.data_path is not None and not Path(cfg.data_path).exists():
            raise CLIError(f"{path} was trained on {cfg.data_path}, which no longer exists; pass --data-path with "
                           f"where that {'folder' if cfg.task == 'mnist' else 'file'} is now")
        return cfg
    if cfg.task in SHIPPED:
        raise CLIError(f"--data-path {data_path} is not used: {path} is a model of the {cfg.task} task, whose data "
                       f"ships with {SHIPPED[cfg.task]}; drop --data-path")
    return replace(cfg, data_path=data_path)  # validated, and made absolute, like train's


def eval_command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from ..tasks.data import load_task
    from .run import build, resolve_device

    device = resolve_device(args.device)
    path, sharded = find_checkpoint(args.checkpoint)
    if sharded:  # a --shard run's last.dcp: its gradaccum.pt says what model to build
        from .sharding import read_sharded_meta

        state = read_sharded_meta(path, fix=EVAL_FIX)
    else:
        state = load_checkpoint(path, fix=EVAL_FIX)
    cfg = _settings(state, path, args.data_path)
    task = load_task(cfg.task, cfg.data_path)
    model = build(cfg, task, device)
    if sharded:
        from .sharding import load_sharded_model

        load_sharded_model(model, path)
    else:
        model.load_state_dict(state["model"])
    model.eval()
    metrics = task.evaluate(model, device)
    held = {"step": int(state["accumulator"]["steps"]), "epoch": int(state["epoch"]), "window": int(state["window"])}
    print(strict_json({"checkpoint": str(path), "task": cfg.task, "model": cfg.model, **held,
                       "complete": (held["epoch"], held["window"]) == (cfg.epochs, 0), **metrics}))
    return 0
