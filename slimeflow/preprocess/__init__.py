"""The preprocess library: raw rows -> prompt parquet (mapping, tokenising, dedup, quarantine, manifest). The
preprocess stage runs it on its inputs; the rollout library runs it on raw --prompt-data (inline.py)."""
