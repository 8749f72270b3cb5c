"""Plots as inline SVG, written directly (no plotting library, nothing fetched): a histogram with a threshold line,
and x-y charts for ROC and precision-recall curves, reliability diagrams and flags over time."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

import numpy as np

PALETTE = ("#1f6fb4", "#d9480f", "#2b8a3e", "#862e9c", "#c92a2a", "#0b7285", "#5c940d", "#e67700")
WIDTH, HEIGHT = 420, 260
LEFT, RIGHT, TOP, BOTTOM = 54, 14, 26, 40
MAX_POINTS = 600  # a curve is drawn through at most this many of its points


def fmt(v: float) -> str:
    """A tick label: few digits, no trailing zeros."""
    return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"


def _frame(title: str, x_label: str, y_label: str) -> list[str]:
    w, h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    return [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" '
            f'height="{HEIGHT}" role="img" aria-label="{escape(title)}">',
            f'<title>{escape(title)}</title>',
            f'<text x="{WIDTH / 2}" y="16" text-anchor="middle" class="t">{escape(title)}</text>',
            f'<rect x="{LEFT}" y="{TOP}" width="{w}" height="{h}" class="frame"/>',
            f'<text x="{LEFT + w / 2}" y="{HEIGHT - 6}" text-anchor="middle" class="l">{escape(x_label)}</text>',
            f'<text transform="translate(13 {TOP + h / 2}) rotate(-90)" text-anchor="middle" class="l">'
            f'{escape(y_label)}</text>']


@dataclass(frozen=True)
class Axis:
    """A linear axis from lo to hi with labeled ticks (log: the values are log10(1 + v), labeled as v)."""

    lo: float
    hi: float
    ticks: tuple[float, ...] = ()
    labels: tuple[str, ...] = ()
    log: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lo) and math.isfinite(self.hi) and self.hi > self.lo):
            raise ValueError(f"axis from {self.lo} to {self.hi}")
        if len(self.labels) not in (0, len(self.ticks)):
            raise ValueError("one label per tick")

    @staticmethod
    def unit() -> "Axis":
        return Axis(0.0, 1.0, (0.0, 0.25, 0.5, 0.75, 1.0))

    @staticmethod
    def counts(top: float) -> "Axis":
        """Rows on a log scale (0 at the bottom): a few large bins do not flatten the rest."""
        hi = math.log10(1.0 + max(top, 1.0))
        ticks = [0.0] + [float(k) for k in range(1, int(hi) + 1)]
        return Axis(0.0, hi * 1.05, tuple(ticks), tuple("0" if t == 0 else fmt(10 ** t) for t in ticks), log=True)

    @staticmethod
    def up_to(top: float) -> "Axis":
        """From 0 to a little above `top`, with 3 to 6 round ticks (steps of 1, 2 or 5 times a power of ten)."""
        top = max(top, 1e-3)
        step = 10.0 ** math.floor(math.log10(top / 4))
        step *= next(m for m in (1, 2, 5, 10) if top / (step * m) <= 5)
        ticks = tuple(round(step * k, 12) for k in range(int(top / step) + 2) if step * k <= top * 1.15)
        return Axis(0.0, max(top * 1.15, ticks[-1]), ticks)

    def text(self, k: int) -> str:
        return self.labels[k] if self.labels else fmt(self.ticks[k])

    def value(self, v: float) -> float:
        return math.log10(1.0 + v) if self.log else v


@dataclass(frozen=True)
class Plot:
    """Pixel positions of a chart's data."""

    x: Axis
    y: Axis
    parts: list[str] = field(default_factory=list)

    def px(self, v: float) -> float:
        return LEFT + (self.x.value(v) - self.x.lo) / (self.x.hi - self.x.lo) * (WIDTH - LEFT - RIGHT)

    def py(self, v: float) -> float:
        return HEIGHT - BOTTOM - (self.y.value(v) - self.y.lo) / (self.y.hi - self.y.lo) * (HEIGHT - TOP - BOTTOM)

    def ticks(self) -> None:
        for k, t in enumerate(self.x.ticks):
            x = LEFT + (t - self.x.lo) / (self.x.hi - self.x.lo) * (WIDTH - LEFT - RIGHT)
            self.parts.append(f'<line x1="{x:.1f}" y1="{HEIGHT - BOTTOM}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM + 4}" '
                              f'class="ax"/><text x="{x:.1f}" y="{HEIGHT - BOTTOM + 15}" text-anchor="middle" '
                              f'class="k">{escape(self.x.text(k))}</text>')
        for k, t in enumerate(self.y.ticks):
            y = HEIGHT - BOTTOM - (t - self.y.lo) / (self.y.hi - self.y.lo) * (HEIGHT - TOP - BOTTOM)
            self.parts.append(f'<line x1="{LEFT - 4}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" class="grid"/>'
                              f'<text x="{LEFT - 6}" y="{y + 3.5:.1f}" text-anchor="end" class="k">'
                              f'{escape(self.y.text(k))}</text>')


def histogram(counts: np.ndarray, threshold: float | None, title: str, x_label: str = "p (violation)") -> str:
    """Equal-width bins over [0, 1] (rows on a log scale) with the threshold as a dashed line."""
    counts = np.asarray(counts)
    plot = Plot(Axis.unit(), Axis.counts(float(counts.max()) if len(counts) else 1.0))
    parts = _frame(title, x_label, "rows (log scale)")
    plot.ticks()
    width = 1.0 / max(len(counts), 1)
    for i, n in enumerate(counts):
        if n > 0:
            x0, x1, y = plot.px(i * width), plot.px((i + 1) * width), plot.py(float(n))
            parts.append(f'<rect x="{x0:.1f}" y="{y:.1f}" width="{max(x1 - x0 - 0.6, 0.5):.1f}" '
                         f'height="{plot.py(0.0) - y:.1f}" class="bar"><title>{i * width:.2f}-{(i + 1) * width:.2f}: '
                         f'{int(n):,} rows</title></rect>')
    if threshold is not None:
        parts.append(_threshold_line(plot, threshold))
    return "".join(parts + plot.parts + ["</svg>"])


def _threshold_line(plot: Plot, threshold: float) -> str:
    x = plot.px(threshold)
    return (f'<line x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM}" class="thr"/>'
            f'<text x="{x + 3:.1f}" y="{TOP + 11}" class="k thrt">threshold {threshold:.3g}</text>')


@dataclass(frozen=True)
class Series:
    """One line of a chart: points (x, y), drawn as a line, dots, or both."""

    name: str
    x: np.ndarray
    y: np.ndarray
    dots: bool = False
    line: bool = True

    def __post_init__(self) -> None:
        if len(self.x) != len(self.y):
            raise ValueError(f"series {self.name!r}: {len(self.x)} x and {len(self.y)} y values")


def chart(series: list[Series], title: str, x_label: str, y_label: str, x: Axis | None = None,
          y: Axis | None = None, diagonal: bool = False, marks: list[tuple[float, float, str]] | None = None,
          threshold: float | None = None) -> str:
    """An x-y chart: lines and dots per series, a legend, an optional diagonal (a perfect calibration or a chance
    ROC), marked points (x, y, label) and a vertical threshold line."""
    plot = Plot(x or Axis.unit(), y or Axis.unit())
    parts = _frame(title, x_label, y_label)
    plot.ticks()
    if diagonal:
        parts.append(f'<line x1="{plot.px(plot.x.lo):.1f}" y1="{plot.py(plot.y.lo):.1f}" '
                     f'x2="{plot.px(plot.x.hi):.1f}" y2="{plot.py(plot.y.hi):.1f}" class="diag"/>')
    for k, s in enumerate(series):
        color = PALETTE[k % len(PALETTE)]
        xs, ys = _thin(np.asarray(s.x, dtype=np.float64), np.asarray(s.y, dtype=np.float64))
        pts = " ".join(f"{plot.px(a):.1f},{plot.py(b):.1f}" for a, b in zip(xs, ys) if np.isfinite(a + b))
        if s.line and pts:
            parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.8"/>')
        if s.dots:
            parts += [f'<circle cx="{plot.px(a):.1f}" cy="{plot.py(b):.1f}" r="2.8" fill="{color}"/>'
                      for a, b in zip(xs, ys) if np.isfinite(a + b)]
        parts.append(f'<rect x="{LEFT + 8}" y="{TOP + 6 + 14 * k}" width="10" height="3" fill="{color}"/>'
                     f'<text x="{LEFT + 22}" y="{TOP + 11 + 14 * k}" class="k">{escape(s.name)}</text>')
    for mx, my, label in marks or []:
        x, y = plot.px(mx), plot.py(my)
        right = x < LEFT + 0.6 * (WIDTH - LEFT - RIGHT)  # the label beside the point, inside the frame
        parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4.5" class="mark"><title>{escape(label)}</title>'
                     f'</circle><text x="{x + 7 if right else x - 7:.1f}" y="{max(y - 6, TOP + 10):.1f}" '
                     f'text-anchor="{"start" if right else "end"}" class="k">{escape(label)}</text>')
    if threshold is not None:
        parts.append(_threshold_line(plot, threshold))
    return "".join(parts + plot.parts + ["</svg>"])


def _thin(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """At most MAX_POINTS points, the first and last kept: a curve of a million rows draws in a page."""
    if len(x) <= MAX_POINTS:
        return x, y
    keep = np.unique(np.linspace(0, len(x) - 1, MAX_POINTS).round().astype(int))
    return x[keep], y[keep]
