"""Config templates (configs/): every one validates; the scaled-down ones train here."""
import os

import pyarrow.parquet as pq
import pytest

from moe_rl.app.cli import main
from moe_rl.app.run_config import load_run_config, validate_run_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEMPLATES = ("pretrain", "finetune", "multitask")


@pytest.mark.parametrize("name", [f"{t}{size}" for t in TEMPLATES for size in ("", "_full")])
def test_template_validates(name):
    config = validate_run_config(load_run_config(os.path.join(ROOT, "configs", f"{name}.yaml")))
    assert config.stability_settings   # every template sets the stability toolkit


@pytest.mark.slow
@pytest.mark.parametrize("name", TEMPLATES)
def test_scaled_down_template_trains_here(tmp_path, name):
    out = tmp_path / name
    assert main(["train", "--config", os.path.join(ROOT, "configs", f"{name}.yaml"), "--iterations", "2",
                 "--output", str(out)]) == 0
    rows = pq.read_table(out / "metrics.parquet").to_pylist()
    assert [r["iteration"] for r in rows] == [1, 2]
    assert all(r["stability/skipped_steps"] == 0 and r["stability/grad_norm/total"] > 0 for r in rows)
    assert any(k.startswith("stability/lr/") for k in rows[-1])
    assert (out / "report.html").exists()
