"""Notebook widgets: a live metrics plot, a slice timeline, a lease table and a stop button (one module each).

They take plain data (metric values, rows, DataFrames), never a connection, so they work in any kernel and in
tests without a browser. Each has a plain-text repr (nbval, terminals) and a pandas DataFrame behind it, and
`close()` releases its thread and comms.

    from openrl_lab.lab.widgets import LivePlot, TimelineView, LeasePanel, StopButton
"""

from __future__ import annotations

from openrl_lab.lab.widgets.downsample import downsample, downsample_rows
from openrl_lab.lab.widgets.lease_panel import LeasePanel
from openrl_lab.lab.widgets.live_plot import LivePlot
from openrl_lab.lab.widgets.stop_button import StopButton
from openrl_lab.lab.widgets.timeline import TimelineView, duty_cycles

__all__ = ["LeasePanel", "LivePlot", "StopButton", "TimelineView", "downsample", "downsample_rows", "duty_cycles"]
