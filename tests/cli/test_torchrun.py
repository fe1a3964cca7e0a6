"""The command line under torchrun (2 gloo processes on the CPU) where issue #26 found it wrong: a
damaged --shard checkpoint (--compare's record of the two runs' windows on 2 ranks: in
tests/distributed/test_global_batch.py, whose one launch runs it)."""
from __future__ import annotations

import pytest
import torch

from distributed.launch import run_cli_here, torchrun

pytestmark = pytest.mark.distributed

MLP = ["--model", "mlp", "--device", "cpu", "--micro-batch-size", "16"]


def test_a_damaged_shard_is_refused_in_one_line_on_every_rank_and_left_in_place(tmp_path):
    """DCP's shard files carry no checksum: a flipped byte in a tensor loaded as other weights, one in
    its records gave a 154-line traceback from every rank. gradaccum.pt now holds the SHA-256 of every
    file beside it; a damaged one is refused before anything loads, in one line (rank 0's), on every
    rank, and the file is left as it was. The checkpoint is written by one process (--shard on a
    group of one) and resumed on two: a sharded checkpoint resumes on any number of ranks."""
    out = tmp_path / "sharded"
    args = ["train", *MLP, "--shard", "--out", str(out)]
    first = run_cli_here([*args, "--epochs", "1"])  # in this process: a group of one
    assert first.returncode == 0, first.stderr[-3000:]
    folder = out / "last.dcp"
    shard = folder / "__0_0.distcp"
    damaged = bytearray(shard.read_bytes())
    damaged[len(damaged) // 2] ^= 0x40  # inside the tensors' bytes: torch.load alone reads other weights
    shard.write_bytes(bytes(damaged))

    resumed = torchrun(["-m", "gradaccum", *args, "--epochs", "2", "--resume"], timeout=300)
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode != 0, said[-3000:]
    lines = [line for line in said.splitlines() if line.startswith("gradaccum train:")]
    assert lines == [f"gradaccum train: error: checkpoint {folder} is corrupt or unreadable (its file __0_0.distcp "
                     "does not match the checksum written with it: damaged on disk or in transfer); it was left in "
                     "place: restore a good copy, or start over with --overwrite (which removes it)"], said[-3000:]
    assert "exitcode  : 2" in said  # every worker stopped with the usage error's code, not a crash
    assert said.count("Traceback") <= 1 and "UnpicklingError" not in said and "CheckpointException" not in said, \
        said[-3000:]  # the one traceback torchrun may print is its own report of the stopped workers
    assert shard.read_bytes() == bytes(damaged)
    meta = torch.load(folder / "gradaccum.pt", weights_only=True)
    assert sorted(meta["shards"]) == sorted(p.name for p in folder.iterdir() if p.name != "gradaccum.pt")

    shown = run_cli_here(["eval", "--checkpoint", str(out), "--device", "cpu"])
    assert shown.returncode == 2 and shown.stderr.count("\n") == 1, shown.stderr
    assert "__0_0.distcp does not match the checksum" in shown.stderr and "evaluate another checkpoint" in shown.stderr

