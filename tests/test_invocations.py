"""vLLM's (SageMaker's) POST /invocations on `dsakv serve`: a body with `messages` is a chat
request, one with a `prompt` (and no messages) a completions request, answered as that
route answers it (streamed too, its 400s too); a body with neither is vLLM's 400. A real
server on a loopback port, glm-tiny on the CPU. (Through `dsakv router`:
tests/test_router_relays.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from dsakv.engine import EngineConfig
from dsakv.models.tiny import write_tiny_model

from .serving import NO_THINKING, TIMEOUT, serving

GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], **NO_THINKING, **GREEDY}
PROMPT = {"prompt": "Once upon a time", **GREEDY}
NO_HANDLER = (
    "Cannot find suitable handler for request. Expected one of: "
    "['ChatCompletionRequest', 'CompletionRequest']"
)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Iterator[str]:
    model = str(write_tiny_model(tmp_path_factory.mktemp("invocations") / "m", "glm-tiny"))
    conf = EngineConfig(model, device="cpu", num_pages=64, page_size=16,
                        kv_cache_dtype="fp32", index_k_dtype="fp32")  # fmt: skip
    with serving(conf) as (url, _):
        yield url


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, timeout=TIMEOUT)


def _same(got: httpx.Response, want: httpx.Response) -> None:
    """The same answer but for its id and time."""
    assert got.status_code == want.status_code == 200, got.text
    a, b = got.json(), want.json()
    assert (a["object"], a["choices"], a["usage"]) == (b["object"], b["choices"], b["usage"])


def test_messages_is_chat_and_prompt_is_completions(base):
    for body, path in ((CHAT, "/v1/chat/completions"), (PROMPT, "/v1/completions")):
        _post(base, path, body)  # (the prompt cached first: both answers count it cached)
        _same(_post(base, "/invocations", body), _post(base, path, body))
    # both: chat, as vLLM tries chat first; a null field is not there
    _same(
        _post(base, "/invocations", {**CHAT, "prompt": "x"}),
        _post(base, "/v1/chat/completions", CHAT),
    )
    _same(
        _post(base, "/invocations", {**PROMPT, "messages": None}),
        _post(base, "/v1/completions", PROMPT),
    )
    r = httpx.post(f"{base}/invocations", json={**PROMPT, "stream": True}, timeout=TIMEOUT)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.text.rstrip().endswith("data: [DONE]") and '"text_completion"' in r.text
    metrics = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text  # (its own label)
    assert 'endpoint="/invocations",status="200"' in metrics


def test_the_errors_are_vllms_and_the_routes_own(base):
    for body in ({"input": "Hi"}, {"messages": None, "prompt": None}, {}):
        r = _post(base, "/invocations", body)
        assert r.status_code == 400, r.text
        assert r.json()["error"] == {
            "message": NO_HANDLER, "type": "invalid_request_error", "param": None, "code": None
        }  # fmt: skip
    # a body of the route's shape gets that route's 400, naming the field
    for body, path in (
        ({**CHAT, "temperature": "hot"}, "/v1/chat/completions"),
        ({**CHAT, "messages": []}, "/v1/chat/completions"),
        ({**PROMPT, "prompt": 7}, "/v1/completions"),
        ({**PROMPT, "max_tokens": -1}, "/v1/completions"),
    ):
        got, want = _post(base, "/invocations", body), _post(base, path, body)
        assert (got.status_code, got.json()) == (400, want.json()), body
    json_type = {"content-type": "application/json"}
    for raw in (b"{not json", b"[1, 2]", b""):
        r = httpx.post(f"{base}/invocations", content=raw, headers=json_type, timeout=TIMEOUT)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert ("not valid JSON" in r.text) == (raw == b"{not json"), r.text
