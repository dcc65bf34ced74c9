"""`slimeflow deploy`: create the process work pool (if missing) and apply the deployments in prefect.yaml."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def deployment_names(prefect_yaml: Path = ROOT / "prefect.yaml") -> list[str]:
    return [d["name"] for d in yaml.safe_load(prefect_yaml.read_text())["deployments"]]


def main(argv: Sequence[str] = ()) -> int:
    parser = argparse.ArgumentParser(prog="slimeflow deploy", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"deployments to apply (default: all of {deployment_names()})")
    parser.add_argument("--pool", default="slimeflow", help="process work pool name (default: slimeflow)")
    args = parser.parse_args(list(argv))
    prefect = shutil.which("prefect") or str(Path(sys.executable).with_name("prefect"))
    env = {**os.environ, "SLIMEFLOW_ROOT": str(ROOT)}
    pools = subprocess.run([prefect, "work-pool", "ls"], capture_output=True, text=True, env=env)
    if args.pool not in pools.stdout:
        subprocess.run([prefect, "work-pool", "create", args.pool, "--type", "process"], check=True, env=env)
    names = args.names or deployment_names()
    command = [prefect, "--no-prompt", "deploy", *sum((["--name", n] for n in names), [])]
    return subprocess.run(command, cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
