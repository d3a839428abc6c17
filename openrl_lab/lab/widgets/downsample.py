"""Downsampling for live plots: at most `max_points` per trace, spikes kept, the newest points exact."""

from __future__ import annotations

import numpy as np


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
    z[:, old:] = y[:, old - 1 : old]  # pad with the last real value: no bucket's min or max changes
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
    ys[:, : 2 * rows] = y.ravel()[idx + (np.arange(m) * n)[:, None]]
    ys[:, 2 * rows :] = y[:, old:]
    xs[:, : 2 * rows] = x[idx]
    xs[:, 2 * rows :] = x[old:]
    return xs, ys
