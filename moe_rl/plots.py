"""Tiny dependency-free SVG line plots (reports must not need a plotting stack)."""
from __future__ import annotations

from typing import Dict, Sequence
from xml.sax.saxutils import escape


def line_plot_svg(series: Dict[str, Sequence[tuple]], title: str, xlabel: str, ylabel: str,
                  width: int = 560, height: int = 320, log_x: bool = False) -> str:
    """series: name -> [(x, y), ...]. Returns an SVG document."""
    import math
    pts = [(x, y) for s in series.values() for x, y in s if y == y]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="40"><text x="8" y="24">{escape(title)}: no data</text></svg>'
    fx = (lambda v: math.log2(v)) if log_x else (lambda v: v)
    x0, x1 = min(fx(p[0]) for p in pts), max(fx(p[0]) for p in pts)
    y0, y1 = min(0.0, min(p[1] for p in pts)), max(p[1] for p in pts)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    L, R, T, B = 70, 20, 30, 45
    sx = lambda v: L + (fx(v) - x0) / (x1 - x0) * (width - L - R)
    sy = lambda v: height - B - (v - y0) / (y1 - y0) * (height - T - B)
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="11">',
           f'<text x="{width / 2}" y="16" text-anchor="middle" font-size="13">{escape(title)}</text>',
           f'<line x1="{L}" y1="{height - B}" x2="{width - R}" y2="{height - B}" stroke="#333"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{height - B}" stroke="#333"/>',
           f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">{escape(xlabel)}</text>',
           f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">{escape(ylabel)}</text>']
    for v in sorted({p[0] for p in pts}):
        out.append(f'<text x="{sx(v):.1f}" y="{height - B + 14}" text-anchor="middle">{v:g}</text>')
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{L - 4}" y="{sy(v) + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    for i, (name, s) in enumerate(series.items()):
        c = colors[i % len(colors)]
        s = [(x, y) for x, y in s if y == y]
        out.append('<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>' % (
            c, " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)))
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{c}"/>' for x, y in s]
        out.append(f'<text x="{width - R - 4}" y="{T + 14 * (i + 1)}" text-anchor="end" fill="{c}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)
