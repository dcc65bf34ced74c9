"""slime's whole flag surface: every flag slime defines and every flag its scripts pass is taken or refused by name.

The lists in tests/data come from THUDM/slime 624b824a8: slime/utils/arguments.py's flags, and the bash-expanded argv
of its 23 scripts/run-*.sh and 39 scripts/models/*.sh (stubs for pkill/ray/python3, each script sourced as is).
"""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest
from paths import DATA, ROOT

from slimeflow import cli
from slimeflow.config.base import ConfigModel
from slimeflow.config.flags import leaves
from slimeflow.config.pipeline import STAGE_CONFIGS, STAGE_INDEX, TOP_INDEX, RunSettings
from slimeflow.config.slime_flags import (
    NOT_YET_SUPPORTED,
    NOT_YET_SUPPORTED_PREFIXES,
    RENAMED,
    refusal_reason,
)

SCRIPTS = DATA / "slime_scripts"


def tokens(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if not line.startswith("# ")]


def taken(flag: str) -> bool:
    return flag.startswith("--sglang-") or flag in TOP_INDEX.by_flag or any(
        index.takes(flag) for index in STAGE_INDEX.values())


def test_every_flag_slime_defines_is_taken_or_refused_with_a_reason():
    flags = tokens(DATA / "slime_flags" / "arguments.args")
    assert len(flags) == 223
    unknown = [f for f in flags if not taken(f) and refusal_reason(f) is None and f not in RENAMED]
    assert unknown == []


@pytest.mark.parametrize("script", sorted(p.name for p in [*SCRIPTS.glob("*.args"), *SCRIPTS.glob("models/*.args")]))
def test_every_flag_of_slimes_scripts_is_taken_or_refused_with_a_reason(script):
    path = SCRIPTS / script if (SCRIPTS / script).exists() else SCRIPTS / "models" / script
    flags = {t for t in tokens(path) if t.startswith("--")}
    assert [f for f in sorted(flags) if not taken(f) and refusal_reason(f) is None] == []


def test_no_flag_is_both_taken_and_refused():
    """A refusal left behind after its flag was built would be dead text; the table stays true."""
    taken_flags = set(TOP_INDEX.by_flag).union(*(index.by_flag for index in STAGE_INDEX.values()),
                                               *(index.negations for index in STAGE_INDEX.values()))
    assert sorted(taken_flags & set(NOT_YET_SUPPORTED)) == []
    # A prefix refusal (--moe-*) covers the rest of a family whose taken members are checked flags.
    assert sorted(taken_flags & set(RENAMED)) == []


def test_every_refusal_names_its_reason():
    for flag, reason in [*NOT_YET_SUPPORTED.items(), *NOT_YET_SUPPORTED_PREFIXES.items()]:
        assert flag.startswith("--") and len(reason.split()) >= 5, (flag, reason)


RUN_SCRIPTS = sorted(p.name for p in SCRIPTS.glob("run-*.args"))


@pytest.mark.parametrize("script", RUN_SCRIPTS)
def test_slimes_run_scripts_print_their_config_and_name_what_a_run_refuses(script, capsys, caplog):
    """`slimeflow train "${ALL_ARGS[@]}" --print-config` exits 0; the refused flags are listed on stderr."""
    argv = tokens(SCRIPTS / script)
    with caplog.at_level(logging.WARNING, logger="slimeflow.config"):
        code = cli.main(["train", *argv, "--print-config"])
    out, err = capsys.readouterr()
    if script == "run-kimi-k2-Instruct.args":
        # slime's own script drops a line continuation (after --update-weight-buffer-size), so train.py gets 8
        # tokens and no batch settings: slime fails on it too.
        assert code == cli.EXIT_CONFIG and "--rollout-batch-size is required" in err
        return
    dispatchers = [argv[i + 1] for i, token in enumerate(argv) if token == "--moe-token-dispatcher-type"]
    if len(set(dispatchers)) > 1:
        # Several of slime's MoE scripts set the dispatcher twice (alltoall, then flex with --moe-enable-deepep):
        # the last stands, as in argparse, said once.
        assert [r.getMessage() for r in caplog.records if "given" in r.getMessage()] == [
            f"slimeflow train: --moe-token-dispatcher-type is given 2 times ({', '.join(dispatchers)}); the last, "
            "flex, stands"]
    if script.endswith("-sft.args"):  # slime's SFT mode: --debug-train-only, the rollouts made by sft_rollout
        assert code == 0, err
        assert "debug_train_only: true" in out and "slime.rollout.sft_rollout.generate_rollout" in out
    if len(set(dispatchers)) > 1:  # and a run is refused for that value's own reason: DeepEP's
        assert code == 0 and "moe_token_dispatcher_type: flex" in out
        assert cli.main(["train", *argv]) == cli.EXIT_CONFIG and "DeepEP" in capsys.readouterr().err
        return
    assert code == 0, err
    assert "rollout_batch_size" in out
    refused = [line.split(":")[0].strip() for line in err.splitlines()[1:]]
    assert all(refusal_reason(flag) for flag in refused)
    if refused:  # and a run with them stops at parse, before any work, naming each of them
        assert cli.main(["train", *argv]) == cli.EXIT_CONFIG
        stopped = capsys.readouterr().err
        assert all(f"{flag}: not supported yet" in stopped for flag in refused)


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("models/*.args")))
def test_slimes_model_args_parse_for_the_converter(script, capsys):
    """`slimeflow convert hf-to-torch-dist "${MODEL_ARGS[@]}" --hf-checkpoint D --save S --print-config` exits 0."""
    argv = tokens(SCRIPTS / "models" / script)
    code = cli.main(["convert", "hf-to-torch-dist", *argv, "--hf-checkpoint", "/m", "--save", "/s", "--print-config"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "megatron:" in out


def _names_read_outside_config() -> set[str]:
    """Attribute names (`config.colocate`, `self.colocate` in a validator) and bare string constants
    (`getattr(megatron, "sequence_parallel")`) anywhere in the code: what some code reads. A field's definition is
    an annotated name, neither of these, so a field that only exists is not counted as read."""
    names: set[str] = set()
    for root in ("slimeflow", "stages", "flows", "io", "deployments"):
        for path in (ROOT / root).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute):
                    names.add(node.attr)
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    names.add(node.value)
    return names


def test_no_config_field_is_accepted_and_then_ignored():
    """Every flag of every stage is read by code outside the config definitions (used, or refused at run start)."""
    read = _names_read_outside_config()
    models: list[type[ConfigModel]] = [RunSettings, *STAGE_CONFIGS.values()]
    unread = sorted({leaf.flag for model in models for leaf in leaves(model) if leaf.path[-1] not in read})
    assert unread == []
