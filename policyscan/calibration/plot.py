"""Reliability diagram (matplotlib is an optional extra: pip install policyscan[plot])."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from policyscan.calibration.metrics import reliability
from policyscan.engine.errors import PolicyscanError


def require_matplotlib() -> None:
    """--plot without matplotlib: one line saying what to install."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise PolicyscanError("--plot needs matplotlib: pip install 'policyscan[plot]' (or leave out --plot)") from e


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".eps", ".ps")  # what matplotlib writes with no LaTeX or Pillow plugin


def reliability_plot(path: Path, title: str, curves: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """curves: label -> (p, y). Writes a PNG."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], ":", color="gray", label="perfect")
    for label, (p, y) in curves.items():
        conf, acc, count = reliability(p, y)
        keep = count > 0
        ax.plot(conf[keep], acc[keep], "o-", label=label)
    ax.set(xlabel="predicted probability of violation", ylabel="observed frequency", title=title,
           xlim=(0, 1), ylim=(0, 1))
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
