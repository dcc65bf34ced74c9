"""The preprocess stage vs a straightforward pandas implementation of the same transformation, same data, same run.

The transformation: JSONL rows (a prompt, a label, a metadata dict and two extra columns) -> the prompt parquet
(row_id = hash of the source row, extras packed into the metadata JSON, empty and duplicate prompts dropped),
measured twice: with prompt token counts (the tiny byte-level tokenizer of slimeflow/families/tiny.py, one token per
byte, so the Rust tokenizer's time is large and the same for both) and without a tokenizer. Each run is a
subprocess, so its peak RSS is its own; times include imports.

Goals (issue #4): throughput >= 3x pandas at --rows; peak RSS of the stage at --small and --large rows equal
within 20% (measured without a tokenizer, the stage's own memory).

    python benchmarks/preprocess_bench.py [--rows 1000000] [--small 100000] [--large 2000000] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = "_child"


def make_data(path: Path, rows: int, seed: int = 0) -> None:
    """Synthetic dapo/Search-R1-like rows; about 1% of prompts repeat."""
    rng = random.Random(seed)
    words = ["integer", "sum", "triangle", "prime", "sequence", "modulo", "remainder", "probability", "circle"]
    with path.open("w", encoding="utf-8") as f:
        for i in range(rows):
            n = i if rng.random() > 0.01 else rng.randrange(max(i, 1))
            text = f"Problem {n}: " + " ".join(rng.choice(words) for _ in range(rng.randint(10, 40)))
            row = {"prompt": text, "label": str(n % 997), "metadata": {"source": "synthetic", "level": n % 5},
                   "session_id": f"s{i}", "tool_code": f"search({n})"}
            f.write(json.dumps(row) + "\n")


def run_stage(data: Path, out: Path, tokenizer_dir: Path | None) -> int:
    from slimeflow.config.preprocess import PreprocessConfig
    from slimeflow.io.storage import Storage
    from slimeflow.stages.base import StageContext
    from slimeflow.stages.preprocess.stage import run

    config = PreprocessConfig(input=[str(data)], output=str(out), input_key="prompt", label_key="label",
                              hf_checkpoint=str(tokenizer_dir) if tokenizer_dir else None)
    return run(config, StageContext(Storage(), out.parent / "work", str(out))).counts["rows_out"]


def run_pandas(data: Path, out: Path, tokenizer_dir: Path | None) -> int:
    """What one would write by hand with pandas: read everything, apply row-wise, write once."""
    import hashlib

    import pandas as pd

    df = pd.read_json(data, lines=True, dtype=False)
    source = df.to_dict(orient="records")
    extras = [c for c in df.columns if c not in ("prompt", "label", "metadata")]

    def pack(row):
        metadata = dict(row["metadata"]) if isinstance(row["metadata"], dict) else {}
        for column in extras:
            metadata[column] = row[column]
        return json.dumps(metadata)

    df["metadata"] = df.apply(pack, axis=1)
    df["row_id"] = [hashlib.sha256(json.dumps(r, sort_keys=True).encode()).hexdigest()[:32] for r in source]
    df = df[df["prompt"].str.strip() != ""].drop_duplicates("prompt")
    df["prompt_tokens"] = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        prompts = df["prompt"].tolist()
        counts = []
        for start in range(0, len(prompts), 8192):  # in one call, the id lists of 1M prompts take > 12 GB
            encoded = tokenizer(prompts[start : start + 8192], add_special_tokens=False)["input_ids"]
            counts += [len(ids) for ids in encoded]
        df["prompt_tokens"] = counts
    df["tools"] = None
    df["label"] = df["label"].astype(str)
    out.mkdir(parents=True)
    df[["row_id", "prompt", "label", "metadata", "tools", "prompt_tokens"]].to_parquet(
        out / "part-00000.parquet", row_group_size=8192, index=False)
    return len(df)


def child(kind: str, data: str, out: str, tokenizer_dir: str) -> None:
    import resource

    start = time.perf_counter()
    tokenizer = Path(tokenizer_dir) if tokenizer_dir != "-" else None
    rows = (run_stage if kind == "stage" else run_pandas)(Path(data), Path(out), tokenizer)
    seconds = time.perf_counter() - start
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"rows_out": rows, "seconds": seconds, "peak_rss_mib": peak_mib}))


def measure(kind: str, data: Path, work: Path, tokenizer_dir: Path | None) -> dict:
    out = work / f"out-{kind}-{data.stem}-{'tok' if tokenizer_dir else 'notok'}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(out.parent / "work", ignore_errors=True)
    done = subprocess.run([sys.executable, __file__, CHILD, kind, str(data), str(out), str(tokenizer_dir or "-")],
                          check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--small", type=int, default=100_000)
    parser.add_argument("--large", type=int, default=2_000_000)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="preprocess-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    from slimeflow.families.tiny import build_tiny_tokenizer

    tokenizer_dir = work / "tokenizer"
    build_tiny_tokenizer("qwen3").save_pretrained(tokenizer_dir)
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}\nworkdir: {work}")

    data = work / f"rows-{args.rows}.jsonl"
    make_data(data, args.rows)
    for label, tokenizer in (("with token counts", tokenizer_dir), ("without a tokenizer", None)):
        stage, pandas = measure("stage", data, work, tokenizer), measure("pandas", data, work, tokenizer)
        assert stage["rows_out"] == pandas["rows_out"], (stage, pandas)
        print(f"{label}, {args.rows:,} rows: stage {args.rows / stage['seconds']:,.0f} rows/s "
              f"({stage['seconds']:.1f} s, peak RSS {stage['peak_rss_mib']:.0f} MiB), pandas "
              f"{args.rows / pandas['seconds']:,.0f} rows/s ({pandas['seconds']:.1f} s, peak RSS "
              f"{pandas['peak_rss_mib']:.0f} MiB); ratio {pandas['seconds'] / stage['seconds']:.2f}x (goal >= 3x)",
              flush=True)

    peaks = {}
    for rows in (args.small, args.large):
        sized = work / f"rows-{rows}.jsonl"
        if not sized.exists():
            make_data(sized, rows)
        peaks[rows] = measure("stage", sized, work, None)
    small, large = peaks[args.small]["peak_rss_mib"], peaks[args.large]["peak_rss_mib"]
    print(f"stage peak RSS (no tokenizer): {small:.0f} MiB at {args.small:,} rows, {large:.0f} MiB at {args.large:,} rows; "
          f"ratio {large / small:.2f} (goal <= 1.20)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == CHILD:
        child(*sys.argv[2:])
    else:
        main()
