"""The report's multi-task section: per-task curves and which experts each task uses.

Reads the metrics rows' `task/<name>/return|success|length` and `task/<name>/experts/layer{i}/e{j}`
columns (moe_rl.rllib.task_metrics); a run without them has no such section.
"""
from __future__ import annotations

import math
import re

from moe_rl.app.plots import heatmap_svg, xy_plot_svg

LAST = 10   # the routing heat map averages each task's share over the last LAST iterations


def task_names(rows) -> list:
    return sorted({k.split("/")[1] for r in rows or () for k in r if k.startswith("task/") and k.endswith("/return")})


def _series(rows, key):
    return [(r["iteration"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))
            and math.isfinite(r[key])]


def task_figures(rows) -> list:
    """SVGs: return, success and episode length per task (with the average over tasks), then one
    task x expert heat map of routing shares per MoE layer."""
    names = task_names(rows)
    if not names:
        return []
    returns = {n: _series(rows, f"task/{n}/return") for n in names}
    returns["average over tasks"] = _series(rows, "task_return_mean")
    figs = [xy_plot_svg(returns, "return per task", ylabel="return", width=460)]
    for figure in ("success", "length"):
        series = {n: _series(rows, f"task/{n}/{figure}") for n in names}
        if any(series.values()):
            figs.append(xy_plot_svg(series, f"{figure} per task", ylabel=figure, width=460))
    pattern = re.compile(r"task/(.+)/experts/layer(\d+)/e(\d+)$")
    cells = {}   # layer -> task -> expert -> shares over the last iterations
    for r in rows[-LAST:]:
        for k, v in r.items():
            g = pattern.match(k)
            if g and isinstance(v, (int, float)) and math.isfinite(v):
                task, layer, expert = g.group(1), int(g.group(2)), int(g.group(3))
                cells.setdefault(layer, {}).setdefault(task, {}).setdefault(expert, []).append(v)
    for layer, per_task in sorted(cells.items()):
        experts = sorted({e for shares in per_task.values() for e in shares})
        grid = {t: [_mean(per_task.get(t, {}).get(e)) for e in experts] for t in names}
        top = max((v for vs in grid.values() for v in vs if v is not None), default=1.0) or 1.0
        figs.append(heatmap_svg(
            grid, [f"e{e}" for e in experts], f"layer{layer}: each task's share of its tokens per expert "
            f"(last {min(LAST, len(rows))} iterations)",
            lambda _, v: f"hsl(210,70%,{96 - 60 * v / top:.0f}%)", xlabel="expert",
            legend=[("hsl(210,70%,96%)", "0"), ("hsl(210,70%,36%)", f"{top:.2f}")],
            label_width=8 + 7 * max(len(n) for n in names)))
    return figs


def _mean(values):
    return sum(values) / len(values) if values else None
