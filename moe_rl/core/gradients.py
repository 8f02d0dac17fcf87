"""Gradient transforms and the LAMB optimizer of the stability toolkit (pure torch).

- winsorize_: clamp a gradient to its (1 - p) quantile of magnitudes (exact kthvalue up to 16M
  elements, a sample above: torch.quantile refuses large inputs).
- orthonormal_basis / project_: project a 2-d gradient onto its top-r right singular vectors; the
  basis has orthonormal rows, so g @ P^T @ P is a true projection.
- Lamb: per-tensor trust ratio with the weight norm clamped (e.g. lr 2e-3, clamp 10: docs/stability.md).

moe_rl.core.stability.StabilityToolkit applies them in its optimizer step.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

# --- gradient surgery -------------------------------------------------------------------------------
EXACT_QUANTILE_MAX = 1 << 24   # torch.quantile refuses inputs above 16M elements; kthvalue does not


def abs_quantile(x: torch.Tensor, q: float, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """q-quantile of |x|: exact (kthvalue) up to 16M elements, else from a 1M-element random sample."""
    a = x.detach().reshape(-1).abs().float()
    if a.numel() > EXACT_QUANTILE_MAX:
        a = a[torch.randint(a.numel(), (1 << 20,), generator=generator, device=a.device)]
    k = min(a.numel(), max(1, math.ceil(q * a.numel())))
    return a.kthvalue(k).values


def winsorize_(grad: torch.Tensor, p: float) -> torch.Tensor:
    """Clamp a gradient in place to +-(1-p) quantile of its magnitudes (outliers only)."""
    if grad.numel() >= 2:
        hi = abs_quantile(grad, 1.0 - p)
        grad.clamp_(-hi.item(), hi.item())
    return grad


def orthonormal_basis(grad: torch.Tensor, rank: int) -> torch.Tensor:
    """[..., r, in] rows: the top-r right singular vectors of a 2-D gradient, or of each matrix of
    a stacked one ([N, out, in]: one basis per expert), orthonormal by SVD."""
    _, _, vh = torch.linalg.svd(grad.detach().float(), full_matrices=False)
    return vh[..., :rank, :].contiguous()


def project_(grad: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """g <- g P^T P (per matrix): an orthogonal projection because P's rows are orthonormal."""
    grad.copy_((grad.float() @ basis.transpose(-1, -2) @ basis).to(grad.dtype))
    return grad


# --- LAMB ---------------------------------------------------------------------------------------------
class Lamb(torch.optim.Optimizer):
    """LAMB (You et al. 2019): Adam direction with a per-tensor trust ratio ||w|| / ||update||;
    ||w|| is clamped to `clamp` so large tensors cannot take huge steps."""

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, clamp=10.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, clamp=clamp))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(())
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                update = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm().clamp(max=group["clamp"]), update.norm()
                trust = (w_norm / u_norm).item() if w_norm > 0 and u_norm > 0 else 1.0
                p.add_(update, alpha=-group["lr"] * trust)
        return loss
