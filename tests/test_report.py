"""`moe_rl.app.report.write_report` on synthetic run directories (no Ray): every section renders from the
real column names, missing files/columns say "not recorded", and the page is self-contained."""
import math
import re
import shutil
import subprocess

import pytest
import yaml

from moe_rl.algo.results import write_table
from moe_rl.app.report import DECISION_COLOURS, GRADE_COLOURS, write_report
from moe_rl.core.drift import format_breach
from moe_rl.core.metrics import GRADES, WORST_OF

pytestmark = pytest.mark.pure

N, LAYERS, ITERS = 8, 2, 12


def metrics_rows(per_expert: bool):
    rows = []
    for it in range(1, ITERS + 1):
        row = {"iteration": it, "env_steps_total": 4000 * it, "time_s": 1.5 * it, "episode_return_mean": 20.0 + 8 * it,
               "episode_len_mean": 20.0 + 8 * it, "weights_seq_no": float(it - 1), "policy_loss": -0.05 / it,
               "vf_loss": 50.0 + it, "entropy": 0.69 - 0.01 * it, "mean_kl_loss": 0.02, "aux_loss": 2.0 + 0.001 * it,
               "z_loss": 6.0 / it}
        for layer in range(LAYERS):
            skew = 0.03 * it * (layer + 1)      # layer 1 drifts into the danger band
            util = [1 / N + skew] + [1 / N - skew / (N - 1)] * (N - 1)
            m = {"min_util": min(util), "max_util": max(util), "cv": 0.1 * it, "active_experts": float(N),
                 "health": float(min(2, it // 5)), "router_entropy": 2.0, "router_entropy_norm": 0.99 - 0.01 * it,
                 "replay_divergence": 0.0}
            row.update({f"moe/layer{layer}/{k}": v for k, v in m.items()})
            if per_expert:
                row.update({f"moe/layer{layer}/util/e{j}": u for j, u in enumerate(util)})
                row.update({f"moe/layer{layer}/logit_mean/e{j}": 0.1 * j - 0.01 * it for j in range(N)})
                row.update({f"moe/layer{layer}/logit_std/e{j}": 0.5 for j in range(N)})
        row.update({f"moe/{k}": worst(row[f"moe/layer{i}/{k}"] for i in range(LAYERS))
                    for k, worst in WORST_OF.items() if f"moe/layer0/{k}" in row})
        row["moe/health_level"] = int(row["moe/health"])
        row["moe/health"] = GRADES[row["moe/health_level"]]
        row.update({"drift/k1": 1e-9, "drift/k3": 1e-4 * it, "drift/max_abs_logp_diff": 0.05 * it,
                    "drift/routing_agreement": 1.0 - 0.01 * it, "drift/param_max_diff": 0.0,
                    "drift/decision": "sync" if it < 10 else "warn"})
        rows.append(row)
    return rows


def ledger_rows():
    rows = []
    for it in range(1, ITERS + 1):
        breach = [("layers.1.experts.3.w1", 0.47, 1e-5), ("pi.weight", 0.031, 1e-5)] if it == 7 else []
        decision = {7: "hold", 10: "warn", 11: "rollback"}.get(it, "sync")
        rows.append({"iteration": it, "sync_id": it - 1, "weights_seq_no": it - 1, "k1": 1e-9, "k2": 1e-9,
                     "k3": 1e-4 * it, "chi2": 0.0, "ess": 1.0, "max_abs_logp_diff": 0.05 * it,
                     "mean_abs_logp_diff": 0.01, "mean_abs_prob_diff": 0.01,
                     "routing_agreement/layer0": 1.0, "routing_jaccard/layer0": 1.0,
                     "routing_agreement/layer1": 1.0 - 0.02 * it, "routing_jaccard/layer1": 1.0,
                     "routing_agreement": 1.0 - 0.01 * it, "routing_jaccard": 1.0, "routing_flip_rate": 0.01 * it,
                     "first_divergent_layer": 1, "lag_versions": 0,
                     "param_breach_lines": "\n".join(format_breach(*b) for b in breach),
                     "weights_finite": True, "k3_old_new": 0.01, "probe_flip_rate": 0.1,
                     "decision": decision, "cause": "" if decision == "sync" else "bad_update",
                     "action": "" if decision == "sync" else decision,
                     "reason": "" if decision == "sync" else "bad update k3_old_new=0.0012 (threshold=0.001)",
                     "check_time_s": 0.01})
    return rows


ALERTS = [{"iteration": 5, "metric": "moe/layer1/min_util", "kind": "threshold", "value": 0.01,
           "message": "layer 1 starves expert 4 <script>alert(1)</script>"},
          {"iteration": 9, "metric": "vf_loss", "kind": "spike", "value": 912.5, "message": "value loss spiked 9x"}]


def sections(html: str) -> dict:
    return {t: body for t, body in re.findall(r"<section><h2>(.*?)</h2>(.*?)</section>", html, re.DOTALL)}


def assert_self_contained(html: str) -> None:
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html, re.IGNORECASE)
    assert "<script" not in html.lower() and "@import" not in html and "url(" not in html


def full_run(tmp_path, per_expert: bool):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "env": "CartPole-v1", "seed": 0, "iterations": ITERS,
        "moe": {"num_experts": N, "top_k": 2, "router": "topk", "num_layers": LAYERS},
        "learners": {"num_learners": 0}, "env_runners": {"num_env_runners": 1},
        "consistency": {"policy": "hold", "thresholds": {}}}))
    write_table(str(tmp_path / "metrics.parquet"), metrics_rows(per_expert))
    write_table(str(tmp_path / "drift.parquet"), ledger_rows())
    write_table(str(tmp_path / "alerts.parquet"), ALERTS)
    write_table(str(tmp_path / "drift_study.parquet"), [
        {"seq_len": L, "source": "bf16", "seed": s, "k3": 1e-5 * L * (1 + s), "k1": 0.0,
         "max_abs_logp_diff": 0.001 * math.log2(L), "routing_agreement": 1.0, "k3_by_position": "{}"}
        for L in (64, 128, 256) for s in (0, 1)])
    return tmp_path


@pytest.mark.parametrize("per_expert", [True, False], ids=["per-expert-util", "min-max-util"])
def test_full_run_renders_every_section(tmp_path, per_expert):
    path = write_report(str(full_run(tmp_path, per_expert)))
    assert path == str(tmp_path / "report.html")
    html = (tmp_path / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert_self_contained(html)
    # header: the run config summary
    for needle in ("CartPole-v1", "<td>experts</td><td>8</td>", "<td>top_k</td><td>2</td>", "<td>topk</td>",
                   f"{ITERS} / {ITERS}"):
        assert needle in html, needle
    s = sections(html)
    assert len(s) == 7
    plotted = [t for t in s if not t.startswith(("3.", "7."))] + (["3. Router-logit distributions per expert"]
                                                                   if per_expert else [])
    for title in plotted:
        assert "<svg" in s[title], title
    util = s["2. Expert utilisation and health"]
    assert "health grade per layer" in util
    if per_expert:  # one experts x iterations heat map per layer, cells carry their value and band colour
        assert util.count("utilisation share per expert") == LAYERS
        assert util.count("<rect") >= LAYERS * N * ITERS and "hsl(0," in util  # some cell in the danger band
        assert "not recorded" not in s["3. Router-logit distributions per expert"]
    else:  # min/max lines against the band lines
        assert "min / max expert utilisation vs the LM load table bands" in util and "uniform 1/N" in util
        assert "not recorded" in s["3. Router-logit distributions per expert"]
    drift = s["5. Training-inference drift"]
    assert "K3 (rollout vs trainer)" in drift and "threshold 0.001" in drift and "K3 vs sequence length" in drift
    sync = s["6. Parameter divergence and sync decisions"]
    assert "<td>layers.1.experts.3.w1</td><td>0.47</td><td>1e-05</td>" in sync and "<td>pi.weight</td>" in sync
    for decision, count in (("sync", 9), ("warn", 1), ("hold", 1), ("rollback", 1)):
        assert f"<tr><td>{decision}</td><td>{count}</td></tr>" in sync
    assert "sync decision per check" in sync and "k3_old_new=0.0012 (threshold=0.001)" in sync
    alerts = s["7. Alerts"]
    assert "<td>moe/layer1/min_util</td><td>threshold</td>" in alerts and "value loss spiked 9x" in alerts
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in alerts  # text is escaped, never markup
    assert "not recorded" not in html.replace(s["3. Router-logit distributions per expert"], "")


def test_minimal_run_says_not_recorded(tmp_path):
    write_table(str(tmp_path / "metrics.parquet"), [
        {"iteration": i, "episode_return_mean": 10.0 * i, "policy_loss": -0.1 / i} for i in range(1, 4)])
    (tmp_path / "drift.parquet").write_bytes(b"not parquet")  # a torn file costs only its sections
    with open(write_report(str(tmp_path))) as f:
        html = f.read()
    assert_self_contained(html)
    s = sections(html)
    assert "<svg" in s["1. Return and losses"] and "not recorded: vf_loss" in s["1. Return and losses"]
    for title, body in s.items():
        if not title.startswith("1."):
            assert "not recorded" in body and "<svg" not in body, title
    assert "drift.parquet: unreadable" in html
    assert "<td>config.yaml</td><td>not recorded</td>" in html and "<td>experts</td><td>not recorded</td>" in html


def test_long_run_keeps_rare_events_when_columns_are_grouped(tmp_path):
    """400 iterations -> grouped heat-map columns; one rollback and one danger grade still show."""
    rows = [{"iteration": i, "moe/health": "danger" if i == 201 else "healthy",
             "drift/decision": "rollback" if i == 200 else "sync", "drift/k3": 1e-5} for i in range(1, 401)]
    write_table(str(tmp_path / "metrics.parquet"), rows)
    write_report(str(tmp_path))
    s = sections((tmp_path / "report.html").read_text())
    sync, util = s["6. Parameter divergence and sync decisions"], s["2. Expert utilisation and health"]
    assert "(3 checks per column)" in sync and "<tr><td>rollback</td><td>1</td></tr>" in sync
    assert sync.count(f'fill="{DECISION_COLOURS["rollback"]}"><title>') == 1
    assert "(3 iterations per column)" in util and util.count(f'fill="{GRADE_COLOURS[2]}"><title>') == 1


BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def test_headless_screenshot(tmp_path):
    browser = next((b for b in map(shutil.which, BROWSERS) if b), None)
    if browser is None:
        pytest.skip(f"no headless browser on PATH ({', '.join(BROWSERS)})")
    path = write_report(str(full_run(tmp_path, per_expert=True)))
    png = tmp_path / "report.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,2400",
                    f"--screenshot={png}", f"file://{path}"], capture_output=True, timeout=180, check=False)
    assert png.is_file() and png.stat().st_size > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"



def test_line_plot_log_y_spans_orders_of_magnitude_and_floors_zero():
    """K3 of the drift study spans 1e-15 (fp32) to 1e-3 (capacity) and can be exactly 0."""
    from moe_rl.app.plots import line_plot_svg
    svg = line_plot_svg({"fp32": [(64, 0.0), (128, 3e-15)], "capacity": [(64, 1e-3), (128, 2e-3)]}, "K3", "length",
                        "K3", log_x=True, log_y_floor=1e-16)
    ys = [float(y) for y in re.findall(r'<circle cx="[\d.]+" cy="([\d.-]+)"', svg)]
    assert len(ys) == 4 and all(30 <= y <= 320 - 45 for y in ys)      # every point inside the axes
    assert ys[0] > ys[1] > ys[2] > ys[3]                              # svg y grows downwards
    assert ">1e-16<" in svg and ">1e-1<" in svg                       # whole decades, floor to top
