"""Plots of training curves (matplotlib, imported lazily; the core never needs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List


def plot_losses(curves: Dict[str, List[Dict[str, Any]]], path: Path) -> None:
    """One line per run: loss against optimizer step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - the cli extra brings it
        print(f"gradaccum: matplotlib is missing, so {path.name} was not drawn: pip install 'gradaccum[cli]'")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for (label, rows), style in zip(curves.items(), ("-", "--", ":", "-.")):
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], style, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (item-weighted window mean)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
