"""The top-level folders are subpackages of slimeflow; `io` stays Python's own module (editable and wheel)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from paths import ROOT

SUBPACKAGES = ("flows", "stages", "io", "deployments")

CHECK = """
import io, json, sys
import slimeflow, slimeflow.io, slimeflow.flows, slimeflow.stages, slimeflow.deployments
import slimeflow.io.storage, slimeflow.io.tracking, slimeflow.io.checkpoints
print(json.dumps({"io": getattr(io, "__file__", "<frozen>"), "bytesio": hasattr(io, "BytesIO"),
                  "slimeflow.io": slimeflow.io.__file__, "slimeflow": slimeflow.__file__}))
"""

DEPLOYMENTS = """
from slimeflow.deployments.definitions import PREFECT_YAML, load, names
print(PREFECT_YAML, *names(load()[0]))
"""


def _check(cwd: Path, python: str = sys.executable, env: dict | None = None) -> dict:
    import json

    out = subprocess.run([python, "-c", CHECK], cwd=cwd, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_io_is_the_standard_library_and_slimeflow_io_is_ours_from_the_repo_root():
    found = _check(ROOT)
    assert found["bytesio"]
    assert not found["io"].startswith(str(ROOT)), found
    assert Path(found["slimeflow.io"]) == ROOT / "io" / "__init__.py"


def test_every_top_level_folder_maps_to_a_subpackage():
    import slimeflow

    for name in SUBPACKAGES:
        module = __import__(f"slimeflow.{name}", fromlist=["_"])
        assert Path(module.__file__).parent == ROOT / name
    assert Path(slimeflow.__file__).parent == ROOT / "slimeflow"


@pytest.mark.slow
def test_the_wheel_installs_the_same_layout(tmp_path):
    """Build the wheel, install it into a target directory, import from there with the repo out of sight."""
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    wheel = next(dist.glob("slimeflow-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "slimeflow/io/storage.py" in names and "slimeflow/flows/pipeline.py" in names
    assert zipfile.ZipFile(wheel).read("slimeflow/deployments/prefect.yaml") == (ROOT / "prefect.yaml").read_bytes(), \
        "the wheel ships the root prefect.yaml, which `slimeflow deploy` reads"
    assert {"slimeflow/config/pipeline.py", "slimeflow/families/__init__.py",
            "slimeflow/slime_compat/rollout/filter_hub/base_types.py"} <= set(names), "a subpackage is missing"
    assert not any(n.startswith(("io/", "flows/", "tests/")) for n in names), "a top-level folder leaked into the wheel"
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    import os

    env = {**os.environ, "PYTHONPATH": str(target)}
    found = _check(tmp_path, env=env)
    assert Path(found["slimeflow.io"]) == target / "slimeflow" / "io" / "__init__.py"
    assert not found["io"].startswith(str(target))
    # What `slimeflow deploy` reads, found in the installed package.
    read = subprocess.run([sys.executable, "-c", DEPLOYMENTS], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert read.returncode == 0, read.stderr
    assert read.stdout.split() == [str(target / "slimeflow" / "deployments" / "prefect.yaml"),
                                   "pipeline", "model", "convert", "preprocess", "train", "evaluate", "export"]
