"""The drift study on a trained token policy, every mismatch source.

    .venv/bin/moe-rl train --config configs/tokens_long.yaml --output RUN_DIR      # ~2.5 min here
    .venv/bin/python bench/bench_drift_trained.py --checkpoint RUN_DIR --output OUT
        [--sources none,bf16,deepspeed,capacity,second_expert] [--lengths 64,...,1024] [--seeds 0,1,2]

Per source, `moe-rl drift-study --checkpoint RUN_DIR` (OUT/<source>/; a source whose
drift_study.parquet is there already is read, not re-run). Then one table (mean ± std over seeds of
K3 and routing agreement, the worst max |Δ log-prob|, the policy's return) and two plots over every
source: OUT/drift_trained_k3.svg and OUT/drift_trained_agreement.svg.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from moe_rl.app.drift_study import K3_FLOOR  # noqa: E402
from moe_rl.app.plots import line_plot_svg  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--sources", default="none,bf16,deepspeed,capacity,second_expert")
    ap.add_argument("--lengths", default="64,128,256,512,1024")
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    k3, agreement = {}, {}
    print("| source | sequence length | K3 (mean ± std) | routing agreement (mean ± std) | max abs Δ log-prob "
          "| return |")
    print("|---|---|---|---|---|---|")
    for source in args.sources.split(","):
        out = os.path.join(args.output, source)
        if not os.path.isfile(os.path.join(out, "drift_study.parquet")):
            subprocess.run([os.path.join(os.path.dirname(sys.executable), "moe-rl"), "drift-study", "--checkpoint",
                            args.checkpoint, "--source", source, "--lengths", args.lengths, "--seeds", args.seeds,
                            "--output", out], check=True, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
        rows = pq.read_table(os.path.join(out, "drift_study.parquet")).to_pylist()
        for L in sorted({r["seq_len"] for r in rows}):
            at = [r for r in rows if r["seq_len"] == L]
            ks, ag = np.array([r["k3"] for r in at]), np.array([r["routing_agreement"] for r in at])
            k3.setdefault(source, []).append((L, float(ks.mean())))
            agreement.setdefault(source, []).append((L, float(ag.mean())))
            print(f"| {source} | {L} | {ks.mean():.2e} ± {ks.std():.1e} | {ag.mean():.4f} ± {ag.std():.4f} | "
                  f"{max(r['max_abs_logp_diff'] for r in at):.1e} | {np.mean([r['episode_return'] for r in at]):.3f} |")
    with open(os.path.join(args.output, "drift_trained_k3.svg"), "w") as f:
        f.write(line_plot_svg(k3, "K3 by sequence length, trained token policy (mean of seeds)", "sequence length",
                              "K3", log_x=True, log_y_floor=K3_FLOOR))
    with open(os.path.join(args.output, "drift_trained_agreement.svg"), "w") as f:
        f.write(line_plot_svg(agreement, "Routing agreement by sequence length, trained token policy",
                              "sequence length", "routing agreement", log_x=True))


if __name__ == "__main__":
    main()
