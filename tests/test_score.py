"""SGLang's scoring API (`dsakv.server.score`, POST /v1/score): per item, the probability of
each label token next after query + item (item + query with item_first), equal to what
/generate's token_ids_logprob reports for that prompt run by hand, and to a full forward's
log_softmax; softmax over the labels with apply_softmax; bad input is a 400 naming the
field; `dsakv router` relays it with a bootstrap room per item."""

# ruff: noqa: F811 - the tests take the imported fixtures by their names

from __future__ import annotations

import asyncio
import json
import math

import httpx
import pytest

from dsakv.disagg.config import ROOM_HEADER
from dsakv.disagg.router import build_router_app
from dsakv.errors import DsakvError

from .serving import TIMEOUT, sglang_generate

# The completions tests' model, engine and server, their fixtures imported (as /generate's)
from .test_completions_api import (  # noqa: F401
    _full_forward_logprobs,
    model_dir,
    reference,
    served,
)

LABELS = [3, 17, 101, 17]  # (a label twice is scored twice, as SGLang's)
QUERY = "Is the following answer correct? Answer: "
ITEMS = ["Paris is the capital of France.", "Berlin is the capital of France."]


def _score(base: str, **body) -> dict:
    r = httpx.post(f"{base}/v1/score", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _by_hand(base: str, **prompt) -> list[float]:
    """The labels' next-token logprobs after `prompt`, from /generate."""
    m = sglang_generate(base, **prompt, sampling_params={"max_new_tokens": 1},
                        return_logprob=True, token_ids_logprob=LABELS)["meta_info"]  # fmt: skip
    return [x for x, _, _ in m["output_token_ids_logprobs"][0]]


def _served_name(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]


def test_scores_are_the_labels_next_token_probabilities(base, model_dir, reference):
    """Token ids: exp of the labels' logprobs after query + item (a full forward's last
    row), or their softmax over the labels; item_first scores item + query instead."""
    tok = reference.tokenizer
    query = tok.encode(QUERY, add_special_tokens=False)
    items = [tok.encode(t, add_special_tokens=False) for t in ITEMS]
    name = _served_name(base)
    out = _score(base, query=query, items=items, label_token_ids=LABELS, model=name)
    assert out["object"] == "scoring" and out["model"] == name
    lengths = [len(query) + len(i) for i in items]
    assert out["usage"] == {"prompt_tokens": sum(lengths), "completion_tokens": 0,
                            "total_tokens": sum(lengths)}  # fmt: skip
    assert len(out["scores"]) == 2
    for item, scores in zip(items, out["scores"]):
        ids = query + item
        row = _full_forward_logprobs(model_dir, ids)[-1, LABELS].tolist()
        assert scores == pytest.approx([math.exp(x) for x in row], rel=1e-4)
        assert scores == pytest.approx([math.exp(x) for x in _by_hand(base, input_ids=ids)])
    assert out["scores"][0] != pytest.approx(out["scores"][1], rel=1e-3)  # (items differ)

    soft = _score(base, query=query, items=items, label_token_ids=LABELS, apply_softmax=True)
    for probs, scores in zip(soft["scores"], out["scores"]):
        assert sum(probs) == pytest.approx(1)
        assert probs == pytest.approx([s / sum(scores) for s in scores], rel=1e-5)

    first = _score(base, query=query, items=items, label_token_ids=LABELS, item_first=True)
    for item, scores in zip(items, first["scores"]):
        want = _by_hand(base, input_ids=item + query)
        assert scores == pytest.approx([math.exp(x) for x in want])
    assert first["scores"][0] != pytest.approx(out["scores"][0], rel=1e-3)


def test_text_query_and_items_join_as_text(base):
    """Text: the query and each item joined as strings (SGLang's), then tokenized as
    /generate's text is; one item may come as a string."""
    out = _score(base, query=QUERY, items=ITEMS, label_token_ids=LABELS)
    for item, scores in zip(ITEMS, out["scores"]):
        assert scores == pytest.approx([math.exp(x) for x in _by_hand(base, text=QUERY + item)])
    one = _score(base, query=QUERY, items=ITEMS[1], label_token_ids=LABELS, item_first=True)
    want = _by_hand(base, text=ITEMS[1] + QUERY)
    assert one["scores"] == [pytest.approx([math.exp(x) for x in want])]


def test_no_items_are_no_scores(base):
    """(As SGLang's, which answers an empty list of items before running anything: a
    reranker with no candidates left.)"""
    for query in ("q", [1, 2]):
        out = _score(base, query=query, items=[], label_token_ids=LABELS)
        assert out["scores"] == [] and out["object"] == "scoring"
        assert out["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


_BAD = [
    ({"query": "q", "items": [], "label_token_ids": []}, "label_token_ids"),
    ({"query": "q", "label_token_ids": [1]}, "items"),
    ({"query": "q", "items": ["a"], "label_token_ids": []}, "label_token_ids"),
    ({"query": "q", "items": ["a"]}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": [10**6]}, "label_token_ids"),
    ({"query": "q", "items": ["a"], "label_token_ids": [-1]}, "label_token_ids"),
    ({"query": "q", "items": [[1, 2]], "label_token_ids": [1]}, "items"),  # text and ids
    ({"query": [1, 2], "items": ["a"], "label_token_ids": [1]}, "items"),
    ({"items": ["a"], "label_token_ids": [1]}, "query"),
    ({"query": [], "items": [[]], "label_token_ids": [1]}, "items"),  # an empty prompt
    ({"query": [10**7], "items": [[1]], "label_token_ids": [1]}, "items"),
    ({"query": "q", "items": [1, 2], "label_token_ids": [1]}, "items"),
]


@pytest.mark.parametrize(("body", "param"), _BAD, ids=range(len(_BAD)))
def test_bad_input_is_a_400_naming_the_field(base, body, param):
    r = httpx.post(f"{base}/v1/score", json=body, timeout=TIMEOUT)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param, err


def test_more_than_256_items_is_that_400_whatever_they_hold(base):
    """The item count is read before the items' kinds: 257 items are that 400, of the
    query's kind or not."""
    for query, item in (("q", "a"), ([1], "a"), ("q", [1])):
        body = {"query": query, "items": [item] * 257, "label_token_ids": [1]}
        r = httpx.post(f"{base}/v1/score", json=body, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "at most 256 items per request", r.text


def test_an_unknown_model_is_a_404(base):
    body = {"query": "q", "items": ["a"], "label_token_ids": [1], "model": "nope"}
    r = httpx.post(f"{base}/v1/score", json=body, timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


def _flat(scores: list[list[float]]) -> list[float]:
    return [x for row in scores for x in row]


def test_llm_score_is_the_servers_and_the_models(base, reference, model_dir):
    """`LLM.score` (SGLang's `Engine.score`) answers what /v1/score answers for the same
    input, token ids or text, with apply_softmax and item_first; its scores are exp of a
    full forward's log_softmax at the labels."""
    tok = reference.tokenizer
    query = tok.encode(QUERY, add_special_tokens=False)
    items = [tok.encode(t, add_special_tokens=False) for t in ITEMS]
    for q, its in ((query, items), (QUERY, ITEMS), (QUERY, ITEMS[1])):
        for kw in ({}, {"apply_softmax": True}, {"item_first": True}):
            offline = reference.score(q, its, LABELS, **kw)
            served = _score(base, query=q, items=its, label_token_ids=LABELS, **kw)["scores"]
            assert len(offline) == len(served) == (1 if isinstance(its, str) else 2)
            assert _flat(offline) == pytest.approx(_flat(served), rel=1e-5)
    scores = reference.score(query, items, LABELS)
    for item, row in zip(items, scores):
        want = _full_forward_logprobs(model_dir, query + item)[-1, LABELS].tolist()
        assert [math.log(p) for p in row] == pytest.approx(want, abs=1e-4)
    assert reference.score(query, [], LABELS) == []


@pytest.mark.parametrize(("body", "param"), _BAD, ids=range(len(_BAD)))
def test_llm_score_refuses_what_the_server_refuses(reference, body, param):
    """Each input /v1/score answers with a 400 is a `DsakvError` offline, naming the same
    field where the check is the scoring's own (not the engine's, of a prompt)."""
    with pytest.raises(DsakvError) as e:
        reference.score(body.get("query"), body.get("items"), body.get("label_token_ids"))
    assert e.value.param in (param, None)
    if param in ("query", "label_token_ids"):
        assert e.value.param == param


def test_the_router_relays_it_with_a_room_per_item():
    """`dsakv router`: the body to a prefill and a decode server, the decode server's answer
    back, one bootstrap room per item (each item is one prompt on both servers)."""
    seen: dict[str, httpx.Request] = {}

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/disagg/info":
            return httpx.Response(200, json={"mode": "prefill", "bootstrap_port": 9000})
        seen[request.url.host] = request
        return httpx.Response(200, json={"scores": [[0.5]] * 3, "object": "scoring"})

    app = build_router_app(["http://prefill:1"], ["http://decode:2"])
    body = {"query": "q", "items": ["a", "b", "c"], "label_token_ids": [1]}

    async def run() -> httpx.Response:
        app.state.router._client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            r = await c.post("/v1/score", json=body)
        for _ in range(100):  # (the prefill server's copy goes out beside the decode one)
            if "prefill" in seen:
                break
            await asyncio.sleep(0.01)
        return r

    r = asyncio.run(run())
    assert r.status_code == 200 and r.json()["object"] == "scoring"
    assert {h: q.url.path for h, q in seen.items()} == {"prefill": "/v1/score",
                                                        "decode": "/v1/score"}  # fmt: skip
    rooms = [q.headers[ROOM_HEADER].split(",") for q in seen.values()]
    assert rooms[0] == rooms[1] and len(rooms[0]) == 3
    assert json.loads(seen["decode"].content) == body
