"""The embedded engine's control API with SGLang's shapes (memory release/resume, pause modes, weight-update groups)
and the trainer's weight sync over it: bucketed, by HTTP tensors and by broadcast in a gloo group.

One engine subprocess serves the module; the tests run in file order and each leaves it serving `model_dir`'s
weights again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from slimeflow.engine.client import EngineClient, EngineRequestError, EngineUnavailableError
from slimeflow.engine.launch import new_api_key, start_engine
from slimeflow.engine.shared_segment import NonFiniteWeightsError, SegmentWriter
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model
from slimeflow.stages.train.engines import EngineDiedError, EngineSet, WeightTargets
from slimeflow.stages.train.weight_sync import WeightSync, buckets

# ~63 MB of float32 weights (4 layers of 512 x 2048 MLPs): large enough that freeing them shows in resident memory.
SPEC = TinyModelSpec(seed=5, hidden_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                     intermediate_size=2048)
PROMPT = [256, 72, 101, 108, 108, 111]
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
KEY = new_api_key()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("control") / "tiny", SPEC)


@pytest.fixture(scope="module")
def reference(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir):
    with start_engine(model_dir, num_threads=1, max_batch_size=8, weight_version="v0", api_key=KEY) as process:
        yield process


def call(engine, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(engine.url + path, json=body or {}, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def greedy(engine) -> dict:
    async def once():
        async with EngineClient(engine.url, api_key=KEY) as client:
            return await client.generate(PROMPT, GREEDY)
    return asyncio.run(once())


def hf_greedy(model) -> list[int]:
    out = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=GREEDY["max_new_tokens"])
    return out[0, len(PROMPT):].tolist()


def test_release_frees_resident_memory_and_resume_reloads_the_weights(engine, reference):
    before = greedy(engine)
    assert before["output_ids"] == hf_greedy(reference)
    weight_bytes = sum(p.numel() * 4 for p in reference.parameters())
    held = rss_bytes(engine.process.pid)

    released = call(engine, "/release_memory_occupation", {"tags": None})
    assert released.status_code == 200 and released.json() is None  # SGLang answers null
    freed = held - rss_bytes(engine.process.pid)
    assert freed >= 0.8 * weight_bytes, f"resident memory dropped by {freed / 2**20:.1f} MiB of {weight_bytes / 2**20:.1f}"
    unhealthy = httpx.get(engine.url + "/health_generate", timeout=10)
    assert unhealthy.status_code == 503 and "resume_memory_occupation" in unhealthy.json()["message"]
    refused = call(engine, "/update_weights_from_tensor")
    assert refused.status_code == 400

    assert call(engine, "/resume_memory_occupation", {"tags": ["weights", "kv_cache"]}).status_code == 200
    assert rss_bytes(engine.process.pid) - (held - freed) >= 0.8 * weight_bytes
    after = greedy(engine)
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "v0"


def test_server_info_has_the_fields_slime_sizes_an_external_engine_by(engine):
    info = httpx.get(engine.url + "/server_info", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert {k: info[k] for k in ("tp_size", "pp_size", "ep_size", "disaggregation_mode")} == {
        "tp_size": 1, "pp_size": 1, "ep_size": 1, "disaggregation_mode": "null"}
    assert info["weight_version"] == "v0"


def test_release_refuses_unknown_tags_and_pause_modes_follow_sglang(engine):
    bad = call(engine, "/release_memory_occupation", {"tags": ["weight"]})
    assert bad.status_code == 400 and "unknown memory tags ['weight']" in bad.json()["message"]
    assert call(engine, "/pause_generation", {"mode": "retract"}).status_code == 400

    async def abort_mode() -> dict:
        async with EngineClient(engine.url, api_key=KEY) as client:
            long = asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 400, "ignore_eos": True}))
            while (await client._request("GET", "/get_model_info")).json()["running"] < 1:
                await asyncio.sleep(0.01)
            paused = await client.control("/pause_generation", {})  # SGLang's default mode: abort
            assert paused == {"message": "Generation paused successfully.", "status": "ok"}
            answer = await long
            await client.control("/continue_generation", {})
            return answer

    aborted = asyncio.run(abort_mode())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and aborted["meta_info"]["completion_tokens"] < 400
    assert greedy(engine)["meta_info"]["finish_reason"]["type"] in ("stop", "length")


def shifted_weights(reference, seed: int) -> dict[str, torch.Tensor]:
    noise = torch.Generator().manual_seed(seed)
    return {name: p.detach() + 0.02 * torch.randn(p.shape, generator=noise) for name, p in reference.named_parameters()}


@pytest.mark.parametrize("transport", ["tensor", "shared_memory", "distributed"])
def test_bucketed_pushes_reach_the_engine_as_one_version(engine, reference, model_dir, transport):
    weights = shifted_weights(reference, seed=7)
    limit = 4 * 2**20  # 4 MiB buckets: the 4 MiB MLP matrices go one per bucket, the small tensors together
    expected_buckets = len(list(buckets(weights, limit)))
    assert 8 < expected_buckets < len(weights)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    target.load_state_dict(weights, strict=False)

    async def push_twice() -> WeightSync:
        sync = WeightSync(WeightTargets((engine.url,), str(model_dir), api_key=KEY), buffer_size=limit,
                          transport=transport)
        try:
            assert await sync.push(weights, f"{transport}-1") == f"{transport}-1"
            if transport == "shared_memory":  # mapped by the engine, so no longer named: a killed run leaves nothing
                assert sync.segment.buffer is not None and not sync.segment.path.exists()
            await sync.push(dict(reference.named_parameters()), f"{transport}-2")  # back to the original weights
            await sync.push(weights, f"{transport}-3")
        finally:
            await sync.aclose()
        return sync

    sync = asyncio.run(push_twice())
    # The shared segment holds each version whole, so it goes in one request whatever the bucket size.
    assert sync.buckets_sent == 3 * (1 if transport == "shared_memory" else expected_buckets)
    answer = greedy(engine)
    assert answer["meta_info"]["weight_version"] == f"{transport}-3"
    assert answer["output_ids"] == hf_greedy(target) != hf_greedy(reference)
    asyncio.run(WeightSync(WeightTargets((engine.url,), str(model_dir), api_key=KEY)).push(
        dict(reference.named_parameters()), "v0"))


@pytest.mark.slow  # 20 s in the file's run at load 17 (three weight snapshots of 63 MB over HTTP, ~30 pushes)
def test_shared_memory_pushes_serve_the_trainers_bytes_and_a_refused_one_keeps_the_old_version(engine, reference,
                                                                                              model_dir):
    """The engine serves from the trainer's segment (two slots, written in turn): every push arrives bit for bit,
    a push with NaN or Inf is refused by the trainer as it writes (naming the tensor) and leaves the served version
    untouched (though written into the other slot), and the next push goes to fresh files; a version goes in one
    request whatever the bucket size, so it is refused whole; an HTTP update afterwards gets storage of its own
    instead of writing into the segment."""
    versions = {tag: shifted_weights(reference, seed) for tag, seed in (("a", 11), ("b", 12), ("d", 13))}
    bad = {**versions["a"], "model.norm.weight": torch.full_like(versions["a"]["model.norm.weight"], float("nan"))}

    async def run() -> None:
        sync = WeightSync(WeightTargets((engine.url,), str(model_dir), api_key=KEY), transport="shared_memory")
        client = EngineClient(engine.url, api_key=KEY)

        async def served_equals(weights: dict[str, torch.Tensor], version: str) -> None:
            tensors, served = await client.weights_snapshot()
            assert served == version
            assert all(torch.equal(tensors[name], t) for name, t in weights.items())

        try:
            await sync.push(versions["a"], "shm-a")  # slot 0
            await sync.push(versions["b"], "shm-b")  # slot 1
            await served_equals(versions["b"], "shm-b")
            first_slot = sync.segment.slots[0]
            with pytest.raises(NonFiniteWeightsError, match=r"version 'shm-c' refused .* model\.norm\.weight \("):
                await sync.push(bad, "shm-c")  # written into slot 0 while the engine serves slot 1
            await served_equals(versions["b"], "shm-b")
            await sync.push(versions["d"], "shm-d")
            assert sync.segment.slots[0] is not first_slot and sync.segment.slots[1] is None  # fresh files
            await served_equals(versions["d"], "shm-d")
            sync.buffer_size = 4 * 2**20  # the segment holds the version whole: one request, refused whole
            last = {**versions["a"], "lm_head.weight": torch.full_like(versions["a"]["lm_head.weight"], float("inf"))}
            with pytest.raises(NonFiniteWeightsError, match=r"1 of \d+ tensors .* lm_head\.weight \(element 0 of"):
                await sync.push(last, "shm-e")
            assert not sync.paused
            await served_equals(versions["d"], "shm-d")
            await sync.push(versions["d"], "shm-d")
            assert (await client.generate(PROMPT, GREEDY))["meta_info"]["weight_version"] == "shm-d"
            segment_copy = sync.segment.buffer.clone()
            await WeightSync(WeightTargets((engine.url,), str(model_dir), api_key=KEY)).push(
                dict(reference.named_parameters()), "v0")  # over HTTP, back to the module's weights
            assert torch.equal(sync.segment.buffer, segment_copy)
        finally:
            await client.aclose()
            await sync.aclose()

    asyncio.run(run())


def test_a_full_dev_shm_is_refused_before_any_write_with_the_fix(monkeypatch):
    import errno

    from slimeflow.engine import shared_segment

    tried = []

    def full(fd, offset, size):
        tried.append(os.readlink(f"/proc/self/fd/{fd}"))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shared_segment.os, "posix_fallocate", full)
    writer = shared_segment.SegmentWriter()
    with pytest.raises(OSError, match=r"no room for a 4096-byte weight segment.*--shm-size"):
        writer.begin({"w": torch.zeros(1024)})
    assert len(tried) == 1 and not os.path.exists(tried[0]) and writer.slots == [None, None]  # nothing left behind


def test_shared_memory_updates_read_only_the_trainers_segment_files(engine, tmp_path):
    elsewhere = tmp_path / "slimeflow-weights-x"
    elsewhere.write_bytes(b"\0" * 64)
    for description, words in ((f'{{"path": "{elsewhere}", "size": 64, "tensors": []}}', "is not a /dev/shm/"),
                               ("not json", "is not the trainer's segment JSON")):
        answer = call(engine, "/update_weights_from_tensor", {"serialized_named_tensors": [description],
                                                              "load_format": "slimeflow_shared_memory"})
        assert answer.status_code == 400 and words in answer.json()["message"]
    truncated = call(engine, "/update_weights_from_tensor", {"serialized_named_tensors": ["gASV"]})
    assert truncated.status_code == 400 and "entry does not decode" in truncated.json()["message"]


def test_a_segment_not_marked_finite_by_the_trainer_is_checked_by_the_engine(engine, reference):
    """Only a description with "finite": true (SegmentWriter's, written after its own check) skips the engine's
    NaN/Inf pass: one without it, as an older trainer sends, is read and refused there."""
    weights = {name: p.detach() for name, p in reference.named_parameters()}
    writer = SegmentWriter()
    try:
        writer.begin(weights)
        spec = json.loads(writer.write(weights, "unmarked"))
        assert spec.pop("finite") is True
        name, _, _, offset = next(entry for entry in spec["tensors"] if entry[0] == "model.norm.weight")
        writer.buffer[offset:offset + 4].view(torch.float32)[0] = float("nan")  # after the trainer's check
        answer = call(engine, "/update_weights_from_tensor", {"serialized_named_tensors": [json.dumps(spec)],
                                                              "load_format": "slimeflow_shared_memory",
                                                              "weight_version": "unmarked"})
    finally:
        writer.close()
    assert answer.status_code == 400 and "hold NaN or Inf values (e.g. ['model.norm.weight'])" in answer.json()["message"]
    assert greedy(engine)["meta_info"]["weight_version"] == "v0"


def test_sglangs_tensor_body_from_this_process_serves_the_trainers_log_probs(engine, reference, model_dir):
    """The colocated SGLang transport ("ipc": SGLang's flattened buckets of /dev/shm handles, test_tensor_ipc.py)
    into the engine: after a push in buckets its log-probs of a sequence are those of the pushed weights, and
    bodies SGLang would refuse answer its {"success": false, "message"}."""
    from slimeflow.engine.tensor_ipc import update_body

    shifted = shifted_weights(reference, seed=11)

    async def push(weights: dict[str, torch.Tensor], version: str) -> int:
        sync = WeightSync(WeightTargets((engine.url,), str(model_dir), api_key=KEY), buffer_size=16 * 2**20,
                          transport="ipc")
        try:
            await sync.push(weights, version)
        finally:
            await sync.aclose()
        return sync.buckets_sent

    assert asyncio.run(push(shifted, "ipc-1")) > 1
    tokens = PROMPT + [33, 44, 55]
    answer = call(engine, "/generate", {"input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
                                        "sampling_params": {"temperature": 1.0, "max_new_tokens": 0}}).json()
    unknown, kept = update_body({"model.no_such.weight": torch.ones(2)})
    wrong_shape, kept_too = update_body({"lm_head.weight": torch.ones(2, 3)}, load_format=None)
    refusals = [call(engine, "/update_weights_from_tensor", body).json() for body in (unknown, wrong_shape)]
    asyncio.run(push(dict(reference.named_parameters()), "v0"))
    assert answer["meta_info"]["weight_version"] == "ipc-1"
    with torch.no_grad():  # the trainer's log-probs: the reference model run with the pushed weights
        logits = torch.func.functional_call(reference, shifted, (torch.tensor([tokens]),)).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    served = torch.tensor([e[0] for e in answer["meta_info"]["input_token_logprobs"][1:]])
    torch.testing.assert_close(served, expected, atol=1e-5, rtol=0)
    assert [r["success"] for r in refusals] == [False, False]
    assert "model.no_such.weight" in refusals[0]["message"] and "wrong shape" in refusals[1]["message"]
    del kept, kept_too


def test_distributed_update_without_a_group_or_with_bad_metadata_is_refused(engine):
    missing = call(engine, "/update_weights_from_distributed", {"names": ["lm_head.weight"], "dtypes": ["float32"],
                                                                 "shapes": [[1]], "group_name": "nope"})
    assert missing.status_code == 400 and "POST /init_weights_update_group first" in missing.json()["message"]
    nccl = call(engine, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                       "rank_offset": 1, "world_size": 2, "backend": "nccl"})
    assert nccl.status_code == 400 and "gloo" in nccl.json()["message"]
    with pytest.raises(EngineRequestError, match="no weight-update group 'nope'"):
        asyncio.run(EngineClient(engine.url, api_key=KEY).control("/destroy_weights_update_group",
                                                                  {"group_name": "nope"}))


def test_an_engine_killed_mid_rollout_is_named_with_its_log_tail(tmp_path):
    """Without --use-fault-tolerance a dead engine ends the rollout at once (no hang), and the RolloutManager's error
    names it, how it died and its log."""
    model = build_tiny_model(tmp_path / "tiny", TinyModelSpec(seed=1))
    engines = EngineSet.start(str(model), {}, num_engines=1)  # an engine process (in_process is not asked for)
    engine = engines.processes[0]

    async def killed_mid_request() -> None:
        client = engines.client()
        long = asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 400, "ignore_eos": True}))
        while (await client.workers[0]._request("GET", "/get_model_info")).json()["running"] < 1:
            await asyncio.sleep(0.01)
        os.kill(engine.process.pid, signal.SIGKILL)
        with pytest.raises(EngineUnavailableError, match=engine.url):
            await asyncio.wait_for(long, 30)
        await engines.aclose()

    try:
        engines.check_alive(grace_s=0.1)  # alive: nothing to say
        asyncio.run(killed_mid_request())
        with pytest.raises(EngineDiedError) as died:
            engines.check_alive()
        message = str(died.value)
        assert f"engine at {engine.url} was killed by signal 9" in message
        assert "--use-fault-tolerance" in message and f"serving {model}" in message  # the engine's own log line
    finally:
        engines.stop()


def test_input_token_logprobs_as_sglang_returns_them_for_a_teacher_scoring_a_sequence(engine, reference):
    """max_new_tokens 0 with return_logprob and logprob_start_len: the input tokens' log-probs at the request's
    temperature, first one None (what slime's on-policy distillation asks a teacher server for)."""
    tokens = PROMPT + [33, 44, 55]
    body = {"input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"temperature": 0.7, "max_new_tokens": 0}}
    answer = call(engine, "/generate", body).json()
    entries = answer["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == tokens and entries[0][0] is None and answer["output_ids"] == []
    with torch.no_grad():
        logits = reference(torch.tensor([tokens])).logits[0, :-1] / 0.7
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([e[0] for e in entries[1:]]), expected, atol=1e-4, rtol=1e-4)
    later = call(engine, "/generate", {**body, "logprob_start_len": 3}).json()["meta_info"]["input_token_logprobs"]
    assert later == entries[3:]
    refused = call(engine, "/generate", {**body, "sampling_params": {"max_new_tokens": 4}})
    assert refused.status_code == 400 and "only with max_new_tokens 0" in refused.text


def test_slimes_on_policy_distillation_reward_pair_runs_against_the_engine_as_teacher(engine, reference):
    """slime.rollout.on_policy_distillation (the compat namespace's): reward_func asks the teacher at --rm-url,
    post_process_rewards keeps the response's teacher log-probs and scores 0."""
    from types import SimpleNamespace

    from slimeflow import slime_compat
    from slimeflow.slime_compat.utils.http_utils import init_http_client

    slime_compat.install()
    from slime.rollout.on_policy_distillation import post_process_rewards, reward_func
    from slime.utils.types import Sample

    host, port = engine.url.removeprefix("http://").split(":")
    args = SimpleNamespace(rm_url=engine.url + "/generate", rollout_temperature=1.0, reward_key=None,
                           sglang_api_key=KEY, sglang_router_ip=host, sglang_router_port=int(port))
    init_http_client(args)
    samples = [Sample(index=i, tokens=PROMPT + response, response_length=len(response))
               for i, response in enumerate([[33, 44], [60, 61, 62]])]

    async def score():
        for sample in samples:
            sample.reward = await reward_func(args, sample)
    asyncio.run(score())
    raw, rewards = post_process_rewards(args, samples)
    assert raw == rewards == [0.0, 0.0]
    for sample in samples:
        with torch.no_grad():
            logits = reference(torch.tensor([sample.tokens])).logits[0, :-1]
        logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.tokens[1:])[:, None])[:, 0]
        torch.testing.assert_close(sample.teacher_log_probs, logp[-sample.response_length:], atol=1e-4, rtol=1e-4)


def test_after_an_engine_restart_the_next_shared_memory_push_writes_files_every_engine_can_map():
    """The segment's file names are removed once the engines have mapped them, so a restarted engine (fault
    tolerance) could not map the slot the next push writes into: regroup() drops the segment for new files."""
    import asyncio

    from slimeflow.stages.train.engines import WeightTargets
    from slimeflow.stages.train.weight_sync import WeightSync

    sync = WeightSync(WeightTargets(worker_urls=(), hf_checkpoint="unused"), transport="shared_memory")
    writer, version = sync._segment(), {"w": torch.ones(8)}

    def push() -> str:
        writer.begin(version)
        path = json.loads(writer.write(version))["path"]
        writer.mapped()  # every engine mapped it: its name goes
        writer.commit()
        return path

    first, second = push(), push()  # both slots written, mapped and unlinked
    assert not os.path.exists(first) and not os.path.exists(second)
    asyncio.run(sync.regroup())
    writer.begin(version)
    fresh = json.loads(writer.write(version))["path"]
    assert fresh not in (first, second) and os.path.exists(fresh)  # a restarted engine can map it
    writer.close()
