"""Writes the real demo's questions: "What is a times b?" for a, b in 2..12, 64 of the 121 held out to evaluate.

    python examples/times_tables/make_data.py     (rewrites data/times-train.jsonl and data/times-eval.jsonl)

The split is fixed by a seeded shuffle, so the committed files are what this writes. The label is the product as
text; reward.py reads it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

FACTORS = range(2, 13)
HELD_OUT = 64
SEED = 0
DATA = Path(__file__).parent / "data"


def questions() -> list[dict]:
    """Every pair once, as a chat prompt (one user turn; the model's chat template adds its system prompt)."""
    return [{"prompt": [{"role": "user", "content": f"What is {a} times {b}?"}], "label": str(a * b),
             "id": f"times-{a}x{b}"} for a in FACTORS for b in FACTORS]


def write(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    rows = questions()
    random.Random(SEED).shuffle(rows)
    DATA.mkdir(exist_ok=True)
    write(rows[:HELD_OUT], DATA / "times-eval.jsonl")
    write(rows[HELD_OUT:], DATA / "times-train.jsonl")


if __name__ == "__main__":
    main()
