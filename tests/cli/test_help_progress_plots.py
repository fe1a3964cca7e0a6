"""What the command line says and draws: --help and the README, the window contradiction, progress
lines off a terminal, the counts it prints, and plots a reader can read."""
from __future__ import annotations

import re


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
