"""Tiny dependency-free SVG line plots (reports must not need a plotting stack)."""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape as esc
from xml.sax.saxutils import escape


def _nan(v) -> bool:
    try:
        return math.isnan(v)
    except TypeError:  # None or a non-number: not NaN (kept as before)
        return False


def line_plot_svg(series: dict[str, Sequence[tuple]], title: str, xlabel: str, ylabel: str,
                  width: int = 560, height: int = 320, log_x: bool = False, log_y_floor: float = 0.0) -> str:
    """series: name -> [(x, y), ...]. Returns an SVG document. log_y_floor > 0: a log10 y axis,
    values below the floor drawn at it (K3 spans 1e-15 to 1e-2 between mismatch sources)."""
    if log_y_floor > 0:
        series = {k: [(x, math.log10(max(y, log_y_floor))) for x, y in s if not _nan(y)] for k, s in series.items()}
    pts = [(x, y) for s in series.values() for x, y in s if not _nan(y)]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="40"><text x="8" y="24">{escape(title)}: no data</text></svg>'
    fx = (lambda v: math.log2(v)) if log_x else (lambda v: v)
    x0, x1 = min(fx(p[0]) for p in pts), max(fx(p[0]) for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if log_y_floor > 0:   # at most 7 ticks on whole decades, the axis ending on one
        y0, y1 = math.floor(y0), math.ceil(y1)
        step = max(1, -(-(y1 - y0) // 6))
        y1 = y0 + step * max(1, -(-(y1 - y0) // step))
        yticks = list(range(y0, y1 + 1, step))
    else:
        y0 = min(0.0, y0)
        yticks = None
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + 1)
    # The legend sits right of the plot area, clear of the lines.
    L, R, T, B = 70, 20 + 7 * max(len(str(name)) for name in series), 30, 45
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
        out.append(f'<text x="{sx(v):.1f}" y="{height - B + 14}" text-anchor="middle">{_xtick(v)}</text>')
    for v in yticks if yticks is not None else [y0 + (y1 - y0) * i / 4 for i in range(5)]:
        label = f"1e{v}" if yticks is not None else f"{v:.3g}"
        out.append(f'<text x="{L - 4}" y="{sy(v) + 4:.1f}" text-anchor="end">{label}</text>')
    for i, (name, s) in enumerate(series.items()):
        c = colors[i % len(colors)]
        s = [(x, y) for x, y in s if not _nan(y)]
        out.append('<polyline fill="none" stroke="{}" stroke-width="2" points="{}"/>'.format(
            c, " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)))
        out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{c}"/>' for x, y in s]
        out.append(f'<text x="{width - R + 8}" y="{T + 14 * (i + 1)}" fill="{c}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out)


# --- report plots: small multiples for long runs (thinned ticks, bands, heat maps) ----------------
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")


def _thin(values: Sequence, n: int = 8) -> list:
    """At most n evenly spread values (tick labels stay legible for 1000-iteration runs)."""
    values = list(values)
    step = max(1, -(-len(values) // n))
    return values[::step]


def _xtick(v: float) -> str:
    """Env steps read as 420k and 1.08M, not 1.07848e+06; iterations stay as they are."""
    if abs(v) >= 1e6:
        return f"{v / 1e6:.3g}M"
    return f"{v / 1e3:.3g}k" if abs(v) >= 1e4 else f"{v:g}"


def _tick(v: float, lo: float, hi: float) -> str:
    """Enough significant digits to tell five ticks over [lo, hi] apart (2.016 vs 2.022, not 2.02)."""
    span, mag = (hi - lo) / 4, max(abs(lo), abs(hi))
    digits = max(3, 1 + math.ceil(math.log10(mag / span))) if span > 0 and mag > 0 else 3
    if 1 <= mag < 1e6:  # 8020, not 8.02e+03
        digits = max(digits, len(str(int(mag))))
    return f"{v:.{min(digits, 12)}g}"


def _frame(width: int, height: int, title: str, xlabel: str, ylabel: str, legend: Sequence[tuple]) -> list:
    """SVG header, title and a legend row of (colour, label) swatches under it."""
    out = [(f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'font-family="sans-serif" font-size="10">'),
           f'<text x="{width / 2}" y="14" text-anchor="middle" font-size="12" font-weight="bold">{esc(title)}</text>',
           f'<text x="{width / 2}" y="{height - 4}" text-anchor="middle">{esc(xlabel)}</text>']
    if ylabel:
        out.append(f'<text x="11" y="{height / 2}" transform="rotate(-90 11 {height / 2})" '
                   f'text-anchor="middle">{esc(ylabel)}</text>')
    x = 50
    for colour, label in legend:
        out.append(f'<rect x="{x}" y="21" width="9" height="9" fill="{colour}"/>'
                   f'<text x="{x + 12}" y="29">{esc(label)}</text>')
        x += 20 + 6 * len(label)
    return out


def _no_data(title: str, width: int) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="30" font-family="sans-serif" '
            f'font-size="11"><text x="6" y="20">{esc(title)}: no data</text></svg>')


def xy_plot_svg(series: dict[str, Sequence[tuple]], title: str, xlabel: str = "iteration", ylabel: str = "",
                width: int = 420, height: int = 230, log_x: bool = False, y_range=None,
                bands: Sequence[tuple] = (), hlines: Sequence[tuple] = ()) -> str:
    """series: name -> [(x, y), ...] (NaN y skipped). bands: (y_lo, y_hi, fill) shaded behind the lines;
    hlines: (y, colour, label) dashed reference lines (thresholds), always inside the y range;
    y_range: (lo, hi) fixed limits. At most 8 x labels; markers only on short series."""
    series = {k: [(x, y) for x, y in s if not _nan(y) and (x > 0 or not log_x)] for k, s in series.items()}
    pts = [p for s in series.values() for p in s]
    if not pts:
        return _no_data(title, width)
    fx = math.log2 if log_x else (lambda v: v)
    x0, x1 = min(fx(p[0]) for p in pts), max(fx(p[0]) for p in pts)
    ys = [p[1] for p in pts] + [h[0] for h in hlines]
    y0, y1 = y_range or (min(ys), max(ys))
    x1 = x1 if x1 > x0 else x0 + 1
    if y1 <= y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.5, y1 + (abs(y1) or 1) * 0.5
    L, R, T, B = 62, 12, 36, 30
    sx = lambda v: L + (fx(v) - x0) / (x1 - x0) * (width - L - R)
    sy = lambda v: height - B - (min(max(v, y0), y1) - y0) / (y1 - y0) * (height - T - B)
    colours = {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(series)}
    out = _frame(width, height, title, xlabel, ylabel, [(colours[k], k) for k in series])
    for lo, hi, fill in bands:
        if hi > y0 and lo < y1:
            out.append(f'<rect x="{L}" y="{sy(hi):.1f}" width="{width - L - R}" height="{sy(lo) - sy(hi):.1f}" '
                       f'fill="{fill}" fill-opacity="0.18"/>')
    out += [f'<line x1="{L}" y1="{height - B}" x2="{width - R}" y2="{height - B}" stroke="#333"/>',
            f'<line x1="{L}" y1="{T}" x2="{L}" y2="{height - B}" stroke="#333"/>']
    for v in _thin(sorted({p[0] for p in pts})):
        out.append(f'<text x="{sx(v):.1f}" y="{height - B + 12}" text-anchor="middle">{_xtick(v)}</text>')
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{L - 4}" y="{sy(v) + 3:.1f}" text-anchor="end">{_tick(v, y0, y1)}</text>')
    for y, colour, label in hlines:
        out.append(f'<line x1="{L}" y1="{sy(y):.1f}" x2="{width - R}" y2="{sy(y):.1f}" stroke="{colour}" '
                   f'stroke-dasharray="4 3"/><text x="{width - R - 2}" y="{sy(y) - 2:.1f}" text-anchor="end" '
                   f'fill="{colour}">{esc(label)}</text>')
    for name, s in series.items():
        c = colours[name]
        out.append('<polyline fill="none" stroke="{}" stroke-width="1.5" points="{}"/>'.format(
            c, " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)))
        if len(s) <= 40:
            out += [f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{c}"><title>{esc(name)} '
                    f'{x:g}: {y:.4g}</title></circle>' for x, y in s]
    out.append("</svg>")
    return "\n".join(out)


def heatmap_svg(rows: dict[str, Sequence], xs: Sequence, title: str, colour: Callable[[str, object], str],
                xlabel: str = "iteration", legend: Sequence[tuple] = (), width: int = 560,
                label_width: int = 70) -> str:
    """rows: label -> one value per x (None: not recorded, drawn light grey); colour(label, value) picks
    each cell's fill. Every cell carries a hover <title> with its exact value."""
    if not rows or not xs:
        return _no_data(title, width)
    L, R, T, B, rh = label_width, 12, 36, 30, 14
    height = T + B + rh * len(rows)
    cw = (width - L - R) / len(xs)
    out = _frame(width, height, title, xlabel, "", legend)
    out[0] = out[0].replace("<svg ", '<svg shape-rendering="crispEdges" ', 1)  # no seams between cells
    for r, (label, values) in enumerate(rows.items()):
        y = T + r * rh
        out.append(f'<text x="{L - 4}" y="{y + rh - 3}" text-anchor="end">{esc(label)}</text>')
        for c, (x, v) in enumerate(zip(xs, values)):
            text = "not recorded" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
            fill = "#eee" if v is None else colour(label, v)
            out.append(f'<rect x="{L + c * cw:.1f}" y="{y}" width="{cw + 0.3:.1f}" height="{rh - 1}" '
                       f'fill="{fill}"><title>{esc(f"{label}, {xlabel} {x}: {text}")}</title></rect>')
    for c, x in _thin(list(enumerate(xs))):
        out.append(f'<text x="{L + (c + 0.5) * cw:.1f}" y="{height - B + 12}" text-anchor="middle">{esc(str(x))}</text>')
    out.append("</svg>")
    return "\n".join(out)


def interval_plot_svg(categories: Sequence[str], series: dict[str, Sequence[tuple]], title: str, ylabel: str = "",
                      width: int = 420, height: int = 230) -> str:
    """Per category a mean +- std bar for each series: series name -> [(mean, std) per category]."""
    vals = [(m - s, m + s) for s in series.values() for m, s in s if not (_nan(m) or _nan(s))]
    if not categories or not vals:
        return _no_data(title, width)
    y0, y1 = min(v[0] for v in vals), max(v[1] for v in vals)
    y1 = y1 if y1 > y0 else y0 + 1
    L, R, T, B = 62, 12, 36, 30
    cw = (width - L - R) / len(categories)
    sy = lambda v: height - B - (v - y0) / (y1 - y0) * (height - T - B)
    colours = {k: PALETTE[i % len(PALETTE)] for i, k in enumerate(series)}
    out = _frame(width, height, title, "", ylabel, [(colours[k], k) for k in series])
    out += [f'<line x1="{L}" y1="{height - B}" x2="{width - R}" y2="{height - B}" stroke="#333"/>',
            f'<line x1="{L}" y1="{T}" x2="{L}" y2="{height - B}" stroke="#333"/>']
    for i in range(5):
        v = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{L - 4}" y="{sy(v) + 3:.1f}" text-anchor="end">{_tick(v, y0, y1)}</text>')
    for c, cat in enumerate(categories):
        out.append(f'<text x="{L + (c + 0.5) * cw:.1f}" y="{height - B + 12}" text-anchor="middle">{esc(cat)}</text>')
        for j, (name, s) in enumerate(series.items()):
            if c >= len(s) or _nan(s[c][0]) or _nan(s[c][1]):
                continue
            m, sd = s[c]
            x = L + (c + (j + 1) / (len(series) + 1)) * cw
            out.append(f'<line x1="{x:.1f}" y1="{sy(m - sd):.1f}" x2="{x:.1f}" y2="{sy(m + sd):.1f}" '
                       f'stroke="{colours[name]}" stroke-width="2"/><circle cx="{x:.1f}" cy="{sy(m):.1f}" r="3" '
                       f'fill="{colours[name]}"><title>{esc(name)} {esc(cat)}: {m:.4g} +- {sd:.4g}</title></circle>')
    out.append("</svg>")
    return "\n".join(out)
