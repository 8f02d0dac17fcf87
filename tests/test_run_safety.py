"""Safe on a network and with someone else's run directory.

- a real `moe-rl train` (2 DeepSpeed learners, expert-parallel), started with nothing about Ray in
  its environment, listens on loopback only: every socket of its process tree, sampled while it runs;
- a run directory carrying a code-running pickle, or a config.yaml naming a shell function, is
  opened by evaluate, report, drift-study --checkpoint and --resume without running it: each exits
  non-zero with one line, and the marker file the payload would write never appears;
- the user's own run still evaluates and resumes;
- bad input that used to end in a traceback, or after Ray had started, is refused first (exit 2).
"""
import hashlib
import ipaddress
import json
import os
import pickle
import shutil
import subprocess
import sys
import time

import psutil
import pytest
import yaml

from moe_rl.app.run_signature import sign_bytes, signature_path

pytestmark = pytest.mark.slow
RAY_ENV_SWITCHES = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_ADDRESS")


def listening_sockets(root: psutil.Process):
    """(address, process name) of every TCP socket the process tree of `root` listens on."""
    out = set()
    try:
        tree = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for proc in tree:
        try:
            for c in proc.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    out.add((c.laddr.ip, c.laddr.port, proc.name()))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    return addr.is_loopback or (addr.version == 6 and addr.ipv4_mapped is not None and addr.ipv4_mapped.is_loopback)


@pytest.fixture(scope="module")
def own_run(tmp_path_factory):
    """The user's own run, 2 iterations with 2 expert-parallel DeepSpeed learners, and the sockets its
    process tree listened on (sampled every 0.3 s while it ran)."""
    out = tmp_path_factory.mktemp("safety") / "own"
    env = {k: v for k, v in os.environ.items() if k not in RAY_ENV_SWITCHES}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_rl.app.cli", "train", "--iterations", "2", "--output", str(out),
         "--num-learners", "2", "--ep-size", "2", "--set", "training.train_batch_size_per_learner=300",
         "--set", "training.minibatch_size=100", "--set", "moe.num_experts=4", "--set", "stop_return=null",
         "--set", "checkpoint_every=1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    root, seen, deadline = psutil.Process(proc.pid), set(), time.monotonic() + 900
    while proc.poll() is None and time.monotonic() < deadline:
        seen |= listening_sockets(root)
        time.sleep(0.3)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 0, log[-3000:]
    return out, seen, log


def test_every_socket_of_a_run_with_two_deepspeed_learners_is_on_loopback(own_run):
    _, seen, log = own_run
    names = {name for _, _, name in seen}
    # Not vacuous: the head's servers and the learners' rendezvous were all seen listening.
    assert {"gcs_server", "raylet"} <= names and any("LearnerAct" in n for n in names), sorted(names)
    wide = sorted((ip, port, name) for ip, port, name in seen if not is_loopback(ip))
    assert not wide, f"listening beyond loopback: {wide}"
    assert "Ray listens on 127.0.0.1" in log


def copy_run(src, dst):
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    return dst


def newest_checkpoint(run):
    return sorted((run / "checkpoints").glob("iter_*"))[-1]


class Payload:
    """Unpickling it runs a shell command that writes the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant(run, rel, data: bytes) -> None:
    """A file in the newest checkpoint with its manifest line recomputed, as someone editing the
    run would (the sha256 manifest alone cannot tell)."""
    ckpt = newest_checkpoint(run)
    (ckpt / rel).parent.mkdir(parents=True, exist_ok=True)
    (ckpt / rel).write_bytes(data)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"][rel] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def crafted(kind, own, tmp_path, marker):
    run = copy_run(own, tmp_path / kind)
    if kind == "pickle":
        for rel in ("algorithm_state.pkl", "class_and_ctor_args.pkl",
                    "learner_group/module_shard_rank0.pt", "learner_group/learner_rank_0.pt"):
            plant(run, rel, pickle.dumps(Payload(marker)))
    else:   # a config.yaml naming a shell function, the command in its env_config
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        cfg["env"], cfg["env_config"] = "os:system", {"command": f"touch {marker}"}
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    return run


def run_cli(args, capsys):
    from moe_rl.app.cli import main
    try:
        code = main(args)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("kind", ["pickle", "config"])
@pytest.mark.parametrize("command", ["evaluate", "report", "drift-study", "resume"])
def test_a_crafted_run_directory_is_opened_without_running_its_code(own_run, tmp_path, capsys, kind, command):
    import ray
    marker = tmp_path / "PAYLOAD_RAN"
    run = str(crafted(kind, own_run[0], tmp_path, marker))
    args = {"evaluate": ["evaluate", run, "--episodes", "1"], "report": ["report", run],
            "drift-study": ["drift-study", "--checkpoint", run, "--lengths", "8"],
            "resume": ["train", "--resume", run]}[command]
    code, err = run_cli(args, capsys)
    assert code == 2 and len(err) == 1, (code, err)
    assert "not your own run" in err[0] or "not signed with your key" in err[0], err
    assert "--trust-run" in err[0]
    assert not marker.exists() and not ray.is_initialized()


def test_trusting_a_foreign_run_still_reads_only_data(own_run, tmp_path, capsys):
    """--trust-run opens it, and still no code runs: the policy loads from tensors only (a payload
    there is refused), and an import-path env needs --trust-env-code on top."""
    marker = tmp_path / "PAYLOAD_RAN"
    code, err = run_cli(["evaluate", str(crafted("pickle", own_run[0], tmp_path, marker)), "--trust-run"], capsys)
    assert code == 2 and "holds more than tensors" in err[-1] and not marker.exists()
    code, err = run_cli(["evaluate", str(crafted("config", own_run[0], tmp_path, marker)), "--trust-run"], capsys)
    assert code == 2 and "--trust-env-code" in err[-1] and not marker.exists()


def test_the_users_own_run_evaluates_from_its_tensor_files(own_run, capsys):
    run, _, _ = own_run
    assert (newest_checkpoint(run) / "learner_group" / "module_shard_rank0.pt").is_file()
    code, err = run_cli(["evaluate", str(run), "--episodes", "1"], capsys)
    assert code == 0, err


def resign(run):
    """The user editing their own config.yaml by hand (and so signing it): validation decides."""
    path = run / "config.yaml"
    (run / os.path.basename(signature_path(str(path)))).write_bytes(sign_bytes(path.read_bytes()))


@pytest.mark.parametrize("command", ["evaluate", "drift-study", "resume"])
@pytest.mark.parametrize("text, needle", [
    ("moe: [unclosed", "must be valid YAML"),
    ("- a\n- list\n", "must hold a mapping"),
    (None, "env: must be a registered gymnasium id"),          # an unknown env id
    ("moe: 5\n", "moe: must be a mapping"),                     # a scalar where a section belongs
])
def test_a_runs_malformed_config_yaml_is_refused_naming_it(own_run, tmp_path, capsys, command, text, needle):
    run = copy_run(own_run[0], tmp_path / "edited")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    if text is None:
        cfg["env"] = "NoSuchEnv-v9"
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    elif text.startswith("moe: 5"):
        cfg["moe"] = 5
        (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    else:
        (run / "config.yaml").write_text(text)
    resign(run)
    args = {"evaluate": ["evaluate", str(run)], "drift-study": ["drift-study", "--checkpoint", str(run)],
            "resume": ["train", "--resume", str(run)]}[command]
    code, err = run_cli(args, capsys)
    assert code == 2 and len(err) == 1 and needle in err[0], (code, err)
    assert "config.yaml" in err[0] and "--config" not in err[0], err   # it names the run's file


def test_a_non_utf8_config_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"\xff\xfe env: x")
    code, err = run_cli(["train", "--config", str(bad)], capsys)
    assert code == 2 and err == [f"moe-rl: error: --config: must be UTF-8 text, {str(bad)!r} is not (byte 0)"]


@pytest.mark.parametrize("args, needle", [
    (["train", "--set", "moe=5", "--dry-run"], "moe: must be a mapping"),
    (["train", "--set", "env_config.foo=1", "--dry-run"], "env_config.foo: CartPole-v1 does not take it"),
    (["train", "--seed", "99999999999999999999", "--dry-run"], "seed: must be an int in [0, 2147483647]"),
    (["train", "--set", "moe.num_experts=100000", "--set", "moe.d_model=65536", "--dry-run"],
     "moe: the model cannot fit"),
    (["report", "/"], "RUN_DIR: must be a run directory"),
])
def test_bad_input_is_refused_before_ray_starts(args, needle, capsys):
    import ray
    t0 = time.monotonic()
    code, err = run_cli(args, capsys)
    assert code == 2 and len(err) == 1 and needle in err[0], (code, err)
    assert not ray.is_initialized()
    assert time.monotonic() - t0 < 120   # a hang guard; the 10 s is measured in the closing note


def test_resume_of_the_users_own_run_is_quiet(own_run, tmp_path):
    """No RLlib DeprecationWarning lines (their keys are aliases RLlib moved between sections)."""
    run = copy_run(own_run[0], tmp_path / "resumed")
    p = subprocess.run([sys.executable, "-m", "moe_rl.app.cli", "train", "--resume", str(run), "--iterations", "3"],
                       capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout and "DeprecationWarning" not in p.stderr + p.stdout, p.stderr[-3000:]


DS_MODEL_STATES = "learner_group/moe_rl-default_policy/mp_rank_00_model_states.pt"


def test_a_deepspeed_file_swapped_after_the_check_is_never_loaded(own_run, tmp_path):
    """The file and its manifest line changed while Ray starts (after --resume's first check): the
    restore reads only a private copy checked against the signed manifest, and refuses it."""
    marker = tmp_path / "PAYLOAD_RAN"
    run = copy_run(own_run[0], tmp_path / "swapped")
    proc = subprocess.Popen([sys.executable, "-m", "moe_rl.app.cli", "train", "--resume", str(run),
                             "--iterations", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if "building the algorithm" in line:
            plant(run, DS_MODEL_STATES, pickle.dumps(Payload(marker)))
            break
    stdout, stderr = proc.communicate(timeout=900)
    errors = [line for line in stderr.splitlines() if line.startswith("moe-rl: error:")]
    assert proc.returncode == 2 and len(errors) == 1, (proc.returncode, stdout[-2000:], stderr[-3000:])
    assert "not signed with your key" in errors[0] and "cannot restore" in errors[0]
    assert not marker.exists()


def test_deepspeeds_files_load_weights_only_even_in_a_trusted_run(own_run, tmp_path):
    """--trust-run unpickles RLlib's state by design, but DeepSpeed's model states are read with
    weights_only: a payload there is refused, never run."""
    marker = tmp_path / "PAYLOAD_RAN"
    run = copy_run(own_run[0], tmp_path / "trusted")
    plant(run, DS_MODEL_STATES, pickle.dumps(Payload(marker)))
    p = subprocess.run([sys.executable, "-m", "moe_rl.app.cli", "train", "--resume", str(run), "--trust-run",
                        "--iterations", "3"], capture_output=True, text=True, timeout=900)
    errors = [line for line in p.stderr.splitlines() if line.startswith("moe-rl: error:")]
    assert p.returncode != 0 and len(errors) == 1, (p.returncode, p.stderr[-3000:])
    assert "refused: not plain data" in errors[0] and not marker.exists()
