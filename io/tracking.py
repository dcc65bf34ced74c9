"""MLflow tracking: a run per pipeline run, a nested run per stage; params, metrics and artifact URIs.

Uses MlflowClient with explicit run ids (no global active-run state), so stages in threads or subflows cannot
log into each other's runs. The default store is `sqlite:///<workdir>/mlflow.db`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, Param, RunStatus
from mlflow.tracking import MlflowClient
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID, MLFLOW_RUN_NAME

from slimeflow.io.guard import exclusive

MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param value
BATCH = 100  # MLflow's limit on params per log_batch call


class Tracker:
    """One MLflow experiment; runs are opened and closed explicitly by id."""

    def __init__(self, tracking_uri: str, experiment: str, artifact_location: str | None = None):
        self.tracking_uri = tracking_uri
        with _store_lock(tracking_uri):  # creating the client creates (migrates) a new sqlite store
            self.client = MlflowClient(tracking_uri=tracking_uri)
            found = self.client.get_experiment_by_name(experiment)
            self.experiment_id = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(experiment, artifact_location=artifact_location)
            )

    @contextlib.contextmanager
    def run(
        self,
        name: str,
        params: Mapping[str, Any] | None = None,
        parent_run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
    ) -> Iterator[str]:
        """Open a run (nested under `parent_run_id` when given), yield its id, close it FINISHED or FAILED."""
        all_tags = {MLFLOW_RUN_NAME: name, **(tags or {})}
        if parent_run_id:
            all_tags[MLFLOW_PARENT_RUN_ID] = parent_run_id
        run_id = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags).info.run_id
        status = RunStatus.to_string(RunStatus.FAILED)
        try:
            if params:
                self.log_params(run_id, params)
            yield run_id
            status = RunStatus.to_string(RunStatus.FINISHED)
        finally:
            self.client.set_terminated(run_id, status=status)

    def log_params(self, run_id: str, params: Mapping[str, Any]) -> None:
        """Log a nested mapping as flat dotted params (`train.batch.rollout_batch_size`)."""
        flat = [Param(k, _param_value(v)) for k, v in flatten(params).items()]
        for start in range(0, len(flat), BATCH):
            self.client.log_batch(run_id, params=flat[start : start + BATCH])

    def log_metrics(self, run_id: str, metrics: Mapping[str, float], step: int = 0) -> None:
        import time

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(batch), BATCH):
            self.client.log_batch(run_id, metrics=batch[start : start + BATCH])

    def set_tags(self, run_id: str, tags: Mapping[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(run_id, key, value)


@contextlib.contextmanager
def _store_lock(tracking_uri: str) -> Iterator[None]:
    """Hold an exclusive lock on `<db>.lock` beside a local sqlite store; nothing for any other store.

    MLflow creates a new sqlite store by running its migrations, which two processes cannot do at once (the second
    fails with `table _alembic_tmp_experiments already exists`); nor can they both create the experiment. Two runs
    on one fresh work directory take turns here instead (io.guard; a killed holder's turn ends with it).
    """
    database = _sqlite_file(tracking_uri)
    if database is None:
        yield
        return
    with exclusive(database.parent, f"creating the MLflow store {database.name}", lock_name=f"{database.name}.lock",
                   wait=True):
        yield


def _sqlite_file(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI (None for a server, a file store or in-memory sqlite)."""
    if not tracking_uri.startswith("sqlite:"):
        return None
    from sqlalchemy.engine import make_url

    database = make_url(tracking_uri).database
    return Path(database) if database and database != ":memory:" else None


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; empty mappings are dropped, lists are kept as values."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _param_value(value: Any) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= MAX_PARAM_LENGTH else text[: MAX_PARAM_LENGTH - 3] + "..."
