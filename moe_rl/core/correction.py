"""Rollout correction: importance weights and rejection masks for training-inference mismatch
(pure torch). The design follows verl's rollout correction ("When Speed Kills Stability", Liu, Li
et al. 2025) and adds what only an MoE policy has: rejection by routing disagreement.

Per token t of sequence s, with log r_t = log pi_old(a_t) - log pi_rollout(a_t):

    IS   token      w_t = min(r_t, C)                       (truncated; detached)
         sequence   w_t = min(prod_{u in s} r_u, C)
         batch normalisation rescales the kept weights to mean 1
    RS   token      keep t  iff  L <= r_t <= U              (L defaults to 1/U)
         sequence   keep s  iff  L <= prod_{u in s} r_u <= U
         geometric  keep s  iff  L <= exp(mean_{u in s} log r_u) <= U
    veto            drop s  if any r_t < V (a catastrophic token, e.g. V = 1e-4)
    routing RS      drop t (or its sequence) when its top-k set differs between the rollout and
                    the trainer in any MoE layer (`any`) or in more than a share of layers (`share`)

Rejected tokens leave the loss *and its denominator* (a loss mask, not zero weights). Modes:
decoupled (three policies: rollout, old = the learner before the update, current; the PPO ratio is
taken against old and IS/RS correct rollout -> old) and bypass (rollout = old: no extra forward;
the PPO ratio against the rollout's log-probs already corrects, token-level RS only).
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple, Union

import torch

from moe_rl.core.errors import ConfigError, need
from moe_rl.core.routing import layer_disagreement
from moe_rl.core.sections import CorrectionSettings, defaults

SAFETY = 20.0   # log-ratio clamp before exp: weights stay finite whatever the mismatch
WIDE = 1e4       # |log| of any positive float64 is below 745
IS_LEVELS = (None, "token", "sequence")
RS_LEVELS = (None, "token", "sequence", "geometric")
ROUTING_RS = ("off", "any", "share")
MODES = ("decoupled", "bypass")

CORRECTION_DEFAULTS: Dict[str, Any] = defaults(CorrectionSettings)   # each key: moe_rl.core.sections
PRESETS: Dict[str, Dict[str, Any]] = {
    "off": {},
    "token_is": {"is_level": "token", "is_threshold": 2.0},                     # TIS
    "seq_is": {"is_level": "sequence", "is_threshold": 2.0},
    "token_is_rs": {"is_level": "token", "is_threshold": 2.0, "rs_level": "token", "rs_threshold": 2.0},
    "geo_rs": {"rs_level": "geometric", "rs_threshold": 1.01},
    "geo_rs_veto": {"rs_level": "geometric", "rs_threshold": 1.01, "veto_threshold": 1e-4},
    "token_is_veto": {"is_level": "token", "is_threshold": 2.0, "veto_threshold": 1e-4},
    "routing_rs": {"routing_rs": "any"},
    "bypass_rs": {"mode": "bypass", "rs_level": "token", "rs_threshold": 2.0},
}


def resolve_correction(d: Union[CorrectionSettings, Dict[str, Any], None]) -> CorrectionSettings:
    """consistency.correction with its preset applied under the explicit keys, validated and typed
    (a typed one was checked when it was made)."""
    if isinstance(d, CorrectionSettings):
        return d
    d = dict(d or {})
    unknown = sorted(set(d) - set(CORRECTION_DEFAULTS))
    if unknown:
        raise ConfigError(f"consistency.correction.{unknown[0]}: unknown key, allowed: "
                          f"{', '.join(sorted(CORRECTION_DEFAULTS))}")
    preset = d.get("preset", "off")
    need(preset in PRESETS, "consistency.correction.preset", f"one of {tuple(PRESETS)}", preset)
    s = {**CORRECTION_DEFAULTS, **PRESETS[preset], **d}
    f = "consistency.correction."

    def positive(k):
        v = s[k]
        need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0, f + k,
             "a finite number > 0", v)

    need(s["mode"] in MODES, f + "mode", f"one of {MODES}", s["mode"])
    need(s["is_level"] in IS_LEVELS, f + "is_level", "token, sequence or null", s["is_level"])
    need(s["rs_level"] in RS_LEVELS, f + "rs_level", "token, sequence, geometric or null", s["rs_level"])
    need(s["routing_rs"] in ROUTING_RS, f + "routing_rs", f"one of {ROUTING_RS}", s["routing_rs"])
    positive("is_threshold")
    positive("rs_threshold")
    if s["rs_threshold_lower"] is not None:
        positive("rs_threshold_lower")
        need(s["rs_threshold_lower"] <= s["rs_threshold"], f + "rs_threshold_lower",
             f"<= rs_threshold={s['rs_threshold']}", s["rs_threshold_lower"])
    # The kept interval [L, U] must contain 1, so a step on which rollout and trainer agree (ratio
    # 1) is never rejected: U < 1 with the default L = 1/U > U would reject every step of a run.
    interval = "[" + ("1/rs_threshold" if s["rs_threshold_lower"] is None else "rs_threshold_lower") + ", rs_threshold]"
    need(s["rs_threshold"] >= 1, f + "rs_threshold", f"a number >= 1 (the kept interval {interval} must contain "
         "the ratio 1)", s["rs_threshold"])
    if s["rs_threshold_lower"] is not None:
        need(s["rs_threshold_lower"] <= 1, f + "rs_threshold_lower", f"a number <= 1 (the kept interval {interval} "
             "must contain the ratio 1)", s["rs_threshold_lower"])
    if s["veto_threshold"] is not None:
        positive("veto_threshold")
        need(s["veto_threshold"] <= 1, f + "veto_threshold", "a number in (0, 1] (a token ratio below it vetoes "
             "its sequence: above 1 it would veto steps on which rollout and trainer agree)", s["veto_threshold"])
    need(isinstance(s["routing_rs_share"], (int, float)) and 0 <= s["routing_rs_share"] < 1,
         f + "routing_rs_share", "a number in [0, 1)", s["routing_rs_share"])
    need(isinstance(s["is_batch_normalize"], bool), f + "is_batch_normalize", "true or false", s["is_batch_normalize"])
    need(isinstance(s["routing_rs_sequence"], bool), f + "routing_rs_sequence", "true or false",
         s["routing_rs_sequence"])
    if s["mode"] == "bypass":
        need(s["is_level"] is None, f + "is_level", "null in bypass mode (the PPO ratio against the rollout "
             "already reweights)", s["is_level"])
        need(s["rs_level"] in (None, "token") and s["veto_threshold"] is None and not s["routing_rs_sequence"],
             f + "mode", "decoupled for sequence-level rejection and the veto (bypass sees minibatches)", "bypass")
    return CorrectionSettings(**s)


def active(s: CorrectionSettings) -> bool:
    return bool(s.is_level or s.rs_level or s.veto_threshold or s.routing_rs != "off")


def sequence_ids(mask: torch.Tensor) -> torch.Tensor:
    """[N] sequence index per row of an RLlib train batch: every episode chunk ends with one
    loss-masked phantom row (the bootstrap slot PPO's GAE appends)."""
    ends = (~mask.bool()).long()
    return torch.cumsum(ends, 0) - ends


def _per_sequence_sum(x: torch.Tensor, seq: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, seq, x)


def correct(log_ratio: torch.Tensor, valid: torch.Tensor, seq: torch.Tensor, s: CorrectionSettings,
            routing_disagrees: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float]]:
    """log_ratio [N] = log pi_old - log pi_rollout of the taken actions; valid [N] bool (rows that
    count); seq [N] sequence ids; routing_disagrees [N] bool (for routing RS).
    -> (IS weights [N] (1 where IS is off), keep [N] bool (valid and not rejected), metrics)."""
    # NaN is an unusable step, as bad as a ratio of 0. Rejection and the veto compare in log space,
    # unclamped (a threshold below e^-SAFETY must still fire); WIDE lies beyond the log of any float64
    # threshold and only keeps a sequence's sum finite when a token's ratio is 0 or inf.
    raw = torch.nan_to_num(log_ratio.double(), nan=-math.inf).clamp(-WIDE, WIDE)
    lr = raw.clamp(-SAFETY, SAFETY)   # what is exponentiated: the weights stay finite
    valid = valid.bool()
    n_seq = int(seq.max().item()) + 1 if seq.numel() else 0
    seq_sum = _per_sequence_sum(torch.where(valid, raw, torch.zeros_like(raw)), seq, n_seq)
    seq_len = _per_sequence_sum(valid.double(), seq, n_seq).clamp_min(1)
    keep = valid.clone()
    metrics: Dict[str, float] = {}

    weights = torch.ones_like(lr)
    if s.is_level:
        seq_ratio = seq_sum.clamp(-SAFETY, SAFETY).exp()
        raw_w = lr.exp() if s.is_level == "token" else seq_ratio[seq]
        weights = raw_w.clamp(max=s.is_threshold)
        metrics["correction/is_truncated_fraction"] = _mean((raw_w > s.is_threshold).double(), valid)
    if s.rs_level:
        upper = s.rs_threshold
        lower = s.rs_threshold_lower if s.rs_threshold_lower is not None else 1.0 / upper
        if s.rs_level == "token":
            stat = raw
        elif s.rs_level == "sequence":
            stat = seq_sum[seq]
        else:
            stat = (seq_sum / seq_len)[seq]
        ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
        metrics["correction/rs_rejected_fraction"] = _mean((~ok).double(), valid)
        keep &= ok
    if s.veto_threshold:
        catastrophic = valid & (raw < math.log(s.veto_threshold))
        vetoed = _per_sequence_sum(catastrophic.double(), seq, n_seq) > 0
        metrics["correction/veto_fraction"] = float(vetoed.double().mean()) if n_seq else 0.0
        keep &= ~vetoed[seq]
    if s.routing_rs != "off" and routing_disagrees is not None:
        bad = routing_disagrees.bool() & valid
        if s.routing_rs_sequence:
            bad = (_per_sequence_sum(bad.double(), seq, n_seq) > 0)[seq]
        metrics["correction/routing_rejected_fraction"] = _mean(bad.double(), valid)
        keep &= ~bad
    if s.is_batch_normalize and s.is_level and bool(keep.any()):
        if s.is_level == "sequence":   # as verl: the mean over the kept sequences, each counted once
            kept_seqs = _per_sequence_sum(keep.double(), seq, n_seq) > 0
            weights = weights / seq_ratio[kept_seqs].clamp(max=s.is_threshold).mean()
        else:
            weights = weights / weights[keep].mean()
    metrics.update(offpolicy_metrics(lr, weights, keep, valid, n_seq, seq))
    return weights.to(log_ratio.dtype), keep, metrics


def offpolicy_metrics(lr, weights, keep, valid, n_seq, seq) -> Dict[str, float]:
    """IS-weight statistics over the kept rows, the rejected fraction, ESS and K3 of the batch."""
    out = {"correction/rejected_fraction": _mean((valid & ~keep).double(), valid)}
    if bool(keep.any()):
        w = weights[keep]
        out.update({"correction/is_mean": float(w.mean()), "correction/is_max": float(w.max()),
                    "correction/is_min": float(w.min()),
                    "correction/ess": float(w.mean() ** 2 / (w.pow(2).mean() + 1e-30))})
    r = lr[valid]
    if r.numel():
        out["correction/k3"] = float((r.exp() - 1 - r).mean())
        kept_seqs = _per_sequence_sum(keep.double(), seq, n_seq) > 0
        out["correction/seq_rejected_fraction"] = 1.0 - float(kept_seqs[_per_sequence_sum(
            valid.double(), seq, n_seq) > 0].double().mean())
    return out


def _mean(x: torch.Tensor, valid: torch.Tensor) -> float:
    return float(x[valid].mean()) if bool(valid.any()) else 0.0


def routing_disagreement(rollout_top_k: torch.Tensor, trainer_top_k: torch.Tensor, rule: str,
                         share: float) -> torch.Tensor:
    """[N] bool: the token's top-k expert set differs between the rollout ([N, L, k], as recorded)
    and the trainer's own choice ([N, L, k]) in any layer (`any`) or in more than `share` of them."""
    differs = layer_disagreement(rollout_top_k, trainer_top_k)   # [N, L]
    if rule == "any":
        return differs.any(-1)
    return differs.double().mean(-1) > share
