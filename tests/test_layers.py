"""The package layers, read from the code: every import points down, and the core runs without
Ray or DeepSpeed.

    moe_rl.core  <-  moe_rl.rllib  <-  moe_rl.actors  <-  moe_rl.algo  <-  moe_rl.app    moe_rl.envs: alone
(the folders actors/ and envs/ install as moe_rl.actors and moe_rl.envs)
"""
import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS = ["moe_rl.core", "moe_rl.rllib", "moe_rl.actors", "moe_rl.algo", "moe_rl.app"]
pytestmark = pytest.mark.pure


def layer_of(module: str):
    for i, name in reversed(list(enumerate(LAYERS))):
        if module == name or module.startswith(name + "."):
            return i
    return None


def imports(path: pathlib.Path):
    """(imported module, line, inside a function?) of every import in a file."""
    tree = ast.parse(path.read_text())
    nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno, id(node) in nested
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module, node.lineno, id(node) in nested


def package_files():
    for top in ("moe_rl", "actors", "envs"):
        yield from sorted((ROOT / top).rglob("*.py"))


def module_name(path: pathlib.Path) -> str:
    """The import name: the folders actors/ and envs/ install as moe_rl.actors and moe_rl.envs."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] in ("actors", "envs"):
        parts = ("moe_rl",) + parts
    return ".".join(parts).removesuffix(".__init__")


def test_every_import_points_down():
    wrong = []
    for path in package_files():
        me = module_name(path)
        mine = layer_of(me)
        for target, line, _ in imports(path):
            theirs = layer_of(target)
            if me.startswith("moe_rl.envs"):
                if target.startswith("ray") or (target.startswith("moe_rl") and not target.startswith("moe_rl.envs")):
                    wrong.append(f"{me}:{line} imports {target} (envs stand alone)")
            elif mine is not None and theirs is not None and theirs > mine:
                wrong.append(f"{me}:{line} ({LAYERS[mine]}) imports {target} ({LAYERS[theirs]})")
    assert not wrong, "\n".join(wrong)


def test_imports_sit_at_the_top_of_their_files():
    """Except the optional wandb package, which is imported only when a run asks for it, and minigrid,
    only when a MiniGrid env is made (it brings pygame: 0.6 s in every process that imports envs)."""
    inside = [f"{module_name(p)}:{line} {t}" for p in package_files() for t, line, nested in imports(p)
              if nested and t not in ("wandb", "minigrid", "minigrid.wrappers")]
    assert not inside, "\n".join(inside)


def test_core_imports_no_ray_or_deepspeed():
    modules = sorted(module_name(p) for p in (ROOT / "moe_rl" / "core").glob("*.py") if p.name != "__init__.py")
    code = (f"import sys; import {', '.join(modules)}; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'deepspeed')]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_no_import_circle():
    """No module of the product imports, however indirectly, a module that imports it: not at the
    top, inside a function, or under TYPE_CHECKING (the layers alone allow circles within one)."""
    files = {module_name(p): p for p in package_files()}
    graph = {}
    for me, path in files.items():
        edges = set()
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom) and node.module:
                edges |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in files}
                if node.module in files and not any(f"{node.module}.{a.name}" in files for a in node.names):
                    edges.add(node.module)
        graph[me] = edges - {me}
    circles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"
    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not circles, "\n".join(circles)
