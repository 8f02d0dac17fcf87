"""Helpers the tests share: small DeepSpeed configs and batches, Adam moments, a real local Ray head."""
import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile

import gymnasium as gym
import numpy as np
import ray_processes
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
    It has its own temp dir, ports and auth token, and a process session of its own: stopping it
    kills that session's processes only. Never `ray stop`: it stops every Ray on the host, a user's
    training run included. Yields (ray CLI path, client env whose RAY_ADDRESS is this head's GCS,
    dashboard address)."""
    bindir = os.path.dirname(sys.executable)
    if "--port" not in start_args:
        start_args = ("--port", str(free_port()), *start_args)
    port = start_args[start_args.index("--port") + 1]
    temp_dir = tempfile.mkdtemp(prefix="moerl-ray-", dir="/tmp")   # short: Ray's socket paths
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env = {**base, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN": secrets.token_hex(32), "PATH": bindir + os.pathsep + os.environ["PATH"]}
    ray_cli = shutil.which("ray", path=env["PATH"])
    dash = free_port()
    # Ports of its own for the job agent and the client server too: their defaults (52365, 10001)
    # may be another Ray's on this host. ("auto" would find another Ray's head: RAY_ADDRESS is set.)
    start = subprocess.Popen(
        [ray_cli, "start", "--head", "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
         "--dashboard-agent-listen-port", str(free_port()), "--ray-client-server-port", str(free_port()),
         "--temp-dir", temp_dir, "--disable-usage-stats", *start_args],
        env={**env, **(start_env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    session = start.pid   # the head's processes keep this session id (workers too)
    try:
        out, _ = start.communicate(timeout=120)
        ray_processes.record(ray_processes.session_processes(session))
        if start.returncode != 0:
            raise RuntimeError(f"ray start failed ({start.returncode}): {out[-3000:]}")
        yield ray_cli, {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, f"http://127.0.0.1:{dash}"
    finally:
        start.kill()
        start.wait(30)
        ray_processes.kill_session(session)
        shutil.rmtree(temp_dir, ignore_errors=True)


class PureCheck:
    """A check without Ray: the consistency actor's figures and the gate's decision (GateState.judge),
    both in this process, as the sync gate runs them."""

    def __init__(self, settings, kinds):
        import dataclasses

        from moe_rl.actors.consistency import ConsistencyActor
        from moe_rl.core.gate import GateState, mismatch_limits
        self._asdict = dataclasses.asdict
        self.actor, self.state = ConsistencyActor(settings, kinds), GateState(settings)
        self.limits = mismatch_limits(settings.thresholds)

    def check(self, *, lag=0, stats=None, rollout=None, trainer=None, policy_lag=None, skipped=None,
              old_probe=None, candidate_probe=None):
        """-> (the verdict as a dict, the ledger rows)."""
        self.actor.observe(iteration=1, version=5, sync_id=0, lag=lag, rollout=rollout or {}, trainer=trainer or {},
                           policy_lag=policy_lag)
        stats = stats or {"finite": True, "terms": {}}
        rows = self.actor.figures(stats=stats, old_probe=old_probe or {}, candidate_probe=candidate_probe or {},
                                  skipped=skipped, iteration=1, version=5, sync_id=0, lag=lag)["rows"]
        verdict = self.state.judge(rows, lag, stats["finite"], [], [], self.limits)
        return self._asdict(verdict), [r for _, r in sorted(rows.items())]
