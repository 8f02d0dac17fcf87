"""moe_rl.algo.prometheus: the column -> metric mapping, the Grafana dashboard's queries, the export cost,
and a real Ray head serving the exported metrics on its Prometheus endpoint."""
import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest
import torch

from moe_rl.algo import prometheus
from moe_rl.algo.prometheus import PrometheusExporter, exported_families, metric_name_and_tags
from moe_rl.algo.results import LEARNER_KEYS, metrics_row
from moe_rl.core.metrics import health_summary
from moe_rl.core.param_groups import PARAM_GROUPS
from moe_rl.core.routing import RoutingRecord

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DASHBOARD = os.path.join(ROOT, "cluster", "grafana_dashboard.json")


def realistic_row(num_layers=2, num_experts=4, decision="hold", tokens=64):
    """A metrics row built the way training builds it: health_summary over routing records (the
    learner), the stability toolkit's and sync gate's keys, the driver's figures, metrics_row."""
    g = torch.Generator().manual_seed(0)
    records = []
    for _ in range(num_layers):
        logits = torch.randn(tokens, num_experts, generator=g)
        top = logits.topk(2, -1)
        records.append(RoutingRecord(top.indices, top.values.softmax(-1), logits))
    learner = {k: 0.1 * i for i, k in enumerate(LEARNER_KEYS)}
    learner.update(health_summary(records))
    for grp in PARAM_GROUPS:              # moe_rl.core.stability: StabilityToolkit stats
        learner[f"stability/grad_norm/{grp}"] = 1.0
        learner[f"stability/lr/{grp}"] = 3e-4
        learner[f"stability/clip_coef/{grp}"] = 1.0
    learner.update({"stability/grad_norm/total": 2.0, "stability/skipped_steps": 3.0,
                    "stability/router_warmup": 0.0})
    figures = {f"drift/{k}": 0.01 for k in ("k1", "k3", "max_abs_logp_diff", "routing_agreement",
                                              "lag_k3", "k3_old_new", "probe_flip_rate")}
    figures["drift/decision"] = decision                      # MoEPPO._log_check
    for rank in range(2):                                     # actors/learner.py memory_stats
        for k in ("expert_param_bytes", "peak_rss_mb", "rss_mb"):
            figures[f"learner/{k}/rank{rank}"] = 1000.0 + rank
    figures.update({"memory/rss_mb/driver": 900.0, "memory/rss_mb/runner1": 800.0,   # MoEMonitoring
                    "memory/rss_mb/runner2": 810.0})
    result = {"training_iteration": 7, "num_env_steps_sampled_lifetime": 4000, "time_total_s": 12.5,
              "env_runners": {"episode_return_mean": 42.5, "episode_len_mean": 42.5, "weights_seq_no": 6},
              "learners": {"default_policy": learner}, "moe_rl": figures}
    return metrics_row(result)


# --- mapping -------------------------------------------------------------------------------------
@pytest.mark.parametrize("key, name, tags", [
    ("episode_return_mean", "moe_rl_episode_return_mean", {}),
    ("moe/cv", "moe_rl_moe_cv", {}),
    ("moe/layer0/cv", "moe_rl_moe_cv", {"layer": "0"}),
    ("moe/layer0/util/e3", "moe_rl_moe_util", {"layer": "0", "expert": "3"}),
    ("moe/layer12/logit_std/e63", "moe_rl_moe_logit_std", {"layer": "12", "expert": "63"}),
    ("moe/router_entropy_norm", "moe_rl_moe_router_entropy_norm", {}),
    ("moe/health_level", "moe_rl_moe_health_level", {}),
    ("moe/layer1/health", "moe_rl_moe_health_level", {"layer": "1"}),
    ("stability/grad_norm/experts", "moe_rl_stability_grad_norm_experts", {}),
    ("stability/lr/router", "moe_rl_stability_lr_router", {}),
    ("drift/k3", "moe_rl_drift_k3", {}),
    ("learner/rss_mb/rank0", "moe_rl_learner_rss_mb", {"rank": "0"}),
    ("learner/peak_rss_mb/rank3", "moe_rl_learner_peak_rss_mb", {"rank": "3"}),
    ("memory/rss_mb/runner1", "moe_rl_memory_rss_mb", {"actor": "runner1"}),
    ("memory/rss_mb/driver", "moe_rl_memory_rss_mb", {"actor": "driver"}),
    ("tis/weight-mean.x", "moe_rl_tis_weight_mean_x", {}),
    ("moe/entropy", "moe_rl_moe_entropy", {}),   # `e` followed by letters is not an expert
])
def test_metric_name_and_tags(key, name, tags):
    assert metric_name_and_tags(key) == (name, tags)


def test_every_numeric_column_of_a_real_row_maps_to_a_valid_family():
    row = realistic_row()
    fams = exported_families(row)
    valid = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
    assert all(valid.match(f) and f.startswith("moe_rl_") for f in fams)
    assert fams["moe_rl_moe_util"] == {"run", "layer", "expert"}
    assert fams["moe_rl_moe_cv"] == {"run", "layer"}            # moe/cv and moe/layer{i}/cv
    assert fams["moe_rl_sync_decisions_total"] == {"run", "decision"}
    assert "moe_rl_moe_health" not in fams and "moe_rl_drift_decision" not in fams   # strings
    assert fams["moe_rl_moe_health_level"] == {"run", "layer"}  # moe/health_level, moe/layer{i}/health
    big = exported_families(realistic_row(num_experts=32))
    assert "moe_rl_moe_util" not in big and "moe_rl_moe_cv" in big      # per-expert above 16


# --- the dashboard -------------------------------------------------------------------------------
def _dashboard():
    with open(DASHBOARD) as f:
        return json.load(f)


def _exprs(dash):
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_dashboard_is_a_grafana_dashboard_with_datasource_and_run_variables():
    dash = _dashboard()
    assert 36 <= dash["schemaVersion"] <= 41 and dash["title"] and dash["uid"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["type"] == "query" and "run" in variables["run"]["definition"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)) >= 11
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"] and set(p["gridPos"]) == {"x", "y", "w", "h"}
        assert all('run=~"$run"' in t["expr"] for t in p["targets"])
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for want in ("return", "health", "cv", "entropy", "active experts", "k3", "routing agreement",
                 "sync decisions", "skipped", "alerts", "rss"):
        assert want in titles, want


def test_every_dashboard_metric_is_a_family_the_exporter_produces_as_served():
    fams = exported_families(realistic_row())
    ray_labels = {"SessionName", "WorkerId", "Component", "NodeAddress", "Version"}
    used = set()
    for expr in _exprs(_dashboard()):
        names = re.findall(r"\b([a-zA-Z_][a-zA-Z0-9_]*)\s*\{([^}]*)\}", expr)
        assert names, expr
        for served, selector in names:
            assert served.startswith(prometheus.RAY_PREFIX), served      # Ray 2.60 serves ray_<name>
            family = served[len(prometheus.RAY_PREFIX):]
            assert family in fams, (family, expr)
            used.add(family)
            labels = set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", selector))
            assert labels <= fams[family] | ray_labels, (labels, family)
        for by in re.findall(r"by\s*\(([^)]*)\)", expr):
            labels = {x.strip() for x in by.split(",")}
            for served, _ in names:
                assert labels <= fams[served[len(prometheus.RAY_PREFIX):]] | ray_labels, (labels, expr)
    assert {"moe_rl_episode_return_mean", "moe_rl_moe_health_level", "moe_rl_sync_decisions_total",
            "moe_rl_alerts_total", "moe_rl_learner_rss_mb"} <= used


# --- the exporter (Ray's metric classes faked) ----------------------------------------------------
class _Fake:
    made = []

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.tag_keys, self.calls = name, tag_keys, []
        _Fake.made.append(self)

    def set(self, value, tags):
        assert set(tags) == set(self.tag_keys), (self.name, tags)   # Ray's rule: every declared key
        self.calls.append((value, dict(tags)))

    inc = set


@pytest.fixture
def fake_ray(monkeypatch):
    import ray
    import ray.util.metrics
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util.metrics, "Gauge", _Fake)
    monkeypatch.setattr(ray.util.metrics, "Counter", _Fake)
    _Fake.made = []
    return _Fake


def test_export_sets_gauges_counts_decisions_and_alerts(fake_ray):
    ex = PrometheusExporter(run="r1", refresh_s=3600)
    row = realistic_row()
    row["policy_loss"] = math.nan                     # absent this iteration: not exported
    alerts = [{"kind": "spike"}, {"kind": "spike"}, {"kind": "memory"}]
    ex.export(row, alerts)
    ex.export(row, [])
    by = {m.name: m for m in fake_ray.made}
    assert len(by) == len(fake_ray.made)              # one metric object per family
    assert by["moe_rl_episode_return_mean"].calls == [(42.5, {"run": "r1"})] * 2
    cv = by["moe_rl_moe_cv"].calls
    assert {c[1]["layer"] for c in cv} == {"", "0", "1"}
    util = by["moe_rl_moe_util"].calls
    assert {(c[1]["layer"], c[1]["expert"]) for c in util} == {(str(i), str(j)) for i in range(2) for j in range(4)}
    assert {c[1]["rank"] for c in by["moe_rl_learner_rss_mb"].calls} == {"0", "1"}
    assert {c[1]["actor"] for c in by["moe_rl_memory_rss_mb"].calls} == {"driver", "runner1", "runner2"}
    assert "moe_rl_policy_loss" not in by or not by["moe_rl_policy_loss"].calls
    assert by["moe_rl_sync_decisions_total"].calls == [(1, {"run": "r1", "decision": "hold"})] * 2
    assert sorted(by["moe_rl_alerts_total"].calls) == [(1, {"run": "r1", "kind": "memory"}),
                                                       (2, {"run": "r1", "kind": "spike"})]
    assert set(by) - {"moe_rl_sync_decisions_total", "moe_rl_alerts_total"} <= set(exported_families(row))
    # An iteration without a sync check: the decision column is NaN, nothing is counted.
    ex.export({**row, "drift/decision": math.nan})
    assert len(by["moe_rl_sync_decisions_total"].calls) == 2
    ex.close()


def test_the_last_values_are_re_reported_between_iterations(fake_ray):
    """Ray's agent drops a gauge that is not reported for two report intervals."""
    ex = PrometheusExporter(run="r1", refresh_s=0.05)
    ex.export(realistic_row(), [{"kind": "spike"}])
    ret = next(m for m in fake_ray.made if m.name == "moe_rl_episode_return_mean")
    alerts = next(m for m in fake_ray.made if m.name == "moe_rl_alerts_total")
    deadline = time.time() + 10
    while len(ret.calls) < 3 and time.time() < deadline:
        time.sleep(0.05)
    ex.close()
    assert len(ret.calls) >= 3 and all(c == (42.5, {"run": "r1"}) for c in ret.calls)
    n = len(ret.calls)
    time.sleep(0.3)
    assert len(ret.calls) <= n + 1                 # close() stopped the refresher
    assert len(alerts.calls) == 1                  # counters are cumulative: never re-sent


def test_per_expert_series_are_dropped_above_the_limit(fake_ray):
    ex = PrometheusExporter(run="r", per_expert_max=4, refresh_s=3600)
    ex.export(realistic_row(num_experts=8))
    ex.close()
    names = {m.name for m in fake_ray.made}
    assert "moe_rl_moe_util" not in names and "moe_rl_moe_cv" in names


def test_export_never_raises(monkeypatch):
    import ray
    import ray.util.metrics
    ex = PrometheusExporter()
    ex.export(realistic_row(), [{"kind": "spike"}])   # no Ray connected here: a no-op
    assert not ex._gauges

    class Broken(_Fake):
        def set(self, value, tags):
            raise ValueError("Missing value for tag key(s): layer.")

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util.metrics, "Gauge", Broken)
    ex.export(realistic_row(), [])
    ex.export(realistic_row(), [])
    assert ex._warned
    ex.close()


def test_an_export_is_one_gauge_set_per_column_and_names_are_resolved_once(monkeypatch):
    """What keeps an export cheap (the module docstring's "Cost"): the first export resolves each
    column's family and tags and creates one real ray.util.metrics Gauge per family (recording into
    an unconnected process); every later one is a single Gauge.set per numeric column, resolving
    nothing. ~100 columns. The time per export is printed, not asserted: a wall-clock bound fails on
    a slower or busier machine, and no bench/ script measures it."""
    import ray
    import ray.util.metrics
    made, sets, resolved = [], [], []

    class CountingGauge(ray.util.metrics.Gauge):
        def __init__(self, name, *args, **kwargs):
            super().__init__(name, *args, **kwargs)
            made.append(name)

        def set(self, value, tags=None):
            sets.append(self)
            super().set(value, tags)

    def counting_names(key):
        resolved.append(key)
        return metric_name_and_tags(key)

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray.util.metrics, "Gauge", CountingGauge)
    monkeypatch.setattr(prometheus, "metric_name_and_tags", counting_names)
    row = realistic_row(num_layers=2, num_experts=4)
    numeric = [k for k, v in row.items() if isinstance(v, (int, float))]
    assert 90 <= len(numeric) <= 130, len(numeric)
    ex = PrometheusExporter(run="cost", refresh_s=3600)
    ex.export(row, [])                                     # the first call creates the gauges
    families = set(exported_families(row)) - {prometheus.SYNC_DECISIONS, prometheus.ALERTS}
    assert sorted(made) == sorted(families)
    assert len(sets) == len(numeric)
    made.clear(), sets.clear(), resolved.clear()
    times = []
    for _ in range(200):
        t = time.perf_counter()
        ex.export(row, [{"kind": "spike"}])
        times.append(time.perf_counter() - t)
    ex.close()
    assert made == [] and resolved == [] and len(sets) == 200 * len(numeric)
    print(f"export of {len(row)} columns: median {statistics.median(times) * 1e3:.3f} ms")


# --- a real Ray head ------------------------------------------------------------------------------
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DRIVER = r"""
import json, statistics, sys, time
import ray
from moe_rl.algo.prometheus import PrometheusExporter
from tests.test_prometheus import realistic_row
ray.init(address=sys.argv[1], log_to_driver=False)
ex = PrometheusExporter(run="e2e")
row = realistic_row()
ex.export({**row, "episode_return_mean": 1.0}, [{"kind": "spike"}])
ex.export(row, [{"kind": "spike"}, {"kind": "breach"}])
times = []
for _ in range(50):
    t = time.perf_counter()
    ex.export(row, [])
    times.append(time.perf_counter() - t)
print("EXPORTED", json.dumps({"median_s": statistics.median(times), "columns": len(row)}), flush=True)
time.sleep(600)
"""


def _scrape(port):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return ""


def _samples(text, name):
    """{frozenset(labels): value} of one served metric."""
    out = {}
    for m in re.finditer(r"^" + name + r"\{([^}]*)\} (\S+)$", text, re.M):
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        out[labels] = float(m.group(2))
    return out


@pytest.mark.slow
def test_a_real_ray_head_serves_the_exported_metrics():
    """`ray start --head --block` on loopback (its own temp dir and auth token; stopped by killing its
    process group, not `ray stop`, which would stop every Ray on the host), a driver that exports a
    row twice, and Ray's Prometheus endpoint polled until the metrics appear."""
    port, metrics_port, dash_port = _free_port(), _free_port(), _free_port()
    temp_dir = tempfile.mkdtemp(prefix="moerl-prom-", dir="/tmp")   # short: Ray's socket paths
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_metrics_report_interval_ms": "1000",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
    t0 = time.time()
    log = open(os.path.join(temp_dir, "head.log"), "w")
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", "--port", str(port),
                             "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
                             "--dashboard-port", str(dash_port), "--metrics-export-port", str(metrics_port),
                             "--num-cpus", "1", "--disable-usage-stats", "--temp-dir", temp_dir],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    driver = None
    try:
        while not _scrape(metrics_port):
            assert head.poll() is None and time.time() - t0 < 300, open(log.name).read()[-3000:]   # a hang guard
            time.sleep(1)
        driver = subprocess.Popen([sys.executable, "-c", DRIVER, f"127.0.0.1:{port}"], env=env, cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        line = ""
        while not line.startswith("EXPORTED"):
            line = driver.stdout.readline()
            assert line or driver.poll() is None, "driver exited"
        cost = json.loads(line.split(" ", 1)[1])
        # Printed, not asserted: a wall-clock bound fails on a slower or busier machine.
        print(f"connected export of {cost['columns']} columns: median {cost['median_s'] * 1e3:.3f} ms")
        t1 = time.time()
        while True:
            text = _scrape(metrics_port)
            ret = _samples(text, "ray_moe_rl_episode_return_mean")
            if any(dict(k).get("run") == "e2e" and v == 42.5 for k, v in ret.items()):
                break
            assert time.time() - t1 < 120, [l for l in text.splitlines() if "moe_rl" in l][:20]   # a hang guard
            time.sleep(1)
        print(f"served {time.time() - t1:.1f} s after the export ({time.time() - t0:.1f} s in all)")
        decisions = _samples(text, "ray_moe_rl_sync_decisions_total")
        assert {dict(k)["decision"]: v for k, v in decisions.items()} == {"hold": 52.0}
        alerts = _samples(text, "ray_moe_rl_alerts_total")
        assert {dict(k)["kind"]: v for k, v in alerts.items()} == {"spike": 2.0, "breach": 1.0}
        util = _samples(text, "ray_moe_rl_moe_util")
        assert {(dict(k)["layer"], dict(k)["expert"]) for k in util} == {(str(i), str(j)) for i in range(2)
                                                                         for j in range(4)}
        cv = {dict(k)["layer"] for k in _samples(text, "ray_moe_rl_moe_cv")}
        assert cv == {"", "0", "1"}
        assert {dict(k)["rank"] for k in _samples(text, "ray_moe_rl_learner_rss_mb")} == {"0", "1"}
        # The dashboard's metrics are all served.
        served = set(re.findall(r"^(ray_moe_rl_\w+)\{", text, re.M))
        wanted = {n for e in _exprs(_dashboard()) for n in re.findall(r"\b(ray_moe_rl_\w+)\s*\{", e)}
        assert wanted <= served, wanted - served
        # A gauge outlives Ray's gauge TTL (2 report intervals) between iterations.
        time.sleep(5)
        assert _samples(_scrape(metrics_port), "ray_moe_rl_episode_return_mean")
    finally:
        if driver is not None:
            driver.kill()
            driver.communicate(timeout=30)
        # SIGKILL: a SIGTERM makes the head drain for 30 s. Ray's processes share the group of
        # `ray start` (start_new_session); any that left it still name our private temp dir.
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(30)
        time.sleep(1)
        left = subprocess.run(["pgrep", "-f", temp_dir], capture_output=True, text=True).stdout.split()
        for pid in left:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        print("processes outside the group:", left)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_moe_ppo_exports_every_iteration_without_anomaly_detection(ray_local, tmp_path, monkeypatch):
    """The wiring: the monitoring callback builds the row once per iteration and exports it."""
    from moe_rl import MoEPPOConfig
    calls = []
    real = PrometheusExporter.export

    def spy(self, row, alerts=()):
        calls.append((self.run, dict(row), list(alerts)))
        return real(self, row, alerts)

    monkeypatch.setattr(PrometheusExporter, "export", spy)
    config = (MoEPPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=0, num_envs_per_env_runner=1)
              .training(train_batch_size_per_learner=128, minibatch_size=64, num_epochs=1)
              .moe(num_experts=4, top_k=2, d_model=16, d_ff=16)
              .consistency(sample_size=64, probe_size=32)
              .stability(anomaly_detection=False)
              .debugging(seed=0))
    algo = config.build_algo()
    algo.monitoring.run = "myrun"
    try:
        for _ in range(2):
            algo.train()
        assert algo.monitoring.prometheus._gauges          # a connected Ray: real gauges exist
    finally:
        algo.stop()
    assert [c[1]["iteration"] for c in calls] == [1, 2] and {c[0] for c in calls} == {"myrun"}
    row = calls[-1][1]
    assert "episode_return_mean" in row and "moe/layer0/cv" in row and "memory/rss_mb/driver" in row
    assert row["drift/decision"] in prometheus.DECISIONS
    assert all(c[2] == [] for c in calls)
    assert algo.monitoring.prometheus._stop.is_set()      # cleanup() stopped the refresher
