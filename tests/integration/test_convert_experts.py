"""Expert-sharded conversion: with `--processes N` a MoE model's routed experts are split over the ranks as expert
parallelism splits them (contiguous slices, sizes differing by at most one), each rank reads and holds only its
slice of every MoE layer's experts and its share of the other tensors, and the checkpoint is the one a single
process writes, bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from slimeflow.checkpoint.convert import HFSource, assign_shares, convert_hf_to_torch_dist, read_hf_source
from slimeflow.checkpoint.torch_dist import load_torch_dist, tensor_metadata
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

MODELS = {
    # 5 experts over 2 ranks: unequal slices (2 and 3), every layer an MoE layer (tensors stacked over layers)
    "qwen3_moe": "tiny:qwen3_moe?dtype=bfloat16&num_hidden_layers=2&num_experts=5&seed=4",
    # a dense first layer (each layer keyed on its own), 4 experts in 2 groups, a shared expert, MLA
    "deepseek_v3": "tiny:deepseek_v3?seed=6",
}
ROUTED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
GLOBALS_HF = {"embedding.word_embeddings.weight": "model.embed_tokens.weight",
              "decoder.final_layernorm.weight": "model.norm.weight", "output_layer.weight": "lm_head.weight"}


@pytest.fixture(scope="module", params=sorted(MODELS))
def conversions(request, tmp_path_factory) -> tuple[HFSource, dict[int, tuple[Path, list[dict]]]]:
    tmp = tmp_path_factory.mktemp(request.param)
    source = read_hf_source(build_tiny_model(tmp / "hf", TinyModelSpec.from_uri(MODELS[request.param])))
    return source, {n: convert_hf_to_torch_dist(source, tmp / f"{n}p", processes=n) for n in (1, 2)}


@pytest.mark.slow
def test_two_ranks_write_the_checkpoint_one_process_writes_bit_for_bit(conversions):
    _, by_processes = conversions
    (one, _), (two, _) = by_processes[1], by_processes[2]
    assert tensor_metadata(two) == tensor_metadata(one)
    whole, split = load_torch_dist(one)[0], load_torch_dist(two)[0]
    assert sorted(split) == sorted(whole)
    for key, tensor in whole.items():
        assert split[key].dtype == tensor.dtype and torch.equal(split[key], tensor), key


@pytest.mark.slow
def test_each_rank_reads_and_holds_only_its_slice_of_the_experts_and_its_share_of_the_rest(conversions):
    source, by_processes = conversions
    experts = source.shape.num_experts
    ranks = by_processes[2][1]
    spans = [tuple(rank["experts"]) for rank in ranks]
    assert spans[0][0] == 0 and spans[-1][1] == experts and spans[0][1] == spans[1][0]  # contiguous, all covered
    assert abs((spans[0][1] - spans[0][0]) - (spans[1][1] - spans[1][0])) <= 1
    for rank, share, span in zip(ranks, assign_shares(source, 2), spans, strict=True):
        # What this rank should read, from the HF names alone: its experts of every layer, its layers' other
        # tensors, its globals.
        wanted = {name for name in source.sizes
                  if (m := ROUTED.match(name)) and span[0] <= int(m.group(2)) < span[1]}
        wanted |= {name for name in source.sizes if not ROUTED.match(name)
                   and any(name.startswith(f"model.layers.{layer}.") for layer in share.layers)}
        wanted |= {GLOBALS_HF[g] for g in share.globals_}
        assert rank["read_experts"] == list(range(*span))
        assert (rank["read_tensors"], rank["read_bytes"]) == (len(wanted), sum(source.sizes[n] for n in wanted))
    # Nothing read twice or missed; together the ranks held what one process holds, each well under it.
    assert sum(rank["read_tensors"] for rank in ranks) == len(source.sizes)
    assert sum(rank["read_bytes"] for rank in ranks) == sum(source.sizes.values())
    (alone,) = by_processes[1][1]
    assert sum(rank["bytes"] for rank in ranks) == alone["bytes"]
    assert max(rank["bytes"] for rank in ranks) < 0.75 * alone["bytes"]


def test_experts_are_split_as_expert_parallelism_splits_them_and_the_rest_by_bytes(tmp_path):
    """Shares alone (no conversion): 5 experts over 3 ranks are [0,1), [1,3), [3,5); more ranks than experts
    leaves some ranks none; every layer and global is someone's, once."""
    source = read_hf_source(build_tiny_model(tmp_path / "hf", TinyModelSpec.from_uri(MODELS["qwen3_moe"])))
    assert [share.experts for share in assign_shares(source, 3)] == [(0, 1), (1, 3), (3, 5)]
    shares = assign_shares(source, 7)
    assert [share.experts for share in shares] == [(0, 0), (0, 1), (1, 2), (2, 2), (2, 3), (3, 4), (4, 5)]
    assert sorted(layer for share in shares for layer in share.layers) == [0, 1]
    assert sorted(g for share in shares for g in share.globals_) == sorted(GLOBALS_HF)
