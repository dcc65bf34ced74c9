"""slime's --megatron-config-path (slimeflow/config/megatron_roles.py): the actor entry's overrides win over the
command line, flag for flag; what slimeflow refuses or does not know is named with the file."""

from __future__ import annotations

import pytest

from slimeflow.config.pipeline import load_stage_config
from slimeflow.errors import ConfigError

BASE = ["--rollout-batch-size", "4", "--num-rollout", "1", "--lr", "1e-5", "--micro-batch-size", "1"]


def test_the_actor_overrides_replace_the_command_lines_values(tmp_path):
    path = tmp_path / "roles.yaml"
    # slime's example shape; YAML reads 1e-6 as a string, which is converted as the flag's value would be.
    path.write_text("megatron:\n  - name: default\n    role: actor\n    overrides:\n      lr: 1e-6\n"
                    "      micro-batch-size: 2\n      tensor_model_parallel_size: 2\n")
    config = load_stage_config("train", None, [*BASE, "--megatron-config-path", str(path)])
    assert config.optimizer.lr == 1e-6 and config.batch.micro_batch_size == 2
    assert config.megatron.tensor_model_parallel_size == 2
    again = type(config).model_validate(config.model_dump())  # a flow's parameters are validated again: same run
    assert again == config


@pytest.mark.parametrize(("yaml_text", "expected"), [
    ("megatron:\n  - role: actor\n    overrides: {use_critic: true}\n", "role actor: use_critic: not supported yet (PPO with"),
    ("megatron:\n  - role: actor\n    args: {lrr: 0.1}\n", "role actor: lrr"),
    ("megatron:\n  - role: actor\n    overrides: {num_gpus_per_node: 4}\n", "the GPU allocation follows"),
    ("megatron:\n  - role: critic\n    overrides: {lr: 0.1}\n", "role critic: slimeflow trains no critic"),
    ("critic:\n  lr: 0.1\n", "a top-level 'megatron' list"),
])
def test_what_the_file_cannot_set_is_named_with_the_file(tmp_path, yaml_text, expected):
    path = tmp_path / "roles.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError, match="--megatron-config-path") as err:
        load_stage_config("train", None, [*BASE, "--megatron-config-path", str(path)])
    assert expected in str(err.value)
