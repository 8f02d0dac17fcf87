"""Every `moe-rl` command in a ```bash block of README.md and docs/*.md runs as written.

README's quickstart command trains for 2 iterations (its run directory stands in for RUN_DIR in the
other commands); every other `train` command runs with --dry-run (the config is checked and its
resources worked out: nothing that is written in the docs can fail on a bad key or value), evaluate
and report run for real on that run directory, and drift-study (minutes of work) answers --help.
"""
import glob
import os
import re
import shlex
import subprocess
import sys
from collections import Counter

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def documented_commands():
    """(file, command words) for every moe-rl command in a ```bash block (continuations joined)."""
    out = []
    for path in DOCS:
        text = open(path).read()
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split("&&"):
                    words = shlex.split(part.split(" #")[0])
                    # `moe-rl ...`, `.venv/bin/moe-rl ...`, `VAR=x moe-rl ...`, `ray job submit ... -- moe-rl ...`
                    at = next((i for i, w in enumerate(words) if os.path.basename(w) == "moe-rl"), None)
                    if at is not None:
                        out.append((os.path.relpath(path, ROOT), words[at + 1:]))
    return out


COMMANDS = documented_commands()


def moe_rl(args, timeout=900):
    return subprocess.run([sys.executable, "-m", "moe_rl.app.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=timeout, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})


def test_every_moe_rl_command_of_the_docs_is_collected_and_the_readme_quickstart_is_one_of_them():
    """Counted apart from the parser, file by file: each `moe-rl` word in a ```bash block. A command
    the parser drops (a line it misreads, a continuation or an `&&` it loses) would run nowhere."""
    assert ("README.md", ["train"]) in COMMANDS
    mentions = Counter()
    for path in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", open(path).read(), re.S):
            mentions[os.path.relpath(path, ROOT)] += len(re.findall(r"(?<![\w-])moe-rl(?=\s)", block))
    assert Counter(where for where, _ in COMMANDS) == +mentions, COMMANDS


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """README's first command, for 2 iterations."""
    out = tmp_path_factory.mktemp("docs") / "quickstart"
    p = moe_rl(["train", "--iterations", "2", "--output", str(out)])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "iter    2" in p.stdout
    return out


def _runnable(words, run_dir, tmp_path):
    words = [str(run_dir) if w == "RUN_DIR" else w for w in words]
    if words[0] == "drift-study":
        return ["drift-study", "--help"]
    if words[0] == "train":
        if "--output" in words:   # a cluster path in the docs: a temporary one here
            i = words.index("--output")
            words[i + 1] = str(tmp_path / "out")
        return words + ["--dry-run"]
    if words[0] == "evaluate" and "--episodes" not in words:
        return words + ["--episodes", "1"]
    return words


@pytest.mark.slow
@pytest.mark.parametrize("where, words", COMMANDS, ids=[f"{w}: moe-rl {' '.join(c)}" for w, c in COMMANDS])
def test_a_documented_command_runs_as_written(where, words, quickstart_run, tmp_path):
    args = _runnable(words, quickstart_run, tmp_path)
    p = moe_rl(args)
    assert p.returncode == 0, f"{where}: moe-rl {' '.join(args)}\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
    if "--dry-run" in args:
        assert "dry run: the config is valid" in p.stdout
