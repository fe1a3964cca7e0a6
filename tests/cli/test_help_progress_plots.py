"""What the command line says and draws: --help and the README, the window contradiction, progress
lines off a terminal, the counts it prints, and plots a reader can read."""
from __future__ import annotations

import io
import re

from gradaccum.cli.progress import Progress


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
