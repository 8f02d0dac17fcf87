"""MoEAlgorithm: what every moe-rl Algorithm adds to RLlib's (MoEPPO, MoEAPPO, MoEDQN). One
training step, each part named for what it moves:

    collect      rollout actors step their envs with the inference copy (weights version v):
                 synchronously (every actor runs v, then waits: PPO, DQN) or asynchronously (each
                 always has a request in flight: APPO)
    check 1      rollout copies vs v (digests, repair), the learners' view of what was collected:
                 mismatch on the steps taken at v, policy lag on the older ones
    train        what the family trains on: the batch just collected (PPO, APPO: `passes` passes),
                 or draws from the replay buffer it went into (DQN: `updates` draws, none until
                 `learning_starts` steps were sampled)
    check 2      the candidate: finite, update size, how far it moved on the probe set (the gate
                 decides: moe_rl.algo.sync_gate)
    sync         the learners' parts to the rollout actors: version v + 1, strictly assembled

A family says what its step is (`training_plan()`: an Iteration) and, for a replay, how it stores and
draws; nothing else of the loop is its own. An algorithm is this mixin before RLlib's:

    class MoEPPO(MoEAlgorithm, PPO): ...
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import List, Optional

from ray.rllib.core import DEFAULT_MODULE_ID
from ray.rllib.execution.rollout_ops import synchronous_parallel_sample
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
from moe_rl.core.sample_filter import drop_nonfinite
from moe_rl.rllib.runner import load_shards_into_runner

SAMPLE_TAG = "moe_rl_sample"


@dataclass(frozen=True)
class Iteration:
    """What one training step of a family moves (read by MoEAlgorithm.training_step)."""

    sampling: str              # "synchronous" | "asynchronous": do the rollout actors wait for the sync
    trains_on: str             # "fresh": the batch just collected | "replay": draws from a replay buffer
    passes: int = 1            # passes over each batch (PPO's epochs, APPO's circular-buffer replays)
    updates: int = 1           # learner updates per step (DQN: replay draws per sampled batch)
    learning_starts: int = 0   # env steps sampled before the first update


class MoEAlgorithm:
    """Mixed in before an RLlib Algorithm whose config is a moe_rl.algo.moe_config.MoEConfig."""

    def setup(self, config) -> None:
        super().setup(config)
        self._pending_faults: list = []   # test hooks (moe_rl.algo.faults.inject)
        plan = self.training_plan()
        self.gate = SyncGate(self.env_runner_group, lambda: self.learner_group, self.config.num_learners,
                             self.config.consistency_settings, self.config.weight_sync_settings,
                             rollouts_wait=plan.sampling == "synchronous")
        self._sync_rollout_weights()
        self._faults = {"env_runner_failures": 0, "lost_env_steps": 0, "env_runners_restored": 0,
                        "nonfinite_episodes_dropped": 0, "nonfinite_env_steps_dropped": 0}
        self._healthy_runners = self._healthy_runner_ids()
        self.monitoring = MoEMonitoring(self)   # driver-only: anomaly detection, memory, Prometheus
        self.callbacks = force_list(self.callbacks) + [self.monitoring]

    def training_plan(self) -> Iteration:
        """This family's training step (MoEPPO, MoEAPPO, MoEDQN say theirs)."""
        raise NotImplementedError

    @property
    def sync_gate(self) -> Optional[SyncGate]:
        """The gate where consistency checks run (their ledger: `sync_gate.ledger()`), else None."""
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

    # --- one training step ------------------------------------------------------------------------
    def training_step(self) -> None:
        plan, gate = self.training_plan(), self.gate
        seconds = dict.fromkeys(PHASES, 0.0)
        with self._timed("sample_s", seconds):
            episodes = self.collect(plan)
        if not episodes:
            return
        steps = sum(len(ep) for ep in episodes)
        if plan.trains_on == "replay":
            self.store(episodes)
            if self._sampled() < plan.learning_starts:   # no update yet: nothing to check or sync
                return
        check = gate.check_due()
        if check:
            with self._timed("check_s", seconds):
                gate.before_update(episodes, self.iteration)
        self._inject_faults("before_update")
        with self._timed("learn_s", seconds):
            for _ in range(plan.updates):
                self._update(episodes if plan.trains_on == "fresh" else self.draw(), plan.passes)
        gate.note_update()
        self._inject_faults("after_update")
        try:
            if check:
                with self._timed("check_s", seconds):
                    verdict = gate.after_update(self.iteration)
                self._log_check(verdict)
                if verdict.decision in ("hold", "rollback"):   # rollouts stay on the last good weights
                    return
            with self._timed("sync_s", seconds):
                self._sync_rollout_weights(prepare_check=gate.check_due(ahead=1))
        finally:   # summed over the iteration's training steps (APPO and DQN take many an iteration)
            for k, v in {**seconds, "env_steps": steps}.items():
                self.metrics.log_value(("moe_rl", k), v, reduce="sum")   # summed per iteration

    def collect(self, plan: Iteration) -> list:
        """This step's episodes, as the family samples (see the module docstring). A rollout actor
        that dies mid-sample costs only its in-flight request: the others fill the batch, the loss
        is counted (`faults/*`), and RLlib restarts the actor before the next step. Episodes with
        non-finite observations or rewards are dropped here and counted."""
        group = self.env_runner_group
        self._faults["env_runner_failures"] += self._runners_lost()   # since the last look: in a sync or check
        if plan.sampling == "asynchronous" and group.num_remote_env_runners():
            episodes, metrics = self._collect_asynchronously(self.config.total_train_batch_size)
        else:
            by_agent = self.config.count_steps_by == "agent_steps"
            target = None if plan.trains_on == "replay" else self.config.total_train_batch_size
            episodes, metrics = synchronous_parallel_sample(
                worker_set=group, max_agent_steps=target if by_agent else None,
                max_env_steps=None if by_agent else target, sample_timeout_s=self.config.sample_timeout_s,
                _uses_new_env_runners=True, _return_metrics=True)
        if episodes:
            self.metrics.aggregate(metrics, key=ENV_RUNNER_RESULTS)
        return self.count_sampling_faults(episodes)

    def _collect_asynchronously(self, target: int):
        """Whatever the rollout actors finished, until a batch is full. Every rollout actor keeps a
        sample request in flight (max_requests_in_flight_per_env_runner), so it steps its envs while
        the learner updates and the gate checks; what it returns after a sync was partly sampled
        with the weights before it (policy lag)."""
        group = self.env_runner_group
        episodes, metrics, steps = [], [], 0
        while steps < target and group.num_healthy_remote_workers():
            for eps, m in group.foreach_env_runner_async_fetch_ready(_sample_with_metrics, tag=SAMPLE_TAG,
                                                                     timeout_seconds=0.05):
                episodes.extend(eps)
                metrics.append(m)
                steps += sum(len(e) for e in eps)
        return episodes, metrics

    def store(self, episodes: list) -> None:
        """A replay family keeps what it collected (MoEDQN: RLlib's replay buffer)."""
        raise NotImplementedError

    def draw(self) -> list:
        """A replay family's training batch for one update."""
        raise NotImplementedError

    def _sampled(self) -> int:
        return self.metrics.peek((ENV_RUNNER_RESULTS, NUM_ENV_STEPS_SAMPLED_LIFETIME), default=0)

    @contextlib.contextmanager
    def _timed(self, phase: str, seconds: dict):
        """Times a phase once. The one measurement goes to RLlib's own timer for that phase (TIMERS,
        where RLlib has one: what RLlib's dashboards read) and to this step's phase seconds
        (`moe_rl/<phase>`, summed over the iteration: where the time went, and the check's share)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            seconds[phase] += dt
            if phase in RLLIB_TIMERS:
                self.metrics.log_value((TIMERS, RLLIB_TIMERS[phase]), dt, reduce="ema")

    def _log_check(self, verdict) -> None:
        figures = {"drift/" + k: v for k, v in verdict.figures.items()}
        figures.update({"drift/decision": verdict.decision, "drift/cause": ";".join(verdict.causes),
                        "drift/action": ";".join(verdict.actions)})
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
        fallbacks = self.gate.collective_fallbacks()
        if fallbacks is not None:
            self.metrics.log_value(("moe_rl", "sync/collective_fallbacks"), fallbacks, window=1)

    def get_module(self, module_id=DEFAULT_MODULE_ID):
        """RLlib's: the local EnvRunner's module, brought to the synced version first. moe-rl syncs
        only the rollout actors that sample, so with remote ones the local runner (which RLlib keeps
        for spaces and evaluation) would otherwise still hold its initial weights."""
        group = self.env_runner_group
        if group is not None and group.local_env_runner is not None and group.num_remote_env_runners() > 0:
            load_shards_into_runner(group.local_env_runner, self.gate.weights.refs, self.gate.version)
        return super().get_module(module_id)

    def continue_ledgers(self, drift_rows, alerts_total: int, metrics_rows=()) -> None:
        """A resumed run: the gate's ledger, the alert count and the rolling return go on from the
        checkpoint's."""
        if self.sync_gate is not None:
            self.sync_gate.ledger()[:] = list(drift_rows)
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

    # --- faults -----------------------------------------------------------------------------------
    def _healthy_runner_ids(self) -> set:
        group = self.env_runner_group
        return set(group.healthy_env_runner_ids()) if group.num_remote_env_runners() else set()

    def _runners_lost(self) -> int:
        """Rollout actors that were healthy at the last look and are not now, wherever they were
        lost (sampling, a weight sync, the check's digests, a lost host); one restored by RLlib
        is healthy again and counts again if it is lost again."""
        now = self._healthy_runner_ids()
        lost, self._healthy_runners = self._healthy_runners - now, now
        return len(lost)

    def count_sampling_faults(self, episodes) -> list:
        """Rollout actors lost while sampling (a failed request loses one rollout fragment per
        vectorised env) and episodes with NaN/Inf observations or rewards, which never reach the
        checks or the learners: dropped here and counted (`faults/*`)."""
        failed = self._runners_lost()
        self._faults["env_runner_failures"] += failed
        self._faults["lost_env_steps"] += failed * self.config.get_rollout_fragment_length() * max(
            1, self.config.num_envs_per_env_runner)
        episodes, dropped, steps = drop_nonfinite(episodes or [])
        self._faults["nonfinite_episodes_dropped"] += dropped
        self._faults["nonfinite_env_steps_dropped"] += steps
        for k, v in self._faults.items():
            self.metrics.log_value(("moe_rl", f"faults/{k}"), v, window=1)
        return episodes

    def restore_env_runners(self, env_runner_group):
        """RLlib restarts failed rollout actors and syncs them from the learner group, which may
        be ahead of the version the rollouts run (a hold). A replacement takes the synced version
        before it samples."""
        if env_runner_group is not self.env_runner_group or not hasattr(self, "_faults"):
            return super().restore_env_runners(env_runner_group)
        self._faults["env_runner_failures"] += self._runners_lost()   # before RLlib makes them healthy again
        restored = super().restore_env_runners(env_runner_group)
        if not restored:
            return restored
        self._faults["env_runners_restored"] += len(restored)
        self._healthy_runners |= set(restored)
        if self.gate.version:
            self.gate.push_synced_weights(runner_ids=restored, force=True)
        return restored

    def _update(self, episodes: List, passes: int):
        """The family's loss over the batch on the learner group (RLlib's LearnerGroup or the
        DeepSpeed one), `passes` passes."""
        learner_results = self.learner_group.update(
            episodes=episodes,
            timesteps={
                NUM_ENV_STEPS_SAMPLED_LIFETIME: self._sampled(),
                NUM_MODULE_STEPS_TRAINED_LIFETIME: self.metrics.peek(
                    (LEARNER_RESULTS, ALL_MODULES, NUM_MODULE_STEPS_TRAINED_LIFETIME), default=0),
                # APPO's target network moves on after this many trained steps (PPO reads none)
                NUM_ENV_STEPS_TRAINED_LIFETIME: self.metrics.peek(
                    (LEARNER_RESULTS, ALL_MODULES, NUM_ENV_STEPS_TRAINED_LIFETIME), default=0),
            },
            num_epochs=passes,
            minibatch_size=self.config.minibatch_size,
            shuffle_batch_per_epoch=self.config.shuffle_batch_per_epoch,
        )
        self.metrics.aggregate(self.after_update(learner_results), key=LEARNER_RESULTS)
        for rank, stats in enumerate(self.learner_group.memory_stats()):
            for k, v in stats.items():
                self.metrics.log_value(("moe_rl", f"learner/{k}/rank{rank}"), v, window=1)
        return learner_results

    def after_update(self, learner_results):
        """What a family does with an update's results before they are logged (MoEDQN: the replay's
        priorities from the TD errors, which it takes out)."""
        return learner_results


def _sample_with_metrics(runner):
    return runner.sample(), runner.get_metrics()


GATE_STATE = "moe_rl_gate"
PHASES = ("sample_s", "check_s", "learn_s", "sync_s")
# RLlib's timer for each phase it times itself in its own training_step (the check is moe-rl's)
RLLIB_TIMERS = {"sample_s": ENV_RUNNER_SAMPLING_TIMER, "learn_s": LEARNER_UPDATE_TIMER,
                "sync_s": SYNCH_WORKER_WEIGHTS_TIMER}
