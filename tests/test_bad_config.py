"""Invalid settings fail fast: exit code 2, one line naming the field and what is allowed, and no
Ray started (in-process, so the check is that ray.is_initialized() stays False)."""
import ast
import dataclasses
import inspect
import os
import pathlib

import pytest
import ray
from ray.rllib.algorithms.algorithm_config import NotProvided

from moe_rl import MoEPPOConfig
from moe_rl.algo.config_builders import SECTION_FIELDS
from moe_rl.app.cli import main
from moe_rl.app.run_config import SECTIONS, TOP_LEVEL
from moe_rl.core.errors import ConfigError
from moe_rl.core.gate import CONSISTENCY_DEFAULTS
from moe_rl.core.settings import DEEPSPEED_DEFAULTS, MOE_DEFAULTS, WEIGHT_SYNC_DEFAULTS, validate_moe
from moe_rl.core.stability import STABILITY_DEFAULTS, validate_stability

pytestmark = pytest.mark.pure
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = {"moe": MOE_DEFAULTS, "deepspeed": DEEPSPEED_DEFAULTS, "stability": STABILITY_DEFAULTS,
            "consistency": CONSISTENCY_DEFAULTS, "weight_sync": WEIGHT_SYNC_DEFAULTS}

CASES = [
    # wrong types
    ("moe.num_experts=eight", "moe.num_experts"), ("moe.top_k=1.5", "moe.top_k"),
    ("moe.shared_expert=maybe", "moe.shared_expert"), ("moe.vf_hiddens=64", "moe.vf_hiddens"),
    ("moe.router_kwargs=3", "moe.router_kwargs"), ("training.lr=fast", "training.lr"),
    ("iterations=ten", "iterations"), ("seed=-1", "seed"), ("env_config=5", "env_config"),
    ("consistency.every=true", "consistency.every"),
    # out of range
    ("moe.num_experts=0", "moe.num_experts"), ("moe.top_k=0", "moe.top_k"), ("moe.top_k=9", "moe.top_k"),
    ("moe.temperature=0", "moe.temperature"), ("moe.temperature=.inf", "moe.temperature"),
    ("moe.expert_dropout=1.0", "moe.expert_dropout"), ("moe.capacity_factor=0", "moe.capacity_factor"),
    ("moe.trainer_capacity_factor=-2", "moe.trainer_capacity_factor"), ("moe.aux_loss_coef=-0.1", "moe.aux_loss_coef"),
    ("moe.d_model=0", "moe.d_model"), ("moe.num_heads=3", "moe.num_heads"), ("training.lr=-1", "training.lr"),
    ("training.gamma=1.5", "training.gamma"), ("training.minibatch_size=0", "training.minibatch_size"),
    ("env_runners.num_env_runners=-1", "env_runners.num_env_runners"), ("iterations=0", "iterations"),
    ("consistency.thresholds.k3=-1", "consistency.thresholds.k3"),
    ("consistency.thresholds.routing_agreement=2", "consistency.thresholds.routing_agreement"),
    ("consistency.correction.is_threshold=0", "consistency.correction.is_threshold"),
    ("deepspeed.num_threads=0", "deepspeed.num_threads"),
    # unknown names and values
    ("moe.router=magic", "moe.router"), ("moe.router_init=xavier", "moe.router_init"),
    ("moe.activation=swish", "moe.activation"), ("moe.dispatch=fast", "moe.dispatch"),
    ("moe.inference_dtype=fp8", "moe.inference_dtype"), ("moe.experts=4", "moe.experts"),
    ("moe.rollout_compile=1", "moe.rollout_compile"),
    ("training.learning_rate=1e-3", "training.learning_rate"), ("consistency.policy=panic", "consistency.policy"),
    ("consistency.thresholds.k9=1", "consistency.thresholds.k9"), ("deepspeed.zero=3", "deepspeed.zero"),
    ("stability.clip=1", "stability.clip"), ("stability.optimizer=sgd", "stability.optimizer"),
    ("stability.lr_schedules.decoder.schedule=constant", "stability.lr_schedules"),
    ("learners.num_learner=2", "learners.num_learner"),
    ("moe.policy_head=triple", "moe.policy_head"), ("nonsense=1", "nonsense"), ("env=NoSuchEnv-v0", "env"),
    # incompatible combinations
    ("moe.ep_size=3", "moe.ep_size"), ("deepspeed.config.zero_optimization.stage=3",
                                       "deepspeed.config.zero_optimization.stage"),
    ("moe.router=task", "moe.router_kwargs.num_tasks"),
    ("moe.router_kwargs.sinkhorn_epsilon=0.2", "moe.router_kwargs.sinkhorn_epsilon"),  # not a topk option
    ("consistency.sample=10", "consistency.sample"),
    ("weight_sync.transport=nccl", "weight_sync.transport"), ("weight_sync.bucket_mb=0", "weight_sync.bucket_mb"),
    ("weight_sync.transport=collective", "weight_sync.transport"),   # the quickstart's learner is local
]


@pytest.mark.parametrize("override, field", CASES, ids=[c[0] for c in CASES])
def test_invalid_setting_exits_2_naming_the_field(override, field, capsys):
    assert main(["train", "--set", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"moe-rl: error: {field}: "), err
    assert not ray.is_initialized()


def test_ep_size_not_dividing_learners():
    assert main(["train", "--num-learners", "3", "--ep-size", "2"]) == 2
    assert not ray.is_initialized()


def test_the_cases_cover_every_section_of_a_run_config():
    """Each section of a run config (run_config.SECTIONS) has a case, every case names a section or
    a top-level key (or the unknown one), and no override is there twice: a section added without
    a case, or a case whose field is misspelt, fails here."""
    fields = [field for _, field in CASES]
    assert {f.split(".")[0] for f in fields if "." in f} == set(SECTIONS)
    assert {f for f in fields if "." not in f} <= set(TOP_LEVEL) | {"nonsense"}
    assert len({override for override, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("section", list(SECTION_FIELDS))
def test_each_builder_is_its_sections_dataclass(section):
    """The builder's keywords are exactly the fields of the section's dataclass, in its order, with no
    default of their own; its help lists each with the dataclass's default; the validator's defaults
    are the dataclass's; a misspelt key is the same one-line ConfigError as in a run config."""
    fields = dataclasses.fields(SECTION_FIELDS[section])
    builder = getattr(MoEPPOConfig, section)
    params = inspect.signature(builder).parameters
    named = [n for n, p in params.items() if p.kind == p.KEYWORD_ONLY]
    assert named == [f.name for f in fields]
    assert all(params[n].default is NotProvided for n in named)
    defaults = DEFAULTS[section]
    assert defaults == dataclasses.asdict(SECTION_FIELDS[section]())
    assert all(f"{n}: " in builder.__doc__ and f"Default: {defaults[n]!r}" in builder.__doc__.replace("\n        ", " ")
               for n in named)
    config = MoEPPOConfig()
    with pytest.raises(ConfigError, match=rf"^{section}\.nope: unknown key, allowed: "):
        getattr(config, section)(nope=1)
    getattr(config, section)(**{named[0]: defaults[named[0]]})
    assert getattr(config, f"{section}_settings")[named[0]] == defaults[named[0]]


def _literal(node):
    try:
        return ast.literal_eval(node)
    except ValueError:
        return object()


def test_each_default_is_written_once():
    """No module but moe_rl/core/sections.py holds a table of a section's defaults: a dict literal
    of three or more of one section's keys, most of them at their default (a chosen model, such
    as drift_study's, is not one)."""
    sections = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTION_FIELDS.items()}
    found = []
    for path in sorted(pathlib.Path(ROOT).glob("moe_rl/**/*.py")) + sorted(pathlib.Path(ROOT).glob("actors/*.py")):
        if path.name == "sections.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
                keys = {k.value for k in node.keys}
                for name, own in sections.items():
                    if len(keys) >= 3 and keys <= own:
                        at_default = sum(_literal(v) == DEFAULTS[name][k.value] for k, v in zip(node.keys, node.values))
                        if at_default >= 0.8 * len(keys):
                            found.append(f"{path.relative_to(ROOT)}:{node.lineno} ({name}: {sorted(keys)})")
    assert not found, "\n".join(found)




def test_validate_checks_each_section_once_and_hands_it_on_typed_and_frozen():
    """validate() keeps every section checked and typed: the module's model config carries the
    same object, a validator passes it through unchecked, nobody can change it in place; a builder
    call after validate() gives a plain mapping again, which the next validate() checks."""
    config = MoEPPOConfig().environment("CartPole-v1").moe(num_experts=4).stability(grad_clip=1.0)
    config.validate()
    for section, cls in SECTION_FIELDS.items():
        assert type(getattr(config, f"{section}_settings")) is cls, section
    moe = config.moe_settings
    assert moe.num_experts == 4 and moe.to_dict() == {**MOE_DEFAULTS, "num_experts": 4}
    with pytest.raises(TypeError, match=r"read as attributes: \.num_experts"):   # never by string key
        moe["num_experts"]
    assert config.stability_settings.grad_clip == 1.0
    assert config.model_config["moe"] is moe
    assert validate_moe(moe) is moe and validate_stability(config.stability_settings) is config.stability_settings
    with pytest.raises(dataclasses.FrozenInstanceError):
        moe.top_k = 3
    with pytest.raises(TypeError):
        moe["top_k"] = 3
    config.moe(top_k=5)
    assert type(config.moe_settings) is dict and config.moe_settings["num_experts"] == 4
    with pytest.raises(ConfigError, match=r"^moe\.top_k: "):
        config.validate()
    config.moe(top_k=3).validate()
    assert config.moe_settings.top_k == 3 and type(config.moe_settings) is SECTION_FIELDS["moe"]
