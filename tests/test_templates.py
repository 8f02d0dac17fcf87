"""Config templates (configs/): every one validates; the scaled-down ones train here."""
import os

import pyarrow.parquet as pq
import pytest

from moe_rl.app.cli import main
from moe_rl.app.run_config import load_run_config, validate_run_config
from moe_rl.core.sections import plain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = ("pretrain", "finetune", "multitask")


def _holds(full, given) -> bool:
    if isinstance(given, dict):
        return all(k in full and _holds(full[k], v) for k, v in given.items())
    return full == given


@pytest.mark.parametrize("name", [f"{t}{size}" for t in TEMPLATES for size in ("", "_full")])
def test_template_validates(name):
    """Every template sets the stability toolkit, and the built config holds what the file says."""
    cfg = load_run_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
    config = validate_run_config(cfg)
    # Validated, the section holds every value the file gives (mappings completed with defaults).
    assert cfg["stability"] and _holds(plain(config.stability_settings), cfg["stability"])
    assert {k: getattr(config.moe_settings, k) for k in cfg["moe"]} == cfg["moe"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TEMPLATES + ("stable",))
def test_scaled_down_template_trains_here(tmp_path, name):
    out = tmp_path / name
    assert main(["train", "--config", os.path.join(ROOT, "configs", f"{name}.yaml"), "--iterations", "2",
                 "--output", str(out)]) == 0
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(r["stability/skipped_steps"] == 0 and r["stability/grad_norm/total"] > 0 for r in rows)
    assert any(k.startswith("stability/lr/") for k in rows[-1])
    assert (out / "report.html").exists()


def test_stable_recipe_validates_and_scales_with_training_lr():
    """configs/stable.yaml is the recipe BENCHMARKS.md measures (bench_stability.py's `on` arm):
    adaptive balance, a shared expert, no z loss, clipping, skipping, winsorizing, and LR schedules
    tied to training.lr (router 1/10, experts cosine towards 1/10)."""
    cfg = load_run_config(os.path.join(ROOT, "configs", "stable.yaml"))
    config = validate_run_config(cfg)
    moe, stab, lr = plain(config.moe_settings), plain(config.stability_settings), cfg["training"]["lr"]
    assert (moe["balance"], moe["shared_expert"], moe["z_loss_coef"]) == ("adaptive", True, 0.0)
    assert stab["grad_clip"] == 1.0 and stab["skip_nonfinite"] and stab["winsorize_p"] == 0.01
    router, experts = stab["lr_schedules"]["router"], stab["lr_schedules"]["experts"]
    assert router["lr"] == pytest.approx(lr / 10) and experts["lr"] == pytest.approx(lr)
    assert experts["eta_min"] == pytest.approx(lr / 10)
    t = cfg["training"]   # t_max: twice the run's optimizer steps (batch / minibatch per epoch, give or take one)
    epochs = cfg["iterations"] * t["num_epochs"]
    steps = epochs * t["train_batch_size_per_learner"] / t["minibatch_size"]
    assert 2 * (steps - epochs) <= experts["t_max"] <= 2 * (steps + epochs)
