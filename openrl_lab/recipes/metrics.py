"""Showing an RL run: a plain-text summary table and an interactive HTML plot (plotly) of its metrics.

Both take the `metrics` DataFrame that `rl_train` returns (one row per step). A *skipped* step (no group had
reward spread, or no group came back: nothing was trained) has no loss and no KL; they are missing (NaN) in
the DataFrame, shown as "skipped" in the tables, as gaps with a marker in the plot, and counted in the
summary, never averaged into a figure.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pandas as pd

from openrl_lab.collapse import COLLAPSE_METRIC, ENTROPY_FLOOR, CollapseWatch

SUMMARY_COLUMNS = ["step", "reward", "reward_std", "loss", "kl", "entropy", "tokens_per_s", "sample_s", "train_s"]


def collapse_flags(metrics: pd.DataFrame) -> pd.Series:
    """True for each step in a collapse, as `CollapseWatch` saw the run step by step (the `collapse` column when
    the loop wrote one; computed from reward and entropy otherwise)."""
    if COLLAPSE_METRIC in metrics.columns:
        return cast(pd.Series, metrics[COLLAPSE_METRIC]).fillna(False).astype(bool)
    if metrics.empty or not {"reward", "entropy"} <= set(metrics.columns):
        return pd.Series(False, index=metrics.index)
    watch = CollapseWatch()
    flags = [watch.update(float(r), float(h)) for r, h in zip(metrics["reward"], metrics["entropy"])]
    return pd.Series(flags, index=metrics.index)


def collapse_onsets(metrics: pd.DataFrame) -> list[int]:
    """The steps at which a collapse began (the first step of each stretch of collapsed steps)."""
    flags = collapse_flags(metrics)
    began = flags & ~flags.shift(1, fill_value=False)
    return [int(s) for s in metrics.loc[began, "step"]]


def skipped_steps(metrics: pd.DataFrame) -> pd.Series:
    """True for each step that trained nothing (the `skipped` column; for metrics from before it, a missing loss)."""
    if "skipped" in metrics.columns:  # a column by its name: a Series (pandas types it DataFrame | Series)
        return cast(pd.Series, metrics["skipped"]).fillna(False).astype(bool)
    if "loss" in metrics.columns:
        return cast(pd.Series, metrics["loss"]).isna()
    return pd.Series(False, index=metrics.index)


def summary_table(metrics: pd.DataFrame, rows: int = 10) -> pd.DataFrame:
    """About `rows` evenly spaced steps (always the first and the last), the columns worth reading. When one of
    them was skipped, its loss reads "skipped" and its KL "-" (those two columns are then text)."""
    if metrics.empty:
        return metrics
    n = len(metrics)
    picks = sorted({round(i * (n - 1) / max(min(rows, n) - 1, 1)) for i in range(min(rows, n))})
    cols = [c for c in SUMMARY_COLUMNS if c in metrics.columns]
    table = metrics.iloc[picks][cols].reset_index(drop=True)
    skipped = skipped_steps(metrics).iloc[picks].reset_index(drop=True)
    if skipped.any():
        for col, mark in (("loss", "skipped"), ("kl", "-")):
            if col in table.columns:
                table[col] = [mark if s else ("-" if pd.isna(v) else f"{v:.3f}") for v, s in zip(table[col], skipped)]
    return table


def format_summary(metrics: pd.DataFrame, rows: int = 10, title: str = "") -> str:
    """The summary table as text, with totals: what a terminal or a notebook's plain-text view shows."""
    if metrics.empty:
        return f"{title}\n(no steps)".strip()
    table = summary_table(metrics, rows).to_string(index=False, float_format=lambda x: f"{x:.3f}", na_rep="-")
    skipped = skipped_steps(metrics)
    reward = metrics["reward"].dropna()
    total = float(metrics["step_s"].sum())
    no_samples = int((metrics.loc[skipped, "samples"] == 0).sum()) if "samples" in metrics.columns else 0
    n_skipped = int(skipped.sum())
    if not n_skipped:
        why = "none skipped"
    elif not no_samples:
        why = f"{n_skipped} skipped: no group had reward spread"
    else:
        why = (
            f"{n_skipped} skipped: {n_skipped - no_samples} with no reward spread in any group, "
            f"{no_samples} with no samples"
        )
    solved = int((metrics.loc[skipped, "reward"] == 1.0).sum())
    if solved:
        why += f"; {solved} of them with every sample right"
    onsets = collapse_onsets(metrics)
    lines = [title] if title else []
    if onsets:
        lines.append(
            f"COLLAPSE: from step {onsets[0]} the entropy fell below {ENTROPY_FLOOR} nats/token while the reward fell "
            f"or stayed at zero ({int(collapse_flags(metrics).sum())} of {len(metrics)} steps; "
            "docs/recipes.md, 'Against collapse')"
        )
    lines += [
        table,
        f"steps: {len(metrics)} ({why})   "
        + (
            f"reward: {reward.iloc[0]:.3f} -> {reward.iloc[-1]:.3f} (best {reward.max():.3f})"
            if len(reward)
            else "reward: - (no samples)"
        )
        + f"   wall: {total:.1f} s "
        f"(sampling {metrics['sample_s'].sum():.1f} s, training {metrics['train_s'].sum():.1f} s)",
    ]
    return "\n".join(lines)


def plot_metrics(
    metrics: pd.DataFrame, path: str | Path, title: str = "RL run", extra: dict[str, float] | None = None
) -> Path:
    """Write an interactive HTML plot (self-contained: works offline) of reward, loss, KL and entropy per
    step; `extra` adds horizontal reference lines to the reward panel (e.g. {"before RL": 0.1}). Skipped steps
    leave a gap in the loss and KL lines and are marked with a grey x at 0."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = [
        ("reward", "task reward (mean ± std)"),
        ("loss", "loss per completion token"),
        ("kl", "KL(sampler ‖ learner), per token"),
        ("entropy", "entropy estimate (−mean logprob)"),  # noqa: RUF001 - a typographic minus, in a title
    ]
    fig = make_subplots(
        rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.05, subplot_titles=[t for _, t in panels]
    )
    x = cast(pd.Series, metrics["step"])
    skipped = x[skipped_steps(metrics)]
    for i, (col, _) in enumerate(panels, start=1):
        if col == "reward" and "reward_std" in metrics:
            reward, std = cast(pd.Series, metrics["reward"]), cast(pd.Series, metrics["reward_std"])
            lo, hi = reward - std, reward + std
            fig.add_trace(
                go.Scatter(
                    x=pd.concat([x, x.iloc[::-1]]),
                    y=pd.concat([hi, lo.iloc[::-1]]),
                    fill="toself",
                    line={"width": 0},
                    fillcolor="rgba(31,119,180,0.15)",
                    hoverinfo="skip",
                    showlegend=False,
                ),
                row=i,
                col=1,
            )
        fig.add_trace(go.Scatter(x=x, y=metrics[col], mode="lines+markers", name=col, marker={"size": 4}), row=i, col=1)
        if col in ("loss", "kl") and len(skipped):
            fig.add_trace(
                go.Scatter(
                    x=skipped,
                    y=[0.0] * len(skipped),
                    mode="markers",
                    name="skipped",
                    marker={"symbol": "x", "size": 6, "color": "#999"},
                    hovertemplate="step %{x}: skipped (no group had reward spread)<extra></extra>",
                ),
                row=i,
                col=1,
            )
    for label, value in (extra or {}).items():
        fig.add_hline(y=value, line_dash="dot", annotation_text=label, row=1, col=1)
    for onset in collapse_onsets(metrics):
        fig.add_vline(x=onset, line_color="#d62728", line_dash="dash")
        fig.add_annotation(
            x=onset, y=1.0, row=1, col=1, text=f"collapse at step {onset}", showarrow=False, font={"color": "#d62728"}
        )
    if "entropy" in metrics.columns:
        fig.add_hline(
            y=ENTROPY_FLOOR, line_dash="dot", line_color="#999", annotation_text="entropy floor", row=4, col=1
        )
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    fig.update_layout(title=title, height=220 * len(panels) + 120, showlegend=False, template="plotly_white")
    fig.write_html(path, include_plotlyjs=True, full_html=True)
    return path
