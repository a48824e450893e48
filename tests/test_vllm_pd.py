"""vLLM's P/D protocol (`kv_transfer_params`) on dsakv's prefill and decode servers: a proxy
written here as vLLM's toy_proxy_server.py runs it (the prefill server first, max_tokens 1,
then the original request to the decode server with the prefill answer's
kv_transfer_params), against a plain server's greedy output."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from dsakv.disagg import bootstrap, handoff
from dsakv.engine import EngineConfig
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model

from .serving import (
    NO_THINKING,
    TIMEOUT,
    disagg_info,
    routing,
    scrape_metrics,
    serving,
    serving_disagg,
    wait_idle,
)

HOLD_S = 4  # the prefill server's --disaggregation-timeout: how long it holds KV for a pickup
KEY = "sekret"  # the prefill server's --api-key (every request here sends it)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3  # several pages, one partial
GREEDY = {"temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], **NO_THINKING, **GREEDY}


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """A prefill server (holding KV `HOLD_S` seconds, behind `KEY`), a decode server and a
    plain server, one glm-tiny model (index_topk covering every context: exact) in this
    process."""
    root = tmp_path_factory.mktemp("vllm_pd")
    model = write_tiny_model(root / "tiny", {**TINY_PRESETS["glm-tiny"], "index_topk": 1024})
    conf = EngineConfig(str(model), device="cpu", num_pages=64, page_size=16,
                        kv_cache_dtype="fp32", index_k_dtype="fp32")  # fmt: skip
    with contextlib.ExitStack() as stack:
        prefill, _ = stack.enter_context(
            serving_disagg(conf, "prefill", api_key=KEY, timeout_s=HOLD_S)
        )
        decode, _ = stack.enter_context(serving_disagg(conf, "decode"))
        plain, _ = stack.enter_context(serving(conf))
        yield SimpleNamespace(prefill=prefill, decode=decode, plain=plain, model=str(model))


def _post(url: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url, json=body, timeout=TIMEOUT, headers=headers)


def prefill_first(prefill: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's proxy's first leg: the client's request as max_tokens 1, not streamed, with
    do_remote_decode, without min_tokens (toy_proxy_server.py drops it); returns the
    prefill server's answer."""
    req = {**body, "stream": False, "max_tokens": 1}
    for key in ("min_tokens", "min_completion_tokens"):
        req.pop(key, None)
    req["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req.pop("stream_options", None)
    r = _post(prefill + path, req)
    assert r.status_code == 200, r.text
    return r.json()


def then_decode(decode: str, path: str, body: dict[str, Any], params: dict) -> httpx.Response:
    """The second leg: the original request, with the prefill answer's kv_transfer_params."""
    return _post(decode + path, {**body, "kv_transfer_params": params})


def proxied(pd: SimpleNamespace, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The whole flow, answered 200: the decode server's answer."""
    first = prefill_first(pd.prefill, path, body)
    r = then_decode(pd.decode, path, body, first["kv_transfer_params"])
    assert r.status_code == 200, r.text
    return r.json()


def text_of(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    return r.json()["error"]


# --- the flow ----------------------------------------------------------------------------------


def test_completions_and_chat_equal_the_plain_server(pd):
    """Greedy completions and chat through the proxy flow equal the plain server's; the
    prefill answer is one token plus where the KV waits (vLLM's NixlConnector's fields),
    the decode server took it over the transfer, and both give their pages back."""
    body = {"prompt": PROMPT, "max_tokens": 12, **GREEDY}
    want = _post(pd.plain + "/v1/completions", body).json()
    before = scrape_metrics(pd.decode)
    first = prefill_first(pd.prefill, "/v1/completions", body)
    assert first["usage"]["completion_tokens"] == 1
    assert text_of(first) == text_of(want)[: len(text_of(first))]
    kv = first["kv_transfer_params"]
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert (kv["remote_host"], kv["remote_port"]) == (
        "127.0.0.1",
        disagg_info(pd.prefill)["bootstrap_port"],
    )
    assert len(kv["remote_block_ids"]) == -(-prompt_tokens // 16) and kv["tp_size"] == 1
    assert isinstance(kv["remote_engine_id"], str) and kv["remote_request_id"].isdigit()
    got = then_decode(pd.decode, "/v1/completions", body, kv).json()
    assert text_of(got) == text_of(want) and got["usage"] == want["usage"]
    grew = scrape_metrics(pd.decode)["dsakv_kv_transfer_tokens_total"]
    assert grew - before["dsakv_kv_transfer_tokens_total"] == prompt_tokens

    chat = {**CHAT, "max_completion_tokens": 10}
    want = _post(pd.plain + "/v1/chat/completions", chat).json()
    got = proxied(pd, "/v1/chat/completions", chat)
    assert text_of(got) == text_of(want) and got["usage"] == want["usage"]
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


def test_the_decode_server_streams(pd):
    """The original request streamed (with usage) from the decode server, as the client
    asked; the prefill leg is never streamed."""
    body = {"prompt": PROMPT, "max_tokens": 9, **GREEDY}
    want = text_of(_post(pd.plain + "/v1/completions", body).json())
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    first = prefill_first(pd.prefill, "/v1/completions", streamed)
    params = {**streamed, "kv_transfer_params": first["kv_transfer_params"]}
    with httpx.stream("POST", pd.decode + "/v1/completions", json=params, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    assert chunks[-1]["usage"]["completion_tokens"] == 9
    wait_idle(pd.decode)


def test_the_first_token_follows_the_decode_request_sampling_params(pd):
    """vLLM's proxy drops min_tokens from the prefill leg; the decode server runs the last
    prompt token itself, so its first token obeys min_tokens: with the plain server's first
    greedy token as a stop token, the output (tokens, logprobs, finish) equals the plain
    server's."""
    base = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    base["return_tokens_as_token_ids"] = True
    plain = _post(pd.plain + "/v1/completions", base).json()
    first = int(plain["choices"][0]["logprobs"]["tokens"][0].split(":")[1])
    body = {**base, "min_tokens": 3, "stop_token_ids": [first]}
    want = _post(pd.plain + "/v1/completions", body).json()
    assert want["choices"][0]["logprobs"]["tokens"][0] != f"token_id:{first}"
    got = proxied(pd, "/v1/completions", body)
    assert got["choices"][0] == want["choices"][0] and got["usage"] == want["usage"]
    wait_idle(pd.decode)


def test_concurrent_requests_and_both_protocols_at_once(pd):
    """Two vLLM-protocol requests and one through `dsakv router` (SGLang's protocol) on the
    same pair at once: each equals the plain server's."""
    prompts = [PROMPT, "Once upon a time, in a land far away, " * 2, "Two plus two is"]
    bodies = [{"prompt": p, "max_tokens": 8, **GREEDY} for p in prompts]
    want = [text_of(_post(pd.plain + "/v1/completions", b).json()) for b in bodies]
    with routing([pd.prefill], [pd.decode]) as router, ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(proxied, pd, "/v1/completions", b) for b in bodies[:2]]
        runs.append(pool.submit(lambda: _post(router + "/v1/completions", bodies[2]).json()))
        assert [text_of(f.result()) for f in runs] == want
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


# --- the hold ----------------------------------------------------------------------------------


def test_the_hold_is_let_go_at_pickup_and_a_second_pickup_is_refused(pd):
    """Between the prefill answer and the pickup the prefill server holds the prompt's
    pages; the pickup gives them back; the same kv_transfer_params again is a 410 (gone),
    another room or another prefill engine's a 404, each leaving no page reserved."""
    body = {"prompt": PROMPT, "max_tokens": 4, **GREEDY}
    first = prefill_first(pd.prefill, "/v1/completions", body)
    kv = first["kv_transfer_params"]
    info = disagg_info(pd.prefill)
    assert (info["pending"], info["open_rooms"], info["integrity"]) == (1, 1, "busy")
    r = then_decode(pd.decode, "/v1/completions", body, kv)
    assert r.status_code == 200, r.text
    again = error_of(then_decode(pd.decode, "/v1/completions", body, kv), 410)
    assert "already took it" in again["message"] and again["param"] == "kv_transfer_params"
    wait_idle(pd.prefill)
    assert disagg_info(pd.prefill)["open_rooms"] == 0
    other_room = {**kv, "remote_request_id": str(int(kv["remote_request_id"]) ^ 1)}
    unknown = error_of(then_decode(pd.decode, "/v1/completions", body, other_room), 404)
    assert "no KV is held for room" in unknown["message"]
    other_engine = {**kv, "remote_engine_id": "another-engine"}
    assert (
        "remote_engine_id"
        in error_of(then_decode(pd.decode, "/v1/completions", body, other_engine), 404)["message"]
    )
    wait_idle(pd.decode)


def test_a_wrong_pickup_is_refused_and_the_hold_stays_for_the_right_one(pd):
    """A decode request for another prompt is a 400 that leaves the hold as it was: the
    right pickup after it decodes."""
    body = {"prompt": PROMPT, "max_tokens": 4, **GREEDY}
    kv = prefill_first(pd.prefill, "/v1/completions", body)["kv_transfer_params"]
    wrong = then_decode(pd.decode, "/v1/completions", {**body, "prompt": PROMPT + " x"}, kv)
    assert "not the one prefilled" in error_of(wrong, 400)["message"]
    assert disagg_info(pd.prefill)["open_rooms"] == 1
    want = _post(pd.plain + "/v1/completions", body).json()
    r = then_decode(pd.decode, "/v1/completions", body, kv)
    assert r.status_code == 200, r.text
    assert text_of(r.json()) == text_of(want)
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


def test_bad_block_ids_or_tp_size_leave_the_hold_and_other_block_ids_are_ignored(pd):
    """Malformed remote_block_ids or tp_size are a 400 that leaves the hold for the right
    pickup (it took the KV and decoded); any prefill tp_size pairs (every TP rank holds the
    whole latent). Well-formed block ids that are not the hold's
    pages (or none) are ignored: the prefill server writes the pages it holds for the room
    (dsakv pushes the KV; vLLM's decode server reads the blocks named), the room and engine
    id find the hold and its prompt is checked."""
    body = {"prompt": PROMPT, "max_tokens": 4, **GREEDY}
    want = _post(pd.plain + "/v1/completions", body).json()
    kv = prefill_first(pd.prefill, "/v1/completions", body)["kv_transfer_params"]
    for bad in ({"remote_block_ids": "x"}, {"tp_size": "one"}, {"tp_size": 0}):
        r = then_decode(pd.decode, "/v1/completions", body, {**kv, **bad})
        assert error_of(r, 400)["param"] == _KV
        assert next(iter(bad)) in r.json()["error"]["message"]
    assert disagg_info(pd.prefill)["open_rooms"] == 1
    other = {**kv, "remote_block_ids": [999, 1000]}
    del other["tp_size"]  # (vLLM's older answers carry none)
    r = then_decode(pd.decode, "/v1/completions", body, other)
    assert r.status_code == 200, r.text
    assert text_of(r.json()) == text_of(want)
    kv = prefill_first(pd.prefill, "/v1/completions", body)["kv_transfer_params"]
    r = then_decode(pd.decode, "/v1/completions", body, {**kv, "tp_size": 8})
    assert r.status_code == 200 and text_of(r.json()) == text_of(want), r.text  # (MLA: any TP)
    kv = prefill_first(pd.prefill, "/v1/completions", body)["kv_transfer_params"]
    r = then_decode(pd.decode, "/v1/completions", body, {**kv, "remote_block_ids": None})
    assert r.status_code == 200 and text_of(r.json()) == text_of(want), r.text
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


def test_a_remote_port_that_is_no_bootstrap_port_fails_fast_and_the_hold_stays(pd, monkeypatch):
    """remote_port naming a live port that does not speak the bootstrap protocol (the
    prefill server's HTTP port) is a 502 naming it once the peer leaves the registration
    unanswered a few seconds (a bootstrap server answers at once), not after the decode
    server's --disaggregation-timeout (30 s here: the hold long gone by then); the right
    pickup after it decodes."""
    monkeypatch.setattr(bootstrap, "_ANSWER_S", 1.0)  # (5 s: past this module's hold)
    body = {"prompt": PROMPT, "max_tokens": 4, **GREEDY}
    kv = prefill_first(pd.prefill, "/v1/completions", body)["kv_transfer_params"]
    http_port = httpx.URL(pd.prefill).port
    wrong = then_decode(pd.decode, "/v1/completions", body, {**kv, "remote_port": http_port})
    message = error_of(wrong, 502)["message"]
    assert f"127.0.0.1:{http_port} for 1 s" in message and "bootstrap port" in message
    monkeypatch.undo()
    assert disagg_info(pd.prefill)["open_rooms"] == 1
    want = _post(pd.plain + "/v1/completions", body).json()
    r = then_decode(pd.decode, "/v1/completions", body, kv)
    assert r.status_code == 200 and text_of(r.json()) == text_of(want), r.text
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


def _let_go(pd: SimpleNamespace, body: dict[str, Any], kv: dict[str, Any]) -> dict[str, Any]:
    """Once the prefill server holds nothing, the 410 a pickup of `kv` gets."""
    deadline = time.monotonic() + HOLD_S + TIMEOUT
    while disagg_info(pd.prefill)["pending"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return error_of(then_decode(pd.decode, "/v1/completions", body, kv), 410)


def test_a_decode_request_failing_before_its_pickup_drops_the_hold(pd):
    """The decode server refuses the request (max_tokens past its context) before it picks
    the KV up: it tells the prefill server, which lets the KV go then, not once its
    --disaggregation-timeout passes; a later pickup hears why."""
    body = {"prompt": PROMPT, "max_tokens": 4, **GREEDY}
    kv = prefill_first(pd.prefill, "/v1/completions", body)["kv_transfer_params"]
    refused = then_decode(pd.decode, "/v1/completions", {**body, "max_tokens": 10**6}, kv)
    assert "maximum context length" in error_of(refused, 400)["message"]
    late = _let_go(pd, body, kv)
    assert "the decode request for it failed (HTTP 400" in late["message"], late
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


def test_a_weight_update_lets_the_held_kv_go(pd):
    """/update_weights_from_disk on the prefill server does not wait out the holds (its
    engine is busy while it holds pages): they go, and their pickup hears why."""
    body = {"prompt": PROMPT, "max_tokens": 4, **GREEDY}
    kv = prefill_first(pd.prefill, "/v1/completions", body)["kv_transfer_params"]
    r = _post(pd.prefill + "/update_weights_from_disk", {"model_path": pd.model})
    assert r.status_code == 200 and r.json()["success"], r.text
    late = _let_go(pd, body, kv)
    assert "weights were updated" in late["message"], late
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


def test_a_hold_nobody_takes_expires_and_its_pickup_hears_so(pd):
    """No decode request within --disaggregation-timeout: the prefill server lets the pages
    go by itself; a pickup after that is a 410 saying the hold expired."""
    body = {"prompt": PROMPT, "max_tokens": 4, **GREEDY}
    kv = prefill_first(pd.prefill, "/v1/completions", body)["kv_transfer_params"]
    assert disagg_info(pd.prefill)["pending"] == 1
    late = _let_go(pd, body, kv)
    assert "expired" in late["message"] and "--disaggregation-timeout" in late["message"]
    wait_idle(pd.prefill)
    wait_idle(pd.decode)


# --- refusals ----------------------------------------------------------------------------------

_KV = "kv_transfer_params"
_ASK_DECODE = {"do_remote_decode": True, "do_remote_prefill": False}
_TAKE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "e",
    "remote_request_id": "7",
    "remote_host": "127.0.0.1",
    "remote_port": 1,
}


@pytest.mark.parametrize(
    "server, path, body, param, words",
    [
        ("prefill", "/v1/completions", {"kv_transfer_params": "x"}, None, "must be an object"),
        ("prefill", "/v1/completions", {"kv_transfer_params": _TAKE}, None, "for a decode"),
        ("decode", "/v1/completions", {"kv_transfer_params": _ASK_DECODE}, None, "for a prefill"),
        ("plain", "/v1/completions", {"kv_transfer_params": _TAKE}, None, "--disaggregation-mode"),
        (
            "decode",
            "/v1/completions",
            {"kv_transfer_params": {**_TAKE, "remote_host": None, "remote_port": None}},
            None,
            "needs remote_host, remote_port",
        ),
        (
            "decode",
            "/v1/completions",
            {"kv_transfer_params": {**_TAKE, "remote_port": "x"}},
            None,
            "remote_port must be an integer",
        ),
        (
            "decode",
            "/v1/completions",
            {"kv_transfer_params": {**_TAKE, "remote_block_ids": "x"}},
            None,
            "remote_block_ids must be a list",
        ),
        (
            "decode",
            "/v1/completions",
            {"kv_transfer_params": {**_TAKE, "remote_block_ids": [3, "4"]}},
            None,
            "remote_block_ids must be a list",
        ),
        (
            "decode",
            "/v1/completions",
            {"kv_transfer_params": {**_TAKE, "tp_size": "one"}},
            None,
            "tp_size must be an integer >= 1",
        ),
        (
            "decode",
            "/v1/completions",
            {"kv_transfer_params": {**_TAKE, "tp_size": 0}},
            None,
            "tp_size must be an integer >= 1",
        ),
        (
            "prefill",
            "/v1/completions",
            {"kv_transfer_params": {**_TAKE, "do_remote_decode": True}},
            None,
            "both",
        ),
        ("prefill", "/v1/completions", {"kv_transfer_params": _ASK_DECODE, "n": 2}, "n", "n > 1"),
        (
            "prefill",
            "/v1/completions",
            {"kv_transfer_params": _ASK_DECODE, "stream": True},
            "stream",
            "stream: false",
        ),
        (
            "prefill",
            "/v1/completions",
            {"kv_transfer_params": _ASK_DECODE, "bootstrap_room": 5},
            None,
            "one protocol",
        ),
        ("prefill", "/v1/responses", {"kv_transfer_params": _ASK_DECODE}, None, "is taken by"),
        (
            "prefill",
            "/v1/completions",
            {"kv_transfer_params": _ASK_DECODE, "prompt": [PROMPT, "Hello"]},
            None,
            "one prompt",
        ),
    ],
)
def test_bad_kv_transfer_params_are_one_clear_4xx(pd, server, path, body, param, words):
    """Each a 400 naming kv_transfer_params (or the field at fault), before anything runs:
    no room is left open, no page held."""
    prompt = {"input": "x"} if path == "/v1/responses" else {"prompt": PROMPT}
    error = error_of(_post(getattr(pd, server) + path, {**prompt, **body, "max_tokens": 4}), 400)
    assert error["param"] == (param or "kv_transfer_params") and words in error["message"]
    assert disagg_info(pd.prefill)["open_rooms"] == 0
    wait_idle(pd.prefill if server == "prefill" else pd.decode)


def test_a_keyless_request_is_a_401_whatever_its_kv_transfer_params(pd):
    """The API key is checked first (vLLM's order): malformed kv_transfer_params without
    the key is the 401, not the 400 that would tell what the server takes."""
    for kv in ("x", {**_ASK_DECODE, "do_remote_prefill": True}):
        body = {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": kv}
        error = error_of(_post(pd.prefill + "/v1/completions", body, key=None), 401)
        assert error["code"] == "invalid_api_key"
        assert error_of(_post(pd.prefill + "/v1/completions", body), 400)["param"] == _KV
    assert disagg_info(pd.prefill)["open_rooms"] == 0


def test_the_middleware_parses_only_bodies_that_can_hold_the_fields(monkeypatch):
    """A body that cannot name kv_transfer_params (or, without a router's headers,
    bootstrap_room) goes to the app unparsed (a 2 MB image is not read twice); one that
    may, its key written with escapes too, is read and checked."""
    parsed = []

    def spy(raw: bytes) -> Any:
        parsed.append(len(raw))
        return json_or_none(raw)

    json_or_none = handoff._json_or_none
    monkeypatch.setattr(handoff, "_json_or_none", spy)
    app = FastAPI()
    handoff.install(app)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        kv = handoff.kv_transfer("prefill")
        return JSONResponse({"messages": len(body["messages"]), "kv": kv is not None})

    client = TestClient(app)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 2**21}}
    body = {"messages": [{"role": "user", "content": [image]}]}
    headers = {"x-dsakv-bootstrap-room": "5", "x-dsakv-bootstrap-host": "h"}
    r = client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.json() == {"messages": 1, "kv": False} and parsed == []
    escaped = json.dumps(body)[:-1] + ', "kv\\u005ftransfer_params": "x"}'
    r = client.post("/v1/chat/completions", content=escaped, headers=headers)
    assert r.status_code == 400 and "must be an object" in r.text and len(parsed) == 1


@pytest.mark.parametrize("reply", ["[1]", '{"type": "error", "status": "x", "message": "m"}'])
def test_a_drop_answered_with_nonsense_is_a_bootstrap_error(reply):
    """`drop_kv` (the decode side letting a hold go) raises only `BootstrapError`, which its
    caller logs, whatever a peer answers: not an AttributeError or ValueError from a
    background task."""

    async def run() -> None:
        async def answer(reader, writer) -> None:
            await reader.readline()
            writer.write(reply.encode() + b"\n")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            with pytest.raises(bootstrap.BootstrapError) as e:
                await bootstrap.drop_kv("127.0.0.1", port, 7, None, "gone")
        assert e.value.status == 502 or "answered a drop" in str(e.value)

    asyncio.run(run())
