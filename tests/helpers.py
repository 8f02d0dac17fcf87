"""Helpers the tests share: small DeepSpeed configs and batches, Adam moments, a real local Ray head."""
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time

import gymnasium as gym
import numpy as np
import torch
from ray.rllib.core.columns import Columns

from moe_rl import MoEPPOConfig
from moe_rl.core.losses import moe_aux_losses
from moe_rl.rllib.rl_module import MOE_ROUTING

ENV = gym.make("CartPole-v1")
RNG = np.random.default_rng(0)


def ds_config(**moe):
    return (MoEPPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=1, num_envs_per_env_runner=2)
            .training(lr=1e-3, train_batch_size_per_learner=400, minibatch_size=100, num_epochs=2,
                      vf_loss_coeff=0.5, vf_clip_param=1000.0)
            .learners(num_learners=2)
            .moe(**{"num_experts": 4, "top_k": 2, "ep_size": 2, "d_model": 16, "d_ff": 16, **moe})
            .deepspeed(config={"gradient_clipping": 0.0})
            .debugging(seed=0))


def shard_loss(module, obs, actions):
    out = module.forward_train({Columns.OBS: obs})
    logp = torch.log_softmax(out[Columns.ACTION_DIST_INPUTS], -1).gather(1, actions[:, None]).squeeze(1)
    extra, _, _ = moe_aux_losses(out[MOE_ROUTING], 0.01, 0.001)
    return -logp.mean() + 0.1 * module.compute_values({Columns.OBS: obs}).pow(2).mean() + extra


def batch(n):
    return (torch.as_tensor(RNG.uniform(-1, 1, (n, 4)), dtype=torch.float32),
            torch.as_tensor(RNG.integers(0, 2, n)))


def adam_moments(group):
    """Every learner's Adam state tensors, copied."""
    return group.foreach_learner(lambda l: [
        {k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
        for st in l._engines["default_policy"].optimizer.state_dict()["state"].values()])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_head(*start_args, start_env=None):
    """A real Ray head on loopback (started with the CLI, as a user would), stopped afterwards.
    Yields (ray CLI path, client env, dashboard address)."""
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "PATH": bindir + os.pathsep + os.environ["PATH"]}
    ray_cli = shutil.which("ray", path=env["PATH"])
    dash = free_port()
    # A port of its own for the job agent too: its default (52365) may be another Ray's on this host.
    subprocess.run([ray_cli, "start", "--head", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
                    "--dashboard-agent-listen-port", str(free_port()), "--disable-usage-stats", *start_args],
                   env={**env, **(start_env or {})},
                   check=True, capture_output=True, timeout=120)
    try:
        yield ray_cli, env, f"http://127.0.0.1:{dash}"
    finally:
        subprocess.run([ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
        time.sleep(1)
