"""`LivePlot`: live metrics (reward, loss, KL, ...) against step, cheap for the training loop.

    plot = LivePlot(["reward", "loss", "kl"], title="grpo")
    display(plot)                 # a plotly FigureWidget, updated at most `hz` times a second
    for step in range(n):
        ...
        plot.append(step, reward=r, loss=l, kl=k)   # O(1), never touches the widget
    plot.stop()                   # final flush; `plot.dataframe` holds every point

Why a background thread and not updates from `append`: plotly's FigureWidget has no Python-side extendTraces,
so every update resends whole traces, and each costs ~0.3 ms of CPU in-process and ~2 ms in a kernel from a
background thread, whatever its size (plotly, traitlets, session signing, 4 comm messages handed to
ipykernel's IOPub thread, GIL handoffs); jupyter_server drops iopub above 1000 msg/s. So updates are
coalesced into one restyle per flush, at most `hz` flushes a second, only when there is new data, with at most
`max_points` points per trace (older points downsampled, the newest sent exactly) as binary buffers, and with
budgets for bytes (remote browsers on slow links) and for the flusher's CPU (a loaded machine gets fewer
updates, not a slower loop).
Measured cost: docs/benchmarks.md, "Live plots".
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import threading
import time
import uuid
import weakref
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

from openrl_lab.collapse import COLLAPSE_METRIC, CollapseWatch
from openrl_lab.lab.widgets._bundle import mime_bundle
from openrl_lab.lab.widgets._figure import figure_widget
from openrl_lab.lab.widgets.downsample import downsample, downsample_rows

# --- value checks -------------------------------------------------------------------------------------


def _as_step(step: Any) -> int:
    if isinstance(step, bool):
        raise TypeError(f"step must be an integer, got {step!r}")
    try:
        return operator.index(step)
    except TypeError:
        raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}") from None


def _as_value(name: str, value: Any) -> float:
    """A metric value as a float; None means missing (NaN). Strings are refused even when they parse."""
    if value is None:
        return math.nan
    if isinstance(value, numbers.Real):
        return float(value)
    if not isinstance(value, (str, bytes)) and hasattr(value, "__float__"):  # numpy 0-d arrays, torch scalars
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    raise TypeError(f"metric {name!r} must be a number, got {type(value).__name__} {value!r}")


def _as_flag(value: Any) -> bool | None:
    """A logged `collapse` flag: True/False, or None when missing (None, NaN)."""
    if value is None:
        return None
    v = _as_value(COLLAPSE_METRIC, value)
    return None if math.isnan(v) else bool(v)


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


# Shown until the first point arrives, so a fresh plot says what it waits for rather than drawing empty axes.
_WAITING = dict(
    text="waiting for the first step",
    name="waiting",
    showarrow=False,
    xref="paper",
    yref="paper",
    x=0.5,
    y=0.5,
    font=dict(size=14, color="#888"),
)
STATE_SYNC_S = 1.0  # the widget's synced state lags the live views by at most this (plus one flush period)


def _int_dtick(span: int, ticks: int = 10) -> int:
    """The smallest of 1, 2, 5, 10, 20, 50, ... that puts at most about `ticks` ticks over `span` steps."""
    step = 1
    while True:
        for m in (1, 2, 5):
            if span <= ticks * step * m:
                return step * m
        step *= 10


def _trace(metric: str, panel: int) -> dict:
    return dict(
        type="scatter", mode="lines", name=metric, x=[], y=[], xaxis="x", yaxis="y" if panel == 0 else f"y{panel + 1}"
    )


def _collapse_marks(onsets: list[int]) -> dict:
    """A dashed red line across every panel at each step a collapse began, labelled at the top."""
    line = dict(type="line", xref="x", yref="paper", y0=0, y1=1, line=dict(color="#d62728", dash="dash", width=1.5))
    label = dict(xref="x", yref="paper", y=1.0, yanchor="bottom", showarrow=False, font=dict(color="#d62728"))
    return {
        "shapes": [dict(line, x0=s, x1=s) for s in onsets],
        "annotations": [dict(label, x=s, text=f"collapse at step {s}") for s in onsets],
    }


def _flusher(ref: weakref.ref, stop: threading.Event) -> None:
    # Holds only a weak reference between ticks, so a plot dropped without close() lets its thread end.
    while True:
        plot = ref()
        if plot is None:
            return
        timeout = plot._wait_s()
        del plot
        if stop.wait(timeout):
            return
        plot = ref()
        if plot is None:
            return
        try:
            plot.poll()
        except Exception as e:  # noqa: BLE001 - a broken frontend must not kill the thread, nor reach the training loop
            plot._errors += 1
            plot.last_error = e
        del plot


class LivePlot:
    """Live metrics (reward, loss, KL, ...) against step, one stacked panel per metric sharing the step axis.

    `append(step, **values)` only writes to an in-memory buffer under a lock: O(1), no widget or comm work,
    safe to call from the training loop. A daemon thread flushes the buffer into `figure` (a plotly
    FigureWidget) at most `hz` times a second, and only when something new was appended. The buffer keeps the
    full history (`dataframe`); each trace sends at most `max_points` points (see `downsample`).

    Flushes are further spaced out so that the bytes sent stay under `max_bytes_per_s` and the flusher's own
    CPU time under `max_cpu_share` of wall time (on a loaded machine 5 Hz may become ~4 Hz rather than cost
    the loop more).

    NaN/inf values are kept in `dataframe` but left out of the plot; None means "missing"; a non-numeric value
    raises TypeError naming the metric. `flush()` sends now; `stop()` ends the thread after a last flush;
    `close()` also closes the widget. `stats` counts flushes, points and bytes sent, and the flusher's time.

    `clock` (monotonic seconds) is injectable so tests can drive `poll(now)` without sleeping; so is `cpu_clock`
    (the flusher's own CPU seconds, which the CPU budget spaces flushes by), so that a test of the pacing does not
    depend on how fast this machine runs a flush.
    """

    def __init__(
        self,
        metrics: Sequence[str] | None = None,
        *,
        title: str = "",
        hz: float = 4.0,
        max_points: int = 2000,
        autostart: bool = True,
        max_bytes_per_s: float = 500_000,
        max_cpu_share: float = 0.005,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.thread_time,
    ):
        if not (isinstance(hz, (int, float)) and 0 < hz <= 60):
            raise ValueError(f"hz must be in (0, 60], got {hz!r}")
        if not (isinstance(max_points, int) and max_points >= 8):
            raise ValueError(f"max_points must be an integer >= 8, got {max_points!r}")
        self.title = str(title)
        self.hz = float(hz)
        self.max_points = max_points
        # jupyter_server's 1 MB/s limit counts stream output only, but a browser behind a hub proxy or a slow
        # link still has to take it: 3 traces x 2,000 points at 5 Hz is ~360 kB/s, within this default.
        self.max_bytes_per_s = float(max_bytes_per_s)
        if not 0 < max_cpu_share <= 1:
            raise ValueError(f"max_cpu_share must be in (0, 1], got {max_cpu_share!r}")
        self.max_cpu_share = float(max_cpu_share)  # of wall time, for the flusher thread's own CPU
        self._clock = clock
        self._cpu_clock = cpu_clock
        # Appenders take _lock; readers (the flusher, dataframe) never do, so a flush can't stall the loop on it:
        # columns grow before _steps, and a reader copies the first len(_steps) rows of each, by slicing (one C
        # call, atomic under the GIL; a numpy view of a live array.array would block its resizing).
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one flush at a time (thread, flush(), display)
        self._steps = array("q")
        self._cols: dict[str, array] = {}  # metric -> values aligned with _steps, NaN where missing
        self._monotonic = True
        self._max_step = -math.inf
        self._version = 0
        self._sent_version = 0
        self._next_due = -math.inf
        self._flushes = 0
        self._points_sent = 0
        self._bytes_sent = 0
        self._last_sent: dict[str, int] = {}
        self._flush_s = 0.0
        self._flush_cpu_s = 0.0
        self._errors = 0
        self.last_error: BaseException | None = None
        self._closed = False
        self._display_id: str | None = None  # its outputs, so close() can turn them into text
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # A collapse (openrl_lab.collapse.CollapseWatch) is a marker, not a panel: from a logged `collapse`
        # flag (rl_train's rows, a run's log) or, without one, from `reward` and `entropy` as they come.
        self._watch = CollapseWatch()
        self._collapsed = False
        self.collapses: list[int] = []  # the steps at which a collapse began
        self._sent_collapses = 0
        for m in metrics or ():
            self._add_metric(self._check_name(m))

        self._state_version = 0  # the data version in the widget's synced state (what a new view draws)
        self._state_at = -math.inf
        self._dtick: float | None = None

        # The known metrics' traces and panels are in the widget's initial state (its comm_open), so every view
        # has them whenever it renders; a trace added later by a message could be missed by a view rendering
        # late (see _sync_state).
        panels = list(self._cols)
        self._index: dict[str, int] = {m: i for i, m in enumerate(panels)}  # metric -> trace index
        # uirevision: the user's zoom/pan survives data updates.
        layout = dict(
            title=self.title or None,
            uirevision="live",
            showlegend=False,
            margin=dict(l=60, r=20, t=50 if self.title else 20, b=40),
            hovermode="x",
            annotations=[_WAITING],
        )
        layout.update(self._axes_layout(panels))
        self.figure = figure_widget(data=[_trace(m, i) for i, m in enumerate(panels)], layout=layout)
        if autostart:
            self.start()

    # -- the loop side --
    @staticmethod
    def _check_name(name: Any) -> str:
        if not isinstance(name, str) or not name:
            raise TypeError(f"metric names must be non-empty strings, got {name!r}")
        if name == "step":
            raise ValueError("'step' is the x axis, not a metric name")
        return name

    def _add_metric(self, name: str) -> None:
        # Caller holds _lock (or is __init__), before _steps grows. Backfill keeps columns aligned with _steps.
        self._cols[name] = array("d", [math.nan]) * len(self._steps)

    def append(self, step: int, /, **values: float) -> None:
        """Record one step's values. O(1) in the history length; never touches the widget."""
        # Fast paths for the common types: this runs every training step (~2-4 us for 3 metrics).
        s = step if type(step) is int else _as_step(step)
        cols = self._cols
        flag = _as_flag(values.pop(COLLAPSE_METRIC, None))
        vals = {}
        for k, v in values.items():  # all checked before any write, so a bad value records nothing
            if k not in cols:
                self._check_name(k)
            vals[k] = v if type(v) is float else _as_value(k, v)
        with self._lock:
            if len(vals) > len(cols) or not vals.keys() <= cols.keys():
                for name in vals:
                    if name not in cols:
                        self._add_metric(name)
            if s < self._max_step:
                self._monotonic = False
            else:
                self._max_step = s
            for name, col in cols.items():
                col.append(vals.get(name, math.nan))
            if flag is not None or "entropy" in vals:
                self._see_collapse(s, flag, vals)
            self._steps.append(s)  # last: the row is complete once _steps counts it
            self._version += 1

    def _see_collapse(self, step: int, flag: bool | None, vals: Mapping[str, float]) -> None:
        """One step for the collapse marker (caller holds _lock): the logged flag, else the watch's verdict."""
        if flag is not None:
            now = flag
        elif "reward" in vals:
            now = self._watch.update(vals["reward"], vals["entropy"])
        else:
            return
        if now and not self._collapsed:
            self.collapses.append(step)
        self._collapsed = now

    def extend(self, rows: pd.DataFrame | Iterable[Mapping[str, Any]]) -> None:
        """Append many steps: a DataFrame (a `step` column, else its index) or dicts with a `step` key.

        NaN/None cells are treated as missing, so `extend(other.dataframe)` replays another plot's history.
        """
        if isinstance(rows, pd.DataFrame):
            df = rows
            steps = df["step"] if "step" in df.columns else pd.Series(df.index, index=df.index)
            try:
                step_arr = np.asarray(steps, dtype=np.int64)
            except (TypeError, ValueError):
                raise TypeError("step must be integers") from None
            if len(step_arr) and not np.array_equal(step_arr, np.asarray(steps, dtype=np.float64)):
                raise TypeError("step must be integers")
            cols: dict[str, np.ndarray] = {}
            # checked before any write, as every other column is
            marks = [_as_flag(v) for v in df[COLLAPSE_METRIC]] if COLLAPSE_METRIC in df.columns else None
            for c in df.columns:
                if c in ("step", COLLAPSE_METRIC):
                    continue
                name = self._check_name(c)
                col = df[c]
                if col.dtype.kind in "biuf":
                    cols[name] = col.to_numpy(dtype=np.float64)
                else:  # object columns: check each cell like append does
                    cols[name] = np.array([_as_value(name, v) for v in col], dtype=np.float64)
            with self._lock:
                if len(step_arr):
                    if step_arr[0] < self._max_step or np.any(np.diff(step_arr) < 0):
                        self._monotonic = False
                    self._max_step = max(self._max_step, int(step_arr.max()))
                for name in cols:  # before the steps grow: new columns backfill the rows so far
                    if name not in self._cols:
                        self._add_metric(name)
                for name, col in self._cols.items():
                    vals = cols.get(name)
                    if vals is None:
                        col.extend(array("d", [math.nan]) * len(step_arr))
                        continue
                    col.frombytes(np.ascontiguousarray(vals, dtype=np.float64).tobytes())
                if marks is not None or "entropy" in cols:
                    for i, step in enumerate(step_arr.tolist()):
                        flag = None if marks is None else marks[i]
                        self._see_collapse(step, flag, {k: float(v[i]) for k, v in cols.items()})
                self._steps.extend(step_arr.tolist())  # last, as in append
                self._version += 1
            return
        for given in rows:
            row = dict(given)
            if "step" not in row:
                raise ValueError(f"each row needs a 'step' key, got {sorted(row)}")
            step = row.pop("step")
            self.append(step, **{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()})

    # -- the widget side --
    def start(self) -> None:
        """Start the background flusher (done by the constructor unless autostart=False)."""
        if self._closed:
            raise RuntimeError("this LivePlot is closed")
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_flusher,
            args=(weakref.ref(self), self._stop),
            name=f"LivePlot-flusher {self.title}".strip(),
            daemon=True,
        )
        self._thread.start()

    def _wait_s(self) -> float:
        period = 1.0 / self.hz
        if self._version == self._sent_version:
            return period  # idle: a new point waits at most one period; an idle plot wakes only hz times a second
        return min(max(self._next_due - self._clock(), 0.0), 10 * period)

    def poll(self, now: float | None = None) -> bool:
        """Flush if there is new data and the last flush was long enough ago (the thread calls this)."""
        now = self._clock() if now is None else now
        if self._version == self._sent_version:
            if self._state_version != self._sent_version:  # idle: bring the synced state up to date
                with self._flush_lock:
                    self._sync_state(now)
            return False
        if now < self._next_due:
            return False
        return self._flush(now)

    def flush(self) -> bool:
        """Send the buffer to the widget now (if anything changed). Returns whether a flush happened."""
        return self._flush(self._clock())

    def _snapshot(self) -> tuple[int, np.ndarray, dict[str, np.ndarray], bool]:
        # Without the lock (see __init__): version first, so what is sent covers at least that version.
        version = self._version
        n = len(self._steps)
        steps = np.frombuffer(self._steps[:n], dtype=np.int64)
        cols = {m: np.frombuffer(c[:n], dtype=np.float64) for m, c in list(self._cols.items())}
        return version, steps, cols, self._monotonic  # read after the rows: covers every row copied

    def _flush(self, now: float) -> bool:
        with self._flush_lock:
            if self._closed or self._version == self._sent_version:
                return False
            t0, c0 = time.perf_counter(), self._cpu_clock()
            version, steps, cols, monotonic = self._snapshot()
            if not monotonic:  # the plot is by step; the DataFrame keeps append order
                by_step = np.argsort(steps, kind="stable")
                steps = steps[by_step]
                cols = {m: c[by_step] for m, c in cols.items()}
            # int32 x travels as a binary buffer (plotly sends int64 as a JSON list); float64 beyond 2**31.
            xtype = np.int32 if not len(steps) or (steps[0] > -(2**31) and steps[-1] < 2**31) else np.float64
            new = [m for m in cols if m not in self._index]
            fig = self.figure
            if new:
                panels = list(cols)  # panel i (top to bottom) is metric i; its y axis is y, y2, y3, ...
                fig.add_traces([_trace(m, panels.index(m)) for m in new])
                for m, i in zip(new, range(len(fig.data) - len(new), len(fig.data))):
                    self._index[m] = i
                fig.update_layout(self._axes_layout(panels))
            c1 = self._cpu_clock()  # adding traces is one-off: not charged to the CPU budget below
            data_x, data_y = [], []
            if cols:
                ys = np.stack(list(cols.values()))
                if np.isfinite(ys).all():  # the usual case: every metric every step, all in one pass
                    xd, yd = downsample_rows(steps, ys, self.max_points)
                    # one contiguous array per trace: zmq sends only contiguous buffers
                    data_x, data_y = list(xd.astype(xtype)), list(yd)
                else:  # NaN/inf/missing: each metric its own x
                    for y in ys:
                        keep = np.isfinite(y)
                        xd, yd = downsample(steps[keep], y[keep], self.max_points)
                        data_x.append(xd.astype(xtype))
                        data_y.append(yd)
            # one contiguous array per trace: zmq sends only contiguous buffers (a row of a strided result is not)
            data_x = [np.ascontiguousarray(x) for x in data_x]
            data_y = [np.ascontiguousarray(y) for y in data_y]
            sent = {m: len(xd) for m, xd in zip(cols, data_x)}
            nbytes = sum(xd.nbytes + yd.nbytes for xd, yd in zip(data_x, data_y))
            # One restyle for all traces. plotly_restyle skips the per-array validation that `trace.x = ...`
            # runs (about a third of a flush's CPU); the arrays are plain 1-D numeric ones made above.
            if cols:  # steps appended with no values yet: nothing to draw
                fig.plotly_restyle({"x": data_x, "y": data_y}, [self._index[m] for m in cols])
            relayout: dict[str, Any] = {}
            if len(steps) and any(a.name == _WAITING["name"] for a in fig.layout.annotations):
                fig.layout.annotations = ()  # the "waiting" note goes with the first point
            # Steps are integers: plotly's automatic ticks go to halves below ~10 steps, so the tick step is set
            # here, a whole 1/2/5 x 10^k giving about 10 ticks over the steps so far.
            dtick = _int_dtick(int(steps[-1] - steps[0])) if len(steps) else None
            if dtick != self._dtick:
                relayout["xaxis.dtick"] = dtick
                self._dtick = dtick
            if len(self.collapses) != self._sent_collapses:
                marks = _collapse_marks(self.collapses)
                fig.layout.shapes, fig.layout.annotations = marks["shapes"], marks["annotations"]
                self._sent_collapses = len(self.collapses)
            if relayout:
                fig.plotly_relayout(relayout)
            self._sent_version = version
            if new or now - self._state_at >= STATE_SYNC_S:
                self._sync_state(now)
            self._flushes += 1
            self._points_sent += sum(sent.values())
            self._bytes_sent += nbytes
            self._last_sent = sent
            c2 = self._cpu_clock()
            self._flush_s += time.perf_counter() - t0
            self._flush_cpu_s += c2 - c0
            # hz is the ceiling; the byte budget stretches the interval when traces are big, the CPU budget when
            # flushes get slow (a loaded machine), so the flusher never takes more than its share of the GIL.
            self._next_due = now + max(1.0 / self.hz, nbytes / self.max_bytes_per_s, (c2 - c1) / self.max_cpu_share)
            return True

    def _sync_state(self, now: float) -> None:
        """Puts the figure as it is now into the widget's synced state (caller holds _flush_lock).

        plotly's FigureWidget sends updates as transient messages (`_py2js_restyle` set, then reset to None) that
        only views already listening apply; a view draws from the synced state (`_widget_data`) when it
        renders. That state is set only at construction and display, so a view rendering later (a fresh page's
        ~5 MB widget module still loading when the first updates arrive, a page reload, a second display)
        drew stale or empty data. Synced here at most once a second (and when the flusher goes idle), so any
        view converges to the data; live views keep getting every update."""
        if self._closed or self.figure.comm is None:
            return
        fig = self.figure
        # Shallow copies: the arrays are fresh per flush and never mutated; the state is serialized right here.
        fig._widget_data = [dict(t) for t in fig._data]
        fig._widget_layout = dict(fig._layout_obj._props)
        self._state_version = self._sent_version
        self._state_at = now

    @staticmethod
    def _axes_layout(metrics: list[str]) -> dict:
        n = len(metrics)
        if not n:
            return {"height": 310, "xaxis": dict(title="step")}
        gap = 0.06 if n > 1 else 0.0
        h = (1.0 - gap * (n - 1)) / n
        layout: dict[str, Any] = {"height": 140 + 170 * n}
        for i, m in enumerate(metrics):
            top = 1.0 - i * (h + gap)
            layout["yaxis" if i == 0 else f"yaxis{i + 1}"] = dict(domain=[max(0.0, top - h), top], title=m, anchor="x")
        layout["xaxis"] = dict(anchor="y" if n == 1 else f"y{n}", title="step")  # drawn under the lowest panel
        return layout

    @contextlib.contextmanager
    def edit(self):
        """`with plot.edit() as fig: fig.update_layout(...)`: plotly figures are not thread-safe, so edits made
        while the flusher runs should hold its lock."""
        with self._flush_lock:
            yield self.figure

    def stop(self) -> None:
        """End the background thread, then flush what is left. The plot stays visible; append still records."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
        self._thread = None
        self.flush()
        with self._flush_lock:
            if self._state_version != self._sent_version:
                self._sync_state(self._clock())

    def close(self) -> None:
        """stop(), then close the widget's comm. The data (`dataframe`) stays."""
        if self._closed:
            return
        self.stop()
        self._closed = True
        if self._display_id is not None:
            # views first, then the comm: plotly's front end still sends on a comm that is gone ("no comm channel
            # defined"), and a reload would look up the closed model
            from IPython.display import update_display

            update_display({"text/plain": repr(self)}, raw=True, display_id=self._display_id)
        self.figure.close()

    def __enter__(self) -> LivePlot:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- reading --
    @property
    def metrics(self) -> list[str]:
        return list(self._cols)

    @property
    def closed(self) -> bool:
        """True after close(): the widget is gone (followers stop on it)."""
        return self._closed

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def dataframe(self) -> pd.DataFrame:
        """Every appended step in append order: `step` plus one column per metric, NaN where missing."""
        _, steps, cols, _ = self._snapshot()
        return pd.DataFrame({"step": steps, **cols}, columns=["step", *cols])

    @property
    def stats(self) -> dict[str, Any]:
        """Counters for tests and benchmarks: flushes, points/bytes sent, flusher wall and CPU seconds."""
        _, _, cols, _ = self._snapshot()  # inf values, counted here rather than on every append
        dropped = sum(int(np.isinf(c).sum()) for c in cols.values())
        return {
            "steps": len(self._steps),
            "flushes": self._flushes,
            "points_sent": self._points_sent,
            "bytes_sent": self._bytes_sent,
            "last_sent": dict(self._last_sent),
            "dropped": dropped,
            "flush_s": self._flush_s,
            "flush_cpu_s": self._flush_cpu_s,
            "errors": self._errors,
        }

    def _last_finite(self, metric: str) -> float | None:
        col = self._cols[metric]
        for v in reversed(col[-32:]):  # usually among the last few
            if math.isfinite(v):
                return v
        arr = np.frombuffer(col[:], dtype=np.float64)
        finite = np.flatnonzero(np.isfinite(arr))
        return float(arr[finite[-1]]) if len(finite) else None

    def __len__(self) -> int:
        return len(self._steps)

    def __repr__(self) -> str:
        head = "LivePlot" + (f" {self.title!r}" if self.title else "")
        vals = " ".join(
            f"{m}={_fmt(v)}" if (v := self._last_finite(m)) is not None else f"{m}=-" for m in list(self._cols)
        )
        tail = f" (COLLAPSE at step {self.collapses[-1]})" if self.collapses else ""
        tail += " (closed)" if self._closed else ""
        return f"{head} {len(self._steps)} steps" + (f": {vals}" if vals else "") + tail

    def _ipython_display_(self, **kwargs) -> None:
        from IPython.display import display

        self._display_id = self._display_id or uuid.uuid4().hex
        display(self._repr_mimebundle_(**kwargs), raw=True, display_id=self._display_id)

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> dict:
        if not self._closed:
            self.flush()  # show what is there now rather than waiting for the next tick
        # plotly deep-copies the figure here: not while the flusher edits it
        return mime_bundle(self, lambda: self.figure._repr_mimebundle_(include, exclude, **kwargs), self._flush_lock)
