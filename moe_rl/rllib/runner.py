"""What runs on a rollout actor (an RLlib EnvRunner) for the weight sync and the checks.

The functions take the runner as their first argument, as EnvRunnerGroup.foreach_env_runner calls
them: load the learners' published parts (strictly), digest the copy it holds, hand out one tensor.
"""
from __future__ import annotations

from typing import Any, Dict, List

import ray
from ray.rllib.core import COMPONENT_RL_MODULE, DEFAULT_MODULE_ID
from ray.rllib.core.rl_module.apis import InferenceOnlyAPI
from ray.rllib.core.rl_module.multi_rl_module import MultiRLModule
from ray.rllib.utils.metrics import WEIGHTS_SEQ_NO

from moe_rl.core.digests import Sample, state_digests, state_dtypes
from moe_rl.core.sharding import assemble_modules, canonical_views, stack_experts


def runner_modules(runner) -> Dict[str, Any]:
    """{module_id: RLModule} of the copy this runner samples with."""
    module = runner.module
    if isinstance(module, MultiRLModule):
        return dict(module.items())
    return {DEFAULT_MODULE_ID: module}


def synced_state(module, canonical: bool = True) -> Dict[str, Any]:
    """The part of a rollout copy's state the weight sync provides: everything but the module's
    non-inference attributes (RLlib's default PPO module keeps its value function on the rollout
    side; the learners publish the inference-only state). canonical: stacked experts as their
    per-expert entries, the form the learners publish and digest, as views of the copy's own
    tensors (no copy; a collective sync receives into them)."""
    skip = tuple(module.get_non_inference_attributes()) if isinstance(module, InferenceOnlyAPI) else ()
    state = {k: v for k, v in module.state_dict().items() if not (skip and k.split(".")[0] in skip)}
    return canonical_views(state) if canonical else state


def load_shards_into_runner(runner, shard_refs: List[ray.ObjectRef], version: int, force: bool = False) -> None:
    """Assemble the learners' published parts per module and load them, strictly (a missing,
    unknown or duplicated tensor is an error, never a silent partial load). The copy takes the
    version number of the sync; `force` reloads the version it already has (a repair: RLlib skips
    a state whose version is not newer than the runner's), and a copy that was sent a withdrawn
    candidate goes back to the older version's weights and number."""
    modules = runner_modules(runner)
    full = assemble_modules(ray.get(list(shard_refs)), {mid: synced_state(m).keys() for mid, m in modules.items()})
    full = {mid: stack_experts(s, synced_state(modules[mid], canonical=False).keys()) for mid, s in full.items()}
    state = full if isinstance(runner.module, MultiRLModule) else full[DEFAULT_MODULE_ID]
    if force:   # no version number: RLlib loads it whatever version the copy claims
        runner.set_state({COMPONENT_RL_MODULE: state})
    # RLlib loads a numbered state only when it is newer than the copy's, but takes its number
    # either way: after a forced load this sets the number back where a withdrawn candidate moved it.
    runner.set_state({COMPONENT_RL_MODULE: state, WEIGHTS_SEQ_NO: version})


def runner_digests(runner, sample: Sample = None) -> Dict[str, Dict]:
    return {mid: state_digests(synced_state(m), sample=sample) for mid, m in runner_modules(runner).items()}


def runner_dtypes(runner) -> Dict[str, Dict[str, str]]:
    return {mid: state_dtypes(synced_state(m)) for mid, m in runner_modules(runner).items()}


def runner_tensor(runner, module_id: str, name: str):
    t = synced_state(runner_modules(runner)[module_id]).get(name)
    return None if t is None else t.detach().float().cpu().numpy()
