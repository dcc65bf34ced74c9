"""A slime-style reward (`reward(args, sample)`) whose service can be down: while the file named by the custom
config's `reward_outage_marker` exists and the run has a checkpoint under --save, scoring fails as a remote reward
model's outage would. Otherwise it scores as slimeflow's prefix_match. tests/e2e/test_prefect_server.py uses it to
fail a pipeline run after a checkpoint, fix the cause (remove the marker) and retry it from the UI."""

from __future__ import annotations

from pathlib import Path


def reward(args, sample) -> float:
    marker = Path(args.reward_outage_marker)
    if marker.exists() and (Path(args.save) / "latest_checkpointed_iteration.txt").exists():
        raise ConnectionError(f"reward service down: {marker} exists (remove it to bring the service back)")
    return float(sample.response.lstrip().startswith(str(sample.label).strip()))
