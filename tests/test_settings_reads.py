"""Settings are read as typed attributes: no string-key read of a settings section outside its
validator, found by reading the code's syntax tree (a typed section also refuses one at run time)."""
import ast
import dataclasses
import os
import re

import pytest

from moe_rl.core import sections

pytestmark = pytest.mark.pure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("moe_rl", "actors", "envs", "bench")
FIELDS = {f.name for cls in (sections.MoESettings, sections.DeepSpeedSettings, sections.WeightSyncSettings,
                             sections.StabilitySettings, sections.ConsistencySettings, sections.CorrectionSettings)
          for f in dataclasses.fields(cls)}
# What holds a section: `s`, `settings`, `section`, `<name>_settings`, `<obj>.s` (the gate's, the
# toolkit's, the actor's).
SECTION_NAME = re.compile(r"(^|\.)(s|settings|section|[a-z_]+_settings)$")
# Validators read the user's plain mapping by key before it is typed.
VALIDATOR = re.compile(r"^(validate_|_checked_|_check_|resolve_)")


def string_key_reads(source: str, path: str = "<planted>"):
    """[(path:line, the read)] of `section["field"]` and `section.get("field")` outside validators."""
    found = []

    def visit(node, validator: bool):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            validator = validator or bool(VALIDATOR.match(node.name))
        if not validator:
            key = receiver = None
            if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
                key, receiver = node.slice.value, node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                  and node.args and isinstance(node.args[0], ast.Constant)):
                key, receiver = node.args[0].value, node.func.value
            if key in FIELDS and SECTION_NAME.search(ast.unparse(receiver)):
                found.append(f"{path}:{node.lineno} {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, validator)

    visit(ast.parse(source), False)
    return found


def product_files():
    for top in PRODUCT:
        for folder, _, files in os.walk(os.path.join(ROOT, top)):
            for name in files:
                if name.endswith(".py"):
                    yield os.path.join(folder, name)


def test_no_section_is_read_by_string_key_outside_its_validator():
    found = []
    for path in product_files():
        with open(path, encoding="utf-8") as f:
            found += string_key_reads(f.read(), os.path.relpath(path, ROOT))
    assert not found, "read these as attributes:\n" + "\n".join(found)


def test_the_check_finds_a_planted_read_and_passes_a_validator():
    planted = '''
def build(config):
    s = config.moe_settings
    return s["top_k"], config.stability_settings.get("grad_clip"), self.s["every"]

def validate_thing(s):
    return s["top_k"]        # a validator reads the plain mapping it checks
'''
    found = string_key_reads(planted)
    assert [f.split(" ", 1)[1] for f in found] == [
        "s['top_k']", "config.stability_settings.get('grad_clip')", "self.s['every']"]


def test_a_typed_section_refuses_a_string_key_read_naming_the_attribute():
    from moe_rl.core.settings import MOE_DEFAULTS, validate_moe
    s = validate_moe(dict(MOE_DEFAULTS))
    with pytest.raises(TypeError, match=r"read as attributes: \.top_k"):
        s["top_k"]
