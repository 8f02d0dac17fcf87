"""The sync gate: what a consistency check saw -> causes -> actions (pure python).

Each check separates what it sees into causes, and each cause has its own action:

| cause              | what                                               | action                                 |
| mismatch           | rollout copy vs trainer at the *same* weights:     | report (the corrections act on it:     |
|                    | K3, max |d logp|, routing agreement (absolute)     | IS/RS/R3); never stalls training       |
| corrupt_copy       | a rollout actor's copy is not the bytes it was     | repair: re-send the synced weights and |
|                    | sent (digest mismatch)                             | verify; stop if a repair fails twice   |
| bad_update         | candidate weights non-finite, or update size /     | per consistency.policy: warn (sync and |
|                    | KL old->new / probe flips far above this run's     | record), hold, rollback; non-finite    |
|                    | own recent history                                 | weights always roll back               |
| replica_divergence | learners that hold the same tensor disagree        | resync: every learner takes the        |
|                    |                                                    | publishing learner's copy              |
| all_rejected       | the rollout correction kept no step of the update  | skip: the learners skipped every step  |
|                    | (every minibatch's loss mask empty)                | (counted); report, with the streak     |

Lag (learners ahead of the rollouts, e.g. during a hold) is reported as `lag_versions` and
`lag_k3`, never as mismatch. Update-sized signals are judged against the run's own history
(`RelativeLimit`: rolling median and MAD of the accepted values, after a warm-up), so a healthy
run never trips them; only hard faults (non-finite weights, corrupted copies) are absolute.
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

from moe_rl.core.correction import resolve_correction
from moe_rl.core.errors import ConfigError, need
from moe_rl.core.sections import ConsistencySettings, CorrectionSettings, defaults

POLICIES = ("warn", "hold", "rollback")
DECISIONS = ("sync", "warn", "hold", "rollback", "stop")
CAUSES = ("mismatch", "corrupt_copy", "bad_update", "replica_divergence", "all_rejected")

# Same-weights mismatch: absolute limits (metric -> ("max" | "min", default)). An fp32 copy sits
# near 1e-6 on all of them; a bf16 copy of the quickstart measured K3 <= 4.1e-4, agreement >= 0.97
# and a max |dlogp| of 0.02-0.54 over 512 sampled steps (heavy-tailed: rare actions of a confident
# policy), so |dlogp| is limited at 1.0, a factor e in one step's probability.
MISMATCH_LIMITS = {
    "k3": ("max", 1e-3),
    "max_abs_logp_diff": ("max", 1.0),
    "routing_agreement": ("min", 0.95),
    # A Q-policy (moe_rl.core.drift_kinds): the rollout copy acts greedily on its Q-values, so a
    # flipped greedy action is the mismatch that changes behaviour; the gap is over the Q scale.
    "greedy_agreement": ("min", 0.98),
    "q_gap_max_rel": ("max", 0.05),
    # A Soft MoE layer: the total variation between the rollout's and the trainer's combine shares.
    "combine_tv_max": ("max", 0.05),
}
# Update-sized signals, judged relative to the run's history. A candidate L updates ahead of the
# last good weights (a hold) is compared with the limit x L^exponent: an update size adds up at
# most linearly over L updates, a KL about quadratically.
UPDATE_SIGNALS = {"update_size": 1, "k3_old_new": 2, "probe_flip_rate": 1, "q_change": 1}
# The smallest scale each relative limit uses (the limit is at least median + z x floor): a history
# of near-identical values must not make the next ordinary one a breach. A PPO update moves the
# policy by a KL of ~0.01 and the weights by a few percent; a harmful one by orders of magnitude
# (one optimizer step at LR x 1000: KL 175 under PPO, 525 under APPO). The KL's tail is long once a
# policy sharpens, so its floor is 0.1 (a limit of at least median + 0.8): healthy quickstart
# updates reached 0.21 over a median of 0.005, and three healthy MoE-APPO CartPole runs checked at
# every update (630 checks) reached 0.32 over medians of 0.001-0.005, twice above the limit a
# 0.03 floor gave. LR x 100 for one step moves the KL only to 0.08; update_size catches that one.
SIGNAL_FLOORS = {"update_size": 0.01, "k3_old_new": 0.1, "probe_flip_rate": 0.05, "q_change": 0.1}

CONSISTENCY_DEFAULTS: Dict[str, Any] = defaults(ConsistencySettings)   # moe_rl.core.sections
ABSOLUTE_KEYS = tuple(MISMATCH_LIMITS) + tuple(UPDATE_SIGNALS)
RATES = ("routing_agreement", "probe_flip_rate", "greedy_agreement", "combine_tv_max")   # in [0, 1]


def validate_consistency(c: Mapping[str, Any]) -> ConsistencySettings:
    """Defaults merged in and every `consistency.*` field checked; returns it typed (a typed one
    was checked when it was made)."""
    if isinstance(c, ConsistencySettings):
        return c
    unknown = sorted(set(c) - set(CONSISTENCY_DEFAULTS))
    if unknown:
        raise ConfigError(f"consistency.{unknown[0]}: unknown key, allowed: {', '.join(sorted(CONSISTENCY_DEFAULTS))}")
    c = {**CONSISTENCY_DEFAULTS, **c}

    def num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    def whole(v, low):
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    need(isinstance(c["enabled"], bool), "consistency.enabled", "true or false", c["enabled"])
    need(whole(c["every"], 1), "consistency.every", "an int >= 1", c["every"])
    need(c["policy"] in POLICIES, "consistency.policy", f"one of {POLICIES}", c["policy"])
    need(isinstance(c["thresholds"], dict), "consistency.thresholds", "a mapping", c["thresholds"])
    for k, v in c["thresholds"].items():
        need(k in ABSOLUTE_KEYS, f"consistency.thresholds.{k}", f"one of {sorted(ABSOLUTE_KEYS)}", k)
        ok = num(v) and v >= 0 and (v <= 1 if k in RATES else True)
        need(ok, f"consistency.thresholds.{k}", "a finite number >= 0 (<= 1 for rates and agreements)", v)
    need(num(c["relative_z"]) and c["relative_z"] > 0, "consistency.relative_z", "a number > 0", c["relative_z"])
    need(whole(c["relative_warmup"], 1), "consistency.relative_warmup", "an int >= 1", c["relative_warmup"])
    need(whole(c["relative_window"], 2), "consistency.relative_window", "an int >= 2", c["relative_window"])
    need(num(c["flip_margin"]) and c["flip_margin"] >= 0, "consistency.flip_margin", "a number >= 0",
         c["flip_margin"])
    for f in ("max_holds", "max_rollbacks"):
        need(whole(c[f], 1), f"consistency.{f}", "an int >= 1", c[f])
    need(num(c["rollback_lr_scale"]) and 0 < c["rollback_lr_scale"] <= 1, "consistency.rollback_lr_scale",
         "a number in (0, 1]", c["rollback_lr_scale"])
    for f in ("sample_size", "probe_size"):
        need(whole(c[f], 1), f"consistency.{f}", "an int >= 1", c[f])
    need(num(c["param_sample"]) and 0 < c["param_sample"] <= 1, "consistency.param_sample", "a number in (0, 1]",
         c["param_sample"])
    bins = c["position_bins"]
    need(isinstance(bins, (list, tuple)) and bins and all(whole(b, 1) for b in bins) and list(bins) == sorted(bins),
         "consistency.position_bins", "an ascending list of ints >= 1", bins)
    need(isinstance(c["correction"], (dict, CorrectionSettings)), "consistency.correction", "a mapping",
         c["correction"])
    c["correction"] = resolve_correction(c["correction"])
    return ConsistencySettings(**c)


def mismatch_limits(overrides: Optional[dict] = None) -> Dict[str, Tuple[str, float]]:
    out = dict(MISMATCH_LIMITS)
    for k, v in (overrides or {}).items():
        if k in out:
            out[k] = (out[k][0], float(v))
    return out


def breaches(metrics: Dict[str, float], limits: Dict[str, Tuple[str, float]]) -> List[Tuple[str, float, float]]:
    """[(metric, value, threshold)] for every metric present and outside its limit."""
    out = []
    for k, (kind, thr) in limits.items():
        v = metrics.get(k)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            continue
        if (kind == "max" and v > thr) or (kind == "min" and v < thr):
            out.append((k, float(v), thr))
    return out


class RelativeLimit:
    """A limit from the run's own history: median + z * max(1.4826 MAD, 0.5 |median|, floor) of the
    last `window` accepted values; None during the first `warmup` values. Only accepted (passing)
    values enter the history, so a fault never raises its own bar."""

    MEDIAN_SHARE = 0.5   # the scale is at least half the median: a steady history is no hair trigger

    def __init__(self, z: float, warmup: int, window: int, floor: float = 1e-12):
        self.z, self.warmup, self.floor = z, warmup, floor
        self.values: Deque[float] = deque(maxlen=window)

    def limit(self) -> Optional[float]:
        if len(self.values) < self.warmup:
            return None
        med = statistics.median(self.values)
        mad = statistics.median(abs(x - med) for x in self.values)
        return med + self.z * max(1.4826 * mad, self.MEDIAN_SHARE * abs(med), self.floor)

    def accept(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(float(value))


@dataclass
class Verdict:
    decision: str                       # sync | warn | hold | rollback | stop
    causes: List[str] = field(default_factory=list)
    actions: List[str] = field(default_factory=list)
    reasons: List[str] = field(default_factory=list)   # one line per cause: metric, value, threshold
    lr_scale: float = 1.0               # for the next update (a rollback's retry runs slower)
    reason: str = ""                    # the reasons, one line
    headlines: Dict[str, str] = field(default_factory=dict)   # cause -> its worst breach (the log line)
    lag: int = 0                        # updates the judged candidate was past the synced weights
    figures: Dict[str, Any] = field(default_factory=dict)     # the check's headline figures (metrics.parquet)

    def __post_init__(self):
        self.reason = "; ".join(self.reasons)


class GateState:
    """Counters and the relative limits of one run (checkpointed with the run)."""

    def __init__(self, settings: ConsistencySettings):
        self.s = settings
        self.absolute = {k: float(v) for k, v in settings.thresholds.items() if k in UPDATE_SIGNALS}
        self.limits: Dict[str, RelativeLimit] = {}
        self.holds_in_a_row = 0
        self.rollbacks_in_a_row = 0
        # Rollbacks not yet forgiven: a rollback is forgiven only after max_rollbacks passing
        # checks in a row, so rollback, pass, rollback, pass, ... (the slower retry passes, the
        # next full-LR update fails again) also reaches the stop.
        self.rollbacks_recent = 0
        self.passes_in_a_row = 0
        self.counts = {"holds": 0, "rollbacks": 0, "mismatch_reports": 0, "all_rejected": 0}

    def _limit(self, key: str) -> RelativeLimit:
        if key not in self.limits:
            self.limits[key] = RelativeLimit(self.s.relative_z, self.s.relative_warmup, self.s.relative_window,
                                             SIGNAL_FLOORS[self.signal(key)])
        return self.limits[key]

    @staticmethod
    def signal(key: str) -> Optional[str]:
        """The update signal a row key measures ("module|update_size/router" -> "update_size")."""
        base = key.rsplit("|", 1)[-1].split("/", 1)[0]
        return base if base in UPDATE_SIGNALS else None

    def update_breaches(self, row: Dict[str, Any], lag: int) -> List[Tuple[str, float, float]]:
        """Update-sized signals of a candidate `lag` updates past the last good weights that are
        above this run's own limits (or an absolute cap, when one is set)."""
        out = []
        for key, value in row.items():
            sig = self.signal(key)
            if sig is None or not isinstance(value, (int, float)) or not math.isfinite(value):
                continue
            scale = max(lag, 1) ** UPDATE_SIGNALS[sig]   # absolute caps are per update too
            limit = self._limit(key).limit()
            if limit is not None and value > limit * scale:
                out.append((key, float(value), limit * scale))
            elif sig in self.absolute and value > self.absolute[sig] * scale:
                out.append((key, float(value), self.absolute[sig] * scale))
        return out

    def accept(self, row: Dict[str, Any], lag: int, breached: Sequence[str] = ()) -> None:
        """A candidate passed: its per-update values join the history, except those that breached
        (synced under `warn`): a run's bad updates never raise their own bar."""
        for key, value in row.items():
            sig = self.signal(key)
            if sig is not None and isinstance(value, (int, float)) and key not in breached:
                self._limit(key).accept(value / max(lag, 1) ** UPDATE_SIGNALS[sig])

    def decide(self, *, finite: bool, bad_update: List[Tuple[str, float, float]],
               mismatch: List[Tuple[str, float, float]], corrupt: List[str], replicas: List[str],
               all_rejected: Sequence[str] = ()) -> Verdict:
        """all_rejected: one line per module whose update the rollout correction emptied (the
        learners skipped it; its weights did not move, so nothing else changes)."""
        policy = self.s.policy
        v = Verdict("sync")
        heads = v.headlines
        if mismatch:
            v.causes.append("mismatch")
            v.actions.append("report")
            v.reasons.append("mismatch " + _fmt(mismatch))
            heads["mismatch"] = _fmt([_worst(mismatch)])
            self.counts["mismatch_reports"] += 1
        if corrupt:
            v.causes.append("corrupt_copy")
            v.actions.append("repair")
            v.reasons.append("corrupt rollout copy: " + "; ".join(corrupt[:3]))
            heads["corrupt_copy"] = corrupt[0]
        if replicas:
            v.causes.append("replica_divergence")
            v.actions.append("resync")
            v.reasons.append("replica divergence: " + "; ".join(replicas[:3]))
            heads["replica_divergence"] = replicas[0]
        if all_rejected:
            v.causes.append("all_rejected")
            v.actions.append("skip")
            v.reasons.append("all rejected: " + "; ".join(all_rejected[:3]))
            heads["all_rejected"] = all_rejected[0]
            self.counts["all_rejected"] += 1
        if not finite or bad_update:
            v.causes.append("bad_update")
            v.reasons.append("bad update " + ("candidate weights are not finite" if not finite else _fmt(bad_update)))
            heads["bad_update"] = "candidate weights are not finite" if not finite else _fmt([_worst(bad_update)]) + (
                f" (+{len(bad_update) - 1} more)" if len(bad_update) > 1 else "")
            if not finite:
                v.decision = "rollback"             # nothing can train on from NaN weights
            elif policy == "warn":
                v.decision = "warn"
            elif policy == "hold" and self.holds_in_a_row < self.s.max_holds:
                v.decision = "hold"
            else:
                v.decision = "rollback"             # policy rollback, or a hold that did not clear
            if v.decision == "rollback" and self.rollbacks_recent >= self.s.max_rollbacks:
                v.decision = "stop"
            v.actions.append(v.decision)
        # Streaks end only at a candidate that passes: hold, hold, rollback, hold, ... counts the
        # rollbacks since the last good sync, so a run that keeps producing bad updates stops.
        passed = v.decision in ("sync", "warn")
        self.holds_in_a_row = self.holds_in_a_row + 1 if v.decision == "hold" else 0
        self.rollbacks_in_a_row = 0 if passed else self.rollbacks_in_a_row + (v.decision == "rollback")
        self.passes_in_a_row = self.passes_in_a_row + 1 if passed else 0
        self.rollbacks_recent += v.decision == "rollback"
        if self.passes_in_a_row >= self.s.max_rollbacks:
            self.rollbacks_recent = 0
        for d in ("hold", "rollback"):
            self.counts[d + "s"] += v.decision == d
        v.lr_scale = self.s.rollback_lr_scale ** self.rollbacks_in_a_row
        v.reason = "; ".join(v.reasons)
        return v

    def judge(self, rows: Dict[str, Dict[str, Any]], lag: int, finite: bool, corrupt: List[str],
              replicas: List[str], limits: Dict[str, Tuple[str, float]]) -> Verdict:
        """One check's decision from its figures (per module, the consistency actor's rows): mismatch
        at the same weights (absolute `limits`), bad updates (the run's own history of update-sized
        signals, judged per update: the candidate is `lag + 1` updates past the last good weights,
        lag being how far the learners were ahead before this update), hard faults. Each row gets
        the decision's columns; a passing candidate's signals join the history."""
        named = lambda mid, k: k if len(rows) == 1 else f"{mid}/{k}"   # noqa: E731
        # A corrupt copy sampled this batch: its drift is that cause's, not mismatch.
        mismatch = [] if corrupt else [(named(mid, k), v, t) for mid, row in rows.items()
                                       for k, v, t in breaches(row, limits)]
        signals, held, emptied = {}, {}, []
        for mid, row in sorted(rows.items()):
            empty = bool(row.pop("correction_emptied", False))
            streak = row.pop("correction_in_a_row", 1)
            if empty:
                emptied.append(f"{mid}: the rollout correction kept no step of the update "
                               f"({row['correction_skipped_steps']} steps skipped; {streak} updates in a row)")
            for k, v in row.items():
                if self.signal(k):   # an emptied update's figures are no history (below)
                    (held if empty else signals)[f"{mid}|{k}"] = v
        found = self.update_breaches(signals, lag + 1)
        if lag > 0:   # an emptied update applied nothing, but the held updates before it still differ
            found += self.update_breaches(held, lag)
        bad = [(k.split("|", 1)[1] if len(rows) == 1 else k.replace("|", "/"), v, t) for k, v, t in found]
        verdict = self.decide(finite=finite, bad_update=bad, mismatch=mismatch, corrupt=corrupt, replicas=replicas,
                              all_rejected=emptied)
        if verdict.decision in ("sync", "warn"):
            self.accept(signals, lag + 1, {k for k, _, _ in found})
        verdict.lag = lag + 1
        for row in rows.values():
            row.update({"decision": verdict.decision, "cause": ";".join(verdict.causes),
                        "action": ";".join(verdict.actions), "reason": verdict.reason,
                        "param_breach_lines": "\n".join(corrupt + replicas), "holds_in_a_row": self.holds_in_a_row,
                        "rollbacks_in_a_row": self.rollbacks_in_a_row, "lr_scale_next": verdict.lr_scale})
        return verdict

    def get_state(self) -> Dict[str, Any]:
        return {"limits": {k: list(l.values) for k, l in self.limits.items()}, "holds_in_a_row": self.holds_in_a_row,
                "rollbacks_in_a_row": self.rollbacks_in_a_row, "rollbacks_recent": self.rollbacks_recent,
                "passes_in_a_row": self.passes_in_a_row, "counts": dict(self.counts)}

    def set_state(self, state: Dict[str, Any]) -> None:
        for k, values in state.get("limits", {}).items():
            for x in values:
                self._limit(k).accept(x)
        self.holds_in_a_row = int(state.get("holds_in_a_row", 0))
        self.rollbacks_in_a_row = int(state.get("rollbacks_in_a_row", 0))
        self.rollbacks_recent = int(state.get("rollbacks_recent", self.rollbacks_in_a_row))
        self.passes_in_a_row = int(state.get("passes_in_a_row", 0))
        self.counts.update({k: int(v) for k, v in state.get("counts", {}).items() if k in self.counts})


def _worst(found: List[Tuple[str, float, float]]) -> Tuple[str, float, float]:
    """The breach furthest past its threshold (by ratio; an agreement below its floor counts too)."""
    return max(found, key=lambda b: b[1] / b[2] if b[1] > b[2] and b[2] > 0 else (b[2] / max(b[1], 1e-12)))


def _fmt(found: List[Tuple[str, float, float]]) -> str:
    return ", ".join(f"{k}={v:.4g} (threshold={t:.4g})" for k, v, t in found)
