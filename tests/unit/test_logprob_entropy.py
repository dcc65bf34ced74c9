"""The fused log-prob/entropy pass (slimeflow.train.logprob_entropy) against plain autograd over log_softmax."""

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slimeflow.train.logprob_entropy import log_probs_and_entropy


def reference(logits, tokens, keep_mask=None):
    """log_softmax over the kept tokens (the sampled one always kept), entropy over all of them."""
    scored = logits
    if keep_mask is not None:
        keep = keep_mask.clone()
        keep[torch.arange(len(tokens)), tokens] = True
        scored = logits.masked_fill(~keep, float("-inf"))
    log_probs = scored.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    logp = logits.log_softmax(-1)
    return log_probs, -(logp.exp() * logp).sum(-1)


def case(rows=5, vocab=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 3
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    keep = torch.rand(rows, vocab, generator=gen) > 0.5
    return logits, tokens, keep


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("chunk_size", [-1, 2])
def test_values_and_gradients_equal_autograd_over_log_softmax(masked, chunk_size):
    logits, tokens, keep = case()
    w_lp, w_ent = torch.linspace(-1, 2, 5, dtype=torch.float64), torch.linspace(0.5, -0.3, 5, dtype=torch.float64)
    fused_in = logits.clone().requires_grad_()
    log_probs, entropy = log_probs_and_entropy(fused_in, tokens, with_entropy=True, chunk_size=chunk_size,
                                               keep_mask=keep if masked else None)
    ((log_probs * w_lp).sum() + (entropy * w_ent).sum()).backward()
    ref_in = logits.clone().requires_grad_()
    ref_lp, ref_ent = reference(ref_in, tokens, keep if masked else None)
    ((ref_lp * w_lp).sum() + (ref_ent * w_ent).sum()).backward()
    torch.testing.assert_close(log_probs, ref_lp)
    torch.testing.assert_close(entropy, ref_ent)
    torch.testing.assert_close(fused_in.grad, ref_in.grad)


@pytest.mark.parametrize("used", ["log_probs", "entropy"])
def test_an_output_the_loss_leaves_out_changes_nothing(used):
    """The entropy computed beside the log-probs (one softmax for both) leaves the log-probs and their gradient
    exactly as without it; each output alone back-propagates what autograd gives for it."""
    logits, tokens, _ = case()
    alone_in, both_in, ref_in = (logits.clone().requires_grad_() for _ in range(3))
    both = log_probs_and_entropy(both_in, tokens, with_entropy=True)
    ref = reference(ref_in, tokens)
    if used == "log_probs":
        alone = log_probs_and_entropy(alone_in, tokens)
        alone[0].sum().backward()
        both[0].sum().backward()
        ref[0].sum().backward()
        assert torch.equal(both[0], alone[0]) and torch.equal(both_in.grad, alone_in.grad)
    else:
        both[1].sum().backward()
        ref[1].sum().backward()
    torch.testing.assert_close(both_in.grad, ref_in.grad)


def test_metric_only_entropy_has_no_gradient_and_half_precision_is_upcast():
    logits, tokens, _ = case()
    half = logits.to(torch.bfloat16).requires_grad_()
    log_probs, entropy = log_probs_and_entropy(half, tokens, with_entropy=True, entropy_grad=False)
    assert log_probs.dtype == torch.float32 and not entropy.requires_grad
    log_probs.sum().backward()
    assert half.grad is not None and half.grad.dtype == torch.bfloat16


def test_no_rows():
    log_probs, entropy = log_probs_and_entropy(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long),
                                               with_entropy=True)
    assert log_probs.shape == (0,) and entropy.shape == (0,)
    assert log_probs_and_entropy(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))[1] is None


def _sharded(rank, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        logits, tokens, keep = case(rows=4, vocab=8, seed=1)
        shard = slice(rank * 4, rank * 4 + 4)
        local = logits[:, shard].clone().requires_grad_()
        log_probs, entropy = log_probs_and_entropy(local, tokens, with_entropy=True, keep_mask=keep[:, shard],
                                                   group=dist.group.WORLD)
        (log_probs.sum() + entropy.sum()).backward()
        out[rank] = (log_probs.detach(), entropy.detach(), local.grad)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_vocabulary_sharded_over_two_ranks_gives_the_whole_vocabularys_values():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_sharded, args=(port, out), nprocs=2, join=True)
    logits, tokens, keep = case(rows=4, vocab=8, seed=1)
    full = logits.clone().requires_grad_()
    ref_lp, ref_ent = reference(full, tokens, keep)
    (ref_lp.sum() + ref_ent.sum()).backward()
    for rank in range(2):
        log_probs, entropy, grad = out[rank]
        torch.testing.assert_close(log_probs, ref_lp.detach())
        torch.testing.assert_close(entropy, ref_ent.detach())
        torch.testing.assert_close(grad, full.grad[:, rank * 4:rank * 4 + 4])
