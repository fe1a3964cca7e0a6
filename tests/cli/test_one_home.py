"""#31 item 3: one home for each repeated procedure of the command line (the atomic write, the
checksum, the rank-0 decision), and that what was written before still reads."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradaccum.cli import main

from .test_cli import FAST


def test_the_one_checksum_scheme_reads_checkpoints_written_before_it():
    """digest() is the one checksum of the command line: a checkpoint's contents and a shard file's
    bytes. Its values are those the two schemes it replaced wrote (checkpoint.digest, sharding's
    SHA-256 of a file), so every checkpoint written before still verifies: pinned here."""
    from gradaccum.cli.checksum import digest

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.zeros(0, dtype=torch.int64)}, "epoch": 1,
             "config": {"lr": 0.1, "seed": 0, "out": None}, "hist": [1.5, (2, "x")]}
    assert digest(state) == "2f3148c62ec424fe4dbdeaddf0b69240af615ad80bdc867c68d7a3a4da4bbf9d"


def test_shard_digests_are_sha256_of_the_files_bytes(tmp_path):
    import hashlib

    from gradaccum.cli.checksum import digest, file_digests, files_damaged

    (tmp_path / "__0_0.distcp").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "gradaccum.pt").write_bytes(b"meta")
    written = file_digests(tmp_path, but="gradaccum.pt")
    assert written == {"__0_0.distcp": hashlib.sha256(bytes(range(256)) * 10).hexdigest()}
    assert digest(tmp_path / "__0_0.distcp") == written["__0_0.distcp"]
    assert files_damaged(tmp_path, written) is None
    (tmp_path / "__0_0.distcp").write_bytes(b"other")
    assert "__0_0.distcp does not match the checksum" in files_damaged(tmp_path, written)


def test_every_file_of_a_run_is_written_by_the_one_atomic_write(tmp_path, monkeypatch, capsys):
    """last.pt, metrics.jsonl, summary.json and loss.png are all written by write_atomic (whose failures
    tests/cli/test_cli.py and test_run_folder.py provoke), not by copies of it."""
    from gradaccum.cli import atomic

    written = []
    real = atomic.write_atomic

    def recording(path, write):
        written.append(Path(path).name)
        return real(path, write)

    monkeypatch.setattr(atomic, "write_atomic", recording)
    for module in ("checkpoint", "folder", "tracking", "report"):
        mod = __import__(f"gradaccum.cli.{module}", fromlist=["x"])
        if hasattr(mod, "write_atomic"):
            monkeypatch.setattr(mod, "write_atomic", recording)
    out = tmp_path / "run"
    assert main(["train", "--model", "mlp", *FAST, "--out", str(out)]) == 0
    assert {"last.pt", "metrics.jsonl", "summary.json", "loss.png"} <= set(written), written


def test_rank0_decides_hands_out_the_result_or_the_refusal():
    from gradaccum.cli.errors import CLIError
    from gradaccum.cli.rank0 import rank0_decides

    assert rank0_decides(lambda: 42) == 42

    def refuse():
        error = CLIError("no")
        error.exit_code = 1
        raise error

    with pytest.raises(CLIError, match="^no$") as raised:
        rank0_decides(refuse)
    assert raised.value.exit_code == 1
