"""`moe-rl` main job end to end: a real embedded Ray in a subprocess, a real run directory."""
import os
import re
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

REQUIRED_COLUMNS = ["iteration", "env_steps_total", "time_s", "episode_return_mean", "policy_loss", "vf_loss",
                    "entropy", "aux_loss", "z_loss", "moe/cv", "moe/min_util", "moe/max_util",
                    "moe/active_experts", "moe/router_entropy_norm", "moe/health"]


def moe_rl(*args, timeout=600, cwd=None):
    return subprocess.run([sys.executable, "-m", "moe_rl.app.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, cwd=cwd)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One short run that the tests below read: its output is a file:// storage URI (the run is
    staged locally and mirrored through pyarrow.fs, pruned checkpoints disappear there too), with
    W&B in offline mode (no network). The mirror is a plain directory: evaluate and report read it."""
    out = tmp_path_factory.mktemp("runs") / "quick"
    p = moe_rl("train", "--iterations", "3", "--output", out.as_uri(), "--seed", "1",
               "--set", "training.train_batch_size_per_learner=500", "--set", "training.minibatch_size=125",
               "--set", "checkpoint_every=1", "--set", "checkpoint_keep=2", "--set", "stop_return=null",
               "--set", "wandb.mode=offline", "--set", "wandb.project=moe-rl-test")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "iter    3" in p.stdout and f"run directory {out.as_uri()}" in p.stdout
    return out


def test_run_directory_is_complete(run_dir):
    assert (run_dir / "config.yaml").is_file()
    table = pq.read_table(run_dir / "metrics.parquet")
    assert table.num_rows == 3
    missing = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    assert not missing, missing
    assert any(c.startswith("moe/layer1/") for c in table.column_names)
    assert set(table.column("moe/health").to_pylist()) <= {"healthy", "warning", "danger"}
    assert table.column("env_steps_total").to_pylist() == sorted(table.column("env_steps_total").to_pylist())
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["iter_000002", "iter_000003"]   # iter 1 pruned
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(run_dir / "tb"))
    config_text = (run_dir / "config.yaml").read_text()
    assert "num_experts: 8" in config_text and "train_batch_size_per_learner: 500" in config_text
    from moe_rl.app.checkpoint import verify_checkpoint
    verify_checkpoint(str(run_dir / "checkpoints" / "iter_000003"))   # the storage copy is byte-exact


def test_rows_go_to_weights_and_biases(run_dir):
    """wandb receives every row; its run files live in RUN_DIR/wandb."""
    (run,) = [d for d in os.listdir(run_dir / "wandb") if d.startswith("offline-run-")]
    (log,) = [f for f in os.listdir(run_dir / "wandb" / run) if f.endswith(".wandb")]
    data = (run_dir / "wandb" / run / log).read_bytes()
    assert b"episode_return_mean" in data and b"moe/cv" in data and b"stability/grad_norm/total" in data


def test_drift_study_refuses_a_run_that_is_not_a_token_policy(run_dir):
    p = moe_rl("drift-study", "--checkpoint", str(run_dir), "--lengths", "16", timeout=120)
    assert p.returncode != 0 and "--checkpoint: must be a single-agent run on moe_rl/TokenSequence-v0" in p.stderr


@pytest.mark.parametrize("relative", [False, True])
def test_evaluate_loads_the_last_checkpoint(run_dir, relative):
    """RUN_DIR as given on the command line, absolute or relative to the working directory."""
    p = moe_rl("evaluate", run_dir.name if relative else str(run_dir), "--episodes", "2", timeout=300,
               cwd=run_dir.parent)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "mean return over 2 episodes:" in p.stdout


@pytest.mark.parametrize("args, needle", [
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["train", "--iterations", "two"], "--iterations: invalid int value"),
    (["train", "--set", "moe.top_k=99"], "moe.top_k: must be"),
    (["train", "--set", "moe.router=magic"], "moe.router: must be one of"),
    (["train", "--env", "NoSuchEnv-v9"], "env: must be a registered gymnasium id"),
    (["train", "--set", "training.lr=-1"], "training.lr: must be > 0"),
    (["train", "--num-learners", "1", "--ep-size", "2"], "moe.ep_size: must be"),
    (["train", "--config", "/nonexistent.yaml"], "--config: must be a readable YAML file"),
    (["evaluate", "/nonexistent-run"], "RUN_DIR: must be a moe-rl run directory"),
    (["drift-study", "--checkpoint", "/nonexistent-run"], "--checkpoint: must be a moe-rl run directory"),
    (["report", "/nonexistent-run"], "RUN_DIR: must be a run directory"),
    (["train", "--output", "nosuchfs://bucket/run"], "output: cannot use the storage URI"),
    (["train", "--set", "wandb.mode=sometimes"], "wandb.mode: must be online, offline or disabled"),
])
def test_bad_input_exits_2_with_one_line(args, needle, capsys):
    """In this process (the CLI's own main(), without a Python start and the imports per case):
    every bad input is refused before anything starts. test_unwritable_output_is_a_clear_error
    checks the exit code of a real `python -m moe_rl.app.cli` process."""
    import ray

    from moe_rl.app.cli import main
    try:
        code = main(args)
    except SystemExit as e:   # argparse's own refusals
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, (code, err[-2000:])
    assert needle in err.strip().splitlines()[-1], err
    assert not ray.is_initialized(), "a refused input started Ray"


def test_report_renders_the_run(run_dir):
    assert (run_dir / "report.html").is_file()   # train writes it at the end
    os.unlink(run_dir / "report.html")
    p = moe_rl("report", str(run_dir), timeout=120)
    assert p.returncode == 0 and (run_dir / "report.html").stat().st_size > 10_000, p.stderr[-2000:]


def test_unwritable_output_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    p = moe_rl("train", "--output", str(blocker / "run"), timeout=120)
    assert p.returncode == 2 and "output: cannot write the run directory" in p.stderr


@pytest.mark.slow
def test_train_with_deepspeed_expert_parallel_learners(tmp_path):
    """`moe-rl train --num-learners 2 --ep-size 2`: DeepSpeed learner group from the CLI; the
    run's checkpoint evaluates from the learners' shards. As on a fresh install of a busy machine:
    an empty torch extension cache except for the lock a killed build of DeepSpeed's shm
    comm op leaves (torch waits on it forever), and both cores busy. The learners compile nothing."""
    out, extensions = tmp_path / "ep2", tmp_path / "torch_extensions"
    (extensions / "deepspeed_shm_comm").mkdir(parents=True)
    (extensions / "deepspeed_shm_comm" / "lock").touch()
    log_path, burners = tmp_path / "ep2.log", []
    with open(log_path, "w") as log:
        p = subprocess.Popen(
            [sys.executable, "-m", "moe_rl.app.cli", "train", "--iterations", "2", "--output", str(out),
             "--num-learners", "2", "--ep-size", "2", "--set", "training.train_batch_size_per_learner=300",
             "--set", "training.minibatch_size=100", "--set", "moe.num_experts=4", "--set", "stop_return=null"],
            stdout=log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "TORCH_EXTENSIONS_DIR": str(extensions)})
        try:
            # Every core busy from the moment the learners start (Ray's own start is not the subject).
            while "building the algorithm" not in log_path.read_text() and p.poll() is None:
                time.sleep(0.5)
            burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                       for _ in range(os.cpu_count() or 2)]
            # Busy until the learners have started (the subject); the two iterations run without them
            # (saturated, one took 178 s: the suite's time, not the start's).
            deadline = time.monotonic() + 1800   # a hang guard: a saturated 2-core machine took 654 s to start
            while "2 learners): done in" not in log_path.read_text() and p.poll() is None:
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.5)
            for b in burners:
                b.kill()
                b.wait()
            p.wait(900)
        finally:
            for b in burners:
                b.kill()
                b.wait()
            if p.poll() is None:
                p.kill()
                p.wait()
    output = log_path.read_text()
    assert p.returncode == 0, output[-4000:]
    assert sorted(str(f.relative_to(extensions)) for f in extensions.rglob("*")) == [
        "deepspeed_shm_comm", "deepspeed_shm_comm/lock"]
    start = re.search(r"building the algorithm \(1 env runners, 2 learners\): done in ([\d.]+)s", output)
    assert start, output[-2000:]
    note = f"expert-parallel start (2 learners, empty extension cache, {len(burners)} CPU burners): {start[1]} s"
    print(note)
    if os.environ.get("MOE_RL_CI_NOTES"):   # .ci/run prints these at the end
        with open(os.environ["MOE_RL_CI_NOTES"], "a") as f:
            f.write(f"tests/test_cli.py: {note}\n")
    table = pq.read_table(out / "metrics.parquet")
    assert table.num_rows == 2
    assert "learner/expert_param_bytes/rank1" in table.column_names
    ckpt = out / "checkpoints" / "iter_000002" / "learner_group"
    assert sorted(f for f in os.listdir(ckpt) if f.startswith("module_shard")) == [
        "module_shard_rank0.pt", "module_shard_rank1.pt"]
    p = moe_rl("evaluate", str(out), "--episodes", "1", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
