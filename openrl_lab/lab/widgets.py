"""Notebook widgets: a live metrics plot, a slice timeline, a lease table and a stop button.

They take plain data (metric values, rows, DataFrames), never a connection, so they work in any kernel and in
tests without a browser. Each has a plain-text repr (nbval, terminals) and a pandas DataFrame behind it, and
`close()` releases its thread and comms.

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
import html
import math
import numbers
import operator
import threading
import time
import weakref
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import ipywidgets
import numpy as np
import pandas as pd

__all__ = ["LeasePanel", "LivePlot", "StopButton", "TimelineView", "downsample", "downsample_rows",
           "duty_cycles"]

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


def _fmt(v: float) -> str:
    return "nan" if math.isnan(v) else f"{v:.4g}"


# --- downsampling -------------------------------------------------------------------------------------

def downsample(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """At most `max_points` of (x, y): the newest quarter exact, older points as min/max per bucket.

    Min/max bucketing (not plain striding) keeps spikes and the global extremes visible; the exact tail keeps
    the part of the curve people watch during training exact. Input must be sorted by x. A bucket whose min
    and max are the same point gives it twice (harmless in a line plot, and it keeps the arrays rectangular).
    """
    xs, ys = downsample_rows(x, y[None, :], max_points)
    return xs[0], ys[0]


def downsample_rows(x: np.ndarray, y: np.ndarray, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """`downsample` for several series sharing x: y is (series, n); returns (series, k) x and y, k <= max_points.

    All series in one pass, with few numpy calls: each call on a big array releases the GIL, and while the
    training loop runs every release can become a GIL handoff to it and back (a wait of up to the 5 ms switch
    interval, plus syscalls), so the number of calls, more than their size, is what a flush costs.
    """
    m, n = y.shape
    if n <= max_points:
        return np.broadcast_to(x, (m, n)), y
    tail = max(1, max_points // 4)
    buckets = (max_points - tail) // 2
    old = n - tail
    size = -(-old // buckets)  # ceil: every bucket but the last is full
    rows = -(-old // size)
    z = np.empty((m, rows * size))
    z[:, :old] = y[:, :old]
    z[:, old:] = y[:, old - 1:old]  # pad with the last real value: no bucket's min or max changes
    z = z.reshape(m, rows, size)
    lo, hi = z.argmin(axis=2), z.argmax(axis=2)
    base = np.arange(0, rows * size, size)
    lo += base
    hi += base
    idx = np.empty((m, rows, 2), dtype=np.intp)
    np.minimum(lo, hi, out=idx[:, :, 0])  # each bucket's two points in x order
    np.maximum(lo, hi, out=idx[:, :, 1])
    idx = idx.reshape(m, 2 * rows)
    np.minimum(idx, old - 1, out=idx)  # a pick in the padding is the last real point
    k = 2 * rows + tail
    xs, ys = np.empty((m, k), dtype=x.dtype), np.empty((m, k), dtype=y.dtype)
    ys[:, :2 * rows] = y.ravel()[idx + (np.arange(m) * n)[:, None]]
    ys[:, 2 * rows:] = y[:, old:]
    xs[:, :2 * rows] = x[idx]
    xs[:, 2 * rows:] = x[old:]
    return xs, ys


# --- LivePlot -----------------------------------------------------------------------------------------

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
        except Exception as e:  # a broken frontend must not kill the thread, nor reach the training loop
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

    `clock` (monotonic seconds) is injectable so tests can drive `poll(now)` without sleeping.
    """

    def __init__(self, metrics: Sequence[str] | None = None, *, title: str = "", hz: float = 4.0,
                 max_points: int = 2000, autostart: bool = True, max_bytes_per_s: float = 500_000,
                 max_cpu_share: float = 0.005,
                 clock: Callable[[], float] = time.monotonic):
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
        # Appenders take _lock; readers (the flusher, dataframe) never do, so a flush can't stall the loop on it:
        # columns grow before _steps, and a reader copies the first len(_steps) rows of each, by slicing (one C
        # call, atomic under the GIL; a numpy view of a live array.array would block its resizing).
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()  # one flush at a time (thread, flush(), display)
        self._steps = array("q")
        self._cols: dict[str, array] = {}   # metric -> values aligned with _steps, NaN where missing
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
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        for m in metrics or ():
            self._add_metric(self._check_name(m))

        import plotly.graph_objects as go

        self.figure = go.FigureWidget()
        self._index: dict[str, int] = {}  # metric -> trace index
        # uirevision: the user's zoom/pan survives data updates.
        self.figure.update_layout(title=self.title or None, uirevision="live", showlegend=False,
                                  margin=dict(l=60, r=20, t=50 if self.title else 20, b=40),
                                  xaxis=dict(title="step"), hovermode="x")
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
            self._steps.append(s)  # last: the row is complete once _steps counts it
            self._version += 1

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
            for c in df.columns:
                if c == "step":
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
                self._steps.extend(step_arr.tolist())  # last, as in append
                self._version += 1
            return
        for row in rows:
            row = dict(row)
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
        self._thread = threading.Thread(target=_flusher, args=(weakref.ref(self), self._stop),
                                        name=f"LivePlot-flusher {self.title}".strip(), daemon=True)
        self._thread.start()

    def _wait_s(self) -> float:
        period = 1.0 / self.hz
        if self._version == self._sent_version:
            return period  # idle: a new point waits at most one period; an idle plot wakes only hz times a second
        return min(max(self._next_due - self._clock(), 0.0), 10 * period)

    def poll(self, now: float | None = None) -> bool:
        """Flush if there is new data and the last flush was long enough ago (the thread calls this)."""
        now = self._clock() if now is None else now
        if self._version == self._sent_version or now < self._next_due:
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
            t0, c0 = time.perf_counter(), time.thread_time()
            version, steps, cols, monotonic = self._snapshot()
            if not monotonic:  # the plot is by step; the DataFrame keeps append order
                by_step = np.argsort(steps, kind="stable")
                steps = steps[by_step]
                cols = {m: c[by_step] for m, c in cols.items()}
            # int32 x travels as a binary buffer (plotly sends int64 as a JSON list); float64 beyond 2**31.
            xtype = np.int32 if not len(steps) or (-2**31 < steps[0] and steps[-1] < 2**31) else np.float64
            new = [m for m in cols if m not in self._index]
            fig = self.figure
            if new:
                panels = list(cols)  # panel i (top to bottom) is metric i; its y axis is y, y2, y3, ...
                fig.add_traces([dict(type="scatter", mode="lines", name=m, x=[], y=[], xaxis="x",
                                     yaxis="y" if panels.index(m) == 0 else f"y{panels.index(m) + 1}") for m in new])
                for m, i in zip(new, range(len(fig.data) - len(new), len(fig.data))):
                    self._index[m] = i
                fig.update_layout(self._axes_layout(panels))
            c1 = time.thread_time()  # adding traces is one-off: not charged to the CPU budget below
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
            self._sent_version = version
            self._flushes += 1
            self._points_sent += sum(sent.values())
            self._bytes_sent += nbytes
            self._last_sent = sent
            c2 = time.thread_time()
            self._flush_s += time.perf_counter() - t0
            self._flush_cpu_s += c2 - c0
            # hz is the ceiling; the byte budget stretches the interval when traces are big, the CPU budget when
            # flushes get slow (a loaded machine), so the flusher never takes more than its share of the GIL.
            self._next_due = now + max(1.0 / self.hz, nbytes / self.max_bytes_per_s, (c2 - c1) / self.max_cpu_share)
            return True

    @staticmethod
    def _axes_layout(metrics: list[str]) -> dict:
        n = len(metrics)
        gap = 0.06 if n > 1 else 0.0
        h = (1.0 - gap * (n - 1)) / n
        layout: dict[str, Any] = {"height": 140 + 170 * n}
        for i, m in enumerate(metrics):
            top = 1.0 - i * (h + gap)
            layout["yaxis" if i == 0 else f"yaxis{i + 1}"] = dict(domain=[max(0.0, top - h), top], title=m,
                                                                  anchor="x")
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

    def close(self) -> None:
        """stop(), then close the widget's comm. The data (`dataframe`) stays."""
        if self._closed:
            return
        self.stop()
        self._closed = True
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
        return {"steps": len(self._steps), "flushes": self._flushes, "points_sent": self._points_sent,
                "bytes_sent": self._bytes_sent, "last_sent": dict(self._last_sent), "dropped": dropped,
                "flush_s": self._flush_s, "flush_cpu_s": self._flush_cpu_s, "errors": self._errors}

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
        vals = " ".join(f"{m}={_fmt(v)}" if (v := self._last_finite(m)) is not None else f"{m}=-"
                        for m in list(self._cols))
        tail = " (closed)" if self._closed else ""
        return f"{head} {len(self._steps)} steps" + (f": {vals}" if vals else "") + tail

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> dict:
        if self._closed:
            return {"text/plain": repr(self)}
        self.flush()  # show what is there now rather than waiting for the next tick
        with self._flush_lock:  # plotly deep-copies the figure here; not while the thread edits it
            bundle = dict(self.figure._repr_mimebundle_(include, exclude, **kwargs))
        bundle["text/plain"] = repr(self)
        return bundle


# --- TimelineView ------------------------------------------------------------------------------------

_PALETTE = ["#636EFA", "#EF553B", "#00CC96", "#AB63FA", "#FFA15A", "#19D3F3", "#FF6692", "#B6E880", "#FF97FF",
            "#FECB52"]
_SWITCH_COLOR = "#B0B0B0"


def _slices(df: pd.DataFrame, clock: Callable[[], float]) -> pd.DataFrame:
    """Normalise slice rows: accepts `Timeline.to_dataframe()` (granted_at, restore_s, released_at, outcome)
    or a minimal frame with started_at. Output: group_id, row, job, kind, run_start, run_end, switch_s, ..."""
    missing = [c for c in ("group_id", "run_s") if c not in df.columns]
    if "started_at" not in df.columns and "granted_at" not in df.columns:
        missing.append("started_at (or granted_at)")
    if missing:
        raise ValueError(f"timeline frame lacks column(s) {', '.join(missing)}; has {list(df.columns)}")
    n = len(df)

    def col(name, default):
        return df[name] if name in df.columns else pd.Series([default] * n, index=df.index)

    job = next((df[c].astype(str) for c in ("job", "name", "lease_name") if c in df.columns),
               pd.Series([""] * n, index=df.index))
    ref = col("lease_ref", "").astype(str)
    # Another user's slice comes with job "" (the orchestrator hides it): label it by its opaque lease ref.
    job = job.where(job != "", "other " + ref.where(ref != "", "job"))
    if "started_at" in df.columns:
        start = df["started_at"].astype(float)
    else:  # the orchestrator's records: the run starts after the holder's restore
        start = df["granted_at"].astype(float) + col("restore_s", 0.0).astype(float)
    run = df["run_s"].astype(float)
    end = start + run
    running = (col("outcome", "") == "running").to_numpy()
    if running.any():
        end = end.where(~running, max(clock(), 0.0))
    out = pd.DataFrame({
        "group_id": df["group_id"].astype(str), "job": job, "kind": col("kind", "phase").astype(str),
        "run_start": start, "run_end": end, "run_s": end - start,
        "switch_s": col("switch_s", 0.0).astype(float), "wait_s": col("wait_s", 0.0).astype(float),
        "outcome": col("outcome", "ok").astype(str),
    })
    out["row"] = out["group_id"] + " / " + out["job"]
    return out.reset_index(drop=True)


def duty_cycles(slices: pd.DataFrame, since: float, until: float) -> pd.DataFrame:
    """Per group over [since, until]: busy = run time, switch = eviction wait + restore, as shares of wall.

    Same definition as the orchestrator's DutyCycle: a slice's switch part is the `switch_s` seconds before
    its run starts; both are clipped to the window. `slices` is the frame `_slices` returns.
    """
    wall = max(0.0, until - since)
    rows = []
    for gid, g in slices.groupby("group_id", sort=True):
        rs, re = g["run_start"].to_numpy(), g["run_end"].to_numpy()
        ss = rs - g["switch_s"].to_numpy()
        busy = np.clip(np.minimum(re, until) - np.maximum(rs, since), 0, None).sum()
        switch = np.clip(np.minimum(rs, until) - np.maximum(ss, since), 0, None).sum()
        n = int(((re >= since) & (ss <= until)).sum())
        rows.append(dict(group_id=gid, slices=n, wall_s=wall, busy_s=float(busy), switch_s=float(switch),
                         duty_cycle=busy / wall if wall else 0.0, switch_share=switch / wall if wall else 0.0))
    return pd.DataFrame(rows, columns=["group_id", "slices", "wall_s", "busy_s", "switch_s", "duty_cycle",
                                       "switch_share"])


class TimelineView:
    """A Gantt of slices: one row per (group, job), bars coloured by phase kind, switch time in grey.

    Takes the orchestrator's `Timeline.to_dataframe()` as is (or any frame with group_id, job, kind,
    started_at, run_s, wait_s, switch_s). The window is the last `window_s` seconds of the data (ending at the
    latest slice end; a running slice ends now), or all of it when shorter. Duty cycle per group (busy / wall
    over the window) is in the title, `summary()` and `duty`.
    """

    def __init__(self, df: pd.DataFrame | None = None, *, window_s: float = 120,
                 clock: Callable[[], float] = time.time):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = float(window_s)
        self._clock = clock
        self._closed = False
        self._lock = threading.Lock()
        import plotly.graph_objects as go

        self.figure = go.FigureWidget()
        self.figure.update_layout(barmode="overlay", uirevision="timeline", margin=dict(l=10, r=20, t=50, b=40),
                                  legend=dict(orientation="h", y=-0.2), yaxis=dict(type="category",
                                                                                   automargin=True))
        self._kinds: dict[str, str] = {}
        self.update(df if df is not None else pd.DataFrame(columns=["group_id", "job", "kind", "started_at",
                                                                    "run_s", "wait_s", "switch_s"]))

    def update(self, df: pd.DataFrame) -> None:
        """Replace the data and redraw: one batched restyle while the phase kinds stay the same."""
        if hasattr(df, "to_dataframe"):  # a Timeline
            df = df.to_dataframe()
        with self._lock:
            if self._closed:
                raise RuntimeError("this TimelineView is closed")
            self._df = df.copy()
            s = _slices(df, self._clock) if len(df) else _slices(
                pd.DataFrame(columns=["group_id", "started_at", "run_s"]), self._clock)
            if len(s):
                self.until = float(s["run_end"].max())
                self.since = max(self.until - self.window_s, float((s["run_start"] - s["switch_s"]).min()))
            else:
                self.until = self.since = 0.0
            self.duty = duty_cycles(s, self.since, self.until)
            self._draw(s[(s["run_end"] >= self.since) & (s["run_start"] - s["switch_s"] <= self.until)])

    def _color(self, kind: str) -> str:
        # Stable per view: a kind keeps its colour across updates.
        return self._kinds.setdefault(kind, _PALETTE[len(self._kinds) % len(_PALETTE)])

    def _draw(self, s: pd.DataFrame) -> None:
        rows = sorted(s["row"].unique().tolist())
        until = self.until
        traces = []
        sw = s[s["switch_s"] > 0]
        if len(sw):
            traces.append(dict(type="bar", orientation="h", name="switch", y=sw["row"].tolist(),
                               base=(sw["run_start"] - sw["switch_s"] - until).to_numpy(),
                               x=sw["switch_s"].to_numpy(), marker=dict(color=_SWITCH_COLOR),
                               hovertemplate="switch %{x:.3f} s<extra>%{y}</extra>"))
        for kind in sorted(s["kind"].unique().tolist()):
            k = s[s["kind"] == kind]
            traces.append(dict(
                type="bar", orientation="h", name=kind, y=k["row"].tolist(), base=(k["run_start"] - until).to_numpy(),
                x=k["run_s"].to_numpy(), marker=dict(color=self._color(kind)),
                customdata=np.stack([k["wait_s"].to_numpy(), k["switch_s"].to_numpy()], axis=1),
                hovertemplate=f"{html.escape(kind)}: run %{{x:.3f}} s, waited %{{customdata[0]:.3f}} s, "
                              "switch %{customdata[1]:.3f} s<extra>%{y}</extra>"))
        fig = self.figure
        title = self._title()
        at = time.strftime("%H:%M:%S", time.localtime(until)) if until else "-"
        # Same trace names: restyle in place (one message). Otherwise replace the traces.
        if [t.name for t in fig.data] != [t["name"] for t in traces]:
            fig.data = ()
            fig.add_traces(traces)
        else:
            with fig.batch_update():
                for tr, new in zip(fig.data, traces):
                    tr.update({k: v for k, v in new.items() if k != "type"})
        with fig.batch_update():
            fig.update_layout(title=title, height=120 + 28 * max(len(rows), 1),
                              xaxis=dict(title=f"seconds before {at}", range=[self.since - until, 0]),
                              yaxis=dict(categoryorder="array", categoryarray=rows[::-1]))

    def _title(self) -> str:
        if not len(self.duty):
            return "Timeline: no slices"
        parts = [f"{r.group_id}: {r.duty_cycle:.0%} busy, {r.switch_share:.0%} switching" for r in
                 self.duty.itertuples()]
        return f"Timeline, last {self.until - self.since:.0f} s: " + "; ".join(parts)

    @property
    def dataframe(self) -> pd.DataFrame:
        """The slice rows last given to `update` (as given)."""
        return self._df.copy()

    def summary(self) -> str:
        """Per group: slices in the window, duty cycle %, switch share %."""
        n = self.duty["group_id"].nunique()
        head = f"TimelineView: {n} group{'' if n == 1 else 's'}, window {self.until - self.since:.1f} s"
        if not len(self.duty):
            return head + ", no slices"
        w = max(5, *(len(g) for g in self.duty["group_id"]))
        lines = [head, f"  {'group':<{w}}  {'slices':>6}  {'duty cycle':>10}  {'switch share':>12}"]
        for r in self.duty.itertuples():
            lines.append(f"  {r.group_id:<{w}}  {r.slices:>6}  {r.duty_cycle:>10.1%}  {r.switch_share:>12.1%}")
        return "\n".join(lines)

    __repr__ = summary

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self.figure.close()

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> dict:
        if self._closed:
            return {"text/plain": repr(self)}
        with self._lock:
            bundle = dict(self.figure._repr_mimebundle_(include, exclude, **kwargs))
        bundle["text/plain"] = repr(self)
        return bundle


# --- LeasePanel --------------------------------------------------------------------------------------

_LEASE_COLUMNS = ["name", "group_id", "weight", "share", "state", "queue_position", "reason", "resident",
                  "used_s", "slices"]


def _lease_rows(rows: Any) -> list[dict]:
    if rows is None:
        return []
    if isinstance(rows, pd.DataFrame):
        return [{k: v for k, v in r.items() if not (isinstance(v, float) and math.isnan(v))}
                for r in rows.to_dict("records")]
    return [dict(r.to_dict() if hasattr(r, "to_dict") else r) for r in rows]  # LeaseInfo or dicts


class LeasePanel:
    """A table of leases: name, group, share (weight and share of its group), state, queue position and why,
    resident (device/host/none), used_s, slices.

    Rows are `LeaseInfo.to_dict()` dicts (or the LeaseInfo objects, or a DataFrame of them) plus optional keys:
    `reason` (shown as is) and `waiting_behind` (a job name). Without them a waiting lease is explained from
    the rows themselves: behind the lease one place ahead in its group's queue, else behind the holder.
    """

    def __init__(self, rows: list[dict] | pd.DataFrame | None = None):
        self.widget = ipywidgets.HTML()
        self._closed = False
        self.update(rows)

    def update(self, rows: list[dict] | pd.DataFrame | None) -> None:
        """Replace the rows and redraw (one comm message)."""
        self._rows = _lease_rows(rows)
        self._df = self._frame(self._rows)
        if not self._closed:
            self.widget.value = self._html()

    @staticmethod
    def _frame(rows: list[dict]) -> pd.DataFrame:
        df = pd.DataFrame(rows)
        for c, default in (("name", ""), ("group_id", ""), ("weight", 1.0), ("state", "idle"),
                           ("queue_position", 0), ("resident", "none"), ("used_s", 0.0), ("slices", 0)):
            if c not in df.columns:
                df[c] = default
        if not len(df):
            return pd.DataFrame(columns=_LEASE_COLUMNS)
        if "lease_id" in df.columns:
            df["name"] = df["name"].where(df["name"].astype(str) != "", df["lease_id"])
        df["weight"] = df["weight"].astype(float)
        total = df.groupby("group_id")["weight"].transform("sum")
        df["share"] = (df["weight"] / total.where(total > 0, 1.0)).astype(float)
        df["queue_position"] = df["queue_position"].fillna(0).astype(int)
        df["reason"] = [LeasePanel._reason(r, df) for r in df.to_dict("records")]
        extra = [c for c in df.columns if c not in _LEASE_COLUMNS]
        return df[_LEASE_COLUMNS + extra].reset_index(drop=True)

    @staticmethod
    def _reason(r: dict, df: pd.DataFrame) -> str:
        given = r.get("reason")
        if isinstance(given, str) and given:
            return given
        state = str(r.get("state", "idle"))
        if state != "waiting":
            return state
        same = df[df["group_id"] == r.get("group_id")]
        pos = int(r.get("queue_position") or 0)
        behind = r.get("waiting_behind")
        if not (isinstance(behind, str) and behind):
            ahead = same[same["queue_position"] == pos - 1] if pos > 1 else same[same["state"] == "holding"]
            behind = str(ahead["name"].iloc[0]) if len(ahead) else "another job"
        return f"waiting behind {behind}"

    @property
    def dataframe(self) -> pd.DataFrame:
        """One row per lease: the columns shown (share and reason computed), then any other keys given."""
        return self._df.copy()

    def _cells(self) -> list[list[str]]:
        out = []
        for r in self._df.to_dict("records"):
            q = int(r["queue_position"])
            out.append([str(r["name"]), str(r["group_id"]), f"{r['weight']:g} ({r['share']:.0%})", str(r["state"]),
                        f"#{q}" if q else "-", str(r["reason"]), str(r["resident"]), f"{float(r['used_s']):.1f}",
                        str(int(r["slices"]))])
        return out

    _HEAD = ["name", "group", "share", "state", "queue", "reason", "resident", "used_s", "slices"]

    def __repr__(self) -> str:
        cells = self._cells()
        if not cells:
            return "LeasePanel: no leases"
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(self._HEAD)]
        right = {7, 8}  # numbers right-aligned

        def line(cols):
            return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(cols, widths))).rstrip()

        return "\n".join([f"LeasePanel: {len(cells)} lease{'s' if len(cells) != 1 else ''}", line(self._HEAD),
                          *(line(c) for c in cells)])

    def _html(self) -> str:
        colors = {"holding": "#2ca02c", "waiting": "#ff7f0e", "idle": "#7f7f7f"}
        head = "".join(f"<th style='text-align:left;padding:2px 8px'>{h}</th>" for h in self._HEAD)
        body = []
        for cells in self._cells():
            tds = []
            for i, c in enumerate(cells):
                style = "padding:2px 8px"
                if i == 3:
                    style += f";color:{colors.get(c, 'inherit')};font-weight:bold"
                if i in (7, 8):
                    style += ";text-align:right"
                tds.append(f"<td style='{style}'>{html.escape(c)}</td>")
            body.append("<tr>" + "".join(tds) + "</tr>")
        if not body:
            body = ["<tr><td colspan='9' style='padding:2px 8px'>no leases</td></tr>"]
        return ("<table style='border-collapse:collapse;font-family:monospace;font-size:12px'>"
                f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>")

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.widget.close()

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> dict:
        if self._closed:
            return {"text/plain": repr(self)}
        bundle = dict(self.widget._repr_mimebundle_(**kwargs))
        bundle["text/plain"] = repr(self)
        return bundle


# --- StopButton --------------------------------------------------------------------------------------

class StopButton(ipywidgets.Button):
    """A button that asks a loop to stop at its next step boundary: `if stop.should_stop(): break`.

    Clicking only sets a flag (a threading.Event), so the loop decides where it is safe to stop. Clicks
    arrive while a cell is still running with ipykernel >= 7 and JupyterLab's `commsOverSubshells` setting
    (the comm message is handled on a subshell); with older kernels or frontends the click is queued until
    the cell ends. `reset()` re-arms it.
    """

    def __init__(self, description: str = "Stop", **kwargs):
        kwargs.setdefault("button_style", "danger")
        kwargs.setdefault("icon", "stop")
        kwargs.setdefault("tooltip", "stop the loop at its next step")
        super().__init__(description=description, **kwargs)
        self._label = description
        self._event = threading.Event()
        self.on_click(lambda _button: self.stop())

    def stop(self) -> None:
        """What a click does; also callable from code."""
        self._event.set()
        if self.comm is not None:  # a closed widget has no comm; the flag still works
            self.description = "Stopping…"
            self.disabled = True

    @property
    def stopped(self) -> bool:
        return self._event.is_set()

    def should_stop(self) -> bool:
        return self._event.is_set()

    def reset(self) -> None:
        self._event.clear()
        if self.comm is not None:
            self.description = self._label
            self.disabled = False

    def __repr__(self) -> str:
        return f"StopButton {self._label!r}: {'stopped' if self.stopped else 'not stopped'}"
