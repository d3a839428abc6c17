"""`TimelineView`: a Gantt of the orchestrator's slices per group, with each group's duty cycle."""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable

import numpy as np
import pandas as pd

from openrl_lab.lab.widgets._bundle import mime_bundle
from openrl_lab.lab.widgets._figure import figure_widget
from openrl_lab.orchestrator.reporting import duty_cycle

_PALETTE = [
    "#636EFA",
    "#EF553B",
    "#00CC96",
    "#AB63FA",
    "#FFA15A",
    "#19D3F3",
    "#FF6692",
    "#B6E880",
    "#FF97FF",
    "#FECB52",
]
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

    job = next(
        (df[c].astype(str) for c in ("job", "name", "lease_name") if c in df.columns),
        pd.Series([""] * n, index=df.index),
    )
    ref = col("lease_ref", "").astype(str)
    # Another user's slice comes with job "" (the orchestrator hides it): label it by its opaque lease ref,
    # and a kind it hid (one the user chose) as "other".
    job = job.where(job != "", "other " + ref.where(ref != "", "job"))
    kind = col("kind", "phase").astype(str)
    kind = kind.where(kind != "", "other")
    if "started_at" in df.columns:
        start = df["started_at"].astype(float)
    else:  # the orchestrator's records: the run starts after the holder's restore
        start = df["granted_at"].astype(float) + col("restore_s", 0.0).astype(float)
    run = df["run_s"].astype(float)
    end = start + run
    running = (col("outcome", "") == "running").to_numpy()
    if running.any():
        end = end.where(~running, max(clock(), 0.0))
    out = pd.DataFrame(
        {
            "group_id": df["group_id"].astype(str),
            "job": job,
            "kind": kind,
            "run_start": start,
            "run_end": end,
            "run_s": end - start,
            "switch_s": col("switch_s", 0.0).astype(float),
            "wait_s": col("wait_s", 0.0).astype(float),
            "outcome": col("outcome", "ok").astype(str),
            "priority": col("priority", "batch").astype(str),
        }
    )
    out["row"] = out["group_id"] + " / " + out["job"]
    return out.reset_index(drop=True)


_DUTY_COLUMNS = ["group_id", "slices", "wall_s", "busy_s", "switch_s", "duty_cycle", "switch_share"]


def duty_cycles(slices: pd.DataFrame, since: float, until: float) -> pd.DataFrame:
    """Per group over [since, until]: busy = run time, switch = eviction wait + restore, as shares of wall.

    The orchestrator's own definition (`reporting.duty_cycle`): a slice's switch part is the `switch_s`
    seconds before its run starts; both are clipped to the window. `slices` is the frame `_slices` returns.
    """
    rows = []
    for gid, g in slices.groupby("group_id", sort=True):
        spans = zip(g["run_start"] - g["switch_s"], g["run_start"], g["run_end"])
        rows.append(duty_cycle(str(gid), spans, since, until).to_dict())
    return pd.DataFrame(rows, columns=_DUTY_COLUMNS)


MIN_GAP_S = 5.0  # a pause longer than this (and than twice the median slice) ends the recent activity


def _recent_since(s: pd.DataFrame) -> float:
    """Where the recent activity starts: going back from the latest slice, slices join while the pause before
    the activity so far is short (< max(MIN_GAP_S, 2 x median slice)); an older job an idle stretch earlier
    does not squeeze the recent, interleaved slices into a corner of the plot."""
    lo = (s["run_start"] - s["switch_s"]).to_numpy(dtype=float)
    hi = s["run_end"].to_numpy(dtype=float)
    order = np.argsort(hi)[::-1]
    gap_s = max(MIN_GAP_S, 2.0 * float(np.median(hi - lo)))
    since = lo[order[0]]
    for i in order[1:]:
        if hi[i] < since - gap_s:
            break
        since = min(since, lo[i])
    return float(since)


# Pixel layout: title and subtitle at the top left, the modebar at the top right, the legend in a row of its own
# above the plot, the x-axis title alone at the bottom; rows a fixed height each, width from the page.
_TOP, _BOTTOM, _ROW = 100, 50, 36


class TimelineView:
    """A Gantt of slices: one row per (group, job), bars coloured by phase kind, switch time in grey.

    Takes the orchestrator's `Timeline.to_dataframe()` as is (or any frame with group_id, job, kind,
    started_at, run_s, wait_s, switch_s). The window ends at the latest slice end (a running slice ends now)
    and goes back over the recent activity (see `_recent_since`), at most `window_s` seconds. Duty cycle per
    group (busy / wall over the window) is in the title, `summary()` and `duty`. The plot is as wide as the
    page and as tall as its rows need.
    """

    def __init__(
        self, df: pd.DataFrame | None = None, *, window_s: float = 120, clock: Callable[[], float] = time.time
    ):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s!r}")
        self.window_s = float(window_s)
        self._clock = clock
        self._closed = False
        self._lock = threading.Lock()
        self.figure = figure_widget()
        self.figure._config = {"displaylogo": False}
        self.figure.update_layout(
            barmode="overlay",
            uirevision="timeline",
            autosize=True,
            margin=dict(l=10, r=20, t=_TOP, b=_BOTTOM),
            title=dict(x=0, xref="paper", xanchor="left", y=1, yref="container", yanchor="top", pad=dict(t=10)),
            legend=dict(orientation="h", x=0, xanchor="left", y=1, yanchor="bottom", yref="paper"),
            modebar=dict(orientation="h"),
            yaxis=dict(type="category", automargin=True),
        )
        self._kinds: dict[str, str] = {}
        self.update(
            df
            if df is not None
            else pd.DataFrame(columns=["group_id", "job", "kind", "started_at", "run_s", "wait_s", "switch_s"])
        )

    def update(self, df: pd.DataFrame) -> None:
        """Replace the data and redraw: one batched restyle while the phase kinds stay the same."""
        if hasattr(df, "to_dataframe"):  # a Timeline
            df = df.to_dataframe()
        with self._lock:
            if self._closed:
                raise RuntimeError("this TimelineView is closed")
            self._df = df.copy()
            s = (
                _slices(df, self._clock)
                if len(df)
                else _slices(pd.DataFrame(columns=["group_id", "started_at", "run_s"]), self._clock)
            )
            if len(s):
                self.until = float(s["run_end"].max())
                self.since = max(self.until - self.window_s, _recent_since(s))
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
            traces.append(
                dict(
                    type="bar",
                    orientation="h",
                    name="switch",
                    y=sw["row"].tolist(),
                    base=(sw["run_start"] - sw["switch_s"] - until).to_numpy(),
                    x=sw["switch_s"].to_numpy(),
                    marker=dict(color=_SWITCH_COLOR),
                    hovertemplate="switch %{x:.3f} s<extra>%{y}</extra>",
                )
            )
        for kind in sorted(s["kind"].unique().tolist()):
            k = s[s["kind"] == kind]
            traces.append(
                dict(
                    type="bar",
                    orientation="h",
                    name=kind,
                    y=k["row"].tolist(),
                    base=(k["run_start"] - until).to_numpy(),
                    x=k["run_s"].to_numpy(),
                    # a phase that went before waiting batch phases (interactive priority) is outlined
                    marker=dict(
                        color=self._color(kind),
                        line=dict(color="black", width=(k["priority"] == "interactive").astype(int).mul(2).tolist()),
                    ),
                    customdata=list(zip(k["wait_s"].tolist(), k["switch_s"].tolist(), k["priority"].tolist())),
                    hovertemplate=f"{html.escape(kind)}: run %{{x:.3f}} s, waited %{{customdata[0]:.3f}} s, "
                    "switch %{customdata[1]:.3f} s, %{customdata[2]}<extra>%{y}</extra>",
                )
            )
        fig = self.figure
        title, subtitle = self._title()
        # Same trace names: restyle in place (one message). Otherwise replace the traces.
        if [t.name for t in fig.data] != [t["name"] for t in traces]:
            fig.data = ()
            fig.add_traces(traces)
        else:
            with fig.batch_update():
                for tr, new in zip(fig.data, traces):
                    tr.update({k: v for k, v in new.items() if k != "type"})
        if rows:
            span = until - self.since
            pad = 0.02 * span if span > 0 else 1.0
            xaxis = dict(
                title=f"seconds before {time.strftime('%H:%M:%S', time.localtime(until))}",
                range=[self.since - until - pad, pad],
            )
            empty = []
        else:  # a clear empty state rather than bare axes and "seconds before -"
            xaxis = dict(title="seconds before now", range=[-self.window_s, 0])
            empty = [
                dict(
                    text=f"no slices in the last {self.window_s:.0f} s: phases show here as they run",
                    xref="paper",
                    yref="paper",
                    x=0.5,
                    y=0.5,
                    showarrow=False,
                    font=dict(color="#888"),
                )
            ]
        with fig.batch_update():
            fig.update_layout(
                title=dict(text=title, subtitle=dict(text=subtitle)),
                annotations=empty,
                height=_TOP + _BOTTOM + _ROW * max(len(rows), 2),
                xaxis=xaxis,
                yaxis=dict(categoryorder="array", categoryarray=rows[::-1], visible=bool(rows)),
            )

    def _title(self) -> tuple[str, str]:
        if not len(self.duty):
            return "Timeline: no slices", ""
        parts = [
            f"{r.group_id}: {r.duty_cycle:.0%} busy, {r.switch_share:.0%} switching" for r in self.duty.itertuples()
        ]
        return f"Timeline, last {self.until - self.since:.0f} s", "; ".join(parts)

    @property
    def dataframe(self) -> pd.DataFrame:
        """The slice rows last given to `update` (as given)."""
        return self._df.copy()

    def summary(self) -> str:
        """Per group: slices in the window, duty cycle %, switch share %."""
        n = int(self.duty["group_id"].nunique())
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
        return mime_bundle(self, lambda: self.figure._repr_mimebundle_(include, exclude, **kwargs), self._lock)
