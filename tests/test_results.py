"""The metrics row's return figures (moe_rl.algo.results): RLlib 2.60 reports the mean over the
episodes that ended in the iteration, so the progress line and stop_return read a rolling mean over
the last 100 or more episodes; and a table read while the run rewrites it."""
import math
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# Values an iteration's row may hold for one column: text (a gate decision), numbers, flags, NaN
# (RLlib's "no value this iteration"), None, or nothing at all (the key missing).
CELLS = st.one_of(st.none(), st.just(math.nan), st.booleans(), st.integers(-5, 5),
                  st.floats(allow_nan=False, allow_infinity=True), st.sampled_from(["sync", "hold", ""]))
ROWS = st.lists(st.dictionaries(st.sampled_from(["drift/decision", "k3", "episodes", "flag"]), CELLS).map(
    lambda r: {"iteration": 1, **r}), min_size=1, max_size=12)   # every table's rows carry their iteration


@given(ROWS)
@settings(max_examples=60, deadline=None)
def test_any_mix_of_missing_and_mixed_values_is_written_with_one_type_per_column(tmp_path_factory, rows):
    """A run never dies of its own bookkeeping: whatever an iteration held (no check, no episode,
    a decision in one iteration and NaN in the next), the table is written, each column has one
    type, and nothing is lost: text stays text, numbers keep their value."""
    path = str(tmp_path_factory.mktemp("t") / "t.parquet")
    write_table(path, rows)
    back = read_rows(path)
    assert len(back) == len(rows)
    for column in {k for r in rows for k in r}:
        given_values = [r.get(column) for r in rows]
        got = [r[column] for r in back]
        texts = any(isinstance(v, str) for v in given_values)
        for want, have in zip(given_values, got):
            if want is None or (isinstance(want, float) and math.isnan(want)):
                assert have is None or (isinstance(have, float) and math.isnan(have))
            elif texts:
                assert have == (want if isinstance(want, str) else str(want))
            else:
                assert have == want or float(have) == float(want)
        assert len({type(v) for v in got if v is not None}) <= 1


def test_an_appo_iteration_without_a_check_writes_null_decisions_beside_text(tmp_path):
    """The crash on a busy machine: iteration 1 held a check ("sync"), iteration 2 none (NaN)."""
    path = str(tmp_path / "metrics.parquet")
    write_table(path, [{"iteration": 1, "drift/decision": "sync"}, {"iteration": 2, "drift/decision": math.nan}])
    assert [r["drift/decision"] for r in read_rows(path)] == ["sync", None]
