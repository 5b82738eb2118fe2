"""`retarget bench --plot`: a bar chart of the table's ratio-valued figures (needs matplotlib)."""

from __future__ import annotations

from pathlib import Path


class PlotError(RuntimeError):
    """matplotlib is missing, or there is nothing to plot."""


def plot(rows: list[tuple[str, str, str]], path: Path) -> None:
    """Bar chart of every ratio-valued figure (one bar per figure)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise PlotError("--plot needs matplotlib: pip install -e '.[bench]'") from err
    points = [(f"{s}: {f}"[:70], _number(v)) for s, f, v in rows if _number(v) is not None]
    if not points:
        raise PlotError("no figures to plot: run the suites first")
    fig, ax = plt.subplots(figsize=(10, 0.35 * len(points) + 1.5))
    ax.barh([p[0] for p in points], [p[1] for p in points])
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("ratio (1.0 = baseline measured in the same run)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _number(value: str) -> float | None:
    try:
        return float(value.split(",")[0].split()[-1].rstrip("x"))
    except ValueError:
        return None
