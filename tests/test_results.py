"""The metrics row's return figures (moe_rl.algo.results): RLlib 2.60 reports the mean over the
episodes that ended in the iteration, so the progress line and stop_return read a rolling mean over
the last 100 or more episodes; and a table read while the run rewrites it."""
import math
import threading

import pytest

from moe_rl.algo.results import metrics_row, read_rows, rolling_return_mean, write_table

pytestmark = pytest.mark.pure


def row(episodes, ret):
    return {"episodes": episodes, "episode_return_mean": ret}


def test_the_rolling_mean_weights_whole_iterations_by_their_episodes_until_it_holds_100():
    rows = [row(90, 10.0), row(60, 20.0), row(2, 500.0), row(0, math.nan)]
    # newest first: 0 episodes (skipped), 2 at 500, 60 at 20 (62 < 100), 90 at 10 -> 152 episodes
    assert rolling_return_mean(rows) == pytest.approx((2 * 500 + 60 * 20 + 90 * 10) / 152)
    # 2 long episodes that ended in one iteration do not make a run "solved"
    assert rolling_return_mean(rows) < 30
    assert rolling_return_mean(rows[1:3], episodes=50) == pytest.approx((2 * 500 + 60 * 20) / 62)
    assert rolling_return_mean([row(3, 7.0)]) == 7.0      # fewer than 100 at the start: what there is
    assert math.isnan(rolling_return_mean([row(0, math.nan)]))


def test_the_row_keeps_the_iterations_episode_count():
    result = {"training_iteration": 3, "env_runners": {"episode_return_mean": 42.0, "num_episodes": 7}}
    r = metrics_row(result)
    assert (r["episodes"], r["episode_return_mean"]) == (7, 42.0)
    assert metrics_row({"env_runners": {}})["episodes"] == 0
    assert metrics_row({"env_runners": {"num_episodes": math.nan}})["episodes"] == 0


def test_a_table_read_while_the_run_rewrites_it_is_whole(tmp_path):
    """A user's `moe-rl report` (or a test's poll) during a run: every read sees one whole version.
    Reading by path tore about 1 read in 4 here (pyarrow sizes the file, then opens it)."""
    path, rows, stop = str(tmp_path / "metrics.parquet"), [{"iteration": 0}], threading.Event()
    write_table(path, rows)

    def run():
        while not stop.is_set():
            rows.append({"iteration": len(rows), f"col{len(rows) % 40}": 1.0})
            write_table(path, list(rows))

    writer = threading.Thread(target=run)
    writer.start()
    try:
        lengths = [len(read_rows(path)) for _ in range(600)]
    finally:
        stop.set()
        writer.join()
    assert lengths == sorted(lengths) and lengths[-1] > lengths[0]   # the writer really ran alongside
