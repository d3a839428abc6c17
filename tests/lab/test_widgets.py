"""Notebook widgets without a browser or a control plane: plain data in, DataFrames and plain text out.

No timed assertions: flushes are driven with `poll(now)` on a fake clock or `flush()`; the one threaded test
checks data integrity, not speed.
"""

from __future__ import annotations

import gc
import math
import threading
import weakref

import numpy as np
import pandas as pd
import pytest

from openrl_lab.lab.widgets import LivePlot, StopButton, TimelineView, downsample, downsample_rows
from openrl_lab.orchestrator.scheduler import Scheduler
from openrl_lab.orchestrator.types import SliceRecord


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class FakeCpu:
    """The flusher's CPU clock: each read advances it by `per_read` s, so a flush costs the same on any machine
    (0 by default: hz alone sets the pace). A real CPU clock made these tests depend on the machine's load."""

    def __init__(self, per_read: float = 0.0):
        self.t, self.per_read = 0.0, per_read

    def __call__(self) -> float:
        self.t += self.per_read
        return self.t


def sent(plot: LivePlot, metric: str) -> tuple[np.ndarray, np.ndarray]:
    """What the widget holds for a metric's trace (what the last flush sent)."""
    tr = next(t for t in plot.figure.data if t.name == metric)
    return np.asarray(tr.x), np.asarray(tr.y)


@pytest.fixture
def plots():
    made = []

    def make(*args, **kwargs):
        p = LivePlot(*args, **kwargs)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


# --- LivePlot ----------------------------------------------------------------------------------------


def test_append_from_loop_thread_while_background_flushes_keeps_every_point_in_order(plots):
    plot = plots(["reward", "loss"], hz=60, max_points=64)  # many flushes, heavy downsampling, while appending
    n = 20_000
    done = threading.Event()

    def loop():
        for i in range(n):
            extra = {"kl": i / 7} if i >= n // 2 else {}  # a metric that appears mid-run
            plot.append(i, reward=i * 0.5, loss=-i, **extra)
        done.set()

    t = threading.Thread(target=loop)
    t.start()
    snapshots = 0
    while not done.is_set() or snapshots == 0:  # readers take no lock: every snapshot must still be whole rows
        df = plot.dataframe
        steps = df["step"].to_numpy()
        assert (steps == np.arange(len(df))).all()
        assert (df["reward"].to_numpy() == steps * 0.5).all() and (df["loss"].to_numpy() == -steps).all()
        if "kl" in df:
            kl = df["kl"].to_numpy()
            late = steps >= n // 2
            assert np.isnan(kl[~late]).all() and (kl[late] == steps[late] / 7).all()
        snapshots += 1
    t.join()
    plot.stop()
    assert not plot.running
    df = plot.dataframe
    assert list(df.columns) == ["step", "reward", "loss", "kl"]
    assert len(df) == n
    assert (df["step"].to_numpy() == np.arange(n)).all()
    assert (df["reward"].to_numpy() == np.arange(n) * 0.5).all()
    assert (df["loss"].to_numpy() == -np.arange(n)).all()
    assert df["kl"].isna().sum() == n // 2
    stats = plot.stats
    assert stats["errors"] == 0, plot.last_error
    assert stats["flushes"] >= 1 and stats["last_sent"] == {"reward": 64, "loss": 64, "kl": 64}
    x, y = sent(plot, "reward")  # the final flush at stop() sent the newest point exactly
    assert x[-1] == n - 1 and y[-1] == (n - 1) * 0.5


def test_flushes_are_bounded_by_hz_on_an_injected_clock_and_only_happen_for_new_data(plots):
    clock = FakeClock()
    plot = plots(["reward"], hz=4, autostart=False, clock=clock, cpu_clock=FakeCpu())  # hz alone sets the pace
    assert plot.poll() is False  # nothing appended yet
    for i in range(1000):  # 10 s of a 100 Hz loop, polled at every step
        clock.t += 0.01
        plot.append(i, reward=float(i))
        plot.poll()
    assert 39 <= plot.stats["flushes"] <= 41  # 4 Hz over 10 s, plus the first one
    plot.flush()
    before = plot.stats["flushes"]
    for _ in range(100):  # time passes, no new data: no flush
        clock.t += 1.0
        assert plot.poll() is False
    assert plot.flush() is False
    assert plot.stats["flushes"] == before


def test_byte_budget_slows_flushes_when_traces_are_big(plots):
    def run(budget):
        clock = FakeClock()
        plot = plots(["a", "b", "c"], hz=4, autostart=False, clock=clock, max_bytes_per_s=budget, cpu_clock=FakeCpu())
        for i in range(1000):
            clock.t += 0.01
            plot.append(i, a=1.0, b=2.0, c=3.0)
            plot.poll()
        return plot.stats

    free, tight = run(1e12), run(20_000)
    assert free["flushes"] >= 39
    # With the tight budget bytes_sent/20 kB/s bounds the time flushing took: at most ~10 s worth plus one flush.
    assert tight["flushes"] < free["flushes"] / 2
    assert tight["bytes_sent"] <= 20_000 * 10 + 3 * 1000 * 12


def test_cpu_budget_spaces_flushes_by_their_own_cost(plots):
    clock = FakeClock()
    # Each flush costs 1 ms of (fake) CPU; with a 0.1% share the next one is due 1 s of fake time later.
    plot = plots(["reward"], hz=4, autostart=False, clock=clock, max_cpu_share=1e-3, cpu_clock=FakeCpu(1e-3))
    plot.append(0, reward=0.0)
    assert plot.poll() and plot.stats["flushes"] == 1
    polled = []
    for i in range(1, 1001):
        clock.t += 0.01
        plot.append(i, reward=float(i))
        polled.append(plot.poll())
    assert 9 <= sum(polled) <= 11  # 1 Hz over 10 s: at 4 Hz alone this would be 40 flushes
    assert not any(polled[:95])  # none within the first second
    before = plot.stats["flushes"]
    assert plot.flush() and plot.stats["flushes"] == before + 1  # flush() is not throttled


def test_downsampling_caps_points_keeps_newest_exact_and_global_extremes(plots):
    rng = np.random.default_rng(0)
    n, cap = 10_000, 500
    y = rng.normal(size=n)
    y[1234], y[5678] = 50.0, -50.0  # the global max and min, deep in the downsampled part
    plot = plots(["reward"], max_points=cap, autostart=False)
    for i, v in enumerate(y):
        plot.append(i, reward=v)
    assert plot.flush()
    x, ys = sent(plot, "reward")
    assert len(x) == len(ys) <= cap and plot.stats["last_sent"]["reward"] == len(x)
    assert len(x) > cap * 0.9  # it uses the budget rather than throwing points away
    assert (np.diff(x) >= 0).all()  # still a curve in step order
    assert x[-1] == n - 1 and ys[-1] == y[-1]
    tail = cap // 4
    assert (x[-tail:] == np.arange(n - tail, n)).all() and (ys[-tail:] == y[-tail:]).all()
    assert ys.max() == 50.0 and x[ys.argmax()] == 1234
    assert ys.min() == -50.0 and x[ys.argmin()] == 5678


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 100, 1001, 4999])
@pytest.mark.parametrize("cap", [8, 9, 50, 1000])
def test_downsample_bounds_and_subset(n, cap):
    rng = np.random.default_rng(n * 1000 + cap)
    x = np.arange(n) * 3
    y = rng.normal(size=n)
    xs, ys = downsample(x, y, cap)
    assert len(xs) == len(ys) <= min(n, cap)
    if n <= cap:
        assert (xs == x).all()
    if n:
        assert xs[-1] == x[-1] and ys.max() == y.max() and ys.min() == y.min()
        idx = xs // 3  # every point sent is a real point
        assert (y[idx] == ys).all() and (np.diff(xs) >= 0).all()


def test_downsample_rows_matches_one_series_at_a_time_and_handles_flat_data():
    rng = np.random.default_rng(1)
    x = np.arange(5000)
    ys = np.stack([rng.normal(size=5000), np.zeros(5000), np.cumsum(rng.normal(size=5000))])
    xr, yr = downsample_rows(x, ys, 300)
    assert xr.shape == yr.shape and xr.shape[0] == 3 and xr.shape[1] <= 300
    for row in range(3):
        xs, y1 = downsample(x, ys[row], 300)
        assert (xr[row] == xs).all() and (yr[row] == y1).all()
    assert (yr[1] == 0).all()  # a flat series stays flat (its points repeat, which a line plot does not show)


def test_steps_beyond_int32_are_sent_as_floats(plots):
    plot = plots(["reward"], autostart=False)
    plot.append(2**40, reward=1.0)
    plot.append(2**40 + 1, reward=2.0)
    plot.flush()
    x, _ = sent(plot, "reward")
    assert x.dtype == np.float64 and list(x) == [2**40, 2**40 + 1]
    small = plots(["reward"], autostart=False)
    small.append(5, reward=1.0)
    small.flush()
    assert sent(small, "reward")[0].dtype == np.int32  # a binary buffer, not a JSON list


def test_nan_and_inf_are_dropped_from_the_plot_but_kept_in_the_dataframe(plots):
    plot = plots(autostart=False)
    plot.append(0, reward=1.0, loss=math.nan)
    plot.append(1, reward=math.nan, loss=2.0)
    plot.append(2, reward=math.inf, loss=-math.inf)
    plot.append(3, reward=4.0, loss=None)  # None: missing
    plot.flush()
    x, y = sent(plot, "reward")
    assert list(x) == [0, 3] and list(y) == [1.0, 4.0]
    x, y = sent(plot, "loss")
    assert list(x) == [1] and list(y) == [2.0]
    df = plot.dataframe
    assert df["reward"].isna().tolist() == [False, True, False, False] and np.isinf(df["reward"][2])
    assert plot.stats["dropped"] == 2  # the two infs; NaN is just "missing"
    assert repr(plot) == "LivePlot 4 steps: reward=4 loss=2"  # last finite values


def test_non_numeric_value_raises_type_error_naming_the_metric_and_records_nothing(plots):
    plot = plots(["reward", "loss"], autostart=False)
    plot.append(0, reward=1.0, loss=1.0)
    with pytest.raises(TypeError, match="'loss'"):
        plot.append(1, reward=2.0, loss="0.5")
    with pytest.raises(TypeError, match="'kl'"):
        plot.append(1, reward=2.0, kl=[1.0])
    with pytest.raises(TypeError, match="step"):
        plot.append(1.5, reward=2.0)
    with pytest.raises(TypeError, match="'reward'"):
        plot.extend(pd.DataFrame({"step": [1], "reward": ["high"]}))
    assert len(plot) == 1 and plot.dataframe["reward"].tolist() == [1.0]  # the bad rows left no trace
    plot.append(1, reward=np.float32(2.5), loss=np.int64(3))  # numpy scalars are numbers
    assert plot.dataframe["loss"].tolist() == [1.0, 3.0]


def test_extend_replays_a_dataframe_or_rows_and_out_of_order_steps_plot_sorted(plots):
    src = plots(["reward", "kl"], autostart=False)
    for i in range(10):
        src.append(i, reward=i / 10, **({"kl": i * 1.0} if i % 3 == 0 else {}))
    copy = plots(autostart=False)
    copy.extend(src.dataframe)
    pd.testing.assert_frame_equal(copy.dataframe, src.dataframe)

    rows = plots(autostart=False)
    rows.extend([{"step": 5, "reward": 0.5}, {"step": 2, "reward": 0.2, "kl": 1.0}, {"step": 9, "reward": 0.9}])
    assert rows.dataframe["step"].tolist() == [5, 2, 9]  # the DataFrame keeps append order
    rows.flush()
    x, y = sent(rows, "reward")
    assert list(x) == [2, 5, 9] and list(y) == [0.2, 0.5, 0.9]  # the plot is by step


def test_new_metrics_get_their_own_panel(plots):
    plot = plots(["reward"], autostart=False)
    plot.append(0, reward=1.0)
    plot.flush()
    plot.append(1, reward=2.0, kl=0.1)
    plot.flush()
    assert [t.name for t in plot.figure.data] == ["reward", "kl"]
    assert [t.yaxis for t in plot.figure.data] == ["y", "y2"]
    lay = plot.figure.layout
    assert lay.yaxis.title.text == "reward" and lay.yaxis2.title.text == "kl"
    assert lay.yaxis.domain[0] > lay.yaxis2.domain[1]  # stacked, reward on top, no overlap
    assert plot.dataframe["kl"].isna().tolist() == [True, False]


def test_display_bundle_is_the_figure_widget_plus_plain_text(plots):
    plot = plots(["reward"], title="grpo", autostart=False)
    for i in range(120):
        plot.append(i, reward=0.81)
    bundle = plot._repr_mimebundle_()
    assert bundle["text/plain"] == "LivePlot 'grpo' 120 steps: reward=0.81"
    assert bundle["application/vnd.jupyter.widget-view+json"]["model_id"] == plot.figure.model_id
    assert plot.stats["flushes"] == 1  # displaying sends what is there now


def test_close_stops_the_thread_flushes_last_points_and_closes_the_widget():
    plot = LivePlot(["reward"], hz=0.01)  # the thread would not flush by itself for 100 s
    assert plot.running
    thread = plot._thread
    plot.append(0, reward=1.0)
    plot.append(1, reward=2.0)
    plot.close()
    assert not thread.is_alive() and not plot.running
    assert plot.stats["flushes"] == 1
    assert list(sent(plot, "reward")[1]) == [1.0, 2.0]
    assert plot.figure.comm is None
    assert repr(plot).endswith("(closed)")
    plot.append(2, reward=3.0)  # recording still works; nothing is sent
    assert len(plot.dataframe) == 3 and plot.flush() is False


def test_a_plot_dropped_without_close_lets_its_thread_end():
    plot = LivePlot(["reward"], hz=50)
    thread = plot._thread
    ref = weakref.ref(plot)
    del plot
    gc.collect()
    assert ref() is None
    thread.join(timeout=10)
    assert not thread.is_alive()


# --- TimelineView ------------------------------------------------------------------------------------


def test_timeline_duty_cycle_from_a_hand_built_frame():
    # Group g1, window 100 s ending at the last slice end (t=1200), so [1100, 1200]:
    #   a: run 1090-1110 (10 s inside), switch 1088-1090 (outside)
    #   b: run 1150-1170 (20 s), switch 1145-1150 (5 s)
    #   a: run 1180-1200 (20 s), switch 1179-1180 (1 s)
    # busy 50 s -> 50%, switch 6 s -> 6%, 3 slices. Group g2: run 1120-1130 (10 s) -> 10%, no switch.
    df = pd.DataFrame(
        [
            dict(group_id="g1", job="a", kind="train", started_at=1090.0, run_s=20.0, wait_s=0.5, switch_s=2.0),
            dict(group_id="g1", job="b", kind="sample", started_at=1150.0, run_s=20.0, wait_s=6.0, switch_s=5.0),
            dict(group_id="g1", job="a", kind="train", started_at=1180.0, run_s=20.0, wait_s=1.0, switch_s=1.0),
            dict(group_id="g1", job="a", kind="train", started_at=1000.0, run_s=5.0, wait_s=0.0, switch_s=0.0),
            dict(group_id="g2", job="c", kind="train", started_at=1120.0, run_s=10.0, wait_s=0.0, switch_s=0.0),
        ]
    )
    view = TimelineView(df, window_s=100)
    try:
        duty = view.duty.set_index("group_id")
        assert duty.loc["g1", "busy_s"] == pytest.approx(50.0)
        assert duty.loc["g1", "duty_cycle"] == pytest.approx(0.50)
        assert duty.loc["g1", "switch_share"] == pytest.approx(0.06)
        assert duty.loc["g1", "slices"] == 3
        assert duty.loc["g2", "duty_cycle"] == pytest.approx(0.10)
        text = repr(view)
        assert "g1" in text and "50.0%" in text and "6.0%" in text and "10.0%" in text
        assert view.summary() == text
        assert "g1: 50% busy, 6% switching" in view.figure.layout.title.subtitle.text
        names = [t.name for t in view.figure.data]
        assert names == ["switch", "sample", "train"]  # switch bars in grey, one trace per phase kind
        train = view.figure.data[2]
        assert sorted(train.y) == ["g1 / a", "g1 / a", "g2 / c"]  # the slice before the window is not drawn
        pd.testing.assert_frame_equal(view.dataframe, df)

        view.update(df[df["group_id"] == "g2"])
        assert list(view.duty["group_id"]) == ["g2"] and view.duty["duty_cycle"].iloc[0] == pytest.approx(1.0)
    finally:
        view.close()


def test_timeline_accepts_the_orchestrators_records_with_restore_and_running_slices():
    def rec(seq, job, granted, run, restore=0.0, switch_wait=0.0, outcome="ok"):
        released = 0.0 if outcome == "running" else granted + restore + run
        return SliceRecord(
            seq,
            f"s{seq}",
            "trainer",
            job,
            bool(job),
            f"ref{seq}",
            "train",
            granted - 1.0,
            granted,
            released,
            1.0,
            run,
            switch_wait + restore,
            restore,
            0.0,
            restore > 0,
            outcome,
        )

    clock = FakeClock(150.0)
    recs = [
        rec(1, "alice", 100.0, 10.0),  # busy 100-110
        rec(2, "", 112.0, 20.0, restore=2.0, switch_wait=1.0),  # switch 111-114, busy 114-134
        rec(3, "alice", 140.0, 0.0, outcome="running"),
    ]  # busy 140-now(150)
    df = pd.DataFrame([r.to_dict() for r in recs])
    view = TimelineView(df, window_s=1000, clock=clock)
    try:
        d = view.duty.iloc[0]
        assert (view.since, view.until) == (100.0, 150.0)
        assert d["busy_s"] == pytest.approx(40.0) and d["switch_s"] == pytest.approx(3.0)
        assert d["duty_cycle"] == pytest.approx(0.8) and d["slices"] == 3
        rows = set(view.figure.data[-1].y)
        assert rows == {"trainer / alice", "trainer / other ref2"}  # another user's job shows by its lease ref
    finally:
        view.close()


def test_timeline_duty_cycle_is_the_orchestrators_and_hidden_kinds_show_as_other():
    clock = FakeClock(1000.0)
    evicts = []
    s = Scheduler({"groups": [{"id": "g", "devices": ["d0"]}]}, clock=clock, on_evict_request=evicts.append)
    a, b = s.create_lease("alice", "g", "a").lease_id, s.create_lease("bob", "g", "b").lease_id
    for i in range(6):  # alternating owners with evictions and restores (switch time), gaps in between
        owner, lease = ("alice", a) if i % 2 == 0 else ("bob", b)
        ticket = s.request(owner, lease, "train" if owner == "alice" else "bobs_own_phase")
        clock.t += 0.5
        if i:  # the other job's state is on the device: it is asked to evict, and reports
            ev = evicts.pop()
            s.report_evicted("alice" if ev.lease_id == a else "bob", ev.lease_id, ev.switch_id, 0.5)
        clock.t += 1.0 + i
        s.release(owner, ticket.grant.slice_id, keep_resident=True, restore_s=0.2 if i else 0.0)
        clock.t += 2.0
    view = TimelineView(s.timeline("alice", "g"), window_s=12, clock=clock)
    try:
        ours = view.duty.iloc[0]
        theirs = s.duty_cycle("g", since=view.since, until=view.until)
        assert (ours["busy_s"], ours["switch_s"], ours["slices"]) == pytest.approx(
            (theirs.busy_s, theirs.switch_s, theirs.slices)
        )
        assert theirs.switch_s > 0 and theirs.slices < 6  # the window cut the first slices off
        assert sorted({t.name for t in view.figure.data}) == ["other", "switch", "train"]
        assert "application/vnd.jupyter.widget-view+json" in view._repr_mimebundle_()
    finally:
        view.close()
    assert view._repr_mimebundle_() == {"text/plain": repr(view)}


def test_timeline_empty_and_bad_frames():
    view = TimelineView()
    assert "no slices" in repr(view)
    with pytest.raises(ValueError, match="run_s"):
        view.update(pd.DataFrame({"group_id": ["g"], "started_at": [1.0]}))
    view.close()


# --- StopButton --------------------------------------------------------------------------------------


def test_stop_button_click_sets_stopped_and_reset_rearms():
    button = StopButton()
    assert not button.stopped and not button.should_stop()
    assert repr(button) == "StopButton 'Stop': not stopped"
    button.click()  # what a frontend click runs: the registered click handlers
    assert button.stopped and button.should_stop() and button.disabled
    assert repr(button) == "StopButton 'Stop': stopped"
    assert button._repr_mimebundle_()["text/plain"] == repr(button)
    button.reset()
    assert not button.stopped and not button.disabled and button.description == "Stop"
    button._click_handlers(button)
    assert button.stopped

    steps = 0
    button.reset()
    for step in range(100):  # a loop stops at its next step boundary
        if button.should_stop():
            break
        steps += 1
        if step == 9:
            button.click()
    assert steps == 10
    button.close()
    button.reset()  # a closed button's flag still works
    button.stop()
    assert button.stopped


def test_edit_holds_the_flush_lock_so_user_edits_do_not_race_a_flush(plots):
    plot = plots(["reward"], autostart=False)
    plot.append(0, reward=1.0)
    with plot.edit() as fig:
        fig.update_layout(title="edited")
        done = []
        t = threading.Thread(target=lambda: done.append(plot.flush()))
        t.start()
        t.join(timeout=0.2)  # the flush cannot start while the edit holds the lock
        assert done == []
    t.join()
    assert done == [True] and plot.figure.layout.title.text == "edited"


def test_repr_shows_the_last_finite_value_even_long_ago(plots):
    plot = plots(["reward", "eval"], autostart=False)
    plot.append(0, reward=0.0, eval=0.75)
    for i in range(1, 500):
        plot.append(i, reward=i / 1000)
    plot.append(500, reward=math.nan, eval=math.inf)
    assert repr(plot) == "LivePlot 501 steps: reward=0.499 eval=0.75"
    assert repr(plots(["kl"], autostart=False)) == "LivePlot 0 steps: kl=-"


def test_steps_without_values_and_a_plot_with_no_metrics(plots):
    plot = plots(autostart=False)
    plot.append(0)
    assert plot.flush() and len(plot.figure.data) == 0
    assert list(plot.dataframe.columns) == ["step"] and repr(plot) == "LivePlot 1 steps"
    plot.append(1, reward=0.5)
    assert plot.flush() and plot.dataframe["reward"].isna().tolist() == [True, False]
    with pytest.raises(ValueError, match="step"):
        plot.append(2, step=3)


# --- what a view draws (issue 12: empty plots, reloads, half-step ticks) ------------------------------------


def test_known_metrics_are_in_the_widgets_initial_state_with_a_waiting_note(plots):
    # A view that renders late draws from the synced state: the traces and panels must be there from the start.
    plot = plots(["reward", "loss"], autostart=False)
    assert [t["name"] for t in plot.figure._widget_data] == ["reward", "loss"]
    assert plot.figure._widget_layout["yaxis2"]["title"]["text"] == "loss"
    assert [a.text for a in plot.figure.layout.annotations] == ["waiting for the first step"]
    plot.append(0, reward=1.0, loss=2.0)
    plot.flush()
    assert plot.figure.layout.annotations == ()  # the note goes with the first point


def test_the_synced_state_catches_up_with_the_live_updates(plots):
    clock = FakeClock()
    plot = plots(["reward"], autostart=False, clock=clock, cpu_clock=FakeCpu())
    plot.append(0, reward=1.0)
    assert plot.poll()  # first flush: state synced too
    assert list(plot.figure._widget_data[0]["y"]) == [1.0]
    clock.t += 0.3
    plot.append(1, reward=2.0)
    assert plot.poll()  # within a second of the last sync: live views only
    assert list(plot.figure._widget_data[0]["y"]) == [1.0]
    clock.t += 0.3
    assert not plot.poll()  # nothing new: the idle flusher brings the state up to date
    assert list(plot.figure._widget_data[0]["y"]) == [1.0, 2.0]
    assert list(sent(plot, "reward")[1]) == [1.0, 2.0]
    plot.append(2, reward=3.0)
    plot.stop()  # and the last flush is always in the state
    assert list(plot.figure._widget_data[0]["y"]) == [1.0, 2.0, 3.0]


def test_a_metric_added_later_is_in_the_state_at_once(plots):
    clock = FakeClock()
    plot = plots(["reward"], autostart=False, clock=clock, cpu_clock=FakeCpu())
    plot.append(0, reward=1.0)
    plot.poll()
    clock.t += 0.3
    plot.append(1, reward=1.0, kl=0.5)
    plot.poll()
    assert [t["name"] for t in plot.figure._widget_data] == ["reward", "kl"]


def test_few_steps_tick_every_step_not_half_steps(plots):
    plot = plots(["reward"], autostart=False)
    for i in range(4):
        plot.append(i, reward=float(i))
    plot.flush()
    assert plot.figure.layout.xaxis.dtick == 1
    for i in range(4, 50):
        plot.append(i, reward=float(i))
    plot.flush()
    assert plot.figure.layout.xaxis.dtick == 5  # about 10 ticks over 49 steps, whole numbers
    for i in range(50, 100_000, 7):
        plot.append(i, reward=1.0)
    plot.flush()
    assert plot.figure.layout.xaxis.dtick == 10_000


def test_closed_is_a_real_property(plots):
    plot = plots(["reward"], autostart=False)
    assert plot.closed is False
    plot.close()
    assert plot.closed is True


def test_timeline_fits_the_recent_activity_not_an_older_job():
    # Notebook 03's pattern: one job long ago, then two jobs interleaving short slices for the last 20 s.
    rows = [dict(group_id="g", job="old", kind="train", started_at=1000.0, run_s=30.0, wait_s=0.0, switch_s=0.0)]
    for i in range(20):
        rows.append(
            dict(
                group_id="g",
                job="a" if i % 2 else "b",
                kind="train",
                started_at=1100.0 + i,
                run_s=0.8,
                wait_s=0.1,
                switch_s=0.1,
            )
        )
    view = TimelineView(pd.DataFrame(rows), window_s=300)
    try:
        assert view.since == pytest.approx(1099.9)  # the first interleaved slice's switch
        lo, hi = view.figure.layout.xaxis.range
        assert hi - lo < 25  # not the 120 s back to the old job
        assert set(view.figure.data[-1].y) == {"g / a", "g / b"}
        assert view.figure.layout.height == 100 + 50 + 36 * 2
    finally:
        view.close()


def test_timeline_empty_state_says_so():
    view = TimelineView(window_s=60)
    try:
        lay = view.figure.layout
        assert lay.xaxis.title.text == "seconds before now" and tuple(lay.xaxis.range) == (-60, 0)
        assert [a.text for a in lay.annotations] == ["no slices in the last 60 s: phases show here as they run"]
        assert lay.yaxis.visible is False
    finally:
        view.close()


def test_a_collapse_is_a_marker_on_every_panel_not_a_panel_of_its_own(plots):
    plot = plots(["reward", "entropy"], title="grpo", autostart=False)
    for step in range(30):  # sure of itself (entropy 0.1) while the reward falls from 0.6 to 0
        plot.append(step, reward=max(0.6 - step * 0.03, 0.0), entropy=0.1)
    assert len(plot.collapses) == 1 and 10 <= plot.collapses[0] < 30
    onset = plot.collapses[0]
    plot.flush()
    assert [s.x0 for s in plot.figure.layout.shapes] == [onset]
    assert [a.text for a in plot.figure.layout.annotations] == [f"collapse at step {onset}"]
    assert repr(plot).endswith(f"(COLLAPSE at step {onset})")
    plot.append(30, reward=0.0, entropy=0.1)
    plot.flush()  # later flushes keep the marks
    assert [a.text for a in plot.figure.layout.annotations] == [f"collapse at step {onset}"]
    # a logged flag (rl_train's rows) is a marker too, never a panel; a history replayed marks it the same way
    flagged = plots(["reward"], autostart=False)
    flagged.extend(pd.DataFrame({"step": [1, 2, 3, 4], "reward": [0.1] * 4, "collapse": [0.0, 1.0, 1.0, 0.0]}))
    flagged.append(5, reward=0.0, collapse=True)
    assert flagged.collapses == [2, 5] and flagged.metrics == ["reward"]
    assert "collapse" not in flagged.dataframe.columns
    with pytest.raises(TypeError, match="'collapse'"):  # a flag that is no number: refused, nothing recorded
        flagged.append(6, reward=0.5, collapse="yes")
    assert len(flagged) == 5
