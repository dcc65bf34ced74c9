"""The work of the RolloutManager Ray actor (rollout_manager.py): the buffered data source, the rollout engines and
the rollout function.

It owns the engines (embedded engines started here, with the real sglang-router in front of two or more, or external
SGLang servers named by --sglang-worker-urls / --sglang-router-ip/port) and returns the train batch as a Ray object
that the TrainActors read directly. Weights go from trainer rank 0 straight to every engine (the RolloutManager only
says where they are), versioned: version `k` is the policy that generates rollout `k`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import psutil
import ray
from transformers import AutoTokenizer

from slimeflow.config.train import TrainConfig, staleness_bound
from slimeflow.io.prompts import PromptDataset
from slimeflow.rollout.data_source import BufferedDataSource, DataSource, pop_first
from slimeflow.rollout.evaluation import EvalSettings, evaluate_sets
from slimeflow.rollout.plugins import load_plugin
from slimeflow.rollout.rewards import RewardScorer
from slimeflow.rollout.rollout import OLDEST_WEIGHT_VERSION, RolloutContext, generate_rollout, sampling_params
from slimeflow.rollout.slime_data_source import PluginDataSource
from slimeflow.rollout.slime_plugins import buffer_filter as slime_buffer_filter
from slimeflow.rollout.slime_plugins import settings_read, slime_args
from slimeflow.rollout.slime_rollout_functions import (
    EngineFreeContext,
    run_eval_function,
    run_rollout_function,
)
from slimeflow.rollout.slime_rollout_hooks import train_batch
from slimeflow.rollout.types import PackedBatch, Sample
from slimeflow.stages.train.debug_data import load_rollout, row_ids, save_rollout
from slimeflow.stages.train.engines import EngineDiedError, EngineLaunch, EngineSet, WeightTargets
from slimeflow.stages.train.fault_tolerance import HealthMonitor
from slimeflow.stages.train.heap import freeze_startup_heap
from slimeflow.stages.train.loop import served_version

if TYPE_CHECKING:  # rollout_manager.py imports this module inside its actors
    from slimeflow.stages.train.rollout_manager import RolloutSetup

T = TypeVar("T")

ENGINE_WEIGHTS_TIMEOUT_S = 1800.0
"""How long a restarted engine may wait for the trainer's weights: with --async the trainer first ends the training
step it is in."""


class Rollouts:
    """Data source + buffer, engines (and router), rewards and the rollout function: the work of the RolloutManager
    actor (rollout_manager.py)."""

    def __init__(self, config: TrainConfig, setup: RolloutSetup, launching: EngineLaunch | None = None):
        """`launching`: the engines, already started (RolloutManager starts them before it imports this module, so
        they load meanwhile); None: started here."""
        self.config = config
        self.setup = setup
        self.first_rollout_id: int | None = None
        if launching is None:
            launching = setup.launch_engines(config)
        try:
            self.loop = asyncio.new_event_loop()
            self.tokenizer = AutoTokenizer.from_pretrained(setup.hf_checkpoint)
            self.data = _data_source(config, setup)
            self.eval_sets = {name: _prompts(uri) for name, uri in setup.eval_prompt_data.items()}
            self.scorer = RewardScorer(config.reward, seed=config.data.rollout_seed, post_processed=bool(
                config.algorithm.custom_reward_post_process_path))
            self.in_flight: dict[int, InFlight] = {}
            """With --async: the rollouts generated and not yet trained (up to --async-buffer-size + 1), by id."""
        except BaseException:
            launching.cancel()
            raise
        try:
            self.engines = launching.ready()
        except BaseException:
            self.scorer.close()  # its grading worker, if it started one
            raise
        self._work: asyncio.Task | None = None
        self.monitor = HealthMonitor(self.engines, config.fault_tolerance, on_failure=self._cancel_work)
        if config.fault_tolerance.use_fault_tolerance:
            self.engines.reissue_s = self.monitor.reissue_patience_s
        freeze_startup_heap()

    def _context(self, version: str | None) -> RolloutContext:
        return RolloutContext(self.config, self.tokenizer, self.engines.client(), self.scorer,
                              concurrency=self.setup.concurrency, weight_version=version,
                              batch_groups=not self.engines.routed, router_url=self.engines.rollout_url,
                              api_key=self.engines.api_key, max_staleness=staleness_bound(self.config))

    def generate(self, rollout_id: int, weight_version: int | None = None
                 ) -> tuple[PackedBatch, dict[str, float], list[list[str]]]:
        """Rollout `rollout_id` with the weights of `weight_version` (default: those the engines serve, version
        `rollout_id` or the last pushed with --update-weights-interval): (train batch, metrics, row ids per group).
        With --async the rollout is kept while it may be in flight (generated, not yet trained: until rollout
        `rollout_id` + --async-buffer-size + 1 is asked for) and goes into `state_dict`; a rollout restored from a
        checkpoint by `load_state_dict` is handed out as it was generated, without touching the data source."""
        # The loop's first rollout follows its first push; with --debug-rollout-only no trainer pushes weights.
        if self.first_rollout_id is None:
            self.first_rollout_id = rollout_id
            if hasattr(self.data, "start"):  # a --data-source-path class: slime's load(start_rollout_id - 1)
                self.data.start(rollout_id)
        version = (served_version(rollout_id, self.first_rollout_id, self.config.weight_sync.update_weights_interval)
                   if weight_version is None else weight_version)
        ctx = self._context(None if self.config.debug.debug_rollout_only else str(version))
        self.monitor.weight_version = ctx.weight_version  # what an engine restarted meanwhile must be given
        if rollout_id in self.in_flight:
            samples, metrics = self.in_flight[rollout_id].samples, self.in_flight[rollout_id].metrics
        else:
            if self.config.rollout.rollout_function_path is None:
                result = self._run(generate_rollout(ctx, self.data, rollout_id))
            else:  # slime's contract: a synchronous function that runs its coroutines on slime's background loop
                function = load_plugin(self.config.rollout.rollout_function_path, "rollout-function-path")
                try:
                    with self.monitor.watching():
                        result = run_rollout_function(function, ctx, self.data, rollout_id)
                except Exception:
                    self._raise_engine_failure()
                    raise
                self._raise_monitor_failure()  # the router may have hidden a killed engine from the function
            samples, metrics = result.samples, {**result.metrics, **weight_versions(result.samples)}
            if self.config.debug.save_debug_rollout_data is not None:
                save_rollout(self.config.debug.save_debug_rollout_data, rollout_id, samples,
                             self.config.batch.n_samples_per_prompt)
        if self.config.placement.async_:
            # While rollout k is generated, the loop trains k - N at the earliest (N = --async-buffer-size).
            oldest = rollout_id - self.config.placement.async_buffer_size
            self.in_flight = {k: kept for k, kept in self.in_flight.items() if k >= oldest}
            self.in_flight[rollout_id] = InFlight(rollout_id, samples, metrics)
        return PackedBatch.pack(train_batch(self.config, ctx.args, samples)), metrics, row_ids(samples)

    def evaluate(self, version: str | None) -> dict[str, float]:
        """Every eval set with the eval sampling settings (eval_* flags, else the rollout's)."""
        if self.config.eval.eval_function_path is not None:
            function = load_plugin(self.config.eval.eval_function_path, "eval-function-path")
            rollout_id = int(version) if version is not None and version.isdigit() else None
            self.monitor.weight_version = version
            with self.monitor.watching():
                return run_eval_function(function, self._context(version), self.data, rollout_id)
        if not self.eval_sets:
            return {}
        ev, ro = self.config.eval, self.config.rollout
        params = sampling_params(ro, ev.eval_max_response_len, ev.eval_temperature, ev.eval_top_p, ev.eval_top_k)
        settings = EvalSettings(ev.n_samples_per_eval_prompt, params)
        ctx = self._context(version)
        self.monitor.weight_version = version
        ctx.rollout_id = int(version) if version is not None and version.isdigit() else None  # the loop's version
        return self._run(evaluate_sets(ctx, self.eval_sets, settings))

    def _run(self, work: Coroutine[Any, Any, T]) -> T:
        """Run rollout work on this actor's loop while the health monitor watches the engines; when it fails and an
        engine died or hung, say which one and why (its log tail) instead of the connection error the rollout saw."""
        self._work = self.loop.create_task(work)
        try:
            with self.monitor.watching():
                result = self.loop.run_until_complete(self._work)
        except (Exception, asyncio.CancelledError):
            self._raise_engine_failure()
            raise
        finally:
            self._work = None
        self._raise_monitor_failure()  # an engine lost that the router hid from the rollout, found by the last check
        return result

    def recover_engines(self) -> list[str]:
        """With --use-fault-tolerance, before each weight push: restart an engine lost since the last rollout. Returns
        the URLs of the engines restarted since the last push (the trainer regroups them, as slime reconnects its
        new engines before pushing)."""
        self.monitor.check_now()
        self._raise_monitor_failure()
        return self.monitor.take_restarted()

    def connect_trainer(self, trainer: Any) -> None:
        """With --use-fault-tolerance: trainer rank 0 (a TrainActor) gives a restarted engine the weights it last
        pushed (TrainActor.push_to), when no live embedded peer serves them."""
        def from_trainer(urls: list[str], version: str) -> str:
            return ray.get(trainer.push_to.remote(urls, version), timeout=ENGINE_WEIGHTS_TIMEOUT_S)

        self.monitor.from_trainer = from_trainer

    def _cancel_work(self, reason: str) -> None:
        """The health monitor's call (from its thread) when an engine failed without --use-fault-tolerance."""
        work = self._work
        if work is not None:
            self.loop.call_soon_threadsafe(work.cancel)

    def _raise_engine_failure(self) -> None:
        """After rollout work failed: the engine the health monitor gave up on, or else any engine process gone."""
        self._raise_monitor_failure()
        self.engines.check_alive()

    def _raise_monitor_failure(self) -> None:
        if self.monitor.failure is not None:
            raise EngineDiedError(self.monitor.failure)

    def release_memory(self, tags: list[str] | None = None) -> dict[str, float]:
        """--offload-rollout, while the trainer trains: every engine releases the memory of `tags` ("weights",
        "kv_cache"; None: both) through SGLang's /release_memory_occupation. Returns the resident memory that the
        engines run here gave back (none for engines on other nodes), as a metric."""
        pids = self._engine_pids()
        before = _resident(pids)
        self._control_engines("/release_memory_occupation", {"tags": tags})
        return {"offload/rollout_rss_drop_bytes": float(before - _resident(pids))} if pids else {}

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """The engines take back the memory of `tags` (None: all) through /resume_memory_occupation; a no-op for what
        is not released. Resumed weights are those the engine last loaded from disk: the trainer pushes its own
        next."""
        self._control_engines("/resume_memory_occupation", {"tags": tags})

    def _control_engines(self, path: str, body: dict[str, Any]) -> None:
        """Not watched by the health monitor (as `_run` is): an engine that released its memory answers
        /health_generate 503 until it resumes, which the monitor's closing check would take for a failure and kill."""
        async def every_engine() -> None:
            await asyncio.gather(*(worker.control(path, body) for worker in self.engines.client().workers))

        try:
            self.loop.run_until_complete(every_engine())
        except Exception:
            self._raise_engine_failure()
            raise

    def _engine_pids(self) -> list[int]:
        """The processes of the engines this actor runs: its own for an in-process engine, each engine process's."""
        engines = [p for p in self.engines.processes if getattr(p, "kind", "") != "router"]
        return sorted({p.process.pid if hasattr(p, "process") else os.getpid() for p in engines
                       if hasattr(p, "process") or hasattr(p, "state")})

    def weight_targets(self) -> WeightTargets:
        """Where the trainer pushes its weights (every engine, and the Ray node each runs on; see
        TrainActor.connect_engines)."""
        return dataclasses.replace(self.engines.weight_targets(), node_ids=engine_node_ids(self.engines))

    def engine_locations(self) -> dict[str, Any]:
        """Where the engines started as Ray actors run ("engines": EngineActor.where each: node, GPU ids, command;
        none when they were started in this process or elsewhere) and the command of the router started here."""
        actors = [p.actor for p in self.engines.processes if hasattr(p, "actor")]
        routers = [p.command for p in self.engines.processes if getattr(p, "kind", "") == "router"]
        return {"engines": ray.get([a.where.remote() for a in actors]), "router": routers[0] if routers else None}

    def state_dict(self, trained: int | None = None) -> dict[str, Any]:
        """The data position and the buffer (partial samples included; saved with every checkpoint), and with --async
        the rollouts in flight after rollout `trained`: their prompts are past the data position, so a resume that
        lost them would skip them. A --data-source-path class saves its own state here, as after rollout `trained`
        (slime's save(rollout_id) at each checkpoint)."""
        state = data_state(self.data, trained)
        kept = [self.in_flight[k].to_dict() for k in sorted(self.in_flight) if trained is None or k > trained]
        return {**state, "in_flight": kept} if kept else state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.data.load_state_dict(state)
        saved = state.get("in_flight") or []
        saved = [saved] if isinstance(saved, Mapping) else saved  # one rollout: before --async-buffer-size
        self.in_flight = {int(data["rollout_id"]): InFlight.from_dict(data) for data in saved}

    def plugin_settings_read(self) -> list[str]:
        """The `args` attributes this process's plug-ins read (slime_plugins.settings_read)."""
        return settings_read()

    def shutdown(self) -> None:
        self.scorer.close()
        self.loop.run_until_complete(self.engines.aclose())
        self.engines.stop()


@dataclass
class InFlight:
    """One of the async loop's rollouts generated but not yet trained: what a checkpoint must carry besides the data
    position (which is already past its prompts)."""

    rollout_id: int
    samples: list[Sample]
    metrics: dict[str, float]

    def to_dict(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "samples": [s.to_dict() for s in self.samples],
                "metrics": self.metrics}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InFlight:
        return cls(int(data["rollout_id"]), [Sample.from_dict(s) for s in data["samples"]], dict(data["metrics"]))


def data_state(data: Any, trained: int | None) -> dict[str, Any]:
    """The data source's position and buffer, as saved with a checkpoint; a --data-source-path class saves its own,
    as after rollout `trained` (slime's save(rollout_id))."""
    if isinstance(data, PluginDataSource):
        if trained is None:
            raise ValueError("a --data-source-path class saves its state as after a rollout: pass its id")
        return data.save(trained)
    return data.state_dict()


def _data_source(config: TrainConfig, setup: RolloutSetup) -> Any:
    """The rollout's data source: the class of --data-source-path (slime's API; args as slime's plug-ins get
    them), else slimeflow's over --prompt-data with a buffer in front (--buffer-filter-path, default pop_first)."""
    if config.data.data_source_path is not None:
        cls = load_plugin(config.data.data_source_path, "data-source-path")
        return PluginDataSource(cls, slime_args(config), config.batch.n_samples_per_prompt)
    if setup.prompt_data is None:
        raise ValueError("the rollout needs --prompt-data (the prompts to generate from) or --data-source-path")
    source = DataSource.from_prompt_data(setup.prompt_data, n_samples_per_prompt=config.batch.n_samples_per_prompt,
                                         shuffle=config.data.rollout_shuffle, seed=config.data.rollout_seed)
    buffer_filter = (slime_buffer_filter(load_plugin(config.rollout.buffer_filter_path, "buffer-filter-path"),
                                         slime_args(config))
                     if config.rollout.buffer_filter_path else pop_first)
    return BufferedDataSource(source, buffer_filter)


def weight_versions(samples: list[Sample]) -> dict[str, float]:
    """The oldest and newest policy version that generated the rollout's trained tokens, as the engines reported
    them (a continued partial sample's oldest is its first part's, unless masked out of the loss); the async loop's
    staleness is the trained version minus these. None when an engine reports no version."""
    newest = [s.metadata.get("weight_version") for s in samples]
    oldest = [s.metadata.get(OLDEST_WEIGHT_VERSION, s.metadata.get("weight_version")) for s in samples]
    if not newest or any(v is None or not str(v).isdigit() for v in newest + oldest):
        return {}
    return {"rollout/weight_version_min": float(min(int(str(v)) for v in oldest)),
            "rollout/weight_version_max": float(max(int(str(v)) for v in newest))}


class ReplayRollouts:
    """--debug-train-only: the RolloutManager's interface with no engine. Each rollout's samples come from the file
    --save-debug-rollout-data wrote (--load-debug-rollout-data), else from --rollout-function-path called on the data
    source (slime's SFT scripts: sft_rollout tokenizes --prompt-data's conversations). Nothing is generated or
    scored, and evaluation is skipped (as in slime)."""

    def __init__(self, config: TrainConfig, setup: RolloutSetup):
        self.config = config
        self.template = config.debug.load_debug_rollout_data
        self.data = None if self.template is not None else _data_source(config, setup)
        """None when replaying saved files: the files are the data."""
        self.context = EngineFreeContext(config)
        self.first_rollout_id: int | None = None
        freeze_startup_heap()

    def generate(self, rollout_id: int) -> tuple[PackedBatch, dict[str, float], list[list[str]]]:
        """Rollout `rollout_id`: (train batch, the rollout function's metrics (none for a saved rollout), row ids)."""
        samples, metrics = self._samples(rollout_id)
        if self.config.debug.save_debug_rollout_data is not None:
            save_rollout(self.config.debug.save_debug_rollout_data, rollout_id, samples,
                         self.config.batch.n_samples_per_prompt)
        return PackedBatch.pack(train_batch(self.config, self.context.args, samples)), metrics, row_ids(samples)

    def _samples(self, rollout_id: int) -> tuple[list[Sample], dict[str, float]]:
        if self.data is None:
            return load_rollout(self.template, rollout_id, self.config.batch.n_samples_per_prompt), {}
        if self.first_rollout_id is None:
            self.first_rollout_id = rollout_id
            if hasattr(self.data, "start"):  # a --data-source-path class: slime's load(start_rollout_id - 1)
                self.data.start(rollout_id)
        path = self.config.rollout.rollout_function_path
        assert path is not None  # config.check_train_only: --debug-train-only without saved rollouts needs one
        result = run_rollout_function(load_plugin(path, "rollout-function-path"), self.context, self.data, rollout_id)
        return result.samples, result.metrics

    def evaluate(self, version: str | None) -> dict[str, float]:
        return {}  # no engine to evaluate with

    def weight_targets(self) -> WeightTargets | None:
        return None  # no engine: the trainer pushes its weights nowhere

    def state_dict(self, trained: int | None = None) -> dict[str, Any]:
        """The data source's state (so a resumed run continues its epoch); none when replaying files: a resumed
        replay reads rollout k from rollout k's file."""
        return {} if self.data is None else data_state(self.data, trained)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.data is not None:
            self.data.load_state_dict(state)

    def plugin_settings_read(self) -> list[str]:
        """The `args` attributes this process's plug-ins read (slime_plugins.settings_read)."""
        return settings_read()

    def shutdown(self) -> None:
        pass


def _resident(pids: list[int]) -> int:
    """The resident memory (RSS) of the processes `pids`, in bytes."""
    return sum(psutil.Process(pid).memory_info().rss for pid in pids)


def _prompts(uri: str) -> list[dict[str, Any]]:
    return list(PromptDataset(uri))


def engine_node_ids(engines: EngineSet) -> tuple[str, ...]:
    """The Ray node each engine of `engines` runs on, in worker_urls' order: an engine actor's own node (it reports
    it), else this actor's, which started the engine's process or thread; () when any is not known (external servers:
    no process here), or outside Ray."""
    workers = [p for p in engines.processes if getattr(p, "kind", "") != "router"]
    if not ray.is_initialized() or not workers:
        return ()
    here = ray.get_runtime_context().get_node_id()
    placed = [p for p in workers if hasattr(p, "actor")]
    reported = ray.get([p.actor.where.remote() for p in placed])
    nodes = {p.url: here for p in workers} | {p.url: where["node_id"] for p, where in zip(placed, reported, strict=True)}
    return tuple(nodes[url] for url in engines.worker_urls) if all(url in nodes for url in engines.worker_urls) else ()
