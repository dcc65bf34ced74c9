"""slimeflow: slime's RL post-training system as a Prefect-orchestrated pipeline of discrete stages."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

__version__ = "0.1.0"


@functools.cache
def code_version() -> str:
    """`<version>+g<commit>` inside a git checkout (with `.dirty` for uncommitted changes), else the version."""
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return __version__
    try:
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return __version__
    return f"{__version__}+g{sha}{'.dirty' if dirty else ''}"
