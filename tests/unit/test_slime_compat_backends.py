"""slime's names over slimeflow's own parts, as slime's plug-ins and tests import them with slime absent: external
SGLang servers sized from /server_info, the trainer's advantage step, slime's default rollout function and default
data source classes. slime's behaviour, our cases."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import torch
from test_rollout import CharTokenizer, ScriptedEngine, config, prompts

from slimeflow.rollout.data_source import BufferedDataSource, DataSource
from slimeflow.rollout.rewards import RewardScorer
from slimeflow.rollout.rollout import RolloutContext
from slimeflow.rollout.slime_rollout_functions import run_rollout_function
from slimeflow.slime_compat import install
from slimeflow.train import algorithms as alg

install()

from slime.backends.megatron_utils.loss import compute_advantages_and_returns  # noqa: E402
from slime.backends.sglang_utils import external  # noqa: E402
from slime.rollout.data_source import RolloutDataSource, RolloutDataSourceWithBuffer  # noqa: E402
from slime.rollout.sglang_rollout import generate_rollout  # noqa: E402
from slime.utils.http_utils import get_rollout_num_engines  # noqa: E402
from slime.utils.types import Sample  # noqa: E402


@pytest.fixture
def sglang_servers():
    """HTTP servers answering /server_info with the dict registered for their port (404 for another path)."""
    answers: dict[int, dict] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = answers.get(self.server.server_port) if self.path == "/server_info" else None
            self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(json.dumps(body or {}).encode())

        def log_message(self, *args):
            pass

    servers = []

    def start(info: dict) -> str:
        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        answers[server.server_port] = info
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_port}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_external_servers_are_sized_from_their_server_info(sglang_servers):
    prefill = sglang_servers({"tp_size": 2, "pp_size": 2, "disaggregation_mode": "prefill",
                              "disaggregation_bootstrap_port": 8998})
    decode = sglang_servers({"tensor_parallel_size": 4, "ep_size": 2, "disaggregation_mode": "decode"})
    args = SimpleNamespace(rollout_external_engine_addrs=[prefill, f"http://{decode}/"], rollout_num_gpus=None,
                           router_pd_disaggregation=False)
    external.apply_external_engine_info_to_args(args)
    first, second = external.external_engine_infos_from_args(args)
    assert (first.worker_type, first.num_gpus, first.disaggregation_bootstrap_port) == ("prefill", 4, 8998)
    assert first.parallel_config == {"tp_size": 2, "pp_size": 2, "ep_size": 1, "moe_dp_size": 1}
    assert (second.url, second.worker_type, second.num_gpus) == (f"http://{decode}", "decode", 4)
    assert second.parallel_config["ep_size"] == 2 and second.is_pd_worker
    assert (args.rollout_num_gpus, args.rollout_num_engines, get_rollout_num_engines(args)) == (8, 2, 2)
    assert args.router_pd_disaggregation is False  # the user's flags stay as given


def test_a_server_reporting_nothing_is_one_regular_device(sglang_servers):
    [info] = external.discover_external_engines([sglang_servers({"disaggregation_mode": "null"})])
    assert (info.worker_type, info.num_gpus, info.parallel_config["tp_size"]) == ("regular", 1, 1)


def test_external_addresses_and_servers_that_do_not_answer_are_named(sglang_servers):
    with pytest.raises(ValueError, match="rollout-external-engine-addrs"):
        external.apply_external_engine_info_to_args(SimpleNamespace(rollout_external_engine_addrs=[]))
    with pytest.raises(ValueError, match="host:port"):
        external.normalize_external_engine_addr("https://host:1")
    with pytest.raises(ValueError, match="host:port"):
        external.normalize_external_engine_addr("host-without-port")
    server = sglang_servers({})
    with pytest.raises(RuntimeError, match="/server_info.*/get_server_info"):
        external.get_server_info(f"http://{server}x", timeout=2.0)  # port-suffixed host: nothing answers


def test_starting_slimes_engine_actors_is_refused_with_slimeflows_way():
    with pytest.raises(NotImplementedError, match="--rollout-external-engine-addrs"):
        external.start_external_rollout_servers(SimpleNamespace(), start_router=None)


def advantage_args(**overrides):
    base = dict(advantage_estimator="grpo", kl_coef=0.0, kl_loss_type="k1", use_rollout_logprobs=False,
                custom_advantage_function_path=None, normalize_advantages=False, use_opd=False, gamma=1.0, lambd=1.0)
    return SimpleNamespace(**{**base, **overrides})


def rollout_data(**extra):
    return {"log_probs": [torch.tensor([-0.5, -0.2]), torch.tensor([-1.0])],
            "ref_log_probs": [torch.tensor([-0.7, -0.2]), torch.tensor([-0.4])],
            "rewards": [0.5, -1.0], "loss_masks": [torch.ones(2), torch.ones(1)],
            "response_lengths": [2, 1], "total_lengths": [5, 3], **extra}


def test_grpo_takes_the_rollouts_normalised_rewards_as_they_are():
    data = rollout_data()
    compute_advantages_and_returns(advantage_args(), data)
    assert [a.tolist() for a in data["advantages"]] == [[0.5, 0.5], [-1.0]]  # no second group normalisation
    assert [r.tolist() for r in data["returns"]] == [[0.5, 0.5], [-1.0]]
    assert all(not k.any() for k in data["kl"])  # kl_coef 0: no KL, as slime


def test_ppo_shapes_rewards_with_the_kl_and_leaves_the_logged_kl_alone():
    data = rollout_data(values=[torch.zeros(2), torch.zeros(1)])
    compute_advantages_and_returns(advantage_args(advantage_estimator="ppo", kl_coef=0.1), data)
    torch.testing.assert_close(data["kl"][0], torch.tensor([0.2, 0.0]))  # k1: log pi - log pi_ref
    # token rewards -0.1 * kl, the reward on the last token; gamma = lambda = 1 with zero values: suffix sums
    torch.testing.assert_close(data["returns"][0], torch.tensor([0.48, 0.5]))
    torch.testing.assert_close(data["advantages"][1], torch.tensor([-1.0 + 0.1 * 0.6]))


def test_normalize_advantages_whitens_over_the_masked_tokens():
    data = rollout_data(loss_masks=[torch.tensor([1.0, 0.0]), torch.ones(1)])
    compute_advantages_and_returns(advantage_args(normalize_advantages=True), data)
    expected = alg.masked_whiten(torch.tensor([0.5, 0.5, -1.0]), torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(torch.cat(data["advantages"]), expected)


def fill_advantages(args, data):
    """A custom advantage function, slime's contract: fills rollout_data itself."""
    data["advantages"] = [torch.full_like(k, 7.0) for k in data["kl"]]
    data["returns"] = data["advantages"]


def test_a_custom_advantage_function_gets_slimes_rollout_data():
    data = rollout_data()
    compute_advantages_and_returns(advantage_args(custom_advantage_function_path=f"{__name__}.fill_advantages",
                                                  kl_coef=0.5), data)
    assert [a.tolist() for a in data["advantages"]] == [[7.0, 7.0], [7.0]] and "kl" in data


def test_a_rank_without_log_probs_or_values_is_left_alone():
    data = {"rewards": [1.0], "loss_masks": [torch.ones(1)]}
    compute_advantages_and_returns(advantage_args(), data)
    assert "advantages" not in data


def wrap_slimes_default(args, rollout_id, data_source, evaluation=False):
    """A rollout function of the kind slime's users write: the default one, then something of its own."""
    output = generate_rollout(args, rollout_id, data_source, evaluation)
    output.metrics["wrapped"] = 1.0
    return output


@pytest.fixture
def scorer():
    scorer = RewardScorer(config().reward)
    yield scorer
    scorer.close()


def test_slimes_default_rollout_is_slimeflows_own_under_a_wrapping_rollout_function(scorer):
    cfg = config(rollout={"rollout_function_path": f"{__name__}.wrap_slimes_default",
                          "dynamic_sampling_filter_path": "slimeflow.rollout.filters.check_reward_nonzero_std"})
    engine = ScriptedEngine({"a1": "1", "b2": "2", "c3": "3"})
    from test_rollout import right_on_even_samples_only
    for prompt in ("a1", "c3"):
        right_on_even_samples_only(engine, prompt)  # b2's group scores all-equal: the filter drops it
    ctx = RolloutContext(cfg, CharTokenizer(), engine, scorer, concurrency=8)
    data = BufferedDataSource(DataSource(prompts("a1", "b2", "c3"), n_samples_per_prompt=2))
    result = run_rollout_function(wrap_slimes_default, ctx, data, rollout_id=0)
    # Rounds of 2: (a1, b2) keeps a1 and drops b2, then (c3, a1 of the next epoch) keeps whichever finishes first
    # (both are mixed; test_rollout's over-sampling test says the same).
    rows = [[s.metadata["row_id"] for s in g] for g in result.groups]
    assert rows[0] == ["row-a1"] * 2 and rows[1] in (["row-c3"] * 2, ["row-a1"] * 2), rows
    assert [s.reward for g in result.groups for s in g] == [1.0, 0.0, 1.0, 0.0]
    assert result.metrics["wrapped"] == 1.0


def test_slimes_default_rollout_needs_slimeflows_args_and_does_not_evaluate():
    with pytest.raises(ValueError, match="args"):
        generate_rollout(SimpleNamespace(), 0, None)
    with pytest.raises(ValueError, match="--eval-prompt-data"):
        generate_rollout(SimpleNamespace(), 0, None, evaluation=True)


def test_naming_slimes_default_rollout_and_eval_functions_means_slimeflows_own():
    cfg = config(rollout={"rollout_function_path": "slime.rollout.sglang_rollout.generate_rollout"},
                 eval={"eval_function_path": "slime.rollout.sglang_rollout:generate_rollout"})
    assert cfg.rollout.rollout_function_path is None and cfg.eval.eval_function_path is None


def source_args(tmp_path, **overrides):
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"question": q, "answer": q[-1]}) + "\n" for q in ("x1", "y2", "z3")))
    base = dict(prompt_data=str(rows), input_key="question", label_key="answer", rollout_global_dataset=True,
                n_samples_per_prompt=2, rollout_shuffle=False, rollout_seed=1, buffer_filter_path=None,
                save=str(tmp_path / "save"), load=str(tmp_path / "save"))
    return SimpleNamespace(**{**base, **overrides})


def test_slimes_default_data_source_reads_raw_prompt_data_in_order_and_wraps(tmp_path):
    source = RolloutDataSourceWithBuffer(source_args(tmp_path))
    groups = source.get_samples(2)
    assert [[(s.prompt, s.label, s.group_index, s.index) for s in g] for g in groups] == [
        [("x1", "1", 0, 0), ("x1", "1", 0, 1)], [("y2", "2", 1, 2), ("y2", "2", 1, 3)]]
    assert len(source) == 3
    assert [g[0].prompt for g in source.get_samples(2)] == ["z3", "x1"]  # into the next epoch


def test_its_buffer_is_taken_first_through_the_buffer_filter(tmp_path):
    source = RolloutDataSourceWithBuffer(source_args(tmp_path, buffer_filter_path="slime.rollout.data_source.pop_first"))
    back = [[Sample(index=10), Sample(index=11)], [Sample(index=12), Sample(index=13)]]
    source.add_samples(back)
    assert source.get_buffer_length() == 2 and source.buffer == back
    groups = source.get_samples(3)
    assert [g[0].index for g in groups] == [10, 12, 0]
    with pytest.raises(ValueError, match="n-samples-per-prompt 2"):
        source.add_samples([[Sample()]])
    with pytest.raises(RuntimeError, match="read-only"):
        RolloutDataSource(source_args(tmp_path)).add_samples(back)


def test_its_state_is_saved_and_loaded_in_slimes_file(tmp_path):
    first = RolloutDataSourceWithBuffer(source_args(tmp_path))
    first.get_samples(2)
    first.save(4)
    saved = torch.load(tmp_path / "save" / "rollout" / "global_dataset_state_dict_4.pt")
    assert (saved["sample_offset"], saved["epoch_id"], saved["sample_group_index"], saved["sample_index"]) == (2, 0, 2, 4)
    resumed = RolloutDataSourceWithBuffer(source_args(tmp_path))
    resumed.load(4)
    [group] = resumed.get_samples(1)
    assert (group[0].prompt, group[0].index) == ("z3", 4)


def test_without_prompt_data_it_hands_out_numbered_empty_samples(tmp_path):
    source = RolloutDataSourceWithBuffer(source_args(tmp_path, rollout_global_dataset=False))
    groups = source.get_samples(2)
    assert [[s.index for s in g] for g in groups] == [[0, 1], [2, 3]] and groups[1][0].group_index == 1
    assert groups[0][0].prompt == "" and len(source) == 0


def test_loss_mask_type_is_taken_for_a_rollout_function_and_refused_without_one():
    cfg = config(data={"loss_mask_type": "qwen3_5"},
                 rollout={"rollout_function_path": "slime.rollout.sft_rollout.generate_rollout"})
    assert cfg.data.loss_mask_type == "qwen3_5"
    with pytest.raises(ValueError, match="--loss-mask-type qwen3_5 is read by a rollout function"):
        config(data={"loss_mask_type": "qwen3_5"})
    with pytest.raises(ValueError, match="loss_mask_type"):
        config(data={"loss_mask_type": "llama"})
