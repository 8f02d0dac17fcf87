"""The metrics row's return figures (moe_rl.algo.results): RLlib 2.60 reports the mean over the
episodes that ended in the iteration, so the progress line and stop_return read a rolling mean over
the last 100 or more episodes."""
import math

import pytest

from moe_rl.algo.results import metrics_row, rolling_return_mean

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
