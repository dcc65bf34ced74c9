"""The boundary between slimeflow's records and slime's plug-in contracts (slimeflow.slime_compat).

A plug-in gets what slime gives it: `args` with slime's attribute names (every train flag, plus the running
router's address and the other names slime's plug-ins read) and the rollout's own samples, which are slime's
`Sample` (one class); what it returns is checked by `returned_sample`. `args` carries slimeflow's names too
(`args.client`, `args.tokenizer`, `args.config`), so plug-ins written to slimeflow's documented contracts run the
same way.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from slimeflow.config.slime_flags import NOT_YET_SUPPORTED
from slimeflow.config.train import TrainConfig
from slimeflow.rollout.filters import FilterOutcome, GroupFilter
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.types import Sample, floats
from slimeflow.slime_compat.rollout.filter_hub.base_types import DynamicFilterOutput

SLIME_DEFAULTS: dict[str, Any] = {
    # slime flags slimeflow has no setting for, at the values slimeflow behaves as.
    "rollout_skip_special_tokens": False,
    "rollout_max_context_len": None,
    "rollout_global_dataset": True,
    "sglang_dp_size": None,
    "sglang_enable_deterministic_inference": False,
    "sglang_speculative_algorithm": None,
    "use_rollout_routing_replay": False,
    "use_distributed_post": False,
    "ci_test": False,
    "multimodal_keys": None,
    "apply_chat_template_kwargs": {},
    "rewards_normalization": True,
    "rollout_sample_hook_path": None,
    "eval_function_path": None,
}


_names_read: set[str] = set()
"""Every attribute plug-ins of this process read from their `args`: a --custom-config-path setting none of them
read is reported as unused (settings_read)."""


def settings_read() -> list[str]:
    """The `args` attributes read in this process so far (sorted)."""
    return sorted(_names_read)


class SlimeArgs(SimpleNamespace):
    """slime's `args` namespace; an attribute slimeflow does not have says why (a slime flag it refuses, or none).
    The names read are remembered (settings_read)."""

    def __getattribute__(self, name: str) -> Any:
        _names_read.add(name)
        return super().__getattribute__(name)

    def __getattr__(self, name: str) -> Any:
        flag = "--" + name.replace("_", "-")
        why = (f"slimeflow does not take slime's {flag} ({NOT_YET_SUPPORTED[flag]})" if flag in NOT_YET_SUPPORTED
               else f"slimeflow has no {flag} flag (slime's args.{name}, if slime has it, is not provided)")
        raise AttributeError(f"args.{name}: {why}")


def slime_args(config: TrainConfig, *, router_url: str | None = None, num_engines: int = 1,
               concurrency: int = 64, **native: Any) -> SlimeArgs:
    """slime's `args` for a plug-in: every leaf of `config` by its slime name (they are slime's flag names),
    `sglang_router_ip`/`sglang_router_port` of `router_url`, `sglang_server_concurrency` (per engine), the
    `SLIME_DEFAULTS`, and `native` (client, tokenizer, ... for slimeflow-style plug-ins) as attributes."""
    values: dict[str, Any] = dict(SLIME_DEFAULTS)
    for group in config.model_fields:
        node = getattr(config, group)
        if hasattr(node, "model_fields"):
            values.update({name: getattr(node, name) for name in node.model_fields})
        else:
            values[group] = node
    values.update({f"sglang_{key}": value for key, value in config.sglang.args.items()})
    # slime's --eval-prompt-data is one list: name, path, name, path, ...
    values["eval_prompt_data"] = [item for pair in config.eval.eval_prompt_data.items() for item in pair] or None
    values.pop("args", None)
    values.update(config.custom_args)  # --custom-config-path's own keys, as slime sets them on its args
    if router_url is not None:
        parts = urlsplit(router_url)
        values.update(sglang_router_ip=parts.hostname, sglang_router_port=parts.port)
    values.update(rollout_num_engines=num_engines, sglang_server_concurrency=max(1, concurrency // num_engines),
                  grpo_std_normalization=not config.algorithm.disable_grpo_std_normalization,
                  compute_advantages_and_returns=not config.algorithm.disable_compute_advantages_and_returns,
                  config=config, **native)
    return SlimeArgs(**values)


def returned_sample(value: Any, where: str, origin: Sample | None = None) -> Sample:
    """`value`, a sample a plug-in returned (for `origin`), ready for the rollout; raises TypeError naming `where`
    when it is not a Sample. Indices it left unset are origin's; its metadata is its own dict (samples a plug-in
    made from one another may share one); a tensor of teacher log-probs (slime's OPD post-process stores one)
    becomes a list; the last weight version slime's append_response_tokens recorded is metadata['weight_version'],
    which the rollout's version checks read. The reward is kept as it is: a dict reward is reduced by the scorer
    with --reward-key."""
    if not isinstance(value, Sample):
        raise TypeError(f"{where} returned {type(value).__name__}; it must return a Sample or a list of Samples")
    if origin is not None:
        value.group_index = origin.group_index if value.group_index is None else value.group_index
        value.index = origin.index if value.index is None else value.index
    value.metadata = dict(value.metadata or {})
    value.teacher_log_probs = floats(value.teacher_log_probs)
    if value.weight_versions:
        value.metadata["weight_version"] = value.weight_versions[-1]
    return value


async def call_generate(function: Callable[..., Any], args: Any, sample: Sample, params: dict[str, Any],
                        evaluation: bool = False) -> list[Sample]:
    """slime's custom generate call: `await f(args, sample, sampling_params[, evaluation=])`; the returned Sample
    or list[Sample] (the trajectory's training samples), checked."""
    if takes_keyword(function, "evaluation"):
        result = await function(args, sample, dict(params), evaluation=evaluation)
    else:
        result = await function(args, sample, dict(params))
    where = f"--custom-generate-function-path {plugin_name(function)}"
    results = result if isinstance(result, list) else [result]
    if not results:
        raise ValueError(f"{where} returned an empty list; return the sample (or its samples)")
    return [returned_sample(r, where, sample) for r in results]


def takes_keyword(function: Callable[..., Any], name: str) -> bool:
    """Whether `function` takes keyword `name` (by name or through **kwargs)."""
    params = inspect.signature(function).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def plugin_name(function: Callable[..., Any]) -> str:
    """'module:qualname' of a plug-in, for messages."""
    return f"{getattr(function, '__module__', '?')}:{getattr(function, '__qualname__', function)!s}"


def positional_arity(function: Callable[..., Any]) -> tuple[int, int | None]:
    """(required positional parameters, most positional parameters or None for *args)."""
    params = list(inspect.signature(function).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = sum(p.default is p.empty for p in positional)
    most = None if any(p.kind is p.VAR_POSITIONAL for p in params) else len(positional)
    return required, most


def accepts(function: Callable[..., Any], n: int) -> bool:
    """Whether `function` can be called with `n` positional arguments."""
    required, most = positional_arity(function)
    return required <= n and (most is None or n <= most)


def load_group_filter(path: str | None, args: Any = None) -> GroupFilter | None:
    """The filter at --dynamic-sampling-filter-path (None when unset): slime's `f(args, samples)` (given `args`,
    returning DynamicFilterOutput or a bool) or slimeflow's `f(group)`."""
    return None if path is None else group_filter(load_plugin(path, "dynamic-sampling-filter-path"), args)


def group_filter(function: Callable[..., Any], args: Any) -> Callable[[Sequence[Sample]], Any]:
    """A dynamic-sampling filter as the sampler calls it (group) -> (keep, reason, keep_when_insufficient):
    slime's `f(args, samples)` returning DynamicFilterOutput (keep may be a tensor) or a bool; slimeflow's `f(group)`."""
    slime_form = accepts(function, 2) and not accepts(function, 1)

    def run(group: Sequence[Sample]) -> FilterOutcome:
        out = function(args, list(group)) if slime_form else function(group)
        if isinstance(out, FilterOutcome):
            return out
        if isinstance(out, DynamicFilterOutput) or hasattr(out, "keep"):
            keep = bool(out.keep)
            return FilterOutcome(keep, None if keep else (out.reason or function.__name__),
                                 keep_when_insufficient=bool(getattr(out, "keep_when_insufficient", False)))
        keep = bool(out)
        return FilterOutcome(keep, None if keep else function.__name__)

    run.__name__ = getattr(function, "__name__", "filter")
    return run


def buffer_filter(function: Callable[..., Any], args: Any) -> Callable[[list[list[Sample]], int], list[list[Sample]]]:
    """A buffer filter as the data source calls it (buffer, num_groups): slime's `f(args, rollout_id, buffer,
    num_samples)`, which removes what it takes from the buffer (as slime's pop_first), or slimeflow's `f(buffer, n)`."""
    if not accepts(function, 4) or accepts(function, 2):
        return function

    def run(buffer: list[list[Sample]], num_groups: int) -> list[list[Sample]]:
        where = f"--buffer-filter-path {plugin_name(function)}"
        taken = function(args, None, buffer, num_groups)
        return [[returned_sample(s, where) for s in group] for group in taken]

    return run


_CALLS: dict[str, tuple[tuple[int, ...], str]] = {
    # flag: (positional arguments it may be called with, the contracts as the user reads them)
    "custom-generate-function-path": ((3,), "async def generate(args, sample, sampling_params, evaluation=False)"),
    "rollout-function-path": ((3,), "generate_rollout(args, rollout_id, data_source, evaluation=False)"),
    "eval-function-path": ((3,), "eval_generate_rollout(args, rollout_id, data_source, evaluation=True)"),
    "dynamic-sampling-filter-path": ((2, 1), "filter(args, samples, **kwargs) -> DynamicFilterOutput (slime's), or "
                                             "filter(group) -> FilterOutcome | bool"),
    "buffer-filter-path": ((4, 2), "buffer_filter(args, rollout_id, buffer, num_samples) (slime's pop_first), or "
                                   "take(buffer, num_groups)"),
    "custom-rm-path": ((2,), "async def reward(args, sample, **kwargs) (with --group-rm: reward(args, samples))"),
    "custom-loss-function-path": ((3,), "loss(config, inputs, reduce) -> (loss, metrics) (docs/rl-api.md)"),
    "custom-advantage-function-path": ((2,), "advantage(config, inputs) -> list[Tensor] (docs/rl-api.md)"),
    "rollout-sample-hook-path": ((2,), "hook(args, sample, *, rollout_id=None, evaluation=False) -> Sample | None"),
    "rollout-sample-filter-path": ((2,), "filter(args, groups) -> None, setting sample.remove_sample"),
    "custom-reward-post-process-path": ((2,), "post_process(args, samples) -> (raw_rewards, rewards)"),
    "rollout-all-samples-process-path": ((3,), "process(args, all_samples, data_source)"),
    "custom-eval-rollout-log-function-path": ((4,), "log(rollout_id, args, data, extra_metrics) -> bool"),
    "custom-convert-samples-to-train-data-path": ((2,), "convert(args, samples) -> dict"),
    "custom-pg-loss-reducer-function-path": ((4,), "get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, "
                                                   "calculate_per_token_loss) -> reduce(pg_loss)"),
    "data-source-path": ((1,), "a class DataSource(args) with get_samples, add_samples, save, load and __len__"),
    "custom-rollout-log-function-path": ((5,), "log(rollout_id, args, samples, rollout_extra_metrics, "
                                               "rollout_time) -> bool"),
    "custom-megatron-init-path": ((1,), "custom_init(args)"),
    "custom-model-provider-path": ((0,), "provider(pre_process=, post_process=[, vp_stage=][, args=]) -> GPTModel"),
    "custom-megatron-before-log-prob-hook-path": ((3,), "hook(args, model, store_prefix)"),
    "custom-megatron-before-train-step-hook-path": ((6,), "hook(args, rollout_id, step_id, model, optimizer, "
                                                          "opt_param_scheduler)"),
    "rollout-data-postprocess-path": ((3,), "postprocess(args, rollout_id, rollout_data)"),
    "custom-update-weight-post-write-path": ((3,), "hook(args, version_dir, rollout_engines)"),
}


def call_problem(flag: str, function: Callable[..., Any], *, group_rm: bool = False) -> str | None:
    """Why `function` cannot be called the way the run calls the hook of --`flag` (None when it can)."""
    if flag not in _CALLS:
        return None
    counts, contract = _CALLS[flag]
    try:
        inspect.signature(function)
    except (TypeError, ValueError):
        return None  # a builtin or C function without a signature: its call will tell
    if flag == "custom-loss-function-path" and accepts(function, 4) and not accepts(function, 3):
        return ("this is slime's Megatron loss form loss(args, batch, logits, sum_of_sample_mean), which reads "
                "Megatron's packed logits; slimeflow's custom loss is loss(config, inputs, reduce) -> (loss, "
                "metrics) over per-sample log-probs (docs/rl-api.md): port the loss to it")
    if flag == "data-source-path":
        return data_source_problem(function)
    names = list(inspect.signature(function).parameters)
    if flag == "custom-model-provider-path":  # called by keyword, as slime calls it
        missing = [k for k in ("pre_process", "post_process") if not takes_keyword(function, k)]
        return (f"{plugin_name(function)} takes no {' or '.join(missing)} keyword; it is called as {contract}"
                if missing else None)
    if flag == "custom-advantage-function-path" and names[1:2] == ["rollout_data"]:
        return ("this looks like slime's Megatron form advantage(args, rollout_data) that fills "
                "rollout_data['advantages'] and ['returns']; slimeflow's is advantage(config, inputs) -> "
                "list[Tensor] (docs/rl-api.md): port it (slime's form is not supported yet)")
    if not any(accepts(function, n) for n in counts):
        required, most = positional_arity(function)
        takes = f"{required}" if most == required else f"{required} to {'any' if most is None else most}"
        return (f"{plugin_name(function)} takes {takes} positional arguments, but it is called as {contract}; "
                "fix its signature")
    if flag in ("rollout-function-path", "eval-function-path") and not takes_keyword(function, "evaluation"):
        return f"{plugin_name(function)} takes no evaluation= keyword; it is called as {contract}"
    if flag == "custom-generate-function-path" and not inspect.iscoroutinefunction(function):
        return f"{plugin_name(function)} is not an async function; it is awaited as {contract}"
    return None


DATA_SOURCE_METHODS = ("get_samples", "add_samples", "save", "load", "__len__")
"""slime's DataSource API (slime.rollout.data_source.DataSource)."""


def data_source_problem(cls: Any) -> str | None:
    """Why `cls` is not a data source class as slime instantiates one (`cls(args)`, then its DataSource methods)."""
    if not isinstance(cls, type):
        return f"{plugin_name(cls)} is not a class; slime instantiates the data source as cls(args)"
    missing = [name for name in DATA_SOURCE_METHODS if not callable(getattr(cls, name, None))]
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing or abstract:
        return (f"{plugin_name(cls)} lacks {', '.join(missing or abstract)}"
                f"{' (abstract)' if abstract and not missing else ''}; a data source defines get_samples(num_samples), "
                "add_samples(samples), save(rollout_id), load(rollout_id=None) and __len__()")
    if not accepts(cls, 1):
        return f"{plugin_name(cls)}.__init__ must take (self, args): slime instantiates the data source as cls(args)"
    return None
