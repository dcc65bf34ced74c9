"""The embedded rollout engine over HTTP: batching, log-probs, greedy parity, weight updates, router, errors.

Two engine subprocesses serve the module (one thread each); `engine_b` also takes the weight updates, so the
tests on `engine` always see the original weights.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from slimeflow.engine import launch
from slimeflow.engine.client import EngineClient, EngineRequestError, EngineUnavailableError
from slimeflow.engine.launch import free_port, new_api_key, start_engine, start_router
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

SPEC = TinyModelSpec(seed=1)
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 50, 43, 50, 61], [256, 84, 104, 101, 32, 99, 97, 116, 32, 115]]
GREEDY = {"temperature": 0.0}
KEY = new_api_key()  # the engines' (and router's) API key
AUTH = {"Authorization": f"Bearer {KEY}"}


def run(coro):
    return asyncio.run(coro)


async def _generate(url: str, prompt: list[int], params: dict, key: str, **kwargs) -> dict:
    async with EngineClient(url, api_key=key, timeout_s=60) as client:
        return await client.generate(prompt, params, **kwargs)


def generate(url: str, prompt: list[int], params: dict, key: str = KEY, **kwargs) -> dict:
    return run(_generate(url, prompt, params, key, **kwargs))


def tokens(response: dict) -> list[int]:
    return response["output_ids"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("engine") / "tiny", SPEC)


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    with start_engine(model_dir, num_threads=1, max_batch_size=32, weight_version="v0", api_key=KEY) as process:
        yield process


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    """engine_b's --weights-dir: the only place it loads weights from disk."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def taken_port():
    """A port another process holds: engine_b's first choice, as if taken between its choice and the engine's bind."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture(scope="module")
def engine_b(model_dir, weights_dir, taken_port):
    first_choice = iter([taken_port])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "free_port", lambda host="127.0.0.1": next(first_choice, None) or free_port(host))
        process = start_engine(model_dir, num_threads=1, max_batch_size=32, api_key=KEY, weights_dir=weights_dir)
    with process:
        yield process


def test_an_engine_whose_chosen_port_was_taken_starts_again_on_another(engine_b, taken_port):
    assert engine_b.url != f"http://127.0.0.1:{taken_port}"
    assert httpx.get(engine_b.url + "/health", timeout=5).status_code == 200


def forward_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[i] | prompt + output[:i]) from one plain forward pass."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logp = model(ids).logits[0].float().log_softmax(-1)
    positions = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return logp[positions, torch.tensor(output)]


def wait_running(url: str, at_least: int = 1, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while httpx.get(url + "/get_model_info", headers=AUTH).json()["running"] < at_least:
        assert time.monotonic() < deadline, "the request never started running"
        time.sleep(0.01)


def test_concurrent_requests_share_forward_passes(engine):
    params = {"temperature": 1.0, "max_new_tokens": 64, "ignore_eos": True}
    prompts = [PROMPTS[i % 3] + [65 + i] for i in range(16)]

    async def one_by_one():
        async with EngineClient(engine.url, api_key=KEY) as client:
            return [await client.generate(p, params | {"sampling_seed": i}) for i, p in enumerate(prompts)]

    async def all_at_once():
        async with EngineClient(engine.url, api_key=KEY) as client:
            return await asyncio.gather(*(client.generate(p, params | {"sampling_seed": i})
                                          for i, p in enumerate(prompts)))

    run(all_at_once())  # warm-up
    start = time.perf_counter()
    sequential = run(one_by_one())
    sequential_s = time.perf_counter() - start
    start = time.perf_counter()
    concurrent = run(all_at_once())
    concurrent_s = time.perf_counter() - start
    assert all(r["meta_info"]["completion_tokens"] == 64 for r in sequential + concurrent)
    print(f"16 requests: one by one {sequential_s:.2f} s, concurrently {concurrent_s:.2f} s")
    assert sequential_s / concurrent_s > 1.5, (sequential_s, concurrent_s)


def test_logprobs_equal_forward_pass_alone_and_when_joining(engine, reference):
    params = {"temperature": 1.0, "max_new_tokens": 40, "ignore_eos": True, "sampling_seed": 7}
    alone = generate(engine.url, PROMPTS[0], params)
    logprobs = [entry[0] for entry in alone["meta_info"]["output_token_logprobs"]]
    assert [entry[1] for entry in alone["meta_info"]["output_token_logprobs"]] == tokens(alone)
    torch.testing.assert_close(torch.tensor(logprobs), forward_logprobs(reference, PROMPTS[0], tokens(alone)),
                               atol=1e-4, rtol=0)

    async def join_running_batch():
        """(long, joiner, whether the joiner finished while the long request was still decoding)."""
        async with EngineClient(engine.url, api_key=KEY) as client:
            long = asyncio.create_task(client.generate(PROMPTS[2], params | {"max_new_tokens": 300}))
            await asyncio.to_thread(wait_running, engine.url)
            joiner = await client.generate(PROMPTS[1], params | {"sampling_seed": 3})
            joined = not long.done()
            return await long, joiner, joined

    # The joiner must join while the long request decodes. On a loaded machine its request can arrive after the
    # long one's 300 tokens: that attempt checks nothing and is made again (at most 3 times).
    for _ in range(3):
        long, joiner, joined = run(join_running_batch())
        if joined:
            break
    assert joined, "in 3 attempts the joiner never joined while the long request was decoding"
    for prompt, response in ((PROMPTS[2], long), (PROMPTS[1], joiner)):
        got = torch.tensor([entry[0] for entry in response["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, forward_logprobs(reference, prompt, tokens(response)), atol=1e-4, rtol=0)


def test_greedy_equals_model_generate(engine, reference):
    for prompt in PROMPTS:
        expected = reference.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)[0, len(prompt):]
        assert tokens(generate(engine.url, prompt, GREEDY | {"max_new_tokens": 20})) == expected.tolist()


def test_same_seed_same_sample_and_batch_form(engine):
    params = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "max_new_tokens": 12, "sampling_seed": 11}
    assert tokens(generate(engine.url, PROMPTS[0], params)) == tokens(generate(engine.url, PROMPTS[0], params))
    body = {"input_ids": PROMPTS[:2], "sampling_params": GREEDY | {"max_new_tokens": 5}}
    batch = httpx.post(engine.url + "/generate", json=body, timeout=30, headers=AUTH).json()
    assert isinstance(batch, list) and [tokens(r) for r in batch] == [
        tokens(generate(engine.url, p, GREEDY | {"max_new_tokens": 5})) for p in PROMPTS[:2]]
    assert batch[0]["meta_info"]["weight_version"] == "v0"


def test_stop_token_ids_and_stop_strings(engine):
    reference_run = tokens(generate(engine.url, PROMPTS[1], GREEDY | {"max_new_tokens": 30, "ignore_eos": True}))
    stop_id = reference_run[5]
    cut = generate(engine.url, PROMPTS[1], GREEDY | {"max_new_tokens": 30, "stop_token_ids": [stop_id]})
    first = reference_run.index(stop_id)
    assert tokens(cut) == reference_run[: first + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    # An ASCII byte token decodes to exactly its character and no other token decodes to it.
    ascii_at = next(i for i, t in enumerate(reference_run) if 33 <= t < 127)
    stop = chr(reference_run[ascii_at])
    cut = generate(engine.url, PROMPTS[1], GREEDY | {"max_new_tokens": 30, "ignore_eos": True, "stop": [stop]})
    assert tokens(cut) == reference_run[: ascii_at + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in cut["text"]


def test_abort_request_returns_partial_output(engine):
    async def abort_one():
        async with EngineClient(engine.url, api_key=KEY) as client:
            victim = asyncio.create_task(client.generate(PROMPTS[0], {"max_new_tokens": 400, "ignore_eos": True},
                                                         rid="victim"))
            await asyncio.to_thread(wait_running, engine.url)
            await client.abort("victim")
            return await victim

    response = run(abort_one())
    assert response["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < response["meta_info"]["completion_tokens"] < 400


def test_pause_and_continue(engine):
    async def paused_request():
        async with httpx.AsyncClient(base_url=engine.url, timeout=30, headers=AUTH) as http:
            assert (await http.post("/pause_generation")).status_code == 200
            task = asyncio.create_task(http.post("/generate", json={"input_ids": PROMPTS[0],
                                                                    "sampling_params": {"max_new_tokens": 3}}))
            await asyncio.sleep(0.3)
            assert not task.done(), "a paused engine must not generate"
            assert (await http.post("/continue_generation")).status_code == 200
            return (await task).json()

    assert paused_request_done(run(paused_request()))
    assert httpx.get(engine.url + "/health_generate", timeout=30).status_code == 200
    assert httpx.post(engine.url + "/flush_cache", headers=AUTH).status_code == 200


def paused_request_done(response: dict) -> bool:
    return response["meta_info"]["completion_tokens"] == 3


@pytest.mark.parametrize(("body", "words"), [
    ({"input_ids": [1, 2], "sampling_params": {"temprature": 1.0}}, "unknown sampling_params ['temprature']"),
    ({"input_ids": [], "sampling_params": {}}, "input_ids is empty"),
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 600}}, "max_new_tokens=600 does not fit"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p must be in"),
    ({"text": "hi", "input_ids": [1]}, "exactly one of input_ids"),
    ({"input_ids": [1, 2], "stream": True}, "stream=True is not supported"),
    # A batch's items are checked once per distinct set of parameters: a bad item after a good one still fails.
    ({"input_ids": [[1, 2], [1, 2]], "sampling_params": [{"temperature": 1}, {"temperature": True}]},
     "temperature must be a number"),
    ({"input_ids": [[1, 2], [1, 2]], "sampling_params": [{"sampling_seed": 1}, {"sampling_seed": 1.5}]},
     "sampling_seed must be an integer"),
    ({"input_ids": [[1, 2], [1, True]]}, "input_ids[1] must hold integer token ids"),
])
def test_bad_generate_requests_answer_400_with_the_fix(engine, body, words):
    response = httpx.post(engine.url + "/generate", json=body, headers=AUTH)
    assert response.status_code == 400
    assert words in response.json()["error"]["message"]


def test_weight_updates_change_version_and_outputs_and_abort_in_flight(engine_b, reference, weights_dir):
    before = tokens(generate(engine_b.url, PROMPTS[0], GREEDY | {"max_new_tokens": 16}))
    shifted = {"lm_head.weight": reference.lm_head.weight.detach() + 0.5 * torch.randn_like(reference.lm_head.weight)}

    async def update_during_a_request():
        async with EngineClient(engine_b.url, api_key=KEY) as client:
            long = asyncio.create_task(client.generate(PROMPTS[1], {"max_new_tokens": 400, "ignore_eos": True}))
            await asyncio.to_thread(wait_running, engine_b.url)
            await client.update_weights_from_tensor(shifted, weight_version="v1")
            return await long, await client.weight_version()

    in_flight, version = run(update_during_a_request())
    assert version == "v1"
    assert in_flight["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < in_flight["meta_info"]["completion_tokens"] < 400
    assert in_flight["meta_info"]["weight_version"] == "default"
    after = generate(engine_b.url, PROMPTS[0], GREEDY | {"max_new_tokens": 16})
    assert tokens(after) != before and after["meta_info"]["weight_version"] == "v1"

    other = build_tiny_model(weights_dir / "seed2", TinyModelSpec(seed=2))
    run(EngineClient(engine_b.url, api_key=KEY).update_weights_from_disk(str(other), "v2"))
    expected = AutoModelForCausalLM.from_pretrained(other).generate(
        torch.tensor([PROMPTS[0]]), do_sample=False, max_new_tokens=16)[0, len(PROMPTS[0]):]
    from_disk = generate(engine_b.url, PROMPTS[0], GREEDY | {"max_new_tokens": 16})
    assert tokens(from_disk) == expected.tolist() and from_disk["meta_info"]["weight_version"] == "v2"
    assert httpx.get(engine_b.url + "/get_model_info", headers=AUTH).json()["model_path"] == str(other)


def test_bad_weight_updates_answer_400_and_change_nothing(engine_b, weights_dir):
    client = EngineClient(engine_b.url, api_key=KEY)
    version = run(client.weight_version())
    with pytest.raises(EngineRequestError, match="does not have, e.g. \\['lm_head.weights'\\]") as err:
        run(client.update_weights_from_tensor({"lm_head.weights": torch.zeros(3)}, "bad"))
    assert err.value.status == 400
    with pytest.raises(EngineRequestError, match="wrong shape .*lm_head.weight: got \\(3,\\)"):
        run(client.update_weights_from_tensor({"lm_head.weight": torch.zeros(3)}, "bad"))
    with pytest.raises(EngineRequestError, match="not a directory with \\*.safetensors"):
        run(client.update_weights_from_disk(str(weights_dir / "nonexistent"), "bad"))
    assert run(client.weight_version()) == version


def test_router_spreads_requests_over_both_engines(engine, engine_b):
    def received() -> list[int]:
        return [httpx.get(e.url + "/get_model_info", headers=AUTH).json()["requests_received"]
                for e in (engine, engine_b)]

    before = received()
    with start_router([engine.url, engine_b.url], api_key=KEY) as router:
        async def through_router():
            async with EngineClient(router.url, api_key=KEY) as client:
                return await asyncio.gather(*(client.generate(PROMPTS[i % 3], {"max_new_tokens": 4})
                                              for i in range(8)))

        responses = run(through_router())
    assert all(r["meta_info"]["completion_tokens"] >= 1 for r in responses)
    served = [a - b for a, b in zip(received(), before, strict=True)]
    assert sum(served) == 8 and min(served) >= 1, served


def test_several_external_servers_get_a_router_of_ours_with_the_router_flags(engine, engine_b, model_dir, weights_dir):
    """--rollout-external-engine-addrs host:port ...: as slime, sglang-router in front of them, started with the
    --router-* flags over slime's defaults; it is stopped with the engine set."""
    from slimeflow.stages.train.engines import EngineSet

    def received() -> list[int]:
        return [httpx.get(e.url + "/get_model_info", headers=AUTH).json()["requests_received"]
                for e in (engine, engine_b)]

    before = received()
    engines = EngineSet.launch(str(model_dir), {"weights_dir": str(weights_dir), "api_key": KEY}, 1,
                               external_addrs=[engine.url.removeprefix("http://"), engine_b.url],
                               router_args={"queue_size": "50"}).ready()
    try:
        [router] = engines.processes
        assert engines.routed and engines.rollout_url == router.url and engines.worker_urls == [engine.url, engine_b.url]
        assert router.command[router.command.index("--queue-size") + 1] == "50"
        assert "--disable-circuit-breaker" in router.command and "14400" in router.command  # slime's defaults

        async def rollouts():
            client = engines.client()
            try:
                return await asyncio.gather(*(client.generate(PROMPTS[i % 3], {"max_new_tokens": 2}) for i in range(6)))
            finally:
                await engines.aclose()

        assert all(r["meta_info"]["completion_tokens"] >= 1 for r in run(rollouts()))
    finally:
        engines.stop()
    assert router.process.poll() is not None
    served = [a - b for a, b in zip(received(), before, strict=True)]
    assert sum(served) == 6 and min(served) >= 1, served


def test_unreachable_engine_fails_fast_naming_the_url():
    url = f"http://127.0.0.1:{free_port()}"
    client = EngineClient(url, timeout_s=5, retries=2, backoff_s=0.05)
    start = time.perf_counter()
    with pytest.raises(EngineUnavailableError, match=url.replace(".", "\\.")) as err:
        run(client.generate([1, 2], {"max_new_tokens": 2}))
    assert time.perf_counter() - start < 5
    assert "3 attempt(s)" in str(err.value) and "--sglang-router-ip" in str(err.value)


@pytest.mark.parametrize(("top_k", "top_p", "expected"), [
    (-1, 1.0, [0.5, 0.3, 0.2]), (2, 1.0, [0.625, 0.375, 0.0]), (-1, 0.6, [0.625, 0.375, 0.0]), (1, 1.0, [1.0, 0.0, 0.0]),
])
def test_sampling_follows_top_k_top_p_by_inverse_cdf(top_k, top_p, expected):
    from slimeflow.engine.sampling import SamplingParams, sample_rows

    # A grid of uniforms stands in for the per-request generators: the token frequencies are the distribution.
    grid = (torch.arange(1000, dtype=torch.float32) + 0.5) / 1000
    logits = torch.tensor([[0.2, 0.5, 0.3]]).log().repeat(1000, 1) + 4.0
    step = sample_rows(logits, [SamplingParams(top_k=top_k, top_p=top_p)] * 1000, grid)
    counts = torch.bincount(torch.tensor(step.tokens), minlength=3).float() / 1000
    torch.testing.assert_close(counts, torch.tensor([expected[2], expected[0], expected[1]]), atol=2e-3, rtol=0)
    torch.testing.assert_close(torch.tensor(step.logprobs).exp(), torch.tensor([0.2, 0.5, 0.3])[step.tokens],
                               atol=1e-6, rtol=0)


def test_logprobs_are_of_the_tempered_distribution_and_greedy_rows_of_the_raw_one():
    """As SGLang returns them and the trainer recomputes them: log_softmax(logits / temperature)."""
    from slimeflow.engine.sampling import SamplingParams, sample_rows

    logits = torch.tensor([[0.1, 2.0, -1.0, 0.7]] * 3)
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=1.5, top_k=2), SamplingParams(temperature=0)]
    step = sample_rows(logits, params, torch.tensor([0.3, 0.9, 0.5]))
    temps = torch.tensor([0.5, 1.5, 1.0])
    expected = (logits / temps[:, None]).log_softmax(-1)[torch.arange(3), torch.tensor(step.tokens)]
    torch.testing.assert_close(torch.tensor(step.logprobs), expected, atol=1e-6, rtol=0)
    assert step.tokens[2] == 1  # greedy


def test_kv_batch_matches_plain_forward_through_joins_leaves_and_growth(reference):
    from slimeflow.engine import kv_batch
    from slimeflow.engine.native import HFForward

    forward = HFForward(reference)

    # Decodes in place with 2 columns of headroom (so the buffers grow), a join of a longer prompt (so the running
    # rows are re-padded), and leaves that move rows from the back into the holes; every step's logits must equal
    # a plain forward over the sequence so far.
    seqs = [list(p) for p in PROMPTS]
    cpu = torch.device("cpu")
    with torch.inference_mode():
        batch, logits = kv_batch.prefill(forward, seqs, cpu, headroom=2)
        for step in range(12):
            if step == 2:
                joiners = [[256, *range(70, 90)], [256, 66]]
                new, new_logits = kv_batch.prefill(forward, joiners, cpu, headroom=4)
                batch, seqs, logits = kv_batch.merge(batch, new), seqs + joiners, torch.cat([logits, new_logits])
            if step in (5, 8):
                order = kv_batch.compaction_order([row != {5: 0, 8: 1}[step] for row in range(len(seqs))])
                assert order == ([4, 1, 2, 3] if step == 5 else [0, 3, 2])
                batch, seqs, logits = kv_batch.select(batch, order), [seqs[i] for i in order], logits[order]
            for seq, row in zip(seqs, logits, strict=True):
                torch.testing.assert_close(row, reference(torch.tensor([seq])).logits[0, -1], atol=1e-4, rtol=0)
                seq.append(int(row.argmax()))
            logits = kv_batch.decode(forward, batch, [seq[-1] for seq in seqs])


def test_a_launch_is_running_before_ready_and_cancel_or_a_failed_start_stops_it(tmp_path):
    """EngineSet.launch returns with the engine's process already running (the caller sets up meanwhile);
    cancel() stops it, and an engine that dies while starting fails ready() with its log and stops the rest."""
    from slimeflow.stages.train.engines import EngineSet

    launching = EngineSet.launch(str(tmp_path / "no-model"), {}, num_engines=2, threads=1)
    processes = [p.process for p in launching.processes]
    assert len(processes) == 2 and all(p.poll() is None for p in processes)
    with pytest.raises(RuntimeError, match=r"(?s)engine exited with code \d+ before answering .*no-model"):
        launching.ready()
    assert all(p.poll() is not None for p in processes) and launching.processes == []

    launching = EngineSet.launch(str(tmp_path / "no-model"), {}, num_engines=1, threads=1)
    process = launching.processes[0].process
    launching.cancel()
    assert process.poll() is not None


def test_an_in_process_engine_answers_as_the_process_does_and_stops_with_its_thread(model_dir, engine, reference):
    """One embedded engine served from a thread of the caller (the RolloutManager's default): same answers as an
    engine process for the same seed, weight updates, and stop() frees the thread and the port."""
    import threading

    from slimeflow.engine.server import EngineThread
    from slimeflow.stages.train.engines import EngineSet

    launching = EngineSet.launch(str(model_dir), {}, num_engines=1, threads=1, in_process=True)
    assert [type(p) for p in launching.processes] == [EngineThread]
    engines = launching.ready()
    try:
        assert "engine-scheduler" in {t.name for t in threading.enumerate()}
        params = {"temperature": 1.0, "max_new_tokens": 12, "sampling_seed": 7, "ignore_eos": True}
        here, there = (generate(url, PROMPTS[2], params, key, return_logprob=True)
                       for url, key in ((engines.rollout_url, engines.api_key), (engine.url, KEY)))
        assert tokens(here) == tokens(there)
        logprobs = [[lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] for out in (here, there)]
        assert logprobs[0] == pytest.approx(logprobs[1], abs=1e-5)
        zeros = {"lm_head.weight": torch.zeros_like(reference.lm_head.weight)}
        run(EngineClient(engines.rollout_url, api_key=engines.api_key).update_weights_from_tensor(zeros, "w1"))
        assert generate(engines.rollout_url, PROMPTS[0], GREEDY, engines.api_key)["meta_info"]["weight_version"] == "w1"
    finally:
        engines.stop()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("engine-")]  # server and scheduler
    with pytest.raises(httpx.ConnectError):
        httpx.get(engines.rollout_url + "/health", timeout=2)


def test_an_in_process_engine_that_cannot_load_says_why_and_two_engines_stay_processes(tmp_path):
    from slimeflow.engine.launch import EngineProcess
    from slimeflow.stages.train.engines import EngineSet

    launching = EngineSet.launch(str(tmp_path / "no-model"), {}, num_engines=1, threads=1, in_process=True)
    with pytest.raises(RuntimeError, match=r"in-process engine for .*no-model failed to start: \w+"):
        launching.ready()
    assert launching.processes == []

    # Two or more engines each need a GIL of their own: processes, behind sglang-router.
    launching = EngineSet.launch(str(tmp_path / "no-model"), {}, num_engines=2, threads=1, in_process=True)
    try:
        assert [type(p) for p in launching.processes] == [EngineProcess, EngineProcess]
    finally:
        launching.cancel()
