"""Charts of ``fastpals memory`` (PNG, matplotlib's Agg canvas): :func:`plot_table`, the predicted peak against
the batch size per variant of ``docs/memory.md``; :func:`plot_plan`, one configuration's peak by part beside the
GPUs' memory."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["TableLine", "plot_plan", "plot_table"]

GIB = 2**30

#: one line of :func:`plot_table`: model, variant label, precision, intercept bytes ``a``, bytes per example ``c``
TableLine = tuple[str, str, str, float, float]


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # start-up: matplotlib's import is slow
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=110)
    return fig, FigureCanvasAgg(fig)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    return path


def plot_table(
    lines: Sequence[TableLine],
    gpus: Sequence[tuple[str, int]],
    path: str | Path,
    precision: str = "bf16",
    max_length: int = 128,
) -> Path:
    """Write the chart of ``docs/memory.md``: per model a panel with ``peak(b) = a + c b`` (GiB) for every variant
    of ``lines`` in ``precision`` over the batch sizes up to the largest that fits the largest GPU, and a dashed
    line at each GPU's ``(label, usable bytes)`` of ``gpus``. Returns the path written."""

    models = list(dict.fromkeys(line[0] for line in lines))
    fig, _ = _figure(5.2 * len(models), 4.2)
    top = max(u for _, u in gpus) / GIB
    for i, model in enumerate(models):
        ax = fig.add_subplot(1, len(models), i + 1)
        mine = [line for line in lines if line[0] == model and line[2] == precision]
        b_max = max(max((top * GIB - a) / c for *_, a, c in mine), 1.0)
        b = np.linspace(1, b_max, 200)
        for k, (_, label, _, a, c) in enumerate(mine):
            style = "--" if "checkpointed" in label else "-"
            ax.plot(b, (a + c * b) / GIB, style, color=f"C{k % 10}", label=label)
        for label, usable in gpus:
            ax.axhline(usable / GIB, color="grey", linestyle=":", linewidth=1)
            ax.text(b_max, usable / GIB, f" {label}", va="bottom", ha="right", fontsize=7, color="dimgrey")
        ax.set_title(f"{model}, {precision}, {max_length} tokens", fontsize=9)
        ax.set_xlabel("batch size (examples)")
        ax.set_ylabel("predicted peak (GiB)")
        ax.set_ylim(0, top * 1.05)
        ax.set_xlim(0, b_max)
        ax.grid(alpha=0.3)
        if i == 0:
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("fastpals memory: predicted peak of one training step (fake-tensor trace)", fontsize=10)
    fig.tight_layout()
    return _save(fig, path)


def plot_plan(
    at_peak: dict[str, int],
    labels: dict[str, str],
    gpus: Sequence[tuple[str, int]],
    title: str,
    path: str | Path,
) -> Path:
    """Write one configuration's chart: a stacked bar of ``at_peak`` (bytes per part, in the order of
    ``labels``, which names them) and a dashed line per GPU ``(label, usable bytes)``. Returns the path."""
    fig, _ = _figure(6.4, 4.2)
    ax = fig.add_subplot(1, 1, 1)
    bottom = 0.0
    for k, (cat, text) in enumerate(labels.items()):
        value = at_peak.get(cat, 0) / GIB
        if value > 0:
            ax.bar([0], [value], 0.5, bottom=bottom, color=f"C{k % 10}", label=f"{text}: {value:.2f} GiB")
            bottom += value
    shown = [(label, u / GIB) for label, u in gpus if u / GIB <= max(bottom * 3, 1.0)]
    for label, usable in shown:
        ax.axhline(usable, color="grey", linestyle=":", linewidth=1)
        ax.text(0.45, usable, f"{label}", va="bottom", ha="right", fontsize=7, color="dimgrey")
    ax.set_xticks([0], ["predicted peak"])
    ax.set_xlim(-0.5, 1.8)
    ax.set_ylim(0, max([bottom * 1.15] + [u * 1.05 for _, u in shown]))
    ax.set_ylabel("GiB")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return _save(fig, path)
