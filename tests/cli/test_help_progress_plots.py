"""What the command line says and draws: --help and the README, the window contradiction, progress
lines off a terminal, the counts it prints, and plots a reader can read."""
from __future__ import annotations

import io
import json
import re

import pytest

from gradaccum.cli import main
from gradaccum.cli.parser import FLOAT64_AGREEMENT, build_parser as _parser
from gradaccum.cli.config import window_shape
from gradaccum.cli.progress import Progress

from .test_cli import FAST, ROOT, load


def _subparsers():
    return _parser().commands


def test_every_flag_has_help_with_its_default_and_choices_instead_of_metavars():
    for name, sub in _subparsers().items():
        for action in sub._actions:
            if action.dest == "help":
                continue
            flag = f"{name} {action.option_strings[0]}"
            said = "required" if action.required else "default"
            assert action.help and said in action.help, f"{flag} does not say its {said} in its help"
            if action.dest in ("task", "model", "optimizer", "precision", "device", "dtype"):
                assert action.metavar.startswith("{"), f"{flag} shows {action.metavar}, not its choices"
    train = _subparsers()["train"].format_help()
    assert "--task {digits,mnist5k,mnist,text}" in train and "--device {cpu,cuda,auto}" in train
    assert "0: only at the end and when stopped by" in " ".join(train.split())  # --checkpoint-every 0
    assert re.search(r"digits\s+lenet5\s+15\s+sgd\s+0.02", train), "the per-task defaults table"
    assert re.search(r"text\s+transformer\s+1\s+adamw\s+0.003", train)
    check = " ".join(_subparsers()["check"].format_help().split())
    assert "exit codes: 0 equivalent, 1 not equivalent, 2 a usage error" in check


def test_the_cli_guide_synopsis_names_every_flag_and_the_measured_float64_agreement():
    """docs/guides/cli.md (the README links it) lists every flag of every subcommand."""
    guide = (ROOT / "docs" / "guides" / "cli.md").read_text()
    section = guide.split("# Command line", 1)[1].split("\n## ", 1)[0]
    for name, sub in _subparsers().items():
        for action in sub._actions:
            if action.dest != "help":
                assert action.option_strings[0] in section.split(f"gradaccum {name}", 1)[1], (name, action.dest)
    assert f"agree to {FLOAT64_AGREEMENT}" in section  # the same figure as --help and the console


def test_the_window_check_takes_a_world_size():
    assert window_shape(None, 32, 4) == (128, 32, 4)
    assert window_shape(32, 5, None) == (32, 5, 7)  # the last micro-batch holds 2
    assert window_shape(256, 32, 4, world_size=2) == (256, 32, 4)
    assert window_shape(256, None, 4, world_size=2) == (256, 32, 4)
    with pytest.raises(ValueError, match=r"--batch-size 256, --micro-batch-size 32 and --accum-steps 4 contradict "
                                         r"each other: a window is micro-batch size x accum steps x 3 ranks = "
                                         r"32 x 4 x 3 = 384 items, not 256"):
        window_shape(256, 32, 4, world_size=3)


def test_progress_off_a_terminal_is_a_plain_line_every_k_steps_and_every_10_seconds():
    """The clock is injected: no test waits, and none depends on how fast this machine is."""
    stream, now = io.StringIO(), [0.0]

    def tick() -> float:
        return now[0]

    progress = Progress(100, stream=stream, clock=tick, terminal=False, unit="images")
    for step in range(1, 101):
        now[0] += 20.0 if step == 33 else 0.5  # 10 steps take 5 s; step 33 takes 20 s
        progress.update(step, loss=0.5, items=128, seconds=0.01)
    lines = stream.getvalue().splitlines()
    assert [int(x.split("step ")[1].split("/")[0]) for x in lines] == [10, 20, 30, 33, 40, 50, 60, 70, 80, 90, 100]
    assert lines[0] == "gradaccum train: step 10/100 (10%), loss 0.5000, 12,800 images/s, ETA 0:00:01"


def test_counts_are_what_the_step_used_and_plots_are_titled_with_markers_for_one_step(tmp_path, capsys, monkeypatch):
    """--micro-batch-size 100000 trains 1 step of the 1438 training images, not "1 steps of 400000";
    its plots name task, model and window, draw the one step as a marker, and compare.png has a
    log-scale difference panel with the largest parameter difference and, in float32, why it grows."""
    import matplotlib.pyplot as plt

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep each figure to look at (they are saved first)
    out = tmp_path / "one"
    assert main(["train", "--micro-batch-size", "100000", "--compare", "--model", "mlp", "--out", str(out), *FAST]) == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "digits/mlp: 1 step of 1438 images, " in printed
    progress = [line.split(" step ", 1)[0] for line in captured.err.splitlines() if " step 1/1 " in line]
    assert progress == ["gradaccum train:", "gradaccum train (one batch of 1438):"]  # which run is which
    loss, _, compare = figures  # loss.png, the baseline's loss.png, compare.png
    ax, lr_ax, norm_ax = loss.axes  # loss (and the test loss), learning rate, gradient norm
    assert ax.get_title().startswith("digits / mlp: windows of 1438 images (all) as one micro-batch\n")
    assert "float32 parameters, float32 compute" in ax.get_title()
    assert [line.get_marker() for line in ax.get_lines()] == ["o", "s"]  # training loss, test loss at the end
    assert lr_ax.get_ylabel() == "learning rate" and norm_ax.get_ylabel().startswith("gradient norm")
    loss.canvas.draw()
    ticks = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert len(ticks) >= 3 and all(re.fullmatch(r"\d+(\.\d+)?", t) for t in ticks), ticks  # not 10^0, 10^1
    top, bottom = compare.axes
    assert f"largest parameter difference at the end: {json.loads((out / 'compare.json').read_text())['max_abs_param_diff']:.1e}" in top.get_title()
    assert bottom.get_yscale() == "log" and "compounds" in bottom.get_title(loc="left")
    for fig in figures:
        close(fig)


def test_a_log_axis_over_a_narrow_range_gets_plain_ticks():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradaccum.cli.report import readable_log_ticks

    fig, ax = plt.subplots()
    ax.plot(range(24), [2.31 - 0.04 * i / 23 for i in range(24)])
    ax.set_yscale("log")
    readable_log_ticks(ax)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    plt.close(fig)
    assert 3 <= len(labels) <= 6, labels
    assert all(re.fullmatch(r"\d+(\.\d+)?", x) for x in labels), labels


def test_text_runs_count_tokens_and_eval_from_another_folder_names_the_step(tmp_path, text_file, capsys, monkeypatch):
    """A relative --data-path is stored absolute, so eval works from anywhere; eval names the step,
    epoch and window its checkpoint holds; the text task's steps are counted in tokens."""
    monkeypatch.chdir(text_file.parent)
    out = tmp_path / "t"
    assert main(["train", "--task", "text", "--data-path", text_file.name, "--micro-batch-size", "8",
                 "--accum-steps", "2", "--out", str(out), *FAST]) == 0
    assert re.search(r"text/transformer: \d+ steps of \d+ sequences( \(1 shorter\))?, \d+ to \d+ tokens per step \(all ranks\), test loss", capsys.readouterr().out)
    assert load(out / "last.pt")["config"]["data_path"] == str(text_file)
    monkeypatch.chdir(tmp_path)
    assert main(["eval", "--checkpoint", str(out / "last.pt"), "--device", "cpu"]) == 0
    printed = json.loads(capsys.readouterr().out)
    steps = json.loads((out / "summary.json").read_text())["steps"]
    assert (printed["step"], printed["epoch"], printed["window"], printed["complete"]) == (steps, 1, 0, True)


def test_the_docs_say_what_holds_where():
    """#26 item 13: the CLI guide's scaling example promises "the same model" on 1 and 2 ranks, which
    holds in float64 (float32 rounds apart, and the difference compounds); the README's `make`
    installs the CPU build of torch only where pip's index serves it, and says how to get it."""
    guide = (ROOT / "docs" / "guides" / "cli.md").read_text()
    example = guide.split("## Scaling", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    same = [line for line in example.splitlines() if "--batch-size 64" in line and "--shard" not in line]
    assert len(same) == 3 and all("--dtype float64" in line for line in same), same
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        text = " ".join(page.read_text().split())
        assert "install the CPU build of" not in text, page
        assert "--index-url https://download.pytorch.org/whl/cpu" in text, page
