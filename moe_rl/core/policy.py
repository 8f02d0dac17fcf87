"""Policy trunks built from the MoE core (pure torch).

- MoEMLPTrunk: vector or image observations -> encoder -> tanh(Linear) -> L residual MoE blocks.
- MoETransformerTrunk: token-history observations -> small causal transformer whose feed-forward
  sublayers are MoE layers; the feature of the last filled position drives the action.

Both return (features [B, d], routing records): one RoutingRecord per MoE layer, covering exactly
the B tokens that decide the actions (for the transformer, the current position), so rollout and
trainer routings line up one-to-one.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Union

import gymnasium as gym
import numpy as np
import torch
import torch.utils.checkpoint
from torch import nn

from moe_rl.core.encoders import ObservationEncoder
from moe_rl.core.experts import Activation, tanh
from moe_rl.core.layer import MoELayer, dense_ffn_equal_active
from moe_rl.core.routing import RoutingRecord
from moe_rl.core.sections import MoESettings
from moe_rl.core.soft_moe import SoftMoELayer


def moe_layer_from_settings(s: MoESettings) -> nn.Module:
    """The mixture of one block, by moe.mixture: a sparse MoELayer, a SoftMoELayer, or (dense) a
    feed-forward layer of the sparse layer's active width. normalize_gates: a resolved bool (an
    RLModule resolves "auto"; unresolved it means true)."""
    if s.mixture == "soft":
        return SoftMoELayer(s.d_model, s.num_experts, s.slots_per_expert, s.d_ff, activation=s.activation,
                            normalize=s.soft_normalize)
    if s.mixture == "dense":
        return DenseFFN(s.d_model, s.d_ff, s.top_k, s.activation)
    return MoELayer(s.d_model, s.num_experts, s.top_k, s.d_ff, router=s.router,
                    normalize_gates=s.normalize_gates is not False,
                    temperature=s.temperature, router_init=s.router_init,
                    router_init_std=s.router_init_std, shared_expert=s.shared_expert,
                    expert_dropout=s.expert_dropout, capacity_factor=s.capacity_factor,
                    dispatch=s.dispatch, activation=s.activation, router_kwargs=s.router_kwargs)


class DenseFFN(nn.Module):
    """mixture dense: one feed-forward layer of the sparse block's active width (top_k x d_ff), with
    a block's interface (it records no routing)."""

    def __init__(self, d_model: int, d_ff: int, top_k: int, activation: str):
        super().__init__()
        self.ffn = dense_ffn_equal_active(d_model, d_ff, top_k, activation)

    def forward(self, x, replay_indices=None, task_ids=None, explore=False):
        return self.ffn(x), None


class MoEBlock(nn.Module):
    """Pre-norm residual MoE sublayer: h + MoE(LN(h)); h [B, d] or [B, m, d] (a Soft MoE's tokens)."""

    def __init__(self, s: MoESettings):
        super().__init__()
        self.norm = nn.LayerNorm(s.d_model)
        self.moe = moe_layer_from_settings(s)

    def forward(self, h, replay=None, task_ids=None, explore=False):
        if isinstance(self.moe, SoftMoELayer):   # mixes the tokens of each observation; routes by none of these
            y, rec = self.moe(self.norm(h))
        else:
            y, rec = self.moe(self.norm(h), replay_indices=replay, task_ids=task_ids, explore=explore)
        return h + y, rec


def maybe_checkpoint(enabled: bool, fn, *args):
    """Activation checkpointing in training: keep only the block inputs, recompute the rest in
    backward (the RNG state is replayed, so expert dropout and sampled routing recompute alike)."""
    if enabled and torch.is_grad_enabled():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _replay_for(replay: Optional[torch.Tensor], i: int) -> Optional[torch.Tensor]:
    """replay: [B, L, k] recorded top-k per layer -> layer i's [B, k]."""
    return None if replay is None else replay[:, i]


class MoEMLPTrunk(nn.Module):
    """obs -> encoder (moe_rl.core.encoders: flat vector, or a CNN for images; one token, or one
    per position of the CNN's feature map) -> tanh(Linear) per token -> L residual MoE blocks ->
    (tokens, by moe.token_pool: their mean, or their concatenation) -> features [B, out_dim]. The
    encoder also reads the task id (task_slice) that the task-conditioned router routes on. An int
    stands for a flat vector of that length. Records: one per MoE layer (none for mixture dense)."""

    def __init__(self, encoder: Union[int, ObservationEncoder], s: MoESettings,
                 task_slice: Optional[Sequence[int]] = None):
        super().__init__()
        if isinstance(encoder, int):
            encoder = ObservationEncoder(gym.spaces.Box(-np.inf, np.inf, (encoder,)), "flat", task_slice)
        self.encoder = encoder
        self.embed = nn.Linear(encoder.out_dim, s.d_model)
        self.blocks = nn.ModuleList(MoEBlock(s) for _ in range(s.num_layers))
        self.checkpointing = s.activation_checkpointing
        self.flatten_tokens = s.token_pool == "flatten"
        self.out_dim = s.d_model * (encoder.num_tokens if self.flatten_tokens and encoder.tokens else 1)

    def forward(self, obs, replay: Optional[torch.Tensor] = None, explore: bool = False):
        features, task_ids = self.encoder(obs)
        h = tanh(self.embed(features))
        records: List[RoutingRecord] = []
        for i, block in enumerate(self.blocks):
            h, rec = maybe_checkpoint(self.checkpointing, block, h, _replay_for(replay, i), task_ids, explore)
            if rec is not None:
                records.append(rec)
        if h.dim() == 3:
            h = h.flatten(1) if self.flatten_tokens else h.mean(1)
        return h, records


class CausalSelfAttention(nn.Module):
    """Causal multi-head attention. relative_window: a learned bias per head and distance
    (distances from the window on share its last entry), so positions enter only as offsets and a
    policy trained on short sequences runs on any length."""

    def __init__(self, d: int, heads: int, relative_window: Optional[int] = None):
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.rel_bias = nn.Parameter(torch.zeros(heads, relative_window)) if relative_window else None

    def forward(self, x, pad_mask):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        if self.rel_bias is not None:
            # Padding only trails the history, so causality already hides it from every real
            # row: one [1, H, T, T] bias serves the batch (no [B, H, T, T] mask at long lengths).
            i = torch.arange(T, device=x.device)
            dist = (i[:, None] - i[None, :]).clamp(0, self.rel_bias.shape[1] - 1)
            mask = self.rel_bias[:, dist].masked_fill(~causal, float("-inf"))[None]
        else:
            mask = causal & pad_mask[:, None, None, :]       # [B, 1, T, T]: attend to earlier real tokens
            mask = mask | torch.eye(T, dtype=torch.bool, device=x.device)  # a row is never fully masked
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class MoETransformerTrunk(nn.Module):
    """obs {"tokens": [B, T] int (0 = padding, tokens shifted by +1), "position": [B] int number of
    filled tokens} -> features [B, d] at the current position (a BOS slot precedes the history)."""

    def __init__(self, vocab_size: int, s: MoESettings):
        super().__init__()
        d, self.max_len = s.d_model, s.max_seq_len
        self.out_dim = d
        relative = s.positions == "relative"
        self.tok = nn.Embedding(vocab_size + 2, d)        # 0 pad, 1 BOS, 2.. tokens
        self.pos = None if relative else nn.Embedding(self.max_len + 1, d)
        self.attn_norms = nn.ModuleList(nn.LayerNorm(d) for _ in range(s.num_layers))
        self.attns = nn.ModuleList(CausalSelfAttention(d, s.num_heads, self.max_len if relative else None)
                                   for _ in range(s.num_layers))
        self.blocks = nn.ModuleList(MoEBlock(s) for _ in range(s.num_layers))
        self.final_norm = nn.LayerNorm(d)
        self.checkpointing = s.activation_checkpointing

    def _layer(self, i, h, filled, last, replay, explore):
        """Attention then MoE over every position; the record keeps the current position's routing
        (what drove the action). History positions always route greedily (a sampling router would
        otherwise re-sample them at every step); replay and exploration act on the current one.
        Under a capacity factor each sequence is its own capacity group: a history position's drops
        then depend on its sequence only, at rollout (a few sequences) as in training (hundreds)."""
        B, L, _ = h.shape
        block = self.blocks[i]
        h = h + self.attns[i](self.attn_norms[i](h), filled)
        y, rec = block.moe(block.norm(h), seq_mask=filled)
        rows = torch.arange(B, device=h.device)
        if replay is not None or (explore and block.moe.router.samples_when_exploring):
            y_cur, rec = block.moe(block.norm(h)[rows, last], replay_indices=replay, explore=explore)
            y = y.clone()
            y[rows, last] = y_cur
        else:
            rec = rec.rows(rows * L + last)
        return h + y, rec

    def forward(self, obs: dict, replay: Optional[torch.Tensor] = None, explore: bool = False):
        tokens = obs["tokens"].long()
        position = obs["position"].long().reshape(-1)
        B, T = tokens.shape
        seq = torch.cat([torch.ones(B, 1, dtype=torch.long, device=tokens.device), tokens + 1], 1)
        seq = seq.masked_fill(torch.cat([torch.zeros(B, 1, dtype=torch.bool, device=tokens.device),
                                         tokens < 0], 1), 0)
        # Only the prefix up to the current position matters: trim to the longest one in the batch.
        L = int(position.max().item()) + 1 if B else 1
        seq = seq[:, :L]
        filled = torch.arange(L, device=seq.device)[None, :] <= position[:, None]
        h = self.tok(seq)
        if self.pos is not None:
            h = h + self.pos(torch.arange(L, device=seq.device))[None]
        records = []
        last = position.clamp(max=L - 1)
        for i in range(len(self.blocks)):
            h, rec = maybe_checkpoint(self.checkpointing, self._layer, i, h, filled, last,
                                      None if replay is None else replay[:, i], explore)
            records.append(rec)
        return self.final_norm(h[torch.arange(B), last]), records


class DualBranchHead(nn.Module):
    """Parallel dual-branch policy head : a linear branch plus a
    small MLP branch, summed. Both output layers start near zero: a near-uniform initial policy."""

    def __init__(self, d: int, out: int):
        super().__init__()
        self.linear = nn.Linear(d, out)
        self.mlp = nn.Sequential(nn.Linear(d, d), Activation("tanh"), nn.Linear(d, out))
        for last in (self.linear, self.mlp[-1]):
            nn.init.normal_(last.weight, std=0.01)
            nn.init.zeros_(last.bias)

    def forward(self, h):
        return self.linear(h) + self.mlp(h)


def policy_head(kind: str, d: int, out: int) -> nn.Module:
    if kind == "dual":
        return DualBranchHead(d, out)
    head = nn.Linear(d, out)
    nn.init.normal_(head.weight, std=0.01)   # near-uniform initial policy
    nn.init.zeros_(head.bias)
    return head


def mlp(sizes: Sequence[int], out: int, activation: str = "tanh") -> nn.Sequential:
    layers, prev = [], sizes[0]
    for h in sizes[1:]:
        layers += [nn.Linear(prev, h), Activation(activation)]
        prev = h
    layers.append(nn.Linear(prev, out))
    return nn.Sequential(*layers)
