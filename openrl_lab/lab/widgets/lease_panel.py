"""`LeasePanel`: one row per lease (the rows of `openrl_lab.lab.rows`): group, state, share, queue position, why
it waits and for about how long, resident, kernel and host (for a run on several devices its devices and its
ranks' groups instead of the kernel: `devices 2: cpu0,cpu1`), device memory, last step, reward and checkpoint.
Live when given a `source` (refreshed from a background thread, about once a second); its text repr is always a
snapshot."""

from __future__ import annotations

import html
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import ipywidgets
import pandas as pd

from openrl_lab.lab.rows import ROW_KEYS, devices_text, lease_rows, released_row, variant_text
from openrl_lab.lab.widgets._bundle import mime_bundle
from openrl_lab.memory import fmt_bytes

_HEAD = [
    "name",
    "group",
    "state",
    "class",
    "share",
    "queue",
    "wait",
    "reason",
    "resident",
    "kernel",
    "memory",
    "step",
    "reward",
    "checkpoint",
    "variant",
]
_RIGHT = {4, 6, 10, 11, 12}  # numbers right-aligned
_COLORS = {
    "running": "#2ca02c",
    "waiting": "#ff7f0e",
    "idle": "#7f7f7f",
    "evicted": "#1f77b4",
    "lost": "#d62728",
    "released": "#7f7f7f",
}


def _clean(value: Any) -> Any:
    return None if isinstance(value, float) and math.isnan(value) else value


def as_rows(rows: Any) -> list[dict]:
    """Rows of `openrl_lab.lab.rows` from: those rows (dicts or a DataFrame of them), or orchestrator leases
    (LeaseInfo objects or their dicts), which are turned into rows the same way (`lease_rows`)."""
    if rows is None:
        return []
    if isinstance(rows, pd.DataFrame):
        rows = [{k: _clean(v) for k, v in r.items()} for r in rows.to_dict("records")]
    items = [dict(r.to_dict() if hasattr(r, "to_dict") else r) for r in rows]
    if items and all("lease_id" in r and "group_id" in r for r in items):  # orchestrator leases
        return lease_rows([], items, {})
    return [{**dict.fromkeys(ROW_KEYS), **r} for r in items]


def _released(before: dict | None, now: dict) -> bool:
    """Whether the lab lease of row `before` went away by `now` (only its orchestrator lease is left)."""
    return (
        before is not None
        and now.get("model_id") is None
        and (before.get("model_id") is not None or before.get("state") == "released")
    )


def _wait(r: dict) -> str:
    if r.get("state") != "waiting":
        return ""
    w = r.get("expected_wait_s")
    if w is None:
        return "?"
    return f"~{w:.0f} s" if w >= 1 else "<1 s"


def _cells(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        q = int(r.get("queue_position") or 0)
        reward = r.get("last_reward")
        step = r.get("last_step")
        out.append(
            [
                str(r.get("name") or ""),
                str(r.get("group") or ""),
                str(r.get("state") or ""),
                str(r.get("priority") or ""),
                f"{float(r.get('share') or 0.0):.0%}",
                f"#{q}" if q else "",
                _wait(r),
                str(r.get("reason") or ""),
                "device" if r.get("resident") else "",
                devices_text(r) or str(r.get("kernel") or ""),  # a gang: its devices and where its ranks are
                "" if r.get("state_bytes") is None else fmt_bytes(r["state_bytes"]),
                "" if step is None else str(int(step)),
                ("" if reward is None else f"{float(reward):.3g}")
                + ("" if r.get("collapse_since") is None else f" (collapse since step {r['collapse_since']})"),
                str(r.get("last_checkpoint") or ""),
                variant_text(r.get("variant")),
            ]
        )
    return out


def render_text(rows: list[dict], title: str = "LeasePanel") -> str:
    """The rows as a fixed-width table (what `%openrl status --once` prints and the panel's repr is)."""
    cells = _cells(rows)
    if not cells:
        return f"{title}: no leases"
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(_HEAD)]

    def line(cols):
        return "  ".join(
            c.rjust(w) if i in _RIGHT else c.ljust(w) for i, (c, w) in enumerate(zip(cols, widths))
        ).rstrip()

    return "\n".join(
        [f"{title}: {len(cells)} lease{'s' if len(cells) != 1 else ''}", line(_HEAD), *(line(c) for c in cells)]
    )


class LeasePanel:
    """A table of leases: name, group, state, share of its group, queue position, expected wait and why it
    waits (the orchestrator's sentence, shown as is: the panel never makes one up), resident, kernel, last step,
    last reward, last checkpoint.

    `rows`: the rows of `openrl_lab.lab.rows` (`Lab.status()`), or orchestrator leases (LeaseInfo objects or
    dicts), or a DataFrame of either. `source`: a callable giving fresh rows (`lab.status`): the panel then
    refreshes itself every `interval_s` from a background thread until `stop()` / `close()`; a lease that went
    away stays on as `released`. The text repr is the rows as they are now.
    """

    def __init__(self, rows: Any = None, *, source: Callable[[], Any] | None = None, interval_s: float = 1.0):
        self.widget = ipywidgets.HTML()
        self._closed = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.source = source
        self.interval_s = float(interval_s)
        self.refreshes = 0
        self.refreshed_at: float | None = None
        self.error: str | None = None
        self._rows: list[dict] = []
        self._df = pd.DataFrame(columns=list(ROW_KEYS))
        self.update(rows)
        if source is not None:
            self.start()

    # --- data --------------------------------------------------------------------------------------
    def update(self, rows: Any) -> None:
        """Replace the rows and redraw (one comm message). A live panel keeps leases that went away as
        `released` rows."""
        new = as_rows(rows)
        with self._lock:
            if self.source is not None and self._rows:
                # A lab lease that went away is released: its row goes, or only its orchestrator lease is left for
                # a while (the kernel closes it once the group needs the device).
                before = {r["name"]: r for r in self._rows}
                new = [released_row(before[r["name"]]) if _released(before.get(r["name"]), r) else r for r in new]
                names = {r["name"] for r in new}
                new += [released_row(r) for r in self._rows if r["name"] not in names]
            self._rows = new
            self._df = pd.DataFrame(new, columns=list(dict.fromkeys([*ROW_KEYS, *(k for r in new for k in r)])))
            self.refreshed_at = time.time()
        if not self._closed:
            self.widget.value = self._html()

    @property
    def rows(self) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._rows]

    @property
    def dataframe(self) -> pd.DataFrame:
        """One row per lease: the row keys (share computed), then any other keys given."""
        with self._lock:
            return self._df.copy()

    # --- live --------------------------------------------------------------------------------------
    @property
    def live(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self.source is None:
            raise ValueError("LeasePanel(source=...) is needed to refresh by itself")
        if not self.live:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name="openrl-lease-panel", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stops refreshing (the table stays as it is)."""
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)

    def refresh(self) -> None:
        """Asks the source for the rows now."""
        if self.source is None:
            raise ValueError("LeasePanel(source=...) is needed to refresh by itself")
        try:
            rows = self.source()
        except Exception as e:  # noqa: BLE001 - the control plane may be away for a while: say so, keep the rows
            self.error = f"{type(e).__name__}: {e}".splitlines()[0]
            if not self._closed:
                self.widget.value = self._html()
            return
        self.error = None
        self.refreshes += 1
        self.update(rows)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s) and not self._closed:
            self.refresh()

    # --- views -------------------------------------------------------------------------------------
    def __repr__(self) -> str:
        text = render_text(self.rows)
        if self.error:
            text += f"\n(refresh failed: {self.error})"
        return text

    def _html(self) -> str:
        head = "".join(f"<th style='text-align:left;padding:2px 8px'>{h}</th>" for h in _HEAD)
        body = []
        for cells in _cells(self.rows):
            tds = []
            for i, c in enumerate(cells):
                style = "padding:2px 8px"
                if i == 2:
                    style += f";color:{_COLORS.get(c, 'inherit')};font-weight:bold"
                if i in _RIGHT:
                    style += ";text-align:right"
                tds.append(f"<td style='{style}'>{html.escape(c)}</td>")
            body.append("<tr>" + "".join(tds) + "</tr>")
        if not body:
            body = [f"<tr><td colspan='{len(_HEAD)}' style='padding:2px 8px'>no leases</td></tr>"]
        foot = ""
        if self.source is not None and self.refreshed_at is not None:
            when = time.strftime("%H:%M:%S", time.localtime(self.refreshed_at))
            foot = (
                f"<div style='font-size:11px;color:#7f7f7f'>live: refreshed {when}"
                + (f"; refresh failed: {html.escape(self.error)}" if self.error else "")
                + "</div>"
            )
        return (
            "<table style='border-collapse:collapse;font-family:monospace;font-size:12px'>"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>{foot}"
        )

    def close(self) -> None:
        self._stop.set()
        if not self._closed:
            self._closed = True
            self.widget.close()

    def _repr_mimebundle_(self, include=None, exclude=None, **kwargs) -> dict:
        return mime_bundle(self, lambda: self.widget._repr_mimebundle_(**kwargs))
