"""Plots people would rather look at than read: the training loss by step."""

from collections.abc import Mapping
from typing import Any


def loss_curve(history: Mapping[int, Mapping[str, float]], title: str) -> Any:
    """A matplotlib figure of the logged `loss` by step (an empty axis when none was logged).

    Args:
        history: Logged metrics by step, as in `TrainResult.history`.
        title: The figure's title, e.g. "sft: training loss".
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    steps = sorted(s for s in history if "loss" in history[s])
    fig = Figure(figsize=(6, 3.5), dpi=100)
    ax = fig.subplots()
    ax.plot(steps, [history[s]["loss"] for s in steps], marker=".")
    ax.set(xlabel="step", ylabel="training loss", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
