"""Plots of training curves (matplotlib, imported lazily; the core never needs it).

``loss.png`` has three panels over the windows of the run: the training loss with the test loss at
each epoch's end and the epoch boundaries, the learning rate, and the gradient norm; skipped windows
(no optimizer step) are shaded across the panels and counted, never drawn at a loss they did not
have. Every plot has a title naming the task, the model and the window. Few steps are drawn with
markers, so that a 1-step run shows a point, and a log axis that spans less than a decade gets plain ticks
(2.2, 2.25, 2.3) instead of none or a crowd of ``2x10^0``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .atomic import write_atomic

__all__ = ["epoch_ends", "plot_losses", "plot_compare", "training_rows"]

MARKERS_UP_TO = 40  # steps; more than that and markers only clutter the line


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the cli extra brings it
        return None
    return plt


def _missing(path: Path) -> None:  # pragma: no cover
    print(f"gradaccum: matplotlib is missing, so {path.name} was not drawn: pip install 'gradaccum[cli]'")


def readable_log_ticks(ax: Any) -> None:
    """On a log y axis spanning less than a decade, put 3-6 plain ticks (2.2, 2.25, 2.3) on it."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, NullFormatter, NullLocator

    ax.autoscale_view()
    lo, hi = ax.get_ylim()
    if lo <= 0 or hi >= 10 * lo:
        return  # whole decades: matplotlib's own 10^k ticks read well
    ticks = [t for t in MaxNLocator(nbins=5).tick_values(lo, hi) if lo <= t <= hi and t > 0]
    if len(ticks) < 2:
        return
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.4g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())


def _integer_steps(ax: Any, steps: Sequence[int]) -> None:
    """Steps are whole numbers; a single step gets room on both sides."""
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(set(steps)) == 1:
        ax.set_xlim(steps[0] - 1, steps[0] + 1)


def training_rows(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The windows that took a step (not the test-metric rows, not skipped windows)."""
    return [r for r in rows if r.get("kind", "train") == "train" and not r.get("skipped")]


def _loss_label(unit: str) -> str:
    return f"training loss\n({'token' if unit == 'tokens' else 'item'}-weighted window mean)"


def _loss_panel(ax: Any, curves: Dict[str, List[Dict[str, Any]]], unit: str = "items") -> None:
    values: List[float] = []
    curves = {label: training_rows(rows) for label, rows in curves.items()}
    for (label, rows), style in zip(curves.items(), ("-", "--", ":", "-.")):
        steps = [r["step"] for r in rows]
        losses = [r["loss"] for r in rows]
        values += losses
        marker = "o" if len(rows) <= MARKERS_UP_TO else None
        ax.plot(steps, losses, style, marker=marker, markersize=6 if len(rows) == 1 else 4,
                markerfacecolor="none" if style != "-" else None, label=label)
    ax.set_ylabel(_loss_label(unit))
    positive = [v for v in values if v > 0]
    if positive:
        if max(positive) == min(positive):  # one value (a 1-step run): a range around it, with ticks to read
            ax.set_ylim(min(positive) * 0.8, max(positive) * 1.25)
        ax.set_yscale("log")
        readable_log_ticks(ax)
    _integer_steps(ax, [r["step"] for rows in curves.values() for r in rows])
    ax.grid(alpha=0.3)
    ax.legend()


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _run_panels(axes: Sequence[Any], rows: List[Dict[str, Any]], label: str, unit: str) -> None:
    """Loss (with test loss and epoch boundaries), learning rate and gradient norm against the window."""
    loss_ax, lr_ax, norm_ax = axes
    train = [r for r in rows if r.get("kind", "train") == "train"]
    x = {id(r): int(r.get("window_index", r["step"] - 1)) + 1 for r in train}
    ok = [r for r in train if not r.get("skipped") and _finite(r.get("loss"))]
    marker = "o" if len(ok) <= MARKERS_UP_TO else None
    loss_ax.plot([x[id(r)] for r in ok], [r["loss"] for r in ok], "-", marker=marker, markersize=4,
                 label=f"training: {label}")
    evals = [r for r in rows if r.get("kind") == "eval" and _finite(r.get("test_loss"))]
    if evals:
        loss_ax.plot([int(r["window_index"]) + 1 for r in evals], [r["test_loss"] for r in evals], "s--",
                     color="C1", markersize=5, label="test loss (epoch end)")
    skipped = sorted(x[id(r)] for r in train if r.get("skipped"))
    for i, (first, last) in enumerate(_stretches(skipped)):  # shaded: a skipped window has no loss to put anywhere
        for ax in axes:
            ax.axvspan(first - 0.5, last + 0.5, color="C3", alpha=0.15, linewidth=0,
                       label=f"skipped: {len(skipped)} of {len(train)} windows (non-finite, no step)"
                       if ax is loss_ax and i == 0 else None)
    positive = [r["loss"] for r in ok if r["loss"] > 0] + [r["test_loss"] for r in evals if r["test_loss"] > 0]
    if positive:
        if max(positive) == min(positive):
            loss_ax.set_ylim(min(positive) * 0.8, max(positive) * 1.25)
        loss_ax.set_yscale("log")
        readable_log_ticks(loss_ax)
    loss_ax.set_ylabel(_loss_label(unit))
    loss_ax.legend(fontsize=8)
    for ax, key, name in ((lr_ax, "lr", "learning rate"), (norm_ax, "grad_norm", "gradient norm\n(before clipping)")):
        pts = [(x[id(r)], r[key]) for r in train if _finite(r.get(key))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", color="C2", marker=marker, markersize=3)
        ax.set_ylabel(name, fontsize=9)
    for ax in axes:
        for end in epoch_ends(rows):
            ax.axvline(end + 0.5, color="0.6", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    _integer_steps(norm_ax, sorted(x.values()) or [1])


def _stretches(xs: Sequence[int]) -> List[Tuple[int, int]]:
    """Sorted whole numbers as runs of consecutive ones: ``[3, 4, 5, 9]`` -> ``[(3, 5), (9, 9)]``."""
    runs: List[Tuple[int, int]] = []
    for v in xs:
        if runs and v == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def epoch_ends(rows: List[Dict[str, Any]]) -> List[int]:
    """The windows (counted from 1) that ended an epoch before the run's last window: from the training
    rows' epochs, so a run whose test loss is not finite (a diverged one) has them too."""
    last: Dict[int, int] = {}
    for r in rows:
        if r.get("kind", "train") == "train":
            x = int(r.get("window_index", r["step"] - 1)) + 1
            last[int(r.get("epoch", 0))] = max(x, last.get(int(r.get("epoch", 0)), 0))
    final = max(last.values(), default=0)
    return sorted(end for end in last.values() if end != final)


def plot_losses(curves: Dict[str, List[Dict[str, Any]]], path: Path, *, title: str = "", unit: str = "items") -> None:
    """One run's curves (the first of ``curves``): loss, learning rate and gradient norm per window."""
    plt = _pyplot()
    if plt is None:  # pragma: no cover
        return _missing(path)
    label, rows = next(iter(curves.items()))
    fig, axes = plt.subplots(3, 1, figsize=(8, 7.5), sharex=True, gridspec_kw={"height_ratios": (3, 1, 1)})
    _run_panels(axes, rows, label, unit)
    axes[-1].set_xlabel("window (one optimizer step each, unless skipped)"
                        + ("; dotted: epoch ends" if epoch_ends(rows) else ""))
    if title:
        axes[0].set_title(title, fontsize=10)
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)


def _save(fig: Any, path: Path) -> None:
    """Beside ``path``, then renamed over it: a Ctrl-C while drawing leaves no half-written PNG that
    a later resume would take for whole."""
    write_atomic(path, lambda f: fig.savefig(f, dpi=100, format=path.suffix.lstrip(".") or "png"))


def plot_compare(accumulated: List[Dict[str, Any]], one_batch: List[Dict[str, Any]], labels: Sequence[str],
                 path: Path, *, title: str, max_param_diff: float, dtype: str,
                 float64_agreement: Optional[str] = None, unit: str = "items") -> None:
    """The two runs' losses, and below them their per-step difference on a log scale (the curves
    overlay exactly in float64, so only the difference shows the result). ``unit``: what the loss
    is weighted by, as in ``loss.png`` (``tokens`` for the text task)."""
    plt = _pyplot()
    if plt is None:  # pragma: no cover
        return _missing(path)
    from matplotlib.ticker import NullLocator

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True,
                                     gridspec_kw={"height_ratios": (3, 2)})
    _loss_panel(top, {labels[0]: accumulated, labels[1]: one_batch}, unit)
    top.set_title(f"{title}\nlargest parameter difference at the end: {max_param_diff:.1e}", fontsize=10)

    accumulated, one_batch = training_rows(accumulated), training_rows(one_batch)
    by_step = {r["step"]: r["loss"] for r in one_batch if r.get("loss") is not None}
    both = [r for r in accumulated if r["step"] in by_step and r.get("loss") is not None]
    steps = [r["step"] for r in both]
    diffs = [abs(r["loss"] - by_step[r["step"]]) for r in both]
    nonzero = [(s, d) for s, d in zip(steps, diffs) if d > 0]
    zero = [s for s, d in zip(steps, diffs) if d == 0]
    marker = "o" if len(steps) <= MARKERS_UP_TO else None
    if nonzero:  # the line breaks (NaN) at equal steps instead of bridging them
        bottom.plot(steps, [d if d > 0 else float("nan") for d in diffs], "-", color="C3", marker=marker,
                    markersize=4, label="|loss difference|")
    floor = min([d for _, d in nonzero], default=1e-16) / 10
    if zero:  # log scale has no 0: exactly equal steps sit on the floor, marked as such
        bottom.plot(zero, [floor] * len(zero), "|", color="C2", markersize=8,
                    label=f"equal to the bit ({len(zero)} of {len(steps)} steps)")
    shown = [d for _, d in nonzero] + ([floor] if zero else [])
    if shown and max(shown) == min(shown):  # one value: give the axis a range around it
        bottom.set_ylim(min(shown) / 10, max(shown) * 10)
    bottom.set_yscale("log")
    if nonzero:
        readable_log_ticks(bottom)
    else:  # nothing but equal steps: the floor is not a value, so no scale to read
        bottom.set_yticks([])
        bottom.yaxis.set_minor_locator(NullLocator())
    bottom.set_ylabel("per-step |loss difference|\n(log scale)")
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    if nonzero or zero:
        bottom.legend(loc="best", fontsize=8)
    if dtype == "float32":
        note = ("float32: the two runs sum in a different order and round differently (~1e-7 per step);\n"
                "the difference compounds over training")
        if float64_agreement:
            note += f" (--dtype float64 shows them equal to {float64_agreement})"
        bottom.set_title(note, fontsize=8, loc="left")
    fig.tight_layout()
    _save(fig, path)
    plt.close(fig)
