"""Checkpoints (atomic, manifest, verification), --resume, dead learners, learner-state files."""
import errno
import math
import os
import pickle
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from moe_rl.algo.results import read_rows
from moe_rl.app import checkpoint as ck
from moe_rl.app.cli import main
from moe_rl.core.settings import ConfigError

TINY = ["--set", "training.train_batch_size_per_learner=200", "--set", "training.minibatch_size=100",
        "--set", "training.num_epochs=1", "--set", "moe.num_experts=4", "--set", "moe.d_model=16",
        "--set", "moe.d_ff=16", "--set", "stop_return=null", "--set", "checkpoint_every=2",
        "--set", "checkpoint_verify_every_s=0"]
PLAIN = ["--num-env-runners", "0", *TINY]
DEEPSPEED = ["--num-env-runners", "1", "--num-learners", "2", "--ep-size", "2", *TINY]


# --- manifest, verification, atomic writes (no Ray) -----------------------------------------------
class FakeAlgo:
    """save_to_path writes a small learner-group-like tree; `fail_after` files, then ENOSPC."""

    def __init__(self, fail_after=None):
        self.fail_after = fail_after

    def save_to_path(self, path):
        files = {"algorithm_state.pkl": b"a" * 100,
                 "learner_group/module_shard_rank0.pt": os.urandom(4096),
                 "learner_group/moe_rl/expp_rank_1_mp_rank_00_optim_states.pt": os.urandom(2048)}
        for n, (rel, data) in enumerate(files.items()):
            if self.fail_after is not None and n == self.fail_after:
                raise OSError(errno.ENOSPC, "No space left on device", os.path.join(path, rel))
            os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
            with open(os.path.join(path, rel), "wb") as f:
                f.write(data)
        return path


def make_run(tmp_path, iterations=(2, 4)):
    root = tmp_path / "run" / "checkpoints"
    root.mkdir(parents=True)
    for i in iterations:
        ck.save_checkpoint(FakeAlgo(), str(root), i, {"env": "CartPole-v1"})
    return tmp_path / "run", root


def flip_byte(path, offset=100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (lambda p: flip_byte(p), "learner_group/module_shard_rank0.pt sha256 mismatch"),
    (lambda p: p.write_bytes(p.read_bytes()[:1000]), "learner_group/module_shard_rank0.pt is 1000 bytes"),
    (lambda p: p.unlink(), "learner_group/module_shard_rank0.pt missing"),
    (lambda p: (p.parent / "extra.pt").write_bytes(b"x"), "learner_group/extra.pt is not in the manifest"),
    (lambda p: (p.parent.parent / "manifest.json").unlink(), "manifest.json missing"),
    (lambda p: (p.parent.parent / "manifest.json").write_text("{"), "manifest.json unreadable"),
])
def test_verification_names_the_bad_file_and_falls_back(tmp_path, capsys, damage, message):
    run, root = make_run(tmp_path)
    manifest = ck.verify_checkpoint(str(root / "iter_000004"))
    assert manifest["iteration"] == 4 and manifest["run_config"] == {"env": "CartPole-v1"}
    assert manifest["moe_rl_version"] and manifest["created"]
    assert set(manifest["files"]) == {"algorithm_state.pkl", "driver_rng.pt", "learner_group/module_shard_rank0.pt",
                                      "learner_group/moe_rl/expp_rank_1_mp_rank_00_optim_states.pt"}
    damage(root / "iter_000004" / "learner_group" / "module_shard_rank0.pt")
    with pytest.raises(ck.CheckpointError, match=f"^checkpoint iter_000004 is corrupt: {message}"):
        ck.verify_checkpoint(str(root / "iter_000004"))
    assert ck.latest_good_checkpoint(str(run)) == str(root / "iter_000002")
    assert f"checkpoint iter_000004 is corrupt: {message}" in capsys.readouterr().err


def test_writes_are_atomic_and_pruned(tmp_path):
    run, root = make_run(tmp_path, iterations=(2, 4, 6, 8))
    assert ck.prune(str(root), 3) == ["iter_000002"]
    assert ck.checkpoint_names(str(root)) == ["iter_000004", "iter_000006", "iter_000008"]
    (root / ".tmp-iter_000010").mkdir()  # a writer that died mid-way: never taken for a checkpoint
    assert ck.latest_good_checkpoint(str(run)) == str(root / "iter_000008")
    with pytest.raises(ck.CheckpointWriteError) as err:  # disk full half-way through the next one
        ck.save_checkpoint(FakeAlgo(fail_after=2), str(root), 10, {})
    assert str(err.value) == (f"checkpoints: cannot write checkpoint {str(root / 'iter_000010')!r}: "
                              "No space left on device")
    assert sorted(os.listdir(root)) == ["iter_000004", "iter_000006", "iter_000008"]  # no partial, no tmp
    ck.save_checkpoint(FakeAlgo(), str(root), 8, {})  # the same iteration again replaces it whole
    ck.verify_checkpoint(str(root / "iter_000008"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_checkpoints_dir_is_a_clear_error(tmp_path):
    _, root = make_run(tmp_path, iterations=(2,))
    root.chmod(0o555)
    try:
        with pytest.raises(ck.CheckpointWriteError, match=r"^checkpoints: cannot write checkpoint .*iter_000004"):
            ck.save_checkpoint(FakeAlgo(), str(root), 4, {})
        assert sorted(os.listdir(root)) == ["iter_000002"]
    finally:
        root.chmod(0o755)


@pytest.mark.parametrize("key, value, message", [
    ("checkpoint_keep", 0, "checkpoint_keep: must be an int >= 1, got 0"),
    ("checkpoint_keep", "3", "checkpoint_keep: must be of type int, got '3'"),
    ("checkpoint_verify_every_s", -1, "checkpoint_verify_every_s: must be a finite number >= 0"),
    ("checkpoint_verify_every_s", True, "checkpoint_verify_every_s: must be of type int/float, got True"),
    ("restore_on_learner_failure", "yes", "restore_on_learner_failure: must be of type bool, got 'yes'"),
])
def test_checkpoint_settings_are_validated(key, value, message):
    from moe_rl.app.run_config import validate_run_config
    with pytest.raises(ConfigError) as err:
        validate_run_config({"env": "CartPole-v1", key: value})
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


# --- learner_rank_{r}.pt: plain data, loaded without unpickling code ------------------------------
class RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_learner_state_round_trips_as_plain_data_and_a_code_payload_is_refused(tmp_path):
    from collections import deque

    from moe_rl.actors.learner import load_learner_state, plain_state, save_learner_state
    state = {"weights_seq_no": 3, "should_module_be_updated": None, "f": 0.5, "s": "ema",
             "metrics_logger": {"stats": {"a--b": {"values": deque([1.0, 2.0]), "window": 1, "is_root": False}}},
             "tuple": (1, "x", torch.tensor([1.5])), "array": np.arange(6, dtype=np.float64).reshape(2, 3),
             "scalar": np.float32(2.5), "rng": torch.get_rng_state(), 7: {"int key": True}}
    save_learner_state(state, str(tmp_path / "learner_rank_0.pt"))
    back = load_learner_state(str(tmp_path / "learner_rank_0.pt"))
    assert back["tuple"][:2] == (1, "x") and torch.equal(back["tuple"][2], torch.tensor([1.5]))
    assert isinstance(back["array"], np.ndarray) and np.array_equal(back["array"], state["array"])
    assert back["metrics_logger"]["stats"]["a--b"]["values"] == [1.0, 2.0] and back["scalar"] == 2.5
    assert torch.equal(back["rng"], state["rng"]) and back[7] == {"int key": True}
    with pytest.raises(TypeError, match=r"state\.fn: a function cannot be stored as plain data"):
        plain_state({"fn": lambda: 0})

    marker = tmp_path / "pwned"
    tampered = tmp_path / "learner_rank_1.pt"
    torch.save({"weights_seq_no": 1, "payload": RunsCode(marker)}, str(tampered))  # a pickle that runs code
    with pytest.raises(ValueError, match=r"learner state .*learner_rank_1\.pt' refused: not plain data"):
        load_learner_state(str(tampered))
    with open(tampered, "wb") as f:  # a bare pickle, not even a torch zip file
        pickle.dump(RunsCode(marker), f)
    with pytest.raises(ValueError, match="refused: not plain data"):
        load_learner_state(str(tampered))
    assert not marker.exists()


# --- the train loop in process, on a real local Ray -----------------------------------------------
def learner_snapshot(algo):
    """Every learner's module tensors, optimizer (Adam) state tensors and PPO KL coefficients."""
    def snap(learner):
        module = learner.module["default_policy"]
        opts = ([e.optimizer for e in learner._engines.values()] if hasattr(learner, "_engines")
                else list(learner._named_optimizers.values()))
        return ({k: v.detach().cpu().clone() for k, v in module.state_dict().items()},
                [{k: v.clone() for k, v in st.items() if torch.is_tensor(v)}
                 for opt in opts for st in opt.state_dict()["state"].values()],
                {k: v.detach().clone() for k, v in learner.curr_kl_coeffs_per_module.items()})
    return algo.learner_group.foreach(snap)


def assert_bit_identical(saved, restored):
    assert len(saved) == len(restored) > 0
    for (w_a, m_a, kl_a), (w_b, m_b, kl_b) in zip(saved, restored, strict=True):
        assert w_a.keys() == w_b.keys() and all(torch.equal(w_a[k], w_b[k]) for k in w_a)
        assert len(m_a) == len(m_b) > 0
        assert any(float(t.abs().max()) > 0 for st in m_a for k, t in st.items() if k != "step")  # real moments
        for a, b in zip(m_a, m_b, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert kl_a.keys() == kl_b.keys() == {"default_policy"} and torch.equal(kl_a["default_policy"],
                                                                                  kl_b["default_policy"])


def rows(run):
    return read_rows(str(run / "metrics.parquet"))   # the run may be rewriting it


class Hooks:
    """Wraps moe_rl.app.checkpoint's save/restore as the CLI calls them: records what was saved and
    what was restored; optional action after a given iteration's checkpoint."""

    def __init__(self, monkeypatch, after_save=None):
        self.saved, self.restored, self.after_save = {}, [], after_save or {}
        save, restore = ck.save_checkpoint, ck.restore_checkpoint

        def save_checkpoint(algo, root, iteration, *a, **kw):
            path = save(algo, root, iteration, *a, **kw)
            self.saved[iteration] = (learner_snapshot(algo), torch.get_rng_state())
            if iteration in self.after_save:
                self.after_save[iteration](algo)
            return path

        def restore_checkpoint(algo, path, **kw):
            manifest = restore(algo, path, **kw)
            self.restored.append((manifest["iteration"], algo.iteration, learner_snapshot(algo),
                                  torch.get_rng_state()))
            return manifest
        monkeypatch.setattr(ck, "save_checkpoint", save_checkpoint)
        monkeypatch.setattr(ck, "restore_checkpoint", restore_checkpoint)


def interrupt_after_logging(monkeypatch, iteration):
    """Ctrl-C right after `iteration`'s metrics row is written (its checkpoint is not due)."""
    from moe_rl.app.run_dir import RunDir
    log = RunDir.log

    def interrupting_log(self, row, *tables):
        log(self, row, *tables)
        if row["iteration"] == iteration:
            raise KeyboardInterrupt
    monkeypatch.setattr(RunDir, "log", interrupting_log)


def interrupted_and_resumed(monkeypatch, run, flags):
    """4 iterations, checkpoint every 2, interrupted after iteration 3; --resume for the rest."""
    hooks = Hooks(monkeypatch)
    with monkeypatch.context() as m:
        interrupt_after_logging(m, 3)
        with pytest.raises(KeyboardInterrupt):
            main(["train", "--output", str(run), "--iterations", "4", *flags])
    assert [r["iteration"] for r in rows(run)] == [1, 2, 3]
    assert ck.checkpoint_names(str(run / "checkpoints")) == ["iter_000002"]
    assert main(["train", "--resume", str(run)]) == 0
    return hooks


def assert_resumed_exactly(hooks, run):
    (ckpt_iter, algo_iter, restored, rng), = hooks.restored
    assert ckpt_iter == algo_iter == 2  # the iteration counter continues from the checkpoint
    saved, saved_rng = hooks.saved[2]
    assert_bit_identical(saved, restored)  # weights and Adam moments, on every learner
    assert torch.equal(rng, saved_rng)     # the driver's torch RNG state
    table = rows(run)
    assert [r["iteration"] for r in table] == [1, 2, 3, 4]  # no duplicate of the dropped iteration 3
    for key in ("episode_return_mean", "policy_loss", "vf_loss", "time_s"):
        assert all(math.isfinite(r[key]) for r in table), key
    steps = [r["env_steps_total"] for r in table]
    assert steps == sorted(steps) and steps[2] > steps[1]  # env-step counter restored, not restarted
    assert [r["checkpoint/verified"] for r in table] == [None, 1, None, 1]
    assert [r["faults/learner_restarts"] for r in table] == [0, 0, 0, 0]
    drift = pq.read_table(run / "drift.parquet").column("iteration").to_pylist()
    assert drift == [1, 2, 3, 4]  # the ledger continues too (its iteration-3 row was dropped)
    assert ck.checkpoint_names(str(run / "checkpoints")) == ["iter_000002", "iter_000004"]
    assert yaml.safe_load((run / "config.yaml").read_text())["iterations"] == 4


@pytest.fixture(scope="module")
def plain_run(ray_local, tmp_path_factory):
    run = tmp_path_factory.mktemp("plain") / "run"
    with pytest.MonkeyPatch.context() as mp:
        hooks = interrupted_and_resumed(mp, run, PLAIN)
    return run, hooks


def test_resume_restores_weights_optimizer_rng_and_counters_exactly(plain_run):
    """RLlib's own learner (in the driver): interrupted after iteration 3, resumed from iter_000002."""
    assert_resumed_exactly(plain_run[1], plain_run[0])


def test_resumed_run_matches_an_uninterrupted_one_in_shape(plain_run, tmp_path):
    run = tmp_path / "straight"
    assert main(["train", "--output", str(run), "--iterations", "4", *PLAIN]) == 0
    straight, resumed = rows(run), rows(plain_run[0])
    assert [r["iteration"] for r in straight] == [r["iteration"] for r in resumed] == [1, 2, 3, 4]
    assert set(straight[0]) == set(resumed[0])
    # Iterations 1-2 ran before the interruption with the same seed: the same samples.
    assert [r["env_steps_total"] for r in straight[:2]] == [r["env_steps_total"] for r in resumed[:2]]


def test_resume_skips_a_corrupt_newest_checkpoint_and_evaluate_too(plain_run, tmp_path, capsys):
    run = tmp_path / "copy"
    shutil.copytree(plain_run[0], run)
    flip_byte(run / "checkpoints" / "iter_000004" / "learner_group" / "learner" / "state.pkl")
    assert main(["evaluate", str(run), "--episodes", "1"]) == 0
    err = capsys.readouterr().err
    assert "checkpoint iter_000004 is corrupt: learner_group/learner/state.pkl sha256 mismatch" in err
    assert main(["train", "--resume", str(run), "--iterations", "5"]) == 0
    out = capsys.readouterr()
    assert "resumed from" in out.out and "iter_000002 (iteration 2)" in out.out
    assert "iter_000004 is not a good checkpoint; moved to corrupt-iter_000004" in out.err
    assert [r["iteration"] for r in rows(run)] == [1, 2, 3, 4, 5]
    assert sorted(os.listdir(run / "checkpoints")) == ["corrupt-iter_000004", "iter_000002", "iter_000004",
                                                        "iter_000005"]


@pytest.mark.parametrize("args, needle", [
    (["--set", "moe.num_experts=8"], ("--set moe.num_experts: --resume cannot change the model: "
                                      "moe.num_experts is 4 in the run's config.yaml, got 8")),
    (["--num-learners", "2", "--ep-size", "2"], "--num-learners: --resume cannot change the model"),
    (["--env", "moe_rl/MultiTask-v0"], "--env: --resume cannot change the model"),
    (["--config", "CONFIG"], "--config: conflicts with the run being resumed: moe.d_ff is 16"),
    (["--output", "/elsewhere"], "--output: a resumed run continues in its own directory"),
])
def test_resume_refuses_to_change_the_model(plain_run, capsys, args, needle):
    from moe_rl.app.run_config import default_config_path
    args = [default_config_path() if a == "CONFIG" else a for a in args]
    before = (plain_run[0] / "config.yaml").read_text()
    assert main(["train", "--resume", str(plain_run[0]), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1], err
    assert (plain_run[0] / "config.yaml").read_text() == before


def test_a_run_from_before_a_new_model_key_resumes_from_a_relative_path(plain_run, tmp_path, monkeypatch):
    """An older version's config.yaml lacks the moe keys added since: they count as what that run
    ran with, the default (moe.positions) or, where the default has moved on, the old behaviour
    (moe.normalize_gates: true). RUN_DIR relative to the working directory."""
    run = tmp_path / "older"
    shutil.copytree(plain_run[0], run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    del cfg["moe"]["positions"], cfg["moe"]["normalize_gates"]
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(tmp_path)
    # An older version's run is not signed with this user's key: resuming it takes --trust-run.
    assert main(["train", "--resume", "older", "--iterations", "5"]) == 2
    assert main(["train", "--resume", "older", "--iterations", "5", "--trust-run"]) == 0
    assert [r["iteration"] for r in rows(run)] == [1, 2, 3, 4, 5]
    resumed = yaml.safe_load((run / "config.yaml").read_text())["moe"]
    assert resumed["positions"] == "learned" and resumed["normalize_gates"] is True


def test_resume_needs_a_good_checkpoint(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "config.yaml").write_text("env: CartPole-v1\n")
    assert main(["train", "--resume", str(tmp_path)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"moe-rl: error: --resume: {str(tmp_path)!r} has no good checkpoint under checkpoints/ "
                    "to continue from")


def test_failed_verification_quarantines_the_checkpoint(ray_local, monkeypatch, tmp_path, capsys):
    """The reloaded checkpoint policy must reproduce the live learner module: nudge the live
    weights right after iteration 2's checkpoint is written and the check catches it."""
    def nudge(algo):
        with torch.no_grad():
            algo.learner_group.foreach(lambda l: next(iter(l.module["default_policy"].parameters())).add_(1e-3))
    Hooks(monkeypatch, after_save={2: nudge})
    run = tmp_path / "run"
    assert main(["train", "--output", str(run), "--iterations", "2", *PLAIN]) == 0
    table = rows(run)
    assert table[1]["checkpoint/verified"] == 0 and table[1]["checkpoint/verify_max_abs_diff"] > 1e-6
    assert "checkpoint iter_000002 failed verification (max abs diff" in capsys.readouterr().err
    assert sorted(os.listdir(run / "checkpoints")) == ["corrupt-iter_000002"]


def test_a_checkpoint_that_cannot_be_written_leaves_nothing_partial(ray_local, monkeypatch, tmp_path, capsys):
    """Disk full while the manifest is written: no iter_ directory, no tmp directory, exit 2."""
    def full_disk(path, *a, **kw):
        with open(os.path.join(path, "manifest.json"), "w") as f:
            f.write('{"files": {')
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ck, "write_manifest", full_disk)
    run = tmp_path / "run"
    assert main(["train", "--output", str(run), "--iterations", "2", *PLAIN]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    ckpt = str(run / "checkpoints" / "iter_000002")
    assert err[-1] == f"moe-rl: error: checkpoints: cannot write checkpoint {ckpt!r}: No space left on device"
    assert os.listdir(run / "checkpoints") == []
    assert [r["iteration"] for r in rows(run)] == [1, 2]


# --- the DeepSpeed learner group (ep_size=2, two learner actors) ----------------------------------
@pytest.mark.slow
def test_deepspeed_resume_restores_every_learner_exactly(ray_local, monkeypatch, tmp_path, capsys):
    run = tmp_path / "run"
    hooks = interrupted_and_resumed(monkeypatch, run, DEEPSPEED)
    assert_resumed_exactly(hooks, run)
    assert len(hooks.restored[0][2]) == 2  # both learners' shards and moments compared
    # A learner-state file swapped for a code-running pickle (manifest rewritten to match) is
    # refused by the weights-only load, never executed.
    ckpt = run / "checkpoints" / "iter_000004"
    marker = tmp_path / "pwned"
    torch.save({"weights_seq_no": 1, "payload": RunsCode(marker)}, str(ckpt / "learner_group" / "learner_rank_0.pt"))
    ck.write_manifest(str(ckpt), 4, None)
    assert main(["train", "--resume", str(run), "--iterations", "5"]) == 1
    assert "learner_rank_0.pt' refused: not plain data" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not marker.exists()


def kill_learner_on_update(monkeypatch, rank, iteration):
    """ray.kill a learner actor as iteration `iteration`'s update starts: the update's ray.get
    raises RayActorError (ActorDiedError)."""
    import ray

    from moe_rl.algo.algorithm import MoEPPO
    update = MoEPPO._update

    def killing_update(self, episodes, *args):
        if self.iteration + 1 == iteration and not getattr(self, "_test_killed", False):
            self._test_killed = True
            ray.kill(self.learner_group._workers[rank])
        return update(self, episodes, *args)
    monkeypatch.setattr(MoEPPO, "_update", killing_update)


@pytest.mark.slow
def test_a_killed_learner_is_replaced_and_the_run_goes_on(ray_local, monkeypatch, tmp_path, capsys):
    hooks = Hooks(monkeypatch)
    kill_learner_on_update(monkeypatch, rank=1, iteration=3)
    run = tmp_path / "run"
    assert main(["train", "--output", str(run), "--iterations", "4", *DEEPSPEED]) == 0
    assert "learner 1 died; rebuilt the learner group and restored" in capsys.readouterr().out
    (ckpt_iter, algo_iter, restored, _), = hooks.restored
    assert ckpt_iter == algo_iter == 2
    assert_bit_identical(hooks.saved[2][0], restored)  # a fresh group holds the checkpoint exactly
    table = rows(run)
    assert [r["iteration"] for r in table] == [1, 2, 3, 4]
    assert [r["faults/learner_restarts"] for r in table] == [0, 0, 1, 1]
    assert all(math.isfinite(r["policy_loss"]) for r in table)
    assert table[-1]["checkpoint/verified"] == 1  # the rebuilt group's checkpoint reloads exactly


@pytest.mark.slow
def test_a_killed_learner_stops_the_run_when_restore_is_off(ray_local, monkeypatch, tmp_path, capsys):
    kill_learner_on_update(monkeypatch, rank=0, iteration=3)
    run = tmp_path / "run"
    assert main(["train", "--output", str(run), "--iterations", "4", *DEEPSPEED,
                 "--set", "restore_on_learner_failure=false"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("moe-rl: error: learner 0 died (")
    assert f"continue with `moe-rl train --resume {run}`" in last
    assert [r["iteration"] for r in rows(run)] == [1, 2]
    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0  # what the message says to do
    assert [r["iteration"] for r in rows(run)] == [1, 2, 3, 4]
