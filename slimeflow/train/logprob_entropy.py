"""Per-token log-probs and entropies from logits in one pass, optionally over a vocabulary sharded across ranks.

`log_probs_and_entropy(logits, tokens)` is what the trainer scores responses with (algorithms.compute_log_probs and
compute_entropy_from_logits are views of it). One softmax serves both outputs, and the backward is written out
(d log p_t / dz = onehot_t - p; dH / dz = p * (E_p[z] - z)) so no [tokens, vocab] intermediate of autograd's is kept.

Vocabulary parallelism (`group`): each rank holds logits [T, V / world] for the vocabulary slice
[rank * V/world, (rank + 1) * V/world); the max, the sum of exponentials, the target logit and E_p[z] are
all-reduced over `group`, so every rank gets the full log-probs and entropies and the gradient of its own slice.

`keep_mask` ([T, V] or the local slice, bool): the tokens the sampler could have drawn (an engine's top-p/top-k
set); the log-probs are renormalised over those, the sampled token always counted (it was drawn, so it is kept even
if the mask says otherwise), while the entropy stays that of the full distribution.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)


def _shard_start(vocab_shard: int, group: Any) -> int:
    return 0 if group is None else dist.get_rank(group=group) * vocab_shard


def _softmax(logits: torch.Tensor, group: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max [T,1], sum of exp(z - max) [T,1], softmax [T,V]) over the (possibly sharded) vocabulary."""
    top = logits.max(dim=-1, keepdim=True).values
    _all_reduce(top, dist.ReduceOp.MAX, group)
    exp = (logits - top).exp()
    total = exp.sum(dim=-1, keepdim=True)
    _all_reduce(total, dist.ReduceOp.SUM, group)
    return top, total, exp / total


class _LogProbEntropy(torch.autograd.Function):
    """Forward: (log_probs [T], entropy [T] or empty). Backward: the gradient of the local logits slice."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, keep_mask: torch.Tensor | None, group: Any,
                with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.arange(logits.size(0), device=logits.device)
        if group is None and keep_mask is None:
            return _whole_vocabulary(ctx, logits, tokens, rows, with_entropy, entropy_grad)
        local = tokens - _shard_start(logits.size(-1), group)
        here = (local >= 0) & (local < logits.size(-1))  # the target lies in this rank's slice
        local = torch.where(here, local, torch.zeros_like(local))
        entropy = logits.new_zeros((0,))
        entropy_softmax = expected_logit = None
        # The full distribution's softmax: the entropy's, and the log-probs' too when no mask renormalises them.
        full = _softmax(logits, group) if with_entropy or keep_mask is None else None
        if with_entropy:
            assert full is not None
            top, total, entropy_softmax = full
            expected_logit = (entropy_softmax * logits).sum(dim=-1, keepdim=True)
            _all_reduce(expected_logit, dist.ReduceOp.SUM, group)
            entropy = (top + total.log() - expected_logit).squeeze(-1)
        scored = logits
        if keep_mask is not None:
            scored = logits.masked_fill(~keep_mask, float("-inf"))
            scored[rows[here], local[here]] = logits[rows[here], local[here]]
            top, total, softmax = _softmax(scored, group)
        else:
            assert full is not None
            top, total, softmax = full
        target = (scored - top)[rows, local].masked_fill(~here, 0.0)
        _all_reduce(target, dist.ReduceOp.SUM, group)
        log_probs = target - total.squeeze(-1).log()
        _keep_for_backward(ctx, entropy, with_entropy and entropy_grad, softmax, here, local, entropy_softmax,
                           expected_logit, logits)
        return log_probs, entropy

    @staticmethod
    def backward(ctx: Any, grad_log_probs: torch.Tensor | None,
                 grad_entropy: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None, None, None]:
        """None for an output the loss does not use (set_materialize_grads(False)): its term is skipped."""
        softmax, here, local, entropy_softmax, expected_logit, logits = ctx.saved_tensors
        grad = None
        if grad_log_probs is not None:  # (onehot - p) * g in one pass over [T, V]: -p * g, then g at the targets
            grad = softmax * grad_log_probs.neg().reshape(-1, 1)
            grad[torch.arange(grad.size(0), device=grad.device), local] += grad_log_probs * here.to(grad.dtype)
        if ctx.keep_entropy_grad and grad_entropy is not None and grad_entropy.numel():
            entropy_term = entropy_softmax * (expected_logit - logits) * grad_entropy.reshape(-1, 1)
            grad = entropy_term if grad is None else grad + entropy_term
        return grad, None, None, None, None, None


def _whole_vocabulary(ctx: Any, logits: torch.Tensor, tokens: torch.Tensor, rows: torch.Tensor, with_entropy: bool,
                      entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward on one rank's whole vocabulary with no mask: torch's fused softmax and logsumexp, each one pass
    over [T, V], where the sharded path's max, shift, exp, sum and divide make five (a GRPO step of the real demo:
    ~0.1 s less per call, both backends)."""
    softmax = torch.softmax(logits, dim=-1)
    log_total = torch.logsumexp(logits, dim=-1)
    log_probs = logits[rows, tokens] - log_total
    entropy = logits.new_zeros((0,))
    expected_logit = None
    if with_entropy:  # H = log Z - E_p[z]; the row-wise dot product makes no [T, V] temporary
        expected_logit = torch.einsum("tv,tv->t", softmax, logits).unsqueeze(-1)
        entropy = log_total - expected_logit.squeeze(-1)
    _keep_for_backward(ctx, entropy, with_entropy and entropy_grad, softmax, torch.ones_like(tokens, dtype=torch.bool),
                       tokens, softmax, expected_logit, logits)
    return log_probs, entropy


def _keep_for_backward(ctx: Any, entropy: torch.Tensor, keep_entropy_grad: bool, softmax: torch.Tensor,
                       here: torch.Tensor, local: torch.Tensor, entropy_softmax: torch.Tensor | None,
                       expected_logit: torch.Tensor | None, logits: torch.Tensor) -> None:
    """What backward reads: the log-probs' softmax and targets, and the entropy's terms only when its gradient is
    wanted (otherwise the entropy is a metric, out of the graph)."""
    if not keep_entropy_grad:
        ctx.mark_non_differentiable(entropy)
        entropy_softmax = expected_logit = None
    ctx.keep_entropy_grad = keep_entropy_grad
    ctx.set_materialize_grads(False)  # an output the loss does not use (the entropy as a metric) costs nothing
    ctx.save_for_backward(softmax, here, local, entropy_softmax, expected_logit,
                          logits if keep_entropy_grad else None)


def log_probs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor, *, with_entropy: bool = False,
                          keep_mask: torch.Tensor | None = None, group: Any = None, chunk_size: int = -1,
                          entropy_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(tokens[t]) under logits[t] and (with_entropy) each row's entropy: ([T], [T] or None), at least fp32.

    logits [T, V] (or [T, V / world] with `group`, a process group sharding the vocabulary); tokens [T] (global
    ids). chunk_size > 0 processes that many rows at a time (bounds the [rows, V] temporaries); entropy_grad=False
    returns the entropy as a metric only (no gradient through it).
    """
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    if logits.size(0) == 0:
        return logits.new_zeros((0,)), logits.new_zeros((0,)) if with_entropy else None
    logits = logits.contiguous()
    pieces = 1 if chunk_size <= 0 else -(-logits.size(0) // chunk_size)
    masks = keep_mask.chunk(pieces) if keep_mask is not None else [None] * pieces
    outputs = [_LogProbEntropy.apply(part, part_tokens, part_mask, group, with_entropy, entropy_grad)
               for part, part_tokens, part_mask in zip(logits.chunk(pieces), tokens.chunk(pieces), masks,
                                                       strict=True)]
    log_probs = torch.cat([lp for lp, _ in outputs])
    return log_probs, torch.cat([ent for _, ent in outputs]) if with_entropy else None
