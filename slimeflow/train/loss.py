"""The training loss of one micro-batch: policy loss (PPO clip, GSPO, CISPO, TIS), KL and entropy terms, SFT, custom.

The normaliser is the global batch's (its sample count, or its loss-masked token count with
--calculate-per-token-loss), passed in, so the losses and metrics of micro-batches add up to exactly the values
of one pass over the whole batch, however the samples were packed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from slimeflow.config.train import AlgorithmConfig
from slimeflow.rollout.plugins import load_plugin
from slimeflow.train import algorithms as alg
from slimeflow.train.advantages import CustomAdvantage, load_custom_advantage

Reduce = Callable[[Sequence[torch.Tensor]], torch.Tensor]
"""Per-sample token values -> this micro-batch's share of the global-batch aggregate."""


@dataclass
class LossInputs:
    """One micro-batch, a list entry per sample over its response tokens.

    log_probs carry the gradient (current policy); old_log_probs are the trainer's under the policy that generated
    the batch; rollout_log_probs the rollout engine's (TIS, mismatch metrics, and the old policy's with
    --use-rollout-logprobs); entropy per token (for entropy_coef and the metric); total_lengths (prompt + response)
    per sample, for a TIS function that slices by them as slime's may.
    """

    log_probs: list[torch.Tensor]
    old_log_probs: list[torch.Tensor]
    advantages: list[torch.Tensor]
    loss_masks: list[torch.Tensor]
    ref_log_probs: list[torch.Tensor] | None = None
    rollout_log_probs: list[torch.Tensor] | None = None
    entropy: list[torch.Tensor] | None = None
    total_lengths: list[int] | None = None


@dataclass(frozen=True)
class LossNormalizer:
    """The global batch's sample count and loss-masked token count (summed over micro-batches and DP ranks)."""

    num_samples: int
    num_tokens: float

    @classmethod
    def for_batch(cls, loss_masks: Sequence[torch.Tensor]) -> LossNormalizer:
        """The normaliser of a global batch given all its loss masks."""
        num_tokens = float(torch.cat(list(loss_masks)).double().sum()) if loss_masks else 0.0
        return cls(num_samples=len(loss_masks), num_tokens=num_tokens)

    def reducer(self, loss_masks: Sequence[torch.Tensor], per_token: bool) -> TokenWeights:
        """Aggregation of one micro-batch's token values with these masks.

        Per sample (default): sum over its samples of (masked mean of the sample) / global sample count; a
        zero-length or fully masked sample contributes 0 but still counts as a sample (as in slime).
        Per token: sum of its masked token values / global masked token count; raises when the whole global batch
        has no loss-masked token (the mean would be 0/0).
        """
        if self.num_samples == 0:
            raise ValueError("the global batch is empty: no sample to compute a loss over")
        if per_token and self.num_tokens == 0:
            raise ValueError("--calculate-per-token-loss: no token of the global batch is loss-masked in, "
                             "so the per-token mean is undefined; check the loss masks of the rollout")
        if not loss_masks:
            return TokenWeights(torch.zeros(0))
        mask = torch.cat(list(loss_masks))
        mask = mask if mask.is_floating_point() else mask.float()
        if per_token:
            return TokenWeights(mask / self.num_tokens)
        index = alg.sample_index([m.numel() for m in loss_masks], mask.device)
        return TokenWeights(alg.sample_mean_weights(mask, index, len(loss_masks)) / self.num_samples)


@dataclass(frozen=True)
class TokenWeights:
    """A `Reduce` as one weight per token of the micro-batch (its samples' tokens concatenated): the aggregate of
    token values is their dot product with the weights, one op however many samples (see LossNormalizer.reducer).
    Call it with per-sample tensors (the `Reduce` contract) or `flat` with the concatenated tokens."""

    weights: torch.Tensor

    def __call__(self, values: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.flat(torch.cat(list(values)) if len(values) else self.weights[:0])

    def flat(self, values: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(values.dtype, self.weights.dtype)
        return torch.dot(values.to(dtype), self.weights.to(dtype))


@dataclass
class LossOutput:
    """The micro-batch's loss (backward on it) and its metrics (detached; summing over micro-batches gives the batch's)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


TisFunction = Callable[..., tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]]
"""slime's TIS contract: fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
response_lengths) -> (pg_loss reweighted, loss masks (possibly with tokens rejected), metrics). pg_loss and the
metrics are flat over the micro-batch's tokens; the log-probs and masks are lists, one tensor per sample."""


def vanilla_tis(args: AlgorithmConfig, *, pg_loss: torch.Tensor, train_log_probs: Sequence[torch.Tensor],
                rollout_log_probs: Sequence[torch.Tensor], loss_masks: list[torch.Tensor],
                **_: object) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """slime's vanilla TIS: pg_loss x clamp(pi_train_old / pi_rollout, tis_clip_low, tis_clip) per token.

    Metrics per token: tis (the unclipped ratio), tis_clipfrac (1 where the clamp changed it, either side) and
    tis_abs (|ratio - 1|, the mismatch). The masks come back unchanged (no token is rejected)."""
    ratio = torch.exp(torch.cat(list(train_log_probs)).detach() - torch.cat(list(rollout_log_probs)).detach())
    weights = ratio.clamp(min=args.tis_clip_low, max=args.tis_clip)
    metrics = {"tis": ratio, "tis_clipfrac": (weights != ratio).float(), "tis_abs": (ratio - 1).abs()}
    return pg_loss * weights, loss_masks, metrics


def load_custom_tis(config: AlgorithmConfig, args: object = None) -> TisFunction | None:
    """The function at --custom-tis-function-path, or None (vanilla_tis). Given `args` (slime's args of the run, with
    --custom-config-path's keys, as slime passes its own), the function gets them in place of the algorithm config."""
    path = config.custom_tis_function_path
    if path is None:
        return None
    function = load_plugin(path, "custom-tis-function-path")
    if args is None:
        return function

    def with_args(_config: AlgorithmConfig, **kwargs: object) -> tuple[torch.Tensor, list[torch.Tensor], dict]:
        return function(args, **kwargs)

    return with_args


PgLossReducer = Callable[[list[int], list[int], list[torch.Tensor], bool], Callable[[torch.Tensor], torch.Tensor]]
"""slime's --custom-pg-loss-reducer-function-path: f(total_lengths, response_lengths, loss_masks,
calculate_per_token_loss) -> reduce, where reduce(pg_loss) takes the micro-batch's per-token policy losses (flat,
its samples' responses concatenated) and returns their SUM over the micro-batch, as slime's default
sum_of_sample_mean does (each sample's masked mean, summed; per token: the masked values summed). slime then divides
by the global batch's sample count (per token: its loss-masked token count); so does compute_loss. It replaces the
reduction of pg_loss only: the other metrics keep the default (as slime)."""


def load_custom_pg_loss_reducer(config: AlgorithmConfig) -> PgLossReducer | None:
    """The function at --custom-pg-loss-reducer-function-path, or None (the default aggregation)."""
    path = config.custom_pg_loss_reducer_function_path
    return None if path is None else load_plugin(path, "custom-pg-loss-reducer-function-path")


CustomLoss = Callable[[AlgorithmConfig, LossInputs, Reduce], tuple[torch.Tensor, dict[str, torch.Tensor]]]
"""(config, inputs, reduce) -> (loss, metrics); use `reduce` for every aggregate so packing does not change it."""


def load_custom_loss(config: AlgorithmConfig) -> CustomLoss | None:
    """The function at --custom-loss-function-path when --loss-type custom_loss, else None."""
    if config.loss_type != "custom_loss":
        return None
    if config.custom_loss_function_path is None:
        raise ValueError("--loss-type custom_loss needs --custom-loss-function-path")
    return load_plugin(config.custom_loss_function_path, "custom-loss-function-path")


@dataclass(frozen=True)
class LossPlugins:
    """The user's functions a training step calls, loaded once per trainer rank from their *-path flags (each None
    when its flag is unset): both training backends hold one."""

    loss: CustomLoss | None = None
    advantage: CustomAdvantage | None = None
    tis: TisFunction | None = None
    pg_loss_reducer: PgLossReducer | None = None

    @classmethod
    def load(cls, config: AlgorithmConfig, plugin_args: object = None) -> LossPlugins:
        """`plugin_args`: slime's args of the run, which a custom TIS function gets as slime passes them."""
        return cls(loss=load_custom_loss(config), advantage=load_custom_advantage(config),
                   tis=load_custom_tis(config, plugin_args), pg_loss_reducer=load_custom_pg_loss_reducer(config))


def compute_loss(config: AlgorithmConfig, inputs: LossInputs, normalizer: LossNormalizer,
                 custom: CustomLoss | None = None, tis_function: TisFunction | None = None,
                 pg_loss_reducer: PgLossReducer | None = None) -> LossOutput:
    """The loss of --loss-type for one micro-batch (`tis_function`: a custom TIS function, else vanilla_tis;
    `pg_loss_reducer`: slime's custom pg-loss reducer, else the default aggregation)."""
    reduce = normalizer.reducer(inputs.loss_masks, config.calculate_per_token_loss)
    if config.loss_type == "policy_loss":
        pg_reduce = None if pg_loss_reducer is None else _pg_reduce(pg_loss_reducer, config, inputs, normalizer)
        return policy_loss(config, inputs, reduce, tis_function, pg_reduce)
    if config.loss_type == "sft_loss":
        return sft_loss(inputs, reduce)
    if custom is None:
        raise ValueError("--loss-type custom_loss: pass the function loaded from --custom-loss-function-path")
    loss, metrics = custom(config, inputs, reduce)
    return LossOutput(loss=loss, metrics={k: torch.as_tensor(v).detach() for k, v in metrics.items()})


def policy_loss(config: AlgorithmConfig, inputs: LossInputs, reduce: Reduce,
                tis_function: TisFunction | None = None,
                pg_reduce: Callable[[list[torch.Tensor]], Callable[[torch.Tensor], torch.Tensor]] | None = None
                ) -> LossOutput:
    """pg_loss - entropy_coef * entropy + kl_loss_coef * kl_loss (slime's policy_loss_function).

    The old policy's log-probs are the trainer's, or the engine's with --use-rollout-logprobs. With --use-tis, or
    --get-mismatch-metrics and a custom TIS function (slime's only way to that flag), the per-token policy loss is
    reweighted by the TIS function and summed with the masks it returns over the original normaliser.
    Metrics: pg_loss, pg_clipfrac, ppo_kl, entropy (when given), kl_loss (with use_kl_loss); with --use-tis or
    --get-mismatch-metrics the TIS function's (tis, tis_clipfrac, tis_abs) and ois (pi / pi_old); and, when the
    rollout engine's log-probs are given, train_rollout_logprob_abs_diff (|trainer's log-prob - engine's| per token:
    the old policy's, or the current one's with --use-rollout-logprobs, as slime logs it: near 0 when the engines
    serve the trainer's weights, so a weight-sync or numerics problem shows here); each aggregated like the loss
    over the original masks. `pg_reduce(masks)`, when given, aggregates pg_loss instead (a custom pg-loss reducer,
    given the TIS function's masks when TIS ran, as slime).
    """
    lengths = [lp.numel() for lp in inputs.log_probs]
    agg = _flat_reduce(reduce, lengths)
    log_probs = torch.cat(inputs.log_probs)
    rollout = None if inputs.rollout_log_probs is None else torch.cat(inputs.rollout_log_probs)
    if not config.use_rollout_logprobs:
        old_log_probs = torch.cat(inputs.old_log_probs)
    elif rollout is None:
        raise ValueError("--use-rollout-logprobs needs the rollout engine's log-probs of every sample")
    else:
        old_log_probs = rollout
    if config.advantage_estimator == "gspo":
        index = alg.sample_index(lengths, log_probs.device)
        ppo_kl = alg.gspo_kl_flat(log_probs, old_log_probs, torch.cat(inputs.loss_masks), index, len(lengths))
    else:
        ppo_kl = old_log_probs - log_probs
    advantages = torch.cat(inputs.advantages)
    eps_clip_high = config.eps_clip if config.eps_clip_high is None else config.eps_clip_high
    if config.advantage_estimator == "cispo":
        losses, clipfrac = alg.compute_cispo_loss(ppo_kl, log_probs, advantages, config.eps_clip, eps_clip_high)
    else:
        losses, clipfrac = alg.compute_policy_loss(ppo_kl, advantages, config.eps_clip, eps_clip_high,
                                                   config.eps_clip_c)

    metrics: dict[str, torch.Tensor] = {}
    pg_agg, pg_masks = agg, inputs.loss_masks
    if config.use_tis or config.get_mismatch_metrics:
        if inputs.rollout_log_probs is None:
            raise ValueError("--use-tis / --get-mismatch-metrics need the rollout engine's log-probs of every sample")
        weighted, masks, tis_metrics = (tis_function or vanilla_tis)(
            config, pg_loss=losses, train_log_probs=inputs.old_log_probs, rollout_log_probs=inputs.rollout_log_probs,
            loss_masks=inputs.loss_masks, total_lengths=inputs.total_lengths, response_lengths=lengths)
        pg_masks = masks
        if config.use_tis or tis_function is not None:
            losses = weighted
            if masks is not inputs.loss_masks:
                pg_agg = _remasked(reduce, inputs.loss_masks, masks)
        metrics["ois"] = agg(torch.exp(-ppo_kl).detach())
        metrics.update({key: agg(torch.as_tensor(value).detach()) for key, value in tis_metrics.items()})
    if rollout is not None:
        compared = log_probs if config.use_rollout_logprobs else old_log_probs
        metrics["train_rollout_logprob_abs_diff"] = agg((compared.detach() - rollout).abs())
    pg_loss = pg_agg(losses) if pg_reduce is None else pg_reduce(pg_masks)(losses)
    loss = pg_loss
    metrics.update(pg_loss=pg_loss, pg_clipfrac=agg(clipfrac), ppo_kl=agg(ppo_kl.detach()))
    if inputs.entropy is not None:
        entropy = agg(torch.cat(inputs.entropy))
        if config.entropy_coef:  # at 0 the term adds nothing, and its backward over [tokens, vocab] is skipped
            loss = loss - config.entropy_coef * entropy
        metrics["entropy"] = entropy
    elif config.entropy_coef:
        raise ValueError(f"--entropy-coef {config.entropy_coef} needs the per-token entropy of every sample")
    if config.use_kl_loss:
        if inputs.ref_log_probs is None:
            raise ValueError("--use-kl-loss needs the reference model's log-probs (ref_log_probs)")
        kl_loss = agg(alg.compute_approx_kl(log_probs, torch.cat(inputs.ref_log_probs), config.kl_loss_type))
        loss = loss + config.kl_loss_coef * kl_loss
        metrics["kl_loss"] = kl_loss
    return LossOutput(loss=loss, metrics={k: v.detach() for k, v in metrics.items()})


def _pg_reduce(reducer: PgLossReducer, config: AlgorithmConfig, inputs: LossInputs,
               normalizer: LossNormalizer) -> Callable[[list[torch.Tensor]], Callable[[torch.Tensor], torch.Tensor]]:
    """masks -> the custom reducer's sum over the micro-batch divided by the global batch's normaliser (its sample
    count, or its token count per token), as slime scales the loss after the reducer."""
    total_lengths = inputs.total_lengths
    if total_lengths is None:
        raise ValueError("--custom-pg-loss-reducer-function-path needs each sample's total length (prompt + response)")
    per_token = config.calculate_per_token_loss
    scale = normalizer.num_tokens if per_token else normalizer.num_samples
    lengths = [lp.numel() for lp in inputs.log_probs]

    def with_masks(masks: list[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        reduce = reducer(list(total_lengths), lengths, list(masks), per_token)
        return lambda flat: torch.as_tensor(reduce(flat)) / scale

    return with_masks


def _flat_reduce(reduce: Reduce, lengths: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """`reduce` over the micro-batch's tokens concatenated."""
    return reduce.flat if isinstance(reduce, TokenWeights) else lambda flat: reduce(torch.split(flat, lengths))


def _remasked(reduce: Reduce, original: Sequence[torch.Tensor],
              modified: Sequence[torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The aggregate with a TIS function's masks in the numerator and the original masks' normaliser (slime: rejected
    tokens are zeroed; each sample's or the batch's token count stays the original's)."""
    if not isinstance(reduce, TokenWeights):
        raise TypeError("a TIS function that changes the loss masks needs the token-weight reducer of compute_loss")
    before, after = torch.cat(list(original)).float(), torch.cat(list(modified)).float().to(reduce.weights.device)
    scale = torch.where(before != 0, after / before.where(before != 0, torch.ones_like(before)), 0.0)
    return TokenWeights(reduce.weights * scale).flat


def sft_loss(inputs: LossInputs, reduce: Reduce) -> LossOutput:
    """Supervised loss: the aggregated negative log-likelihood of the loss-masked response tokens."""
    loss = reduce([-lp for lp in inputs.log_probs])
    return LossOutput(loss=loss, metrics={"loss": loss.detach()})
