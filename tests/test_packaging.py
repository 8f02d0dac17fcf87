"""What the distribution installs, and what of Ray it leans on.

- the only top-level import name moe-rl installs is its own (`actors` and `envs` are other
  distributions' names on the package index; the folders install as moe_rl.actors and moe_rl.envs);
- no private Ray or RLlib API outside moe_rl/rllib/ray_private.py, the one module that says why each
  call it makes has no public counterpart.
"""
import ast
import importlib.metadata
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRIVATE_MODULE = ROOT / "moe_rl" / "rllib" / "ray_private.py"
pytestmark = pytest.mark.pure


def test_the_distribution_installs_only_moe_rl():
    dist = importlib.metadata.distribution("moe-rl")
    top_level = set((dist.read_text("top_level.txt") or "").split())
    assert top_level == {"moe_rl"}, top_level
    owners = importlib.metadata.packages_distributions()
    assert "moe-rl" not in owners.get("actors", []) and "moe-rl" not in owners.get("envs", [])


def test_the_folders_import_under_moe_rl():
    import moe_rl.actors.rendezvous
    import moe_rl.envs
    assert pathlib.Path(moe_rl.envs.__file__).parent == ROOT / "envs"
    assert pathlib.Path(moe_rl.actors.rendezvous.__file__).parent == ROOT / "actors"


# A private name: a module path segment or an imported name that starts with "_" under ray.
_TEXT = re.compile(r"ray\._private|_internal_kv|_global_node")


def private_ray_uses(path: pathlib.Path):
    text = path.read_text()
    for line_no, line in enumerate(text.splitlines(), 1):
        if _TEXT.search(line):
            yield f"{path.relative_to(ROOT)}:{line_no}: {line.strip()}"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ray":
            names = [a.name for a in node.names if a.name.startswith("_")]
            if names or any(part.startswith("_") for part in node.module.split(".")):
                yield f"{path.relative_to(ROOT)}:{node.lineno}: from {node.module} import {names or '...'}"


def test_private_ray_apis_only_in_the_one_isolating_module():
    files = [p for top in ("moe_rl", "actors", "envs") for p in sorted((ROOT / top).rglob("*.py"))]
    found = [use for p in files if p != PRIVATE_MODULE for use in private_ray_uses(p)]
    assert not found, "private Ray APIs outside moe_rl/rllib/ray_private.py:\n" + "\n".join(found)
    assert list(private_ray_uses(PRIVATE_MODULE)), "the check finds what it looks for"
