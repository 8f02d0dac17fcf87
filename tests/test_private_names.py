"""No private RLlib or Ray name outside moe_rl/rllib/ray_private.py, found by reading the code's
syntax tree against the names RLlib and Ray define (not by grepping text).

- A class of ours that runs on RLlib's objects (any class composed with an RLlib or Ray class:
  the learner, config and algorithm mixins) must not read, write or override a private name that
  an RLlib/Ray class in that composition defines (`self._params`, `def _make_module`).
- Anywhere, an attribute of another object (not `self`) must not be a private name RLlib or Ray
  defines (`runner._weights_seq_no`), nor may a module import `ray._private` or a private `ray`
  module.
RLlib's documented override points for an RLModule (`_forward`, `_forward_train`, ...) are public
API by RLlib's own docs and are allowed.
"""
import ast
import importlib
import inspect
import os
import pkgutil
import textwrap

import pytest

import moe_rl

pytestmark = pytest.mark.pure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ISOLATING = os.path.join(ROOT, "moe_rl", "rllib", "ray_private.py")
# RLModule's override points: RLlib's docs tell users to override them (rl_module.py's forward_*).
DOCUMENTED = {"_forward", "_forward_train", "_forward_exploration", "_forward_inference"}


def _private_names_of(cls) -> set:
    """Private (one underscore) methods and attributes a class's own source defines."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _is_ray(cls) -> bool:
    return (cls.__module__ or "").split(".")[0] == "ray"


def our_modules():
    mods = []
    for info in pkgutil.walk_packages(moe_rl.__path__, "moe_rl."):
        mods.append(importlib.import_module(info.name))
    return [m for m in mods if os.path.abspath(m.__file__) != ISOLATING]


def ray_private_names() -> set:
    """Every private name a class of RLlib, Ray Tune or Ray core defines (that our code could touch)."""
    import ray
    names = set()
    top = os.path.dirname(ray.__file__)
    for sub in ("rllib", "actor.py", "_private/worker.py", "experimental/internal_kv.py", "util/collective"):
        path = os.path.join(top, sub)
        files = [path] if path.endswith(".py") else [os.path.join(d, f) for d, _, fs in os.walk(path)
                                                     for f in fs if f.endswith(".py") and "/tests" not in d]
        for file in files:
            try:
                tree = ast.parse(open(file, encoding="utf-8").read())
            except (SyntaxError, UnicodeDecodeError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("_"):
                    names.add(node.name)
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_"):
                    names.add(node.attr)
    return {n for n in names if not n.startswith("__")}


def find_private_uses(module_source: str, path: str, classes: dict, ray_names: set):
    """[(where, what)] in one module's source. classes: {class name: private names of the RLlib/Ray
    classes it is composed with}."""
    found = []
    tree = ast.parse(module_source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mod = node.module if isinstance(node, ast.ImportFrom) else None
            names = [mod] if mod else [a.name for a in node.names]
            for name in names:
                if name and name.startswith("ray") and any(part.startswith("_") for part in name.split(".")):
                    found.append((f"{path}:{node.lineno}", f"import {name}"))
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        theirs = classes.get(cls.name, set()) - DOCUMENTED
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in theirs:
                found.append((f"{path}:{node.lineno}", f"{cls.name} overrides {node.name}"))
            if (isinstance(node, ast.Attribute) and node.attr in theirs and isinstance(node.value, ast.Name)
                    and node.value.id == "self"):
                found.append((f"{path}:{node.lineno}", f"{cls.name}: self.{node.attr}"))
            if (isinstance(node, ast.Attribute) and node.attr in theirs and isinstance(node.value, ast.Call)
                    and ast.unparse(node.value.func) == "super"):
                found.append((f"{path}:{node.lineno}", f"{cls.name}: super().{node.attr}"))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in ray_names
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and not (isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super")
                and not (isinstance(node.value, ast.Name) and node.value.id in NON_RAY_MODULES)):
            found.append((f"{path}:{node.lineno}", ast.unparse(node)))
    return found


# Modules whose own private names are theirs, not Ray's (torch's foreach kernels, os._exit, ...).
NON_RAY_MODULES = {"os", "sys", "torch", "np", "numpy", "signal", "threading", "json", "dist"}


def composed_private_names(modules, built=()) -> dict:
    """{our class name: private names of the RLlib/Ray classes composed with it}: a class counts if
    it (or a class of ours built from it) has an RLlib or Ray class in its MRO. built: classes made
    at run time (the DeepSpeed learner's)."""
    ours = {cls: None for cls in built}
    for mod in modules:
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if cls.__module__ == mod.__name__:
                ours[cls] = mod
    out: dict = {}
    for composed in ours:
        ray_bases = [b for b in composed.__mro__ if _is_ray(b)]
        if not ray_bases:
            continue
        names = set().union(*(_private_names_of(b) for b in ray_bases))
        for mine in composed.__mro__:
            if mine in ours:
                out.setdefault(mine.__name__, set()).update(names)
    return out


def test_no_private_ray_name_outside_the_isolating_module():
    modules = our_modules()
    # Composing classes live in every layer (e.g. the DeepSpeed learner class is built at run time).
    from moe_rl.actors.learner import DeepSpeedLearner, deepspeed_learner_class
    from moe_rl.algo.algorithm import MoEPPOConfig
    built = deepspeed_learner_class(MoEPPOConfig())
    classes = composed_private_names(modules, built=[built, *built.__mro__[:2]])
    assert DeepSpeedLearner in built.__mro__
    assert {"MoELearner", "StabilityPart", "MoEConfig", "MoEAlgorithm", "DeepSpeedLearner"} <= set(classes)
    ray_names = ray_private_names()
    found = []
    for mod in modules:
        with open(mod.__file__, encoding="utf-8") as f:
            found += find_private_uses(f.read(), os.path.relpath(mod.__file__, ROOT), classes, ray_names)
    assert not found, "move these into moe_rl/rllib/ray_private.py, with why:\n" + "\n".join(
        f"{w}: {what}" for w, what in found)


def test_the_check_finds_planted_private_uses():
    planted = '''
import ray._private.worker
from ray._private import state

class MyLearner:
    def _make_module(self):
        return self._params

def sync(runner, v):
    runner._weights_seq_no = v
'''
    found = [what for _, what in find_private_uses(planted, "<planted>", {"MyLearner": {"_make_module", "_params"}},
                                                   {"_weights_seq_no"})]
    assert found == ["import ray._private.worker", "import ray._private", "MyLearner overrides _make_module",
                     "MyLearner: self._params", "runner._weights_seq_no"]
