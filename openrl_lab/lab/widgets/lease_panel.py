"""`LeasePanel`: a table of leases with their share of the group, state, queue position and why they wait."""

from __future__ import annotations

import html
import math
from typing import Any

import ipywidgets
import pandas as pd

from openrl_lab.lab.widgets._bundle import mime_bundle

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

    Rows are `LeaseInfo.to_dict()` dicts (or the LeaseInfo objects, or a DataFrame of them). `reason` is the
    orchestrator's sentence saying why a lease waits (`LeaseInfo.reason`), shown as is: the panel does not
    guess one from the rows it was given (they are one user's leases, not the whole queue).
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
                           ("queue_position", 0), ("reason", ""), ("resident", "none"), ("used_s", 0.0),
                           ("slices", 0)):
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
        df["reason"] = df["reason"].fillna("").astype(str)
        extra = [c for c in df.columns if c not in _LEASE_COLUMNS]
        return df[_LEASE_COLUMNS + extra].reset_index(drop=True)

    @property
    def dataframe(self) -> pd.DataFrame:
        """One row per lease: the columns shown (share computed), then any other keys given."""
        return self._df.copy()

    def _cells(self) -> list[list[str]]:
        out = []
        for r in self._df.to_dict("records"):
            q = int(r["queue_position"])
            out.append([str(r["name"]), str(r["group_id"]), f"{r['weight']:g} ({r['share']:.0%})", str(r["state"]),
                        f"#{q}" if q else "-", str(r["reason"]) or "-", str(r["resident"]),
                        f"{float(r['used_s']):.1f}", str(int(r["slices"]))])
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
        return mime_bundle(self, lambda: self.widget._repr_mimebundle_(**kwargs))
