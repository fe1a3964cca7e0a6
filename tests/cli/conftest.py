from __future__ import annotations

import gzip
import struct
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def write_idx(path: Path, data: torch.Tensor, magic: int, gz: bool) -> None:
    raw = struct.pack(f">{1 + data.dim()}I", magic, *data.shape) + bytes(data.to(torch.uint8).flatten().tolist())
    if gz:
        path = path.with_name(path.name + ".gz")
        raw = gzip.compress(raw)
    path.write_bytes(raw)


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory):
    """A tiny MNIST in the seed's MNIST_Data layout: train/ and test/, labels gzipped, images plain."""
    root = tmp_path_factory.mktemp("MNIST_Data")
    g = torch.Generator().manual_seed(0)
    for split, n, prefix in (("train", 96, "train"), ("test", 32, "t10k")):
        (root / split).mkdir()
        labels = torch.randint(0, 10, (n,), generator=g)
        images = (torch.rand(n, 28, 28, generator=g) * 60 + labels.view(-1, 1, 1) * 19).clamp(0, 255)
        write_idx(root / split / f"{prefix}-images-idx3-ubyte", images, 2051, gz=False)
        write_idx(root / split / f"{prefix}-labels-idx1-ubyte", labels, 2049, gz=True)
    return root


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    lines = [("the quick brown fox jumps over the lazy dog " * (1 + i % 3))[: 8 + (i * 7) % 90] for i in range(120)]
    path.write_text("\n".join(lines))
    return path


@pytest.fixture
def here():
    """The command line run in this process, returned as a finished process would be (exit code,
    stdout, stderr): for tests about what it says, records and writes. Tests about the process itself
    (signals, a closed pipe, the interpreter's own output, a file-size limit) run ``cli``, a subprocess.
    ``cwd``: the folder it runs in (default: the repository, as ``cli``). One runner for the suite:
    tests/distributed/launch.py's ``run_cli_here``."""
    from distributed.launch import run_cli_here

    def run(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
        return run_cli_here(args, cwd=cwd)
    return run


@pytest.fixture
def figures(monkeypatch):
    """The figures a run draws, kept open to look at (each is saved first), closed at the end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept: list = []
    close = plt.close
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for fig in kept:
        close(fig)
