"""The reward curve of a run as a PNG: rollout reward mean per rollout, and each eval set's avg@n."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any


def plot_curves(history: Sequence[dict[str, Any]], path: Path) -> Path | None:
    """Write the curve of `history` (rollouts.jsonl lines) to `path`; None when there is nothing to plot."""
    rollouts = [(h["step"], h["rollout/reward_mean"]) for h in history if "rollout/reward_mean" in h]
    evals: dict[str, list[tuple[int, float]]] = {}
    for h in history:
        for key, value in h.items():
            if key.startswith("eval/") and "/avg_at_" in key:
                evals.setdefault(key, []).append((h["step"], value))
    if not rollouts and not evals:
        return None
    # Here, at the run's end: pyplot's import (~0.8 s measured) would otherwise be the driver's start-up.
    import matplotlib

    matplotlib.use("Agg")  # no display on a training machine
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if rollouts:
        ax.plot(*zip(*sorted(rollouts), strict=True), label="rollout reward mean", linewidth=1)
    for key, points in sorted(evals.items()):
        ax.plot(*zip(*sorted(points), strict=True), marker="o", label=key)
    ax.set_xlabel("rollout")
    ax.set_ylabel("reward / score")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
