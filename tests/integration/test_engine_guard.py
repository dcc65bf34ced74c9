"""The engine against callers it should not trust (issue 16, items 7 and 8), over HTTP against a running engine:
the API key, disk updates confined to --weights-dir, NaN/Inf updates, request body caps, text too long for the
context, tokenising off the event loop, and health and other callers kept answering behind one huge call."""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file

from slimeflow.engine.client import EngineClient, EngineRequestError
from slimeflow.engine.launch import new_api_key, start_engine
from slimeflow.families.tiny import TinyModelSpec, build_tiny_model

KEY = new_api_key()
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [256, 72, 101, 108, 108, 111]
GREEDY = {"temperature": 0.0, "max_new_tokens": 8}


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("guard") / "tiny", TinyModelSpec(seed=1))


@pytest.fixture(scope="module")
def engine(model_dir, weights_dir):
    with start_engine(model_dir, num_threads=1, max_batch_size=4, api_key=KEY, weights_dir=weights_dir,
                      weight_version="v0", context_length=256, max_queued_requests=1200) as process:
        yield process


def client(engine, key: str | None = KEY) -> EngineClient:
    return EngineClient(engine.url, api_key=key, timeout_s=30, retries=0)


def greedy(engine) -> dict:
    return httpx.post(engine.url + "/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY},
                      headers=AUTH, timeout=30).json()


def version(engine) -> str:
    return httpx.get(engine.url + "/get_weight_version", headers=AUTH, timeout=10).json()["weight_version"]


# ---- item 7: who may call ------------------------------------------------------------------------------------

MUTATING = [("POST", "/update_weights_from_disk", {"model_path": "/tmp"}), ("POST", "/update_weights_from_tensor", None),
            ("POST", "/abort_request", {"abort_all": True}), ("POST", "/pause_generation", None),
            ("POST", "/continue_generation", None), ("POST", "/flush_cache", None),
            ("POST", "/generate", {"input_ids": PROMPT}), ("GET", "/get_model_info", None),
            ("POST", "/release_memory_occupation", None), ("POST", "/resume_memory_occupation", None),
            ("POST", "/init_weights_update_group", None), ("POST", "/update_weights_from_distributed", None),
            ("POST", "/destroy_weights_update_group", None), ("GET", "/get_weights_snapshot", None)]


@pytest.mark.parametrize("key", [None, "wrong-key"], ids=["no-key", "wrong-key"])
def test_every_path_but_health_needs_the_api_key(engine, key):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    served = version(engine)
    for method, path, body in MUTATING:
        response = httpx.request(method, engine.url + path, json=body, headers=headers, timeout=10)
        assert response.status_code == 401, (path, response.status_code, response.text)
        assert "Authorization: Bearer <key>" in response.json()["error"]["message"]
    for path in ("/health", "/health_generate"):  # as SGLang: probes need no key
        assert httpx.get(engine.url + path, headers=headers, timeout=30).status_code == 200
    assert version(engine) == served
    assert httpx.get(engine.url + "/get_model_info", headers=AUTH, timeout=10).status_code == 200


def test_disk_updates_load_only_from_inside_the_weights_dir(engine, weights_dir, tmp_path):
    before, served = greedy(engine)["output_ids"], version(engine)
    outside = build_tiny_model(tmp_path / "outside", TinyModelSpec(seed=2))
    secret = tmp_path / "secret"
    secret.mkdir()
    save_file({"private.customer_embedding": torch.zeros(2)}, str(secret / "data.safetensors"))
    (weights_dir / "escape").symlink_to(secret)  # inside by name, outside once resolved
    (weights_dir / "files").mkdir()
    (weights_dir / "files" / "model.safetensors").symlink_to(secret / "data.safetensors")
    for path in (outside, secret, weights_dir / "escape", weights_dir / "files", f"{weights_dir}/../{secret.name}"):
        with pytest.raises(EngineRequestError, match="outside the engine's --weights-dir") as err:
            asyncio.run(client(engine).update_weights_from_disk(str(path), "stolen"))
        assert err.value.status == 403 and "customer_embedding" not in err.value.message
    assert version(engine) == served and greedy(engine)["output_ids"] == before


def test_non_finite_weights_are_refused_and_the_old_weights_keep_serving(engine, model_dir, weights_dir):
    from transformers import AutoModelForCausalLM

    before, served = greedy(engine)["output_ids"], version(engine)
    weight = AutoModelForCausalLM.from_pretrained(model_dir).lm_head.weight.detach().clone()
    for bad in (float("nan"), float("inf")):
        poisoned = weight.clone()
        poisoned[3, 5] = bad
        with pytest.raises(EngineRequestError, match=f"NaN or Inf.*keeps serving weight version '{served}'") as err:
            asyncio.run(client(engine).update_weights_from_tensor({"lm_head.weight": poisoned}, "poisoned"))
        assert err.value.status == 400
    on_disk = weights_dir / "nan"
    on_disk.mkdir()
    save_file({"lm_head.weight": weight * float("nan")}, str(on_disk / "model.safetensors"))
    with pytest.raises(EngineRequestError, match="NaN or Inf"):
        asyncio.run(client(engine).update_weights_from_disk(str(on_disk), "poisoned"))
    assert version(engine) == served and greedy(engine)["output_ids"] == before


# ---- item 8: how much they may ask ---------------------------------------------------------------------------

def raw_headers_only(url: str, path: str, length: int) -> tuple[int, str]:
    """Send only the headers of a POST announcing `length` bytes; the engine's answer (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.endswith(b"}"):
            chunk = sock.recv(65536)  # socket.timeout here: the engine waits for a body it should refuse
            if not chunk:
                break
            answer += chunk
    head, _, body = answer.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


def test_an_oversized_body_is_refused_from_its_content_length(engine):
    status, body = raw_headers_only(engine.url, "/generate", 300 * 2**20)
    assert status == 413 and "--max-request-body-mb" in body
    status, body = raw_headers_only(engine.url, "/update_weights_from_tensor", 10 * 2**30)
    assert status == 413 and "send only the served model's tensors" in body
    assert httpx.get(engine.url + "/health", timeout=5).status_code == 200


def test_a_streamed_body_is_cut_off_at_the_limit(engine):
    def chunks():  # no Content-Length: 65 MB of whitespace around a valid request
        yield b'{"input_ids": [256, 72], "sampling_params": {"max_new_tokens": 1}'
        for _ in range(65):
            yield b" " * 2**20
        yield b"}"

    response = httpx.post(engine.url + "/generate", content=chunks(), headers=AUTH, timeout=60)
    assert response.status_code == 413, response.text[:300]
    assert "more than the engine's limit of 67108864 bytes" in response.json()["error"]["message"]


def test_a_text_longer_than_the_context_is_refused_without_tokenising(engine):
    start = time.monotonic()
    response = httpx.post(engine.url + "/generate", json={"text": "x" * 5_000_000}, headers=AUTH, timeout=60)
    assert response.status_code == 400
    assert "5000000 characters" in response.json()["error"]["message"], response.text
    assert time.monotonic() - start < 5  # tokenising 5 M characters here takes ~15 s


def test_health_answers_while_a_long_batch_of_text_tokenises(engine):
    # 240 texts just under the length check (4 x 19 characters x 256 positions), ~4.6 M characters of short words:
    # ~4 s of tokenising, then refused (too many tokens).
    body = {"text": [("ab cd e, " * 2200)[:19_000]] * 240, "sampling_params": {"max_new_tokens": 1}}

    async def probe_while_tokenising() -> tuple[float, httpx.Response]:
        async with httpx.AsyncClient(base_url=engine.url, headers=AUTH, timeout=120) as http:
            request = asyncio.create_task(http.post("/generate", json=body))
            await asyncio.sleep(0.5)  # the body is sent and tokenising
            start = time.monotonic()
            assert (await http.get("/health", timeout=5)).status_code == 200
            waited = time.monotonic() - start
            assert not request.done(), "the text must still be tokenising while /health answers"
            return waited, await request

    waited, response = asyncio.run(probe_while_tokenising())
    assert response.status_code == 400 and "at or beyond the engine's context length (256" in response.text
    print(f"/health answered in {waited:.3f} s while tokenising")


def test_health_generate_and_other_callers_are_not_starved_by_one_huge_call(engine):
    huge = {"input_ids": [PROMPT] * 1000, "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}, "rid": "huge"}

    async def others_during_the_huge_call() -> None:
        async with httpx.AsyncClient(base_url=engine.url, headers=AUTH, timeout=300) as http:
            request = asyncio.create_task(http.post("/generate", json=huge))
            while (await http.get("/get_model_info")).json()["running"] == 0:
                assert not request.done(), request.result().text
                await asyncio.sleep(0.01)
            try:
                # Behind 1000 x 240 tokens at 4 a step (minutes), each of these answered within the bound.
                assert (await http.get("/health_generate", timeout=5)).status_code == 200
                small = await http.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY}, timeout=5)
                assert small.json()["meta_info"]["completion_tokens"] == 8
                more = await http.post("/generate", json={"input_ids": [PROMPT] * 300}, timeout=5)
                assert more.status_code == 503 and "--max-queued-requests 1200" in more.json()["error"]["message"]
                assert not request.done()
            finally:
                await http.post("/abort_request", json={"abort_all": True})
            outputs = (await request).json()
            assert sum(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outputs) >= 990

    asyncio.run(others_during_the_huge_call())


def test_the_key_reaches_the_engine_through_its_environment_not_its_command_line(engine):
    with open(f"/proc/{engine.process.pid}/cmdline", "rb") as cmdline:  # readable by every local user
        assert KEY.encode() not in cmdline.read()


def test_external_servers_get_the_sglang_api_key_on_every_call(engine, model_dir):
    """--sglang-api-key: the key of SGLang servers started with --api-key (this engine stands in for one), sent by
    the rollout client and by the weight sync, which writes into the servers' weights directory."""
    from transformers import AutoModelForCausalLM

    from slimeflow.stages.train.engines import EngineSet
    from slimeflow.stages.train.weight_sync import WeightSync

    weights_dir = engine.command[engine.command.index("--weights-dir") + 1]
    engines = EngineSet.start(str(model_dir), {"worker_urls": [engine.url], "weights_dir": weights_dir,
                                               "api_key": KEY}, num_engines=1)
    targets = engines.weight_targets()
    assert KEY not in repr(targets) and KEY not in repr(engines)

    async def rollout_and_sync() -> dict:
        sync = WeightSync(targets)
        try:
            named = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
            assert await sync.push(named, "external-1") == "external-1"
            return await engines.client().generate(PROMPT, GREEDY)
        finally:
            await sync.aclose()
            await engines.aclose()

    assert asyncio.run(rollout_and_sync())["meta_info"]["weight_version"] == "external-1"


@pytest.mark.parametrize(("body", "words"), [
    ({"input_ids": [[256]] * 1201}, "a /generate of 1201 prompts is more than the engine queues (--max-queued-requests"),
    ({"input_ids": [256] * 300}, "the prompt has 300 tokens, at or beyond the engine's context length (256: --context-length"),
    ({"input_ids": [256] * 200, "sampling_params": {"max_new_tokens": 100}}, "max_new_tokens=100 does not fit"),
])
def test_requests_past_the_engines_limits_answer_400_naming_the_flag(engine, body, words):
    response = httpx.post(engine.url + "/generate", json=body, headers=AUTH, timeout=30)
    assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
