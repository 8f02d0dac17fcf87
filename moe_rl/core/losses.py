"""Router losses (pure torch). Shapes: T tokens, N experts, k slots per token."""
from __future__ import annotations

from typing import Optional

import torch

from moe_rl.core.metrics import topk_sets_equal
from moe_rl.core.routing import RoutingRecord


def load_balancing_loss(router_probs: torch.Tensor, top_k_indices: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer balance loss N * sum_i f_i * P_i.

    router_probs: [T, N] softmax probabilities; top_k_indices: [T, k].
    f_i = share of the T*k assignments that went to expert i (no gradient: counts are discrete);
    P_i = mean router probability of expert i. Perfectly uniform routing gives 1.0.
    """
    n = router_probs.shape[-1]
    counts = torch.bincount(top_k_indices.reshape(-1), minlength=n).to(router_probs.dtype)
    f = (counts / counts.sum().clamp_min(1)).detach()
    return n * (f * router_probs.mean(dim=0)).sum()


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE z-loss mean(logsumexp(logits)^2): keeps logits small so fp32/bf16 softmaxes agree."""
    return torch.logsumexp(router_logits.float(), dim=-1).pow(2).mean()


def reinforce_router_loss(record: RoutingRecord, reward: torch.Tensor,
                          mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Policy-gradient loss for a ReinforceRouter: -(R - b)·log p(selection) + (R - b)^2.

    reward: [T] per-token signal (e.g. the PPO advantage). The baseline is trained by regression;
    the router's advantage uses the detached baseline. mask: [T] bool, the tokens that count (PPO's
    loss mask: rejected and phantom steps leave the loss and its denominator, as in the PPO loss);
    none counts: 0, with no gradient.
    """
    if record.selection_logp is None or record.baseline is None:
        raise ValueError("record: reinforce_router_loss needs a record from the 'reinforce' router")
    reward = reward.reshape(-1).to(record.baseline.dtype)
    logp, baseline = record.selection_logp, record.baseline
    if mask is not None:   # selected, not multiplied by 0: a masked step's -inf log-prob stays out
        mask = mask.reshape(-1).bool()
        reward, logp, baseline = reward[mask], logp[mask], baseline[mask]
    n = max(int(reward.numel()), 1)
    adv = (reward - baseline).detach()
    return (-(adv * logp).sum() + (reward - baseline).pow(2).sum()) / n


def moe_aux_losses(records, aux_coef: float, z_coef: float):
    """Sum of coefficient-weighted balance and z losses over layers -> (total, aux_sum, z_sum).
    The balance loss counts the router's own current choice (`router_top_k`), never replayed
    experts: under routing replay those are frozen for a whole update and the loss would push
    the router onto whatever the rollout picked.

    The layers of one policy route the same tokens over the same experts, so both losses are
    computed for all layers at once (one softmax and one logsumexp over [L, T, N], sharing the
    logsumexp): 153 against 272 us per step, forward and backward, for the quickstart's 2 layers."""
    shapes = {(r.router_logits.shape, r.router_top_k.shape) for r in records}
    if len(shapes) != 1:
        aux = sum(load_balancing_loss(r.router_probs, r.router_top_k) for r in records)
        z = sum(router_z_loss(r.router_logits) for r in records)
        return aux_coef * aux + z_coef * z, aux, z
    logits = torch.stack([r.router_logits.float() for r in records])            # [L, T, N]
    L, _, n = logits.shape
    lse = logits.logsumexp(-1, keepdim=True)                                       # [L, T, 1]
    probs = (logits - lse).exp()
    layer_offset = torch.arange(L, device=logits.device).view(L, 1, 1) * n
    chosen = (torch.stack([r.router_top_k for r in records]) + layer_offset).reshape(-1)
    counts = torch.bincount(chosen, minlength=L * n).view(L, n).to(probs.dtype)
    f = counts / counts.sum(-1, keepdim=True).clamp_min(1)                         # [L, N], no gradient
    aux = n * (f * probs.mean(1)).sum()
    z = lse.square().mean(1).sum()
    return aux_coef * aux + z_coef * z, aux, z


def replay_anchor_loss(records) -> torch.Tensor:
    """Under routing replay: -log(sum of the router's probabilities on the replayed experts) on
    the tokens whose own top-k set has left the replayed one, averaged over all tokens, summed over
    layers.

    Over a long update the router's own top-k drifts away from the replayed experts PPO is
    training, and the next rollouts route elsewhere. This term pulls it back where it drifted.
    Counted on every token it also sharpened the router onto the experts already in use until one
    starved (health danger on every seed of the quickstart; BENCHMARKS.md, gates under replay).
    Records of a sampling router (REINFORCE) are skipped: their selection is trained by its own
    policy-gradient loss."""
    terms = [(-r.router_probs.gather(1, r.top_k_indices).sum(1).clamp_min(1e-9).log()
              * ~topk_sets_equal(r.router_top_k, r.top_k_indices)).mean()
             for r in records if r.selection_logp is None]
    return sum(terms) if terms else torch.zeros(())

