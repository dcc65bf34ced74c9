"""Config input that used to be accepted silently (issue 16, item 16): each is refused, naming what and how to fix."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from slimeflow.config.pipeline import load_pipeline_config, load_stage_config
from slimeflow.config.yaml_file import read_yaml
from slimeflow.errors import ConfigError

TRAIN = ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2"]  # 8 samples: global batch 8


def refused(stage: str, argv: list[str], data: dict | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        load_stage_config(stage, data, argv)
    return str(err.value)


def test_a_micro_batch_larger_than_the_global_batch_is_refused():
    message = refused("train", [*TRAIN, "--num-rollout", "2", "--micro-batch-size", "9"])
    assert "--micro-batch-size 9" in message and "choose at most 8" in message
    assert load_stage_config("train", None, [*TRAIN, "--num-rollout", "2", "--micro-batch-size", "8"])


def test_a_micro_batch_larger_than_a_data_parallel_share_is_refused():
    message = refused("train", [*TRAIN, "--num-rollout", "2", "--micro-batch-size", "5",
                                "--actor-num-gpus-per-node", "2"])
    assert "8 samples over 2 ranks = 4" in message
    # --use-dynamic-batch-size packs by tokens; --micro-batch-size is not used then (as in slime).
    assert load_stage_config("train", None, [*TRAIN, "--num-rollout", "2", "--micro-batch-size", "9",
                                             "--use-dynamic-batch-size", "--max-tokens-per-gpu", "64"])


def test_a_one_value_flag_given_twice_keeps_the_last_value_and_says_so(caplog):
    # As argparse (and so slime) does: slime's scripts give --moe-token-dispatcher-type in the model script and again
    # in the run script.
    with caplog.at_level(logging.WARNING, logger="slimeflow.config"):
        assert load_stage_config("convert", None, ["--processes", "3", "--processes", "2"]).processes == 2
        assert load_stage_config("convert", None, ["--overwrite", "--overwrite=false"]).overwrite is False
        assert load_stage_config("convert", None, ["--processes", "3", "--processes=3"]).processes == 3
    notes = [r.getMessage() for r in caplog.records]
    assert notes == ["slimeflow convert: --processes is given 2 times (3, 2); the last, 2, stands",
                     "slimeflow convert: --overwrite is given 2 times ((no value), false); the last, false, stands"]


def test_list_flags_still_add_up_when_repeated():
    config = load_stage_config("preprocess", None, ["--input", "a.jsonl", "--input", "b.jsonl"])
    assert config.input == ["a.jsonl", "b.jsonl"]


def test_a_flag_given_twice_in_a_pipeline_keeps_the_last_value():
    config = load_pipeline_config({"train": {"rollout-batch-size": 4, "num-rollout": 2}},
                                  ["--lr", "1e-3", "--train.lr", "1e-4"])
    assert config.train.optimizer.lr == 1e-4


def test_num_rollout_and_num_epoch_together_are_refused():
    message = refused("train", [*TRAIN, "--num-rollout", "3", "--num-epoch", "2"])
    assert "--num-rollout 3 and --num-epoch 2" in message and "give one" in message


def test_rollout_devices_that_no_engine_would_use_are_refused():
    message = refused("train", [*TRAIN, "--num-rollout", "2", "--rollout-num-gpus", "4",
                                "--rollout-num-gpus-per-engine", "3"])
    assert "--rollout-num-gpus 4 is not a multiple of --rollout-num-gpus-per-engine 3" in message
    colocated = refused("train", [*TRAIN, "--num-rollout", "2", "--colocate", "--actor-num-gpus-per-node", "4",
                                  "--rollout-num-gpus-per-engine", "3"])
    assert "(the training devices, with --colocate)" in colocated


@pytest.mark.parametrize("value", [True, False])
def test_a_yaml_bool_is_not_read_as_a_number(value):
    message = refused("convert", [], {"processes": value})
    assert f"--processes {str(value).lower()}: takes a number" in message
    assert "--lr true: takes a number" in refused("train", [], {"rollout-batch-size": 4, "num-rollout": 2, "lr": True})


def test_a_bool_field_still_takes_yaml_bools():
    assert load_stage_config("convert", {"overwrite": True}).overwrite is True


def test_a_yaml_key_given_twice_is_refused_with_its_line(tmp_path: Path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  rollout-batch-size: 4\n  lr: 1e-3\n  rollout-batch-size: 8\n")
    with pytest.raises(ConfigError) as err:
        read_yaml(path)
    assert "'rollout-batch-size' is given twice (first on line 2)" in str(err.value) and "line 4" in str(err.value)
    path.write_text("train: {}\nconvert: {}\ntrain: {}\n")
    with pytest.raises(ConfigError, match="'train' is given twice"):
        read_yaml(path)


def test_one_key_in_two_spellings_is_refused():
    message = refused("convert", [], {"make-vocab-size-divisible-by": 64, "make_vocab_size_divisible_by": 128})
    assert "given twice (also as 'make-vocab-size-divisible-by')" in message


def test_every_broken_section_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_pipeline_config({
            "convert": {"processes": True},
            "train": {"rollout-batch-size": 0, "num-rollout": 2},
            "export": {"max-shard-size": "big"},
        })
    lines = err.value.problems
    assert [line.split(":", 1)[0] for line in lines] == ["convert", "train", "export"]


def test_unknown_keys_in_several_sections_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_pipeline_config({"convert": {"procesess": 2}, "export": {"output-dri": "x"}, "train": 5})
    text = str(err.value)
    assert "procesess" in text and "output-dri" in text and "expected a mapping of flags" in text
