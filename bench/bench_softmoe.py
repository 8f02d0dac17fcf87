"""Parameter scaling in MoE-DQN on MinAtar, pre-registered: BENCHMARKS.md, "Does Soft MoE's return
rise with its experts in DQN?" (the hypothesis and the analysis are fixed there).

    .venv/bin/python bench/bench_softmoe.py --games breakout,space_invaders --seeds 0-2   # resumable
    .venv/bin/python bench/bench_softmoe.py --report                                      # tables and plots
    .venv/bin/python bench/bench_softmoe.py --at-init --arms dense,soft8,soft8_ref        # each arm untrained

Every arm is configs/dqn_minatar.yaml with the overrides below: the same encoder, DQN and budget;
only the penultimate layer differs (its parameters, beside the arm's name).
  dense       one token (the flattened feature map), a dense layer of width 64
  dense_wide  one token, the dense layer widened to 512 (the parameters of soft8's experts)
  single      one scaled expert (width 512) over the 49 position tokens, 8 slots: Sokar et al.'s
              control (tokenizing without experts)
  soft4       Soft MoE over the 49 tokens, 4 experts of width 64, one slot each
  soft8       Soft MoE over the 49 tokens, 8 experts of width 64, one slot each
Outside the registration (run only when named in --arms; BENCHMARKS.md says why): the Soft MoE as
Obando-Ceron et al.'s code (google/dopamine labs/moes) sets it up, where the registered arms differ:
raw slot logits (no l2 normalisation), ceil(49 / experts) slots an expert, and the tokens flattened
(concatenated) into the Q head instead of mean-pooled.
  soft4_ref   soft4 with those three: 13 slots an expert
  soft8_ref   soft8 with those three: 7 slots an expert
Per run, per iteration: env steps, the mean training return of the episodes that ended, the
dormant fraction (ReLU units), wall seconds. One JSON per (game, arm, seed); a run cut off keeps its
curve in .partial and starts again from the beginning (resume a run directory with moe-rl instead).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_minigrid import _write_json, missing_runs  # noqa: E402

ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results", "softmoe")
GAMES = {"breakout": "MinAtar/Breakout-v1", "space_invaders": "MinAtar/SpaceInvaders-v1"}
ARMS = {
    "dense": ["moe.mixture=dense", "moe.tokens=one", "moe.d_ff=64"],
    "dense_wide": ["moe.mixture=dense", "moe.tokens=one", "moe.d_ff=512"],
    "single": ["moe.num_experts=1", "moe.slots_per_expert=8", "moe.d_ff=512"],
    "soft4": ["moe.num_experts=4"],
    "soft8": ["moe.num_experts=8"],
}
REGISTERED = tuple(ARMS)
REFERENCE = ["moe.soft_normalize=false", "moe.token_pool=flatten"]
ARMS.update({"soft4_ref": ["moe.num_experts=4", "moe.slots_per_expert=13", *REFERENCE],
             "soft8_ref": ["moe.num_experts=8", "moe.slots_per_expert=7", *REFERENCE]})
BUDGET = 150_000          # env steps a run (BENCHMARKS.md: why this many)
FINAL_SHARE = 0.2         # the final return: the last 20 % of the budget's iterations
PLOT_BIN = 5_000          # env steps a point of the plotted curves
T_95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31}


def config_of(game: str, arm: str, seed: int):
    from moe_rl.app.run_config import apply_overrides, load_run_config, validate_run_config
    cfg = apply_overrides(load_run_config(os.path.join(ROOT, "configs", "dqn_minatar.yaml")),
                          [f"env={GAMES[game]}", f"seed={seed}", *ARMS[arm]])
    return cfg, validate_run_config(cfg)


def run_one(game: str, arm: str, seed: int, out: str, budget: int) -> None:
    import ray
    import torch

    from moe_rl.algo.results import metrics_row
    from moe_rl.app.train import start_local_ray

    torch.set_num_threads(1)
    cfg, config = config_of(game, arm, seed)
    start_local_ray(num_cpus=2)
    start = time.time()
    try:
        algo = config.build_algo()
        params = sum(p.numel() for n, p in algo.get_module().named_parameters() if "_target" not in n)
        curve = []
        while not curve or curve[-1]["env_steps"] < budget:
            row = metrics_row(algo.train())
            curve.append({"time_s": time.time() - start, "env_steps": row["env_steps_total"],
                          "return": row["episode_return_mean"], "episodes": row["episodes"],
                          "dormant": row.get("moe/dormant", math.nan), "health": row.get("moe/health_level"),
                          "qf_loss": row.get("qf_loss", math.nan)})
            _write_json(out + ".partial", {"game": game, "arm": arm, "seed": seed, "curve": curve})
            print(f"{game} {arm} seed {seed}: steps {curve[-1]['env_steps']} return {curve[-1]['return']:.2f} "
                  f"{curve[-1]['time_s']:.0f}s", flush=True)
        algo.stop()
    finally:
        ray.shutdown()
    _write_json(out, {"game": game, "arm": arm, "seed": seed, "budget": budget, "overrides": ARMS[arm],
                      "parameters": params, "train_s": time.time() - start, "curve": curve,
                      "command": " ".join(sys.argv)})
    if os.path.exists(out + ".partial"):
        os.unlink(out + ".partial")


# --- the pre-registered analysis -------------------------------------------------------------------
def final_return(run: dict) -> float:
    """The mean of the per-iteration training returns (episode-weighted) over the last FINAL_SHARE
    of the budget."""
    points = [c for c in _last_share(run) if c["episodes"] and c["return"] == c["return"]]
    weight = sum(c["episodes"] for c in points)
    return sum(c["return"] * c["episodes"] for c in points) / weight if weight else math.nan


def final_dormant(run: dict) -> float:
    values = [c["dormant"] for c in _last_share(run) if c["dormant"] == c["dormant"]]
    return statistics.fmean(values) if values else math.nan


def _last_share(run: dict) -> list:
    return [c for c in run["curve"] if c["env_steps"] > run["budget"] * (1 - FINAL_SHARE)]


def mean_ci(values):
    values = [v for v in values if v == v]
    if len(values) < 2:
        return (values[0] if values else math.nan), math.nan
    return statistics.fmean(values), T_95.get(len(values) - 1, 1.96) * statistics.stdev(values) / math.sqrt(len(values))


def contrast_ci(plus, minus):
    """sum(mean(plus)) - sum(mean(minus)) over independent arms, with a Welch 95 % CI (Satterthwaite's
    degrees of freedom; plus and minus: lists of per-seed value lists)."""
    groups = [(g, 1) for g in plus] + [(g, -1) for g in minus]
    est = sum(sign * statistics.fmean(g) for g, sign in groups)
    terms = [statistics.variance(g) / len(g) for g, _ in groups]
    se2 = sum(terms)
    df = se2 ** 2 / sum(t ** 2 / (len(g) - 1) for t, (g, _) in zip(terms, groups)) if se2 > 0 else 1.0
    from scipy import stats  # scipy comes with minatar
    half = stats.t.ppf(0.975, df) * math.sqrt(se2)
    return est, est - half, est + half, df


# (name, arms added, arms subtracted): S1's contrasts, then the reference arms' (BENCHMARKS.md)
CONTRASTS = (("soft8 - soft4", ["soft8"], ["soft4"]),
             ("dense_wide - dense", ["dense_wide"], ["dense"]),
             ("(soft8 - soft4) - (dense_wide - dense)", ["soft8", "dense"], ["soft4", "dense_wide"]),
             ("soft8 - single", ["soft8"], ["single"]),
             ("soft8_ref - soft4_ref", ["soft8_ref"], ["soft4_ref"]),
             ("(soft8_ref - soft4_ref) - (dense_wide - dense)", ["soft8_ref", "dense"], ["soft4_ref", "dense_wide"]),
             ("soft8_ref - soft8", ["soft8_ref"], ["soft8"]),
             ("soft8_ref - dense", ["soft8_ref"], ["dense"]))


def load(results: str) -> dict:
    """results: a folder of run JSONs, or several, comma-separated (S1's and the reference arms')."""
    runs: dict = {}
    for folder in results.split(","):
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if name.endswith(".json"):
                with open(os.path.join(folder, name)) as f:
                    r = json.load(f)
                runs.setdefault(r["game"], {}).setdefault(r["arm"], []).append(r)
    return runs


def binned_curve(runs: list, key: str) -> list:
    """An arm's curve for the plots: per PLOT_BIN env steps, each run's value (the return weighted
    by the episodes that ended) averaged over the runs; a bin some run lacks is left out."""
    per_bin: dict = {}
    for r in runs:
        bins: dict = {}
        for c in r["curve"]:
            weight = c["episodes"] if key == "return" else 1
            if weight and c[key] == c[key]:
                total = bins.setdefault(c["env_steps"] // PLOT_BIN, [0.0, 0])
                total[0] += c[key] * weight
                total[1] += weight
        for b, (value, weight) in bins.items():
            per_bin.setdefault(b, []).append(value / weight)
    return [((b + 1) * PLOT_BIN, statistics.fmean(v)) for b, v in sorted(per_bin.items()) if len(v) == len(runs)]


def plot(results: str, game: str, arms: dict) -> list:
    """Two figures a game under bench/figures (return and dormant fraction against env steps, each
    arm averaged over its seeds); -> their paths."""
    from moe_rl.app.plots import xy_plot_svg
    name = "+".join(os.path.basename(os.path.normpath(f)) for f in results.split(","))
    paths = []
    for key, label in (("return", "training return"), ("dormant", "dormant fraction (tau 0.025)")):
        series = {f"{arm} ({len(arms[arm])} seed{'s' if len(arms[arm]) > 1 else ''})": binned_curve(arms[arm], key)
                  for arm in ARMS if arm in arms}
        path = os.path.join(HERE, "figures", f"{name}_{game}_{key}.svg")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(xy_plot_svg(series, f"MinAtar {game}, MoE-DQN: {label}, mean over seeds per {PLOT_BIN} steps",
                                "env steps", key, width=720, height=360))
        paths.append(os.path.relpath(path, ROOT))
    return paths


def report(results: str) -> str:
    runs = load(results)
    lines = []
    for game, arms in runs.items():
        lines += [f"\n{game} (final return: mean over the last {int(FINAL_SHARE * 100)} % of {BUDGET} env steps)",
                  "| arm | parameters | seeds | final return (mean ± 95 % CI) | per seed | dormant, last 20 % |",
                  "|---|---|---|---|---|---|"]
        finals = {arm: [final_return(r) for r in rs] for arm, rs in arms.items()}
        for arm in ARMS:
            if arm not in arms:
                continue
            m, h = mean_ci(finals[arm])
            dormant, _ = mean_ci([final_dormant(r) for r in arms[arm]])
            lines.append(f"| {arm} | {arms[arm][0]['parameters']} | {len(arms[arm])} | {m:.2f} ± {h:.2f} | "
                         + ", ".join(f"{v:.2f}" for v in finals[arm]) + f" | {dormant:.3f} |")
        for name, plus, minus in CONTRASTS:
            if all(a in finals and len(finals[a]) > 1 for a in plus + minus):
                est, lo, hi, df = contrast_ci([finals[a] for a in plus], [finals[a] for a in minus])
                lines.append(f"\n{name}: {est:+.3f} (Welch 95 % CI [{lo:+.3f}, {hi:+.3f}], {df:.1f} df)")
        lines.append("\nCurves: " + ", ".join(plot(results, game, arms)))
    return "\n".join(lines)


def at_init(game: str, arms: list, steps: int = 2048) -> str:
    """Each arm's Q-network as built (seed 0, no update) on observations of random play: the dormant
    fraction, how evenly a slot mixes the tokens (dispatch entropy over its maximum), and how far
    the Q-values move when the encoder's positions are shuffled (0 up to rounding: the network
    cannot tell where a feature is)."""
    import gymnasium as gym
    import numpy as np
    import torch
    from ray.rllib.core.columns import Columns

    import envs  # noqa: F401  (registers MinAtar's games)
    from moe_rl.app.checkpoint import policy_module_spec
    from moe_rl.core.plasticity import trunk_dormancy

    env, seen = gym.make(GAMES[game]), []
    obs, _ = env.reset(seed=0)
    env.action_space.seed(0)   # the random play too: the same observations every time
    for _ in range(steps):
        seen.append(obs)
        obs, _, done, cut, _ = env.step(env.action_space.sample())
        if done or cut:
            obs, _ = env.reset()
    batch = {Columns.OBS: torch.as_tensor(np.stack(seen))}
    lines = [f"{game}, {steps} observations of random play, seed 0, no update",
             "| arm | dormant | dispatch entropy / max | max dQ / mean Q, positions shuffled |", "|---|---|---|---|"]
    for arm in arms:
        torch.manual_seed(0)
        cfg = config_of(game, arm, 0)[0]
        spec = policy_module_spec(cfg, cfg["moe"])   # the module a run of this arm trains
        spec.observation_space, spec.action_space = env.observation_space, env.action_space
        module = spec.build()
        trunk = module.trunk
        dormant = trunk_dormancy(trunk, lambda: module.forward_inference(batch))["dormant"]
        with torch.no_grad():
            records = trunk(batch[Columns.OBS])[1]   # one per Soft MoE layer; none for mixture dense
        entropy = f"{statistics.fmean(float(r.dispatch_entropy_norm()) for r in records):.3f}" if records else "-"
        moved = "one token"
        if trunk.encoder.tokens:
            shuffle = torch.randperm(trunk.encoder.num_tokens)
            with torch.no_grad():
                q = module.forward_inference(batch)["moe_q"]
                handle = trunk.encoder.cnn.register_forward_hook(lambda mod, args, out: out[:, shuffle])
                shuffled = module.forward_inference(batch)["moe_q"]
                handle.remove()
            moved = f"{float((shuffled - q).abs().max() / q.abs().mean()):.2g}"
        lines.append(f"| {arm} | {dormant:.3f} | {entropy} | {moved} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--games", default=",".join(GAMES))
    p.add_argument("--arms", default=",".join(REGISTERED), help=f"of {tuple(ARMS)}")
    p.add_argument("--seeds", default="0-2")
    p.add_argument("--budget", type=int, default=BUDGET)
    p.add_argument("--results", default=RESULTS)
    p.add_argument("--report", action="store_true")
    p.add_argument("--at-init", action="store_true", help="each arm untrained (no runs): what it can see")
    args = p.parse_args()
    if args.report:
        print(report(args.results))
        return
    if args.at_init:
        print("\n\n".join(at_init(game, args.arms.split(",")) for game in args.games.split(",")))
        return
    for game in args.games.split(","):
        if game not in GAMES:
            raise SystemExit(f"--games: each one of {tuple(GAMES)}, got {game!r}")
    os.makedirs(args.results, exist_ok=True)
    for game in args.games.split(","):
        for arm, seed, out in missing_runs(args.seeds, args.arms, ARMS,
                                           lambda a, s: os.path.join(args.results, f"{game}-{a}-seed{s}.json")):
            run_one(game, arm, seed, out, args.budget)


if __name__ == "__main__":
    main()
