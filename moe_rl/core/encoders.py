"""Observation encoders in front of the MoE blocks (pure torch).

An encoder turns one batch of observations into (features [B, F], task_ids [B] or None):

- `flat`: a vector observation as it is (flattened).
- `conv`: an image (H, W, C) through the small CNN of MOORE's MiniGrid networks (three 2x2
  convolutions, ReLU, ReLU, tanh): 64 x 4 x 4 = 1 024 features for a 7x7 grid. The mixture then sits
  after the encoder, where MoE-in-RL work places it (Obando-Ceron et al., ICML 2024: the penultimate
  layer), so experts mix state features rather than raw grid cells.

With tokens (moe.tokens, resolved by `uses_position_tokens`), the conv encoder keeps its feature map
as one token per position ([B, positions, 64]: 16 for a 7x7 grid, 49 for MinAtar's 10x10) instead of
one flat vector: a Soft MoE mixes them, and the trunk pools them after the blocks (moe.token_pool). Sokar et al.
(ICLR 2025) found much of Soft MoE's gain in deep RL comes from this tokenizing.

A Dict observation {"image": (H, W, C), "task": one-hot [T]} (moe_rl/MiniGrid-MT*) encodes the image
and appends the task vector to the features; `task_slice` [start, n] locates the task id inside the
vector part (the whole observation, or the Dict's "task" entry) for the task-conditioned router.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from moe_rl.core.errors import ConfigError

ENCODERS = ("auto", "flat", "conv")


def image_shape(space: gym.Space) -> Optional[Tuple[int, int, int]]:
    """(H, W, C) when the observation is an image (a 3-d Box, or a Dict with one under "image")."""
    if isinstance(space, gym.spaces.Dict):
        space = space.spaces.get("image")
    if isinstance(space, gym.spaces.Box) and len(space.shape) == 3:
        return tuple(int(d) for d in space.shape)
    return None


def resolve_encoder(kind: str, space: gym.Space) -> str:
    """moe.encoder resolved for an observation space: auto is conv for images, flat otherwise."""
    image = image_shape(space) is not None
    if kind == "auto":
        return "conv" if image else "flat"
    if kind == "conv" and not image:
        raise ConfigError(f"moe.encoder: 'conv' needs an image observation ((H, W, C) Box, or a Dict with "
                          f"'image'), got {space}; use 'flat' or 'auto'")
    if kind == "flat" and isinstance(space, gym.spaces.Dict):
        raise ConfigError(f"moe.encoder: 'flat' needs a Box observation, got {space}; use 'auto'")
    return kind


class GridCNN(nn.Module):
    """(H, W, C) small-integer grids -> flat features, or (tokens) one token per position of the
    feature map. Inputs are not rescaled (MiniGrid's symbolic indices are at most 10; MinAtar's
    channels are 0/1), as in MOORE's models."""

    def __init__(self, shape: Sequence[int], tokens: bool = False):
        super().__init__()
        h, w, c = shape
        self.tokens = tokens
        self.net = nn.Sequential(
            nn.Conv2d(c, 16, 2), nn.ReLU(),
            nn.Conv2d(16, 32, 2), nn.ReLU(),
            nn.Conv2d(32, 64, 2), nn.Tanh())
        with torch.no_grad():
            _, channels, rows, cols = self.net(torch.zeros(1, c, h, w)).shape
        self.num_tokens = rows * cols if tokens else 1
        self.out_dim = int(channels if tokens else channels * rows * cols)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """[B, H, W, C] -> [B, F] (flat) or [B, positions, channels] (tokens)."""
        features = self.net(image.permute(0, 3, 1, 2))
        return features.flatten(2).transpose(1, 2) if self.tokens else features.flatten(1)


class ObservationEncoder(nn.Module):
    """obs (tensor, or {"image", "task"}) -> (features [B, out_dim], task_ids [B] | None); with
    tokens, features [B, num_tokens, out_dim]: one token per position of the CNN's feature map, the
    task vector (a Dict observation's) appended to every token."""

    def __init__(self, space: gym.Space, kind: str = "auto", task_slice: Optional[Sequence[int]] = None,
                 tokens: bool = False):
        super().__init__()
        self.kind = resolve_encoder(kind, space)
        if tokens and self.kind != "conv":
            raise ConfigError(f"moe.tokens: 'positions' needs an image observation read by the conv encoder, "
                              f"got {space} with encoder {self.kind!r}; use tokens 'one' or 'auto'")
        self.task_slice = tuple(task_slice) if task_slice is not None else None
        self.cnn = GridCNN(image_shape(space), tokens) if self.kind == "conv" else None
        self.num_tokens = self.cnn.num_tokens if self.cnn is not None else 1
        self.tokens = tokens
        if isinstance(space, gym.spaces.Dict):
            extra = space.spaces.get("task")
            unknown = sorted(set(space.spaces) - {"image", "task"})
            if unknown or (extra is not None and len(extra.shape) != 1):
                raise ConfigError(f"observation: a Dict observation needs 'image' (H, W, C) and optionally "
                                  f"'task' (a vector), got {space}")
            self.vector_dim = int(extra.shape[0]) if extra is not None else 0
            self.out_dim = self.cnn.out_dim + self.vector_dim
        else:
            self.vector_dim = int(np.prod(space.shape))
            self.out_dim = self.cnn.out_dim if self.cnn is not None else self.vector_dim
        if self.task_slice is not None and self.task_slice[0] + self.task_slice[1] > self.vector_dim:
            raise ConfigError(f"moe.task_slice: must lie inside the observation's {self.vector_dim}-long task/vector "
                              f"part, got {list(self.task_slice)}")

    def forward(self, obs) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if isinstance(obs, dict):
            image, vector = obs["image"], obs.get("task")
        elif self.cnn is not None:
            image, vector = obs, None
        else:
            image, vector = None, obs.reshape(obs.shape[0], -1)
        dtype = self.cnn.net[0].weight.dtype if self.cnn is not None else None
        parts = [self.cnn(image.to(dtype))] if image is not None else []
        if vector is not None:
            extra = vector.to(parts[0].dtype) if parts else vector
            if self.tokens:   # the task on every position's token
                extra = extra.unsqueeze(1).expand(-1, self.num_tokens, -1)
            parts.append(extra)
        task_ids = None
        if self.task_slice is not None:
            a, n = self.task_slice
            task_ids = vector[:, a:a + n].argmax(-1)
        return (torch.cat(parts, -1) if len(parts) > 1 else parts[0]), task_ids


def uses_position_tokens(tokens: str, mixture: str, space: gym.Space) -> bool:
    """moe.tokens resolved: positions (one token per position of an image's feature map) or one.
    auto: positions for an image under mixture soft (a Soft MoE mixes tokens; a sparse layer routes
    one per observation), else one."""
    if tokens == "auto":
        return mixture == "soft" and image_shape(space) is not None
    return tokens == "positions"
