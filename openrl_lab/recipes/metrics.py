"""Showing an RL run: a plain-text summary table and an interactive HTML plot (plotly) of its metrics.

Both take the `metrics` DataFrame that `rl_train` returns (one row per step).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

SUMMARY_COLUMNS = ["step", "reward", "reward_std", "loss", "kl", "entropy", "tokens_per_s", "sample_s", "train_s"]


def summary_table(metrics: pd.DataFrame, rows: int = 10) -> pd.DataFrame:
    """About `rows` evenly spaced steps (always the first and the last), the columns worth reading."""
    if metrics.empty:
        return metrics
    n = len(metrics)
    picks = sorted({round(i * (n - 1) / max(rows - 1, 1)) for i in range(min(rows, n))})
    cols = [c for c in SUMMARY_COLUMNS if c in metrics.columns]
    return metrics.iloc[picks][cols].reset_index(drop=True)


def format_summary(metrics: pd.DataFrame, rows: int = 10, title: str = "") -> str:
    """The summary table as text, with totals: what a terminal or a notebook's plain-text view shows."""
    if metrics.empty:
        return f"{title}\n(no steps)".strip()
    table = summary_table(metrics, rows).to_string(index=False, float_format=lambda x: f"{x:.3f}")
    first, last = metrics.iloc[0], metrics.iloc[-1]
    total = float(metrics["step_s"].sum())
    lines = [title] if title else []
    lines += [
        table,
        f"steps: {len(metrics)}   reward: {first['reward']:.3f} -> {last['reward']:.3f} "
        f"(best {metrics['reward'].max():.3f})   wall: {total:.1f} s "
        f"(sampling {metrics['sample_s'].sum():.1f} s, training {metrics['train_s'].sum():.1f} s)",
    ]
    return "\n".join(lines)


def plot_metrics(metrics: pd.DataFrame, path: str | Path, title: str = "RL run",
                 extra: dict[str, float] | None = None) -> Path:
    """Write an interactive HTML plot (self-contained: works offline) of reward, loss, KL and entropy per
    step; `extra` adds horizontal reference lines to the reward panel (e.g. {"before RL": 0.1})."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    panels = [("reward", "task reward (mean ± std)"), ("loss", "loss per completion token"),
              ("kl", "KL(sampler ‖ learner), per token"), ("entropy", "entropy estimate (−mean logprob)")]
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.05,
                        subplot_titles=[t for _, t in panels])
    x = metrics["step"]
    for i, (col, _) in enumerate(panels, start=1):
        if col == "reward" and "reward_std" in metrics:
            lo, hi = metrics["reward"] - metrics["reward_std"], metrics["reward"] + metrics["reward_std"]
            fig.add_trace(go.Scatter(x=pd.concat([x, x[::-1]]), y=pd.concat([hi, lo[::-1]]), fill="toself",
                                     line={"width": 0}, fillcolor="rgba(31,119,180,0.15)", hoverinfo="skip",
                                     showlegend=False), row=i, col=1)
        fig.add_trace(go.Scatter(x=x, y=metrics[col], mode="lines+markers", name=col, marker={"size": 4}),
                      row=i, col=1)
    for label, value in (extra or {}).items():
        fig.add_hline(y=value, line_dash="dot", annotation_text=label, row=1, col=1)
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    fig.update_layout(title=title, height=220 * len(panels) + 120, showlegend=False, template="plotly_white")
    fig.write_html(path, include_plotlyjs=True, full_html=True)
    return path
