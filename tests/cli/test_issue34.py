"""Issue #34 (items 7, 9, 10): what the command line says, records and draws, where it was wrong.
Each test failed before its fix. Signals are real signals to a real process; messages and plots
are read in-process."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from gradaccum.cli import main

from .test_cli import FAST, ROOT, cli_env, load, train_rows, wait_for


def _code(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own
        return e.code


# -- #34 item 7: a usage error under torchrun is said once ----------------------------------------

@pytest.mark.distributed
def test_a_usage_error_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """argparse's refusals (an unknown flag, a value of the wrong type) were printed by every worker;
    the guide says rank 0 alone prints the line. Every worker still exits 2."""
    from distributed.launch import torchrun

    proc = torchrun(["-m", "gradaccum", "train", "--epoch", "2", "--out", str(tmp_path / "x")], timeout=300)
    said = proc.stdout + proc.stderr
    lines = [line for line in said.splitlines() if line.startswith("gradaccum train: error:")]
    assert lines == ["gradaccum train: error: unrecognized arguments: --epoch 2; did you mean --epochs? (gradaccum "
                     "train --help lists its flags)"], said[-3000:]
    assert "exitcode  : 2" in said, said[-3000:]  # the usage error's code, not a crash


def test_argparse_says_nothing_on_a_rank_other_than_0(monkeypatch, capsys):
    """The same rule in-process, for every message argparse prints (an error, --help)."""
    monkeypatch.setenv("RANK", "1")
    assert _code(["train", "--accum-steps", "x"]) == 2
    assert _code(["eval", "--help"]) == 0
    assert capsys.readouterr() == ("", "")
    monkeypatch.setenv("RANK", "0")
    assert _code(["train", "--accum-steps", "x"]) == 2
    assert "argument --accum-steps: invalid int value: 'x'" in capsys.readouterr().err
