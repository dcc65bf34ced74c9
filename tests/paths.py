"""Where the tests' fixed inputs are, for the test modules of every tier (tests/unit, tests/integration,
tests/e2e): a module's own folder says nothing about them since the tiers moved the modules one level down."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
"""The checkout (examples/, docs/, pyproject.toml)."""
DATA = TESTS / "data"
"""tests/data: seed scripts, slime's flags, plug-ins, the fake sglang, rm_hub tables."""
TIERS = tuple(TESTS / tier for tier in ("unit", "integration", "e2e"))
"""The tiers' folders: Ray workers import test modules (a test's plug-in) from these."""
