"""`moe-rl report RUN_DIR`: one self-contained HTML page for a training run.

write_report(run_dir) reads RUN_DIR/config.yaml, metrics.parquet, drift.parquet (the consistency
ledger) and, when present, alerts.parquet and drift_study.parquet, and writes RUN_DIR/report.html:
inline SVG plots (moe_rl.app.plots), no scripts, no external resources. Every file and every column is
optional: a section without its data says "not recorded".

Per-expert series are used when metrics.parquet has them under these names (logit names as in
moe_rl.core.metrics.logit_stats): moe/layer{i}/util/e{j} (utilisation share), moe/layer{i}/logit_mean/e{j},
moe/layer{i}/logit_std/e{j}. Without them the utilisation section plots each layer's min_util and
max_util against the LM load table's bands (docs/stability.md) instead (raw; the grade is moe/health).
"""
from __future__ import annotations

import math
import os
import re
import time
from html import escape as esc

import pyarrow as pa
import yaml

from moe_rl.algo.results import atomic_write_bytes, read_rows
from moe_rl.app import bounded_yaml
from moe_rl.app.plots import heatmap_svg, interval_plot_svg, xy_plot_svg
from moe_rl.app.report_html import CSS, fig_row, fmt, not_recorded, section, table
from moe_rl.app.report_tasks import task_figures, task_names
from moe_rl.core.errors import ConfigError
from moe_rl.core.gate import DECISIONS, mismatch_limits
from moe_rl.core.metrics import DANGER_HIGH, DANGER_LOW, GRADES, WARN_HIGH, WARN_LOW

GRADE_COLOURS = ("#2ca02c", "#ff9f1c", "#d62728")  # healthy, warning, danger
DECISION_COLOURS = {"sync": "#2ca02c", "warn": "#ff9f1c", "hold": "#9467bd", "rollback": "#d62728",
                    "stop": "#000000"}
LOSSES = ("policy_loss", "vf_loss", "entropy", "mean_kl_loss", "aux_loss", "z_loss")
MAX_COLUMNS = 150   # heat-map columns (longer runs are strided: the SVG stays small)
SMALL = {"width": 300, "height": 190}

RUN_FILES = ("config.yaml", "metrics.parquet", "drift.parquet", "drift_study.parquet")


def write_report(run_dir: str) -> str:
    """Render RUN_DIR/report.html (atomically) and return its path."""
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"RUN_DIR: must be a run directory, got {run_dir!r} (not a directory)")
    if not any(os.path.isfile(os.path.join(run_dir, f)) for f in RUN_FILES):
        raise FileNotFoundError(f"RUN_DIR: must be a run directory, {run_dir!r} holds none of {', '.join(RUN_FILES)}")
    path = os.path.join(run_dir, "report.html")
    atomic_write_bytes(path, render_report(run_dir).encode())
    return path


def render_report(run_dir: str) -> str:
    notes: list = []
    cfg = _config(run_dir, notes)
    m = _read(run_dir, "metrics.parquet", notes)
    if m:  # iteration is the x axis everywhere
        m = sorted(({"iteration": i + 1, **r} if r.get("iteration") is None else r for i, r in enumerate(m)),
                   key=lambda r: r["iteration"])
    ledger = _read(run_dir, "drift.parquet", notes)
    alerts = _read(run_dir, "alerts.parquet", notes)
    study = _read(run_dir, "drift_study.parquet", notes)
    n = (cfg.get("moe") or {}).get("num_experts") or _experts_in(m)
    limits = mismatch_limits((cfg.get("consistency") or {}).get("thresholds"))
    name = os.path.basename(os.path.abspath(run_dir))
    body = [f"<h1>moe-rl run report: {esc(name)}</h1>",
            f'<p class="sub">{esc(os.path.abspath(run_dir))} · generated {esc(time.strftime("%Y-%m-%d %H:%M:%S"))}</p>',
            _header(cfg, m), *(f'<p class="note">{esc(s)}</p>' for s in notes),
            section("1. Return and losses", _returns_losses(m)),
            *([section("1b. Tasks: return, success and routing per task", [fig_row(task_figures(m))])]
              if task_names(m) else []),
            *_per_module(cfg, m, ledger, study, limits, n),
            section("6. Parameter divergence and sync decisions", _sync(m, ledger)),
            section("7. Alerts", _alerts(alerts))]
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>moe-rl report: {esc(name)}'
            f'</title><style>{CSS}</style></head><body>\n' + "\n".join(body) + "\n</body></html>\n")


def _per_module(cfg, m, ledger, study, limits, n) -> list:
    """Sections 2-5 once for a single-module run; for a multi-agent run once per MoE module (its
    `<module>/` columns and its ledger rows)."""
    modules = sorted({k[:-len("/moe/cv")] for r in m or [] for k in r if k.endswith("/moe/cv") and k != "moe/cv"})
    if not modules:
        return [section("2. Expert utilisation and health", _utilisation(m, n)),
                section("3. Router-logit distributions per expert", _logits(m)),
                section("4. Router entropy, active experts and dormant units", _entropy(m, n)),
                section("5. Training-inference drift", _drift(m, ledger, study, limits))]
    out = []
    for mid in modules:
        prefix = mid + "/"
        rows = [{"iteration": r["iteration"], **{k[len(prefix):]: v for k, v in r.items() if k.startswith(prefix)}}
                for r in m]
        own = [r for r in ledger or [] if r.get("module_id") == mid]
        experts = (((cfg.get("multi_agent") or {}).get("policies") or {}).get(mid) or {}).get("moe", {}).get(
            "num_experts") or n
        out += [section(f"2. Module {mid}: expert utilisation and health", _utilisation(rows, experts)),
                section(f"3. Module {mid}: router-logit distributions per expert", _logits(rows)),
                section(f"4. Module {mid}: router entropy and active experts", _entropy(rows, experts)),
                section(f"5. Module {mid}: training-inference drift", _drift([], own, study, limits))]
    return out


# --- reading ---------------------------------------------------------------------------------------
def _read(run_dir: str, name: str, notes: list):
    """Rows of RUN_DIR/name, or None when absent. A torn or foreign file costs its sections only."""
    path = os.path.join(run_dir, name)
    if not os.path.exists(path):
        return None
    if not os.path.isfile(path):   # a FIFO would block the read, a device never end it
        notes.append(f"{name}: not a regular file (not read)")
        return None
    try:
        return read_rows(path)
    except (OSError, ValueError, pa.ArrowException) as e:
        notes.append(f"{name}: unreadable ({e})")
        return None


def _config(run_dir: str, notes: list) -> dict:
    """config.yaml within bounded_yaml's limits (size, aliases): the header expands its values."""
    try:
        cfg = bounded_yaml.load(bounded_yaml.read(os.path.join(run_dir, "config.yaml")))
    except FileNotFoundError:
        return {}
    except bounded_yaml.YamlLimit as e:   # not damage but someone's doing (an alias bomb): refused
        raise ConfigError(f"RUN_DIR: {run_dir!r} config.yaml is refused: {e}") from None
    except (OSError, ValueError, yaml.YAMLError) as e:   # YamlLimit and UnicodeDecodeError are ValueErrors
        notes.append(f"config.yaml: unreadable ({str(e).splitlines()[0][:300] if str(e) else type(e).__name__})")
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _f(row: dict, key: str, default=math.nan):
    v = row.get(key)
    return float(v) if _num(v) else default


def _pts(rows, key: str, x: str = "iteration") -> list:
    return [(r[x], float(r[key])) for r in rows or () if _num(r.get(key)) and _num(r.get(x))]


def _cols(rows) -> set:
    return set().union(*(r.keys() for r in rows)) if rows else set()


def _layers(rows) -> list:
    """Metric-key prefixes and labels: one per MoE layer, else the headline (worst layer) columns."""
    ids = sorted({int(g.group(1)) for c in _cols(rows) if (g := re.match(r"moe/layer(\d+)/", c))})
    return [(f"moe/layer{i}/", f"layer{i}") for i in ids] or [("moe/", "worst layer")]


def _per_expert(rows, layer_prefix: str, what: str) -> list:
    pat = re.compile(re.escape(layer_prefix) + re.escape(what) + r"/e(\d+)$")
    return sorted(int(g.group(1)) for c in _cols(rows) if (g := pat.match(c)))


def _experts_in(rows):
    return max((len(_per_expert(rows, p, "util")) for p, _ in _layers(rows)), default=0) or None


def _bins(rows) -> tuple:
    """At most MAX_COLUMNS groups of consecutive rows (one heat-map column each), their first
    iterations, and a title suffix naming the group size."""
    k = max(1, -(-len(rows) // MAX_COLUMNS))
    bins = [rows[i:i + k] for i in range(0, len(rows), k)]
    return bins, [b[0].get("iteration") for b in bins], "" if k == 1 else f" ({k} iterations per column)"


def _worst(values, order: tuple):
    """The most severe label of a group: a single hold or danger must survive the grouping."""
    known = [v for v in values if v in order]
    return max(known, key=order.index) if known else None


def _mean(values):
    known = [float(v) for v in values if _num(v)]
    return sum(known) / len(known) if known else None


def _header(cfg: dict, m) -> str:
    moe, last = cfg.get("moe") or {}, (m or [{}])[-1]
    returns = [y for _, y in _pts(m, "episode_return_mean_100") or _pts(m, "episode_return_mean")]
    items = [("algorithm", (cfg.get("algo") or "ppo").upper() if cfg else None), ("env", cfg.get("env")),
             ("experts", moe.get("num_experts")), ("top_k", moe.get("top_k")),
             ("router", moe.get("router")), ("MoE layers", moe.get("num_layers")),
             ("iterations (recorded / configured)", f"{len(m or [])} / {fmt(cfg.get('iterations')) or '?'}"),
             ("env steps", last.get("env_steps_total")), ("wall time (s)", last.get("time_s")),
             ("return (last / best)", f"{returns[-1]:.4g} / {max(returns):.4g}" if returns else None),
             ("health (last)", last.get("moe/health")), ("seed", cfg.get("seed")),
             ("learners", (cfg.get("learners") or {}).get("num_learners")),
             ("env runners", (cfg.get("env_runners") or {}).get("num_env_runners")),
             ("sync policy", (cfg.get("consistency") or {}).get("policy"))]
    if not cfg:
        items.append(("config.yaml", "not recorded"))
    return table(["setting", "value"], [(k, "not recorded" if v is None else v) for k, v in items])


# --- sections --------------------------------------------------------------------------------------
def _returns_losses(m) -> list:
    curves = {name: _pts(m, k) for name, k in (("last 100 episodes", "episode_return_mean_100"),
                                                ("episodes ended in the iteration", "episode_return_mean"))}
    curves = {name: pts for name, pts in curves.items() if pts}
    figs = [xy_plot_svg(curves, "mean episode return", ylabel="return")] if curves else []
    figs += [xy_plot_svg({k: _pts(m, k)}, k, **SMALL) for k in LOSSES if _pts(m, k)]
    missing = [k for k in ("episode_return_mean", *LOSSES) if not _pts(m, k)]
    return ([fig_row(figs)] if figs else []) + ([not_recorded(", ".join(missing))] if missing else [])


def _band(u: float, n: int) -> int:
    """0 healthy, 1 warning, 2 danger for one expert's utilisation share."""
    if u * n < DANGER_LOW or u * n > DANGER_HIGH:
        return 2
    return 1 if u * n < WARN_LOW or u * n > WARN_HIGH else 0


def _grade_name(v):
    if isinstance(v, str):
        return v
    return GRADES[int(v)] if _num(v) and 0 <= v < len(GRADES) else None


def _utilisation(m, n) -> list:
    out, (bins, xs, per) = [], _bins(m or [])
    layers = _layers(m)
    grade_keys = [(p + "health", label) for p, label in layers if p != "moe/"]
    grade_keys.append(("moe/health_level" if _pts(m, "moe/health_level") else "moe/health", "worst layer"))
    strip = {label: [_worst([_grade_name(r.get(k)) for r in b], GRADES) for b in bins] for k, label in grade_keys}
    strip = {k: v for k, v in strip.items() if any(v)}
    legend = [(c, g) for c, g in zip(GRADE_COLOURS, GRADES)]
    if strip:
        out.append(heatmap_svg(strip, xs, "health grade per layer (dead experts, collapse)" + per,
                               lambda _, g: GRADE_COLOURS[GRADES.index(g)] if g in GRADES else "#999", legend=legend))
    else:
        out.append(not_recorded("health grade (moe/health, moe/layer{i}/health)"))
    per_expert = {label: (p, _per_expert(m, p, "util")) for p, label in layers}
    if n and any(e for _, e in per_expert.values()):
        # Hue = health band of the share, lightness = the share itself (darker = more tokens).
        def colour(_, u):
            light = 76 - 44 * min(1.0, math.sqrt(max(u, 0.0)))
            return f"hsl({(130, 35, 0)[_band(u, n)]},80%,{light:.0f}%)"
        # The LM load table's bands (docs/stability.md) colour the shares (raw figures); the grade strip above
        # is moe_rl.core.health's (dead experts, collapse), which an uneven RL load need not breach.
        legend = [(GRADE_COLOURS[0], "LM band 0.8/N..3/N"), (GRADE_COLOURS[1], "outside"),
                  (GRADE_COLOURS[2], "<0.3/N or >8/N"), ("#555", "darker = larger share")]
        for label, (p, experts) in per_expert.items():
            cells = {f"e{j}": [_mean(r.get(f"{p}util/e{j}") for r in b) for b in bins] for j in experts}
            if experts:
                out.append(heatmap_svg(cells, xs, f"{label}: utilisation share per expert (N={n}){per}", colour,
                                       legend=legend))
        return [fig_row(out)]
    series = {f"{label} {k}": _pts(m, f"{p}{k}_util") for p, label in layers for k in ("min", "max")}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return [fig_row(out), not_recorded("expert utilisation (moe/util per expert, moe/min_util, moe/max_util)")]
    bands, hlines, y_range = (), (), None
    if n:  # the healthy band [0.8/N, 3/N] holds every expert's share; the others follow metrics.py
        g, w, d = GRADE_COLOURS
        edges = [0.0, DANGER_LOW / n, WARN_LOW / n, WARN_HIGH / n, DANGER_HIGH / n, math.inf]
        bands = list(zip(edges, edges[1:], (d, w, g, w, d)))
        hlines = [(1.0 / n, "#555", "uniform 1/N")]
        top = max(y for s in series.values() for _, y in s)
        y_range = (0.0, min(1.0, max(top, WARN_HIGH / n) * 1.25))
    out.append(xy_plot_svg(series, f"min / max expert utilisation vs the LM load table bands (N={n or '?'})",
                           ylabel="share of tokens", bands=bands, hlines=hlines, y_range=y_range))
    note = ("per-expert utilisation not logged: layer min/max shares shown; "
            "LM load table bands, docs/stability.md (green in band, orange outside, red far out); grade: moe/health")
    return [fig_row(out), f'<p class="sub">{note}</p>']


def _logits(m) -> list:
    figs = []
    for p, label in _layers(m):
        experts = _per_expert(m, p, "logit_mean")
        if not experts:
            continue
        series = {f"iteration {r['iteration']}": [(_f(r, f"{p}logit_mean/e{j}"), _f(r, f"{p}logit_std/e{j}", 0.0))
                                                  for j in experts] for r in (m[0], m[-1])}
        figs.append(interval_plot_svg([f"e{j}" for j in experts], series,
                                      f"{label}: router logit mean ± std per expert", ylabel="logit"))
    if not figs:
        return [not_recorded("per-expert router-logit statistics (moe/layer{i}/logit_mean/e{j})")]
    return [fig_row(figs)]


def _entropy(m, n) -> list:
    layers = _layers(m)
    ent = {label: _pts(m, p + "router_entropy_norm") for p, label in layers}
    act = {label: _pts(m, p + "active_experts") for p, label in layers}
    figs, out = [], []
    if any(ent.values()):
        figs.append(xy_plot_svg({k: v for k, v in ent.items() if v}, "router entropy / ln N", ylabel="1 = uniform",
                                y_range=(0.0, 1.05), hlines=[(1.0, "#555", "uniform")]))
    else:
        out.append(not_recorded("router entropy (moe/router_entropy_norm)"))
    if any(act.values()):
        top = n or max(y for s in act.values() for _, y in s)
        figs.append(xy_plot_svg({k: v for k, v in act.items() if v}, "active experts", ylabel="experts",
                                y_range=(0.0, top + 0.5), hlines=[(top, "#555", f"all {top:g}")]))
    else:
        out.append(not_recorded("active experts (moe/active_experts)"))
    dormant = {label: _pts(m, p + "dormant") for p, label in layers}
    if any(dormant.values()):   # plasticity: docs/stability.md says how to read it beside the grade
        figs.append(xy_plot_svg({k: v for k, v in dormant.items() if v}, "dormant units (τ = 0.025)",
                                ylabel="share of the block's units", y_range=(0.0, 1.0)))
    return ([fig_row(figs)] if figs else []) + out


def _drift(m, ledger, study, limits) -> list:
    out, figs = [], []
    for key, title in (("k3", "K3 (rollout vs trainer)"), ("max_abs_logp_diff", "max |Δ log-prob|"),
                       ("routing_agreement", "routing agreement")):
        series = {key: _pts(m, "drift/" + key) or _pts(ledger, key)}
        if key == "routing_agreement":  # per-layer agreement, from the ledger
            series.update({c[len("routing_agreement/"):]: _pts(ledger, c) for c in sorted(_cols(ledger))
                           if c.startswith("routing_agreement/layer")})
        if series[key]:
            thr = limits.get(key, (None, None))[1]
            top = max([y for s in series.values() for _, y in s] + [thr or 0.0])
            figs.append(xy_plot_svg(series, title, hlines=[(thr, "#d62728", f"threshold {thr:g}")] if thr else (),
                                    y_range=None if key == "routing_agreement" else (0.0, top or 1.0), **SMALL))
    out.append(fig_row(figs) if figs else
               not_recorded("drift over iterations (drift/k3 in metrics.parquet, drift.parquet)"))
    if not study:
        return [*out, not_recorded("drift versus sequence length (drift_study.parquet from moe-rl drift-study)")]
    figs = []
    for key, title in (("k3", "K3 vs sequence length"), ("max_abs_logp_diff", "max |Δ log-prob| vs sequence length")):
        series = {}
        for source in sorted({str(r.get("source")) for r in study}):
            by_len: dict = {}
            for r in study:
                if str(r.get("source")) == source and _num(r.get("seq_len")) and _num(r.get(key)):
                    by_len.setdefault(r["seq_len"], []).append(r[key])
            series[f"{source} (mean over seeds)"] = [(L, sum(v) / len(v)) for L, v in sorted(by_len.items())]
        figs.append(xy_plot_svg(series, title, xlabel="sequence length", log_x=True, **SMALL))
    return [*out, "<h3>versus sequence length</h3>", fig_row(figs)]


def _sync(m, ledger) -> list:
    out = ["<h3>parameter-divergence breaches (corrupt rollout copies, diverged replicas)</h3>"]
    if not ledger or "param_breach_lines" not in _cols(ledger):
        out.append(not_recorded("parameter divergence (param_breach_lines in drift.parquet)"))
    else:
        rows = []
        for r in ledger:
            for line in (r.get("param_breach_lines") or "").splitlines():
                g = re.match(r"(.*): max_diff=(\S+) \(threshold=([^)]*)\)$", line)
                rows.append((r.get("iteration"), r.get("sync_id"), *(g.groups() if g else (line, "", ""))))
        if rows:
            out.append(table(["iteration", "sync id", "tensor", "max |Δ|", "threshold"], rows))
        else:
            out.append(f'<p>no parameter-divergence breaches in {len(ledger)} checks (digests of every tensor)</p>')
    out.append("<h3>sync decisions</h3>")
    source = ledger if ledger and "decision" in _cols(ledger) else [
        {**r, "decision": r.get("drift/decision")} for r in m or [] if r.get("drift/decision")]
    if not source:
        return [*out, not_recorded("sync decisions (decision in drift.parquet, drift/decision in metrics.parquet)")]
    counts = dict.fromkeys(DECISIONS, 0)
    for r in source:
        counts[r.get("decision")] = counts.get(r.get("decision"), 0) + 1
    out.append(table(["decision", "checks"], list(counts.items())))
    bins, xs, per = _bins(source)
    out.append(heatmap_svg({"decision": [_worst([r.get("decision") for r in b], DECISIONS) for b in bins]}, xs,
                           "sync decision per check" + per.replace("iterations", "checks"),
                           lambda _, d: DECISION_COLOURS.get(d, "#999"),
                           legend=[(c, d) for d, c in DECISION_COLOURS.items()]))
    flagged = [(r.get("iteration"), r.get("decision"), r.get("cause"), r.get("action"), r.get("reason"))
               for r in source if r.get("action")]
    if flagged:
        out.append(table(["iteration", "decision", "cause", "action", "reason"], flagged, pre=(4,)))
    return out


def _alerts(alerts) -> list:
    if alerts is None:
        return [not_recorded("alerts (alerts.parquet)")]
    if not alerts:
        return ["<p>no alerts</p>"]
    first = ["iteration", "metric", "kind", "value", "message"]
    header = [c for c in first if c in _cols(alerts)] + sorted(_cols(alerts) - set(first))
    return [f"<p>{len(alerts)} alerts</p>", table(header, [[r.get(c) for c in header] for r in alerts],
                                                   pre=(header.index("message"),) if "message" in header else ())]
