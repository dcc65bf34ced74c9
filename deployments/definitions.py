"""The Prefect deployments of slimeflow, as prefect.yaml declares them: this module only reads that file.

prefect.yaml at the root of a checkout is the one declaration (`prefect deploy --all` reads it there); the package
ships the same file as slimeflow/deployments/prefect.yaml (a link to the root one in the source tree), which
`slimeflow deploy` reads from any install. It is read by Prefect's own loader, so both see the same deployments.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.cli.deploy._config import _load_deploy_configs_and_actions
from pydantic import BaseModel
from rich.console import Console

PREFECT_YAML = Path(__file__).with_name("prefect.yaml")
"""The packaged prefect.yaml."""


class DefinitionError(Exception):
    """prefect.yaml is missing or unreadable; the message names the file and what is wrong."""


def load(path: Path = PREFECT_YAML) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(deployment configs, top-level build/push/pull actions) of `path`, as `prefect deploy` reads them.

    Prefect's loader prints a warning and returns nothing for a file it cannot read or validate; here that is an
    error naming the file, with Prefect's own explanation."""
    console = Console(record=True, width=200, quiet=True)
    configs, actions = _load_deploy_configs_and_actions(prefect_file=path, console=console)
    if not configs:
        raise DefinitionError(f"{path} declares no deployment: {console.export_text().strip() or 'empty file'}; "
                              "reinstall slimeflow or restore the file from the repository")
    unnamed = [c.get("entrypoint") for c in configs if not c.get("name")]
    if unnamed:
        raise DefinitionError(f"{path}: the deployments of {unnamed} have no name; give each a `name:`")
    return configs, actions


def names(configs: list[dict[str, Any]]) -> list[str]:
    return [config["name"] for config in configs]


def canonical(model: BaseModel) -> dict[str, Any]:
    """A validated config as the JSON that Prefect stores and the server's schema validates (what was set)."""
    return model.model_dump(mode="json", exclude_unset=True)
