"""slime-style plug-ins through the real train path (tiny model, embedded engine, Ray): a two-turn custom generate
that calls slime's `generate` over HTTP to the running engine, appends tool tokens, sets its own reward for some
trajectories and returns list[Sample]; slime's per-sample reward for the others; a DynamicFilterOutput filter that
drops a group; a data source class over prompts of a --custom-config-path key, saved at each checkpoint; a Dr.GRPO
pg-loss reducer."""

from __future__ import annotations

import pytest
import torch
from train_helpers import run_stage, train_config, with_debug


@pytest.mark.slow
def test_slime_plugins_train_unchanged(tmp_path, monkeypatch, slime_plugins_importable):
    from slimeflow import slime_compat

    slime_compat.install()  # for this test's own import of the plug-in (the train stage installs it itself)
    import slime_style_multi_turn as turns

    custom = tmp_path / "custom.yaml"
    custom.write_text("data_source_prompts: [one plus one, two plus two, three plus three, four plus four]\n"
                      "lr: 2.0e-6\nsettting_nobody_reads: 3\n")
    config, _ = train_config(tmp_path / "prep", **{
        "num-rollout": 2, "rollout-batch-size": 2, "n-samples-per-prompt": 2, "eval-interval": None,
        "rm-type": None, "custom-rm-path": "slime_style_hooks.parity_reward",
        "custom-generate-function-path": "slime_style_multi_turn.generate_two_turns",
        "dynamic-sampling-filter-path": "slime_style_hooks.drop_group_zero",
        "data-source-path": "slime_style_data_source.ListDataSource", "save-interval": None,
        "custom-config-path": str(custom), "custom-pg-loss-reducer-function-path": "slime_style_data_source.dr_grpo"})
    template = str(tmp_path / "debug" / "rollout_{rollout_id}.pt")
    records, _, manifest = run_stage(with_debug(config, save_debug_rollout_data=template), tmp_path / "run",
                                     monkeypatch)
    assert [r["step"] for r in records] == [0, 1] and all(r["grad_norm"] > 0 for r in records)
    # What the file set is recorded, with the setting no plug-in read (the data source read its own).
    assert manifest.facts["custom_config"] == {
        "path": str(custom), "flags": {"optimizer.lr": 2.0e-6}, "unused": ["settting_nobody_reads"],
        "settings": {"data_source_prompts": ["one plus one", "two plus two", "three plus three", "four plus four"],
                     "settting_nobody_reads": 3}}
    assert manifest.config["optimizer"]["lr"] == 2.0e-6
    # Rollout 0 dropped group 0 (its filter returned keep=False) and asked for more.
    assert records[0]["rollout/sampler_dropped/group_zero"] == 1.0

    saved = torch.load(template.format(rollout_id=0), weights_only=True)["samples"]
    assert 0 not in {s["group_index"] for s in saved}
    assert {s["prompt"] for s in saved} <= {"two plus two", "three plus three", "four plus four"}  # the class's
    rollout_state = tmp_path / "run" / "checkpoints" / "rollout"  # the class's save(1) with the final checkpoint
    assert sorted(p.name for p in rollout_state.iterdir()) == ["list_source_1.json"]
    assert len(saved) == 2 * 2 * 2  # 2 groups x 2 trajectories x 2 samples (one per turn)
    tool = len(turns_tool_ids(manifest))
    for first, second in zip(saved[::2], saved[1::2], strict=True):
        assert first["response_length"] == 1 and first["loss_mask"] in (None, [1])
        assert second["tokens"][:len(first["tokens"])] == first["tokens"]
        assert second["loss_mask"] == [1] + [0] * tool + [1] and len(second["rollout_log_probs"]) == 2 + tool
        assert second["rollout_log_probs"][1:1 + tool] == [0.0] * tool and second["metadata"]["turns"] == 2
        if first["index"] % 2 == 0:  # the generate function's own reward is kept
            assert first["reward"] == second["reward"] == turns.SET_REWARD
        else:  # the others come from --custom-rm-path
            assert second["reward"] == float(second["tokens"][-1] % 2)


def turns_tool_ids(manifest) -> list[int]:
    import slime_style_multi_turn as turns
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(manifest.config["checkpoint"]["hf_checkpoint"])
    return tokenizer.encode(turns.TOOL_TEXT, add_special_tokens=False)
