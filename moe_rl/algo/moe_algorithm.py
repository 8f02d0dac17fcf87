"""MoEAlgorithm: what every moe-rl Algorithm adds to RLlib's (MoEPPO, MoEAPPO). One iteration:

    sample     rollout actors step their envs with the inference copy (weights version v);
               how, is the algorithm's (`sample_episodes`)
    check 1    rollout copies vs v (digests, repair), the learners' view of the sample: mismatch
               on the steps taken at v, policy lag on the older ones
    update     the algorithm's loss on the learner group
    check 2    the candidate: finite, update size, KL and flips on the probe set (the gate decides)
    sync       the learners' parts to the rollout actors: version v + 1, strictly assembled

An algorithm is this mixin before RLlib's, with its own `sample_episodes`:

    class MoEPPO(MoEAlgorithm, PPO): ...
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.utils import force_list
from ray.rllib.utils.metrics import (
    ALL_MODULES,
    ENV_RUNNER_RESULTS,
    ENV_RUNNER_SAMPLING_TIMER,
    LEARNER_RESULTS,
    LEARNER_UPDATE_TIMER,
    NUM_ENV_STEPS_SAMPLED_LIFETIME,
    NUM_ENV_STEPS_TRAINED_LIFETIME,
    NUM_MODULE_STEPS_TRAINED_LIFETIME,
    SYNCH_WORKER_WEIGHTS_TIMER,
    TIMERS,
)

from moe_rl.algo.monitoring import MoEMonitoring
from moe_rl.algo.sync_gate import SyncGate
from moe_rl.core.gate import validate_consistency
from moe_rl.core.sample_filter import drop_nonfinite
from moe_rl.core.settings import validate_weight_sync
from moe_rl.rllib.runner import load_shards_into_runner


class MoEAlgorithm:
    """Mixed in before an RLlib Algorithm whose config is a moe_rl.algo.moe_config.MoEConfig."""

    def setup(self, config) -> None:
        super().setup(config)
        self._pending_faults: list = []   # test hooks (moe_rl.algo.faults.inject)
        self.gate = SyncGate(self.env_runner_group, lambda: self.learner_group, self.config.num_learners,
                             validate_consistency(self.config.consistency_settings),
                             validate_weight_sync(self.config.weight_sync_settings), self.rollouts_wait)
        self._sync_rollout_weights()
        self._faults = {"env_runner_failures": 0, "lost_env_steps": 0, "env_runners_restored": 0,
                        "nonfinite_episodes_dropped": 0, "nonfinite_env_steps_dropped": 0}
        self.monitoring = MoEMonitoring(self)   # driver-only: anomaly detection, memory, Prometheus
        self.callbacks = force_list(self.callbacks) + [self.monitoring]

    @property
    def sync_gate(self) -> Optional[SyncGate]:
        """The gate where consistency checks run (their ledger: `sync_gate.rows`), else None."""
        gate = getattr(self, "gate", None)
        return gate if gate is not None and gate.checks else None

    @property
    def weights_version(self) -> int:
        """The version of the weights the rollout actors run (RLlib's WEIGHTS_SEQ_NO on them)."""
        return self.gate.version

    def cleanup(self) -> None:
        if getattr(self, "gate", None) is not None:
            self.gate.close()
        if getattr(self, "monitoring", None) is not None:
            self.monitoring.close()
        super().cleanup()

    # --- one iteration ----------------------------------------------------------------------------
    def training_step(self) -> None:
        seconds = dict.fromkeys(PHASES, 0.0)
        with self._timed("sample_s", seconds):
            episodes = self.sample_episodes()
        if not episodes:
            return
        steps = sum(len(ep) for ep in episodes)
        gate = self.gate
        check = gate.checks and (self.check_due(gate.s.every) or gate.holding)
        if check:
            with self._timed("check_s", seconds):
                gate.before_update(episodes, self.iteration)
        self._inject_faults("before_update")
        with self._timed("learn_s", seconds):
            self._update(episodes)
        gate.note_update()
        self._inject_faults("after_update")
        try:
            if check:
                with self._timed("check_s", seconds):
                    verdict = gate.after_update(self.iteration)
                self._log_check(verdict)
                if verdict["decision"] in ("hold", "rollback"):   # rollouts stay on the last good weights
                    return
            with self._timed("sync_s", seconds):
                self._sync_rollout_weights(prepare_check=gate.checks and self.check_due(gate.s.every, ahead=1))
        finally:
            seconds["env_steps_per_s"] = steps / max(sum(seconds.values()), 1e-9)
            for k, v in seconds.items():
                self.metrics.log_value(("moe_rl", k), v, window=1)

    @contextlib.contextmanager
    def _timed(self, phase: str, seconds: dict):
        """Times a phase once. The one measurement goes to RLlib's own timer for that phase (TIMERS,
        where RLlib has one: what RLlib's dashboards read) and to this iteration's phase seconds
        (`moe_rl/<phase>`, per iteration: where the time went, and the check's share)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            seconds[phase] += dt
            if phase in RLLIB_TIMERS:
                self.metrics.log_value((TIMERS, RLLIB_TIMERS[phase]), dt, reduce="ema")

    def _log_check(self, verdict) -> None:
        rows = self.sync_gate.rows
        row = rows[-1]
        figures = {"drift/" + k: row[k] for k in ("k1", "k3", "max_abs_logp_diff", "routing_agreement", "lag_versions",
                                                    "lag_k3", "k3_old_new", "probe_flip_rate", "policy_lag_mean",
                                                    "policy_lag_k3") if k in row}
        figures.update({"drift/decision": verdict["decision"], "drift/cause": ";".join(verdict["causes"]),
                        "drift/action": ";".join(verdict["actions"]), "drift/repairs": self.sync_gate.repairs})
        for k, v in figures.items():
            if isinstance(v, str):
                self.metrics.log_value(("moe_rl", k), v, reduce="item")
            else:
                self.metrics.log_value(("moe_rl", k), v, window=1)

    # --- weights ----------------------------------------------------------------------------------
    def runner_call(self, fn, runner_ids=None, **kwargs):
        """fn(runner, **kwargs) on the rollout actors that sample -> (runner ids, results)."""
        return self.gate.runner_call(fn, runner_ids, **kwargs)

    def _sync_rollout_weights(self, prepare_check: bool = False) -> None:
        self.gate.sync(prepare_check)
        if self.gate.transport is not None:
            self.metrics.log_value(("moe_rl", "sync/collective_fallbacks"), self.gate.transport.fallbacks, window=1)

    def get_module(self, module_id=DEFAULT_MODULE_ID):
        """RLlib's: the local EnvRunner's module, brought to the synced version first. MoEPPO syncs
        only the rollout actors that sample, so with remote ones the local runner (which RLlib keeps
        for spaces and evaluation) would otherwise still hold its initial weights."""
        group = self.env_runner_group
        if group is not None and group.local_env_runner is not None and group.num_remote_env_runners() > 0:
            load_shards_into_runner(group.local_env_runner, self.gate.synced_refs, self.gate.version)
        return super().get_module(module_id)

    def continue_ledgers(self, drift_rows, alerts_total: int, metrics_rows=()) -> None:
        """A resumed run: the gate's ledger, the alert count and the rolling return go on from the
        checkpoint's."""
        if self.sync_gate is not None:
            self.sync_gate.rows[:] = list(drift_rows)
        self.monitoring.continue_from(len(drift_rows), alerts_total, metrics_rows)

    def _inject_faults(self, stage: str) -> None:
        for fault in [f for f in self._pending_faults if f.stage == stage]:
            self._pending_faults.remove(fault)
            fault.apply(self)

    # --- checkpoints ------------------------------------------------------------------------------
    def get_state(self, *args, **kwargs):
        state = super().get_state(*args, **kwargs)
        if self.sync_gate is not None:
            state[GATE_STATE] = self.sync_gate.get_state()
        return state

    def set_state(self, state) -> None:
        self._settle_gate()
        super().set_state(state)
        if self.sync_gate is not None and GATE_STATE in state:
            self.sync_gate.set_state(state[GATE_STATE])

    def _settle_gate(self) -> None:
        """Nothing is kept in the background while the learners change."""
        if getattr(self, "gate", None) is not None:
            self.gate.settle()

    def restore_from_path(self, path, *args, **kwargs):
        self._settle_gate()
        super().restore_from_path(path, *args, **kwargs)
        self._sync_rollout_weights()   # the restored weights are a new version for the rollouts

    # Whether the rollout actors sample only after the sync (synchronous sampling, as MoEPPO's):
    # then the gate may send them the candidate while it is judged.
    rollouts_wait = False

    def check_due(self, every: int, ahead: int = 0) -> bool:
        """consistency.every: a check before every K-th sync; one iteration, one sync here.
        ahead=1: whether the next iteration's is."""
        return (self.iteration + ahead) % every == 0

    def sample_episodes(self) -> list:
        """This iteration's training batch, as the algorithm samples it (PPO: synchronously; APPO:
        whatever the rollout actors finished, never waiting for the learner)."""
        raise NotImplementedError

    def count_sampling_faults(self, healthy_before: int, episodes) -> list:
        """Rollout actors lost while sampling (a failed request loses one rollout fragment per
        vectorised env) and episodes with NaN/Inf observations or rewards, which never reach the
        checks or the learners: dropped here and counted (`faults/*`)."""
        failed = max(0, healthy_before - self.env_runner_group.num_healthy_remote_workers())
        self._faults["env_runner_failures"] += failed
        self._faults["lost_env_steps"] += failed * self.config.get_rollout_fragment_length() * max(
            1, self.config.num_envs_per_env_runner)
        episodes, dropped, steps = drop_nonfinite(episodes or [])
        self._faults["nonfinite_episodes_dropped"] += dropped
        self._faults["nonfinite_env_steps_dropped"] += steps
        self._log_faults()
        return episodes

    def _log_faults(self) -> None:
        for k, v in self._faults.items():
            self.metrics.log_value(("moe_rl", f"faults/{k}"), v, window=1)

    def restore_env_runners(self, env_runner_group):
        """RLlib restarts failed rollout actors and syncs them from the learner group, which may
        be ahead of the version the rollouts run (a hold). A replacement takes the synced version
        before it samples."""
        restored = super().restore_env_runners(env_runner_group)
        if not restored or env_runner_group is not self.env_runner_group:
            return restored
        self._faults["env_runners_restored"] += len(restored)
        if self.gate.version:
            self.gate.push_synced_weights(runner_ids=restored, force=True)
        return restored

    @property
    def update_epochs(self) -> int:
        return self.config.num_epochs

    def _update(self, episodes):
        """The algorithm's loss over the batch on the learner group (RLlib's LearnerGroup or the
        DeepSpeed one), `update_epochs` passes."""
        learner_results = self.learner_group.update(
            episodes=episodes,
            timesteps={
                NUM_ENV_STEPS_SAMPLED_LIFETIME: self.metrics.peek(
                    (ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME)),
                NUM_MODULE_STEPS_TRAINED_LIFETIME: self.metrics.peek(
                    (LEARNER_RESULTS, ALL_MODULES, NUM_MODULE_STEPS_TRAINED_LIFETIME), default=0),
                # APPO's target network moves on after this many trained steps (PPO reads none)
                NUM_ENV_STEPS_TRAINED_LIFETIME: self.metrics.peek(
                    (LEARNER_RESULTS, ALL_MODULES, NUM_ENV_STEPS_TRAINED_LIFETIME), default=0),
            },
            num_epochs=self.update_epochs,
            minibatch_size=self.config.minibatch_size,
            shuffle_batch_per_epoch=self.config.shuffle_batch_per_epoch,
        )
        self.metrics.aggregate(learner_results, key=LEARNER_RESULTS)
        for rank, stats in enumerate(self.learner_group.memory_stats()):
            for k, v in stats.items():
                self.metrics.log_value(("moe_rl", f"learner/{k}/rank{rank}"), v, window=1)
        return learner_results


GATE_STATE = "moe_rl_gate"
PHASES = ("sample_s", "check_s", "learn_s", "sync_s")
# RLlib's timer for each phase it times itself in its own training_step (the check is moe-rl's)
RLLIB_TIMERS = {"sample_s": ENV_RUNNER_SAMPLING_TIMER, "learn_s": LEARNER_UPDATE_TIMER,
                "sync_s": SYNCH_WORKER_WEIGHTS_TIMER}
