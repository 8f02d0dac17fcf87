"""Per-group learning-rate schedules, as torch's own schedulers run them (pure torch).

A `stability.lr_schedules` group follows its schedule alone, over applied optimizer steps; every
other group follows RLlib's `lr` (docs/stability.md, "Learning rates", has the key-to-scheduler table).
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch.optim import lr_scheduler

from moe_rl.core.settings import _is_int, _is_num, _need

SCHEDULES = ("constant", "cosine", "cyclic", "cosine_restarts")
SCHEDULE_KEYS = {"constant": (), "cosine": ("eta_min", "t_max"), "cyclic": ("max_lr", "step_size"),
                 "cosine_restarts": ("eta_min", "t_0", "t_mult")}


def positive_int(v) -> bool:
    return _is_int(v) and v >= 1


def validate_schedule(group: str, spec: Any) -> Dict[str, Any]:
    f = f"stability.lr_schedules.{group}"
    _need(isinstance(spec, dict), f, "a mapping with a 'schedule' key", spec)
    kind = spec.get("schedule")
    _need(kind in SCHEDULES, f"{f}.schedule", f"one of {SCHEDULES}", kind)
    allowed = {"schedule", "lr", "warmup_steps", *SCHEDULE_KEYS[kind]}
    unknown = sorted(set(spec) - set(allowed))
    _need(not unknown, f"{f}.{unknown[0] if unknown else ''}", f"one of {sorted(allowed)} for {kind}",
          unknown[0] if unknown else None)
    s = {"eta_min": 0.0, "t_mult": 1, "warmup_steps": 0, **spec}
    for k in ("lr", "eta_min", "max_lr"):
        if k in allowed:
            _need(k in s and _is_num(s[k]) and s[k] >= 0, f"{f}.{k}", "a finite number >= 0", s.get(k))
    for k in ("t_max", "step_size", "t_0", "t_mult"):
        if k in allowed:
            _need(k in s and positive_int(s[k]), f"{f}.{k}", "an int >= 1", s.get(k))
    _need(_is_int(s["warmup_steps"]) and s["warmup_steps"] >= 0, f"{f}.warmup_steps", "an int >= 0",
          s["warmup_steps"])
    if "eta_min" in allowed:   # a decay from lr towards eta_min
        _need(s["eta_min"] <= s["lr"], f"{f}.eta_min", f"a number <= lr ({s['lr']})", s["eta_min"])
    return s


# --- schedules ---------------------------------------------------------------------------------------
def torch_scheduler(spec: Dict[str, Any], optimizer: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
    """torch's scheduler for a validated schedule spec, over applied optimizer steps (0-based t), on
    an optimizer whose groups start at spec["lr"] (docs/stability.md has the table):

    constant         the lr (ConstantLR with factor 1)
    cosine           CosineAnnealingLR(T_max=t_max, eta_min) for t_max steps, then eta_min (torch's
                     own cosine is periodic: it would climb back to lr over the next t_max steps)
    cyclic           CyclicLR(base_lr=lr, max_lr, step_size_up=step_size), mode triangular
    cosine_restarts  CosineAnnealingWarmRestarts(T_0=t_0, T_mult=t_mult, eta_min)
    warmup_steps w   LinearLR from lr/w to lr over the first w steps (lr (t+1)/w), the schedule
                     then starting at its own step 0 (SequentialLR)
    """
    kind, lr, w = spec["schedule"], spec["lr"], spec["warmup_steps"]
    pieces: List[lr_scheduler.LRScheduler] = []
    milestones: List[int] = []
    if w:
        pieces.append(lr_scheduler.LinearLR(optimizer, start_factor=1 / w, end_factor=1.0, total_iters=max(w - 1, 1)))
        milestones.append(w)
    if kind == "constant":
        pieces.append(lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0))
    elif kind == "cosine":
        pieces.append(lr_scheduler.CosineAnnealingLR(optimizer, T_max=spec["t_max"], eta_min=spec["eta_min"]))
        milestones.append(w + spec["t_max"])
        hold = spec["eta_min"] / lr if lr > 0 else 0.0   # validated: eta_min <= lr
        pieces.append(lr_scheduler.LambdaLR(optimizer, lambda _: hold))
    elif kind == "cyclic":
        pieces.append(lr_scheduler.CyclicLR(optimizer, base_lr=lr, max_lr=spec["max_lr"],
                                            step_size_up=spec["step_size"], cycle_momentum=False))
    else:
        pieces.append(lr_scheduler.CosineAnnealingWarmRestarts(optimizer, T_0=spec["t_0"], T_mult=spec["t_mult"],
                                                               eta_min=spec["eta_min"]))
    return pieces[0] if len(pieces) == 1 else lr_scheduler.SequentialLR(optimizer, pieces, milestones)


class GroupLR:
    """One schedule spec as torch runs it: torch_scheduler on a stand-in optimizer (one empty tensor,
    one param group), stepped once per applied optimizer step. `lr` is the LR of applied step `t`.
    The toolkit copies it into the real optimizer's groups of that stability group (torch's
    schedulers set every group of their optimizer alike; ours differ per group)."""

    def __init__(self, spec: Dict[str, Any]):
        self.spec = spec
        self._reset()

    def _reset(self) -> None:
        self._optimizer = torch.optim.SGD([torch.zeros(0, requires_grad=True)], lr=self.spec["lr"])
        self._scheduler = torch_scheduler(self.spec, self._optimizer)
        self._optimizer.step()   # a no-op (no gradient); torch warns about a scheduler stepped before its optimizer
        self.t = 0

    @property
    def lr(self) -> float:
        return float(self._optimizer.param_groups[0]["lr"])

    def step(self) -> None:
        self._scheduler.step()
        self.t += 1

    def seek(self, t: int) -> None:
        """To applied step t (a restore): torch's schedulers only step forward, so an earlier t
        starts over (about 5 us a step)."""
        if t < self.t:
            self._reset()
        while self.t < t:
            self.step()
