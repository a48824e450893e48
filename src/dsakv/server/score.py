"""SGLang's scoring API, `POST /v1/score`, which reward-model and reranking clients call:
for each item, the probability of each of `label_token_ids` being the next token after
query + item (item + query with `item_first`). One prefill per item and no decode: each
runs for one token, whose logprobs of the labels are /generate's token_ids_logprob (raw:
of the model's logits, as SGLang's at its default temperature 1)."""

from __future__ import annotations

import math

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from dsakv.engine import SamplingParams

from .app import _MAX_PROMPTS, Handlers, _Result
from .protocol import APIError


class ScoringRequest(BaseModel):
    """SGLang's `ScoringRequest` (its other fields are ignored, as SGLang's own are)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None


def add_score_route(app: FastAPI, api: Handlers) -> None:
    """`POST /v1/score`, behind the API key as the other generation routes."""

    async def score(body: ScoringRequest, raw: Request) -> Response:
        return await _score(api, body, raw)

    app.add_api_route("/v1/score", score, methods=["POST"])


async def _score(api: Handlers, body: ScoringRequest, raw: Request) -> Response:
    api._check_model(body.model)
    labels = _labels(body.label_token_ids, api.engine.engine.model_config.vocab_size)
    prompts = _prompts(body)
    results = await _run(api, prompts, labels, raw) if prompts else []  # (none: SGLang's [])
    used = sum(r.prompt_tokens for r in results)
    return JSONResponse(
        {
            "scores": [_probs(r.token_ids_logprobs[0], body.apply_softmax) for r in results],
            "model": api.model_name,
            "usage": {"prompt_tokens": used, "completion_tokens": 0, "total_tokens": used},
            "object": "scoring",
        }
    )


async def _run(
    api: Handlers, prompts: list[str | list[int]], labels: tuple[int, ...], raw: Request
) -> list[_Result]:
    """Each prompt run for its one token, whose logprobs of `labels` it carries."""
    # (greedy: the token is never read; the labels' logprobs are of the logits as they are)
    params = SamplingParams(
        max_tokens=1, temperature=0, logprobs=0, token_ids_logprob=labels, detokenize=False
    )
    await api.weights_ready()
    call = api.in_flight.open([()] * len(prompts))  # (/abort_request's abort_all reaches it)
    streams = await api._submit_all(
        prompts, [params] * len(prompts), 1, raw, [None] * len(prompts), "items", call=call
    )
    results = await api._collect_all(streams, raw, call)
    if any(not r.token_ids_logprobs for r in results):  # (aborted before its token)
        raise APIError(503, "the request was aborted before it was scored", type="server_error")
    return results


def _labels(ids: list[int] | None, vocab: int) -> tuple[int, ...]:
    if not ids:
        raise APIError(400, "label_token_ids is required", param="label_token_ids")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:  # (SGLang's words)
        message = f"Token ID {bad} is out of vocabulary (vocab size: {vocab})"
        raise APIError(400, message, param="label_token_ids")
    return tuple(ids)


def _prompts(body: ScoringRequest) -> list[str | list[int]]:
    """Each item's prompt, as SGLang joins them: texts as strings, token ids as lists."""
    query, items = body.query, body.items
    if query is None:
        raise APIError(400, "query must be a text or a list of token ids", param="query")
    if items is None:
        raise APIError(400, "items must be a text, or a list", param="items")
    items = [items] if isinstance(items, str) else items
    if len(items) > _MAX_PROMPTS:
        raise APIError(400, f"at most {_MAX_PROMPTS} items per request", param="items")
    if items and isinstance(query, str) != isinstance(items[0], str):
        message = "query and items must both be text, or both token ids"
        raise APIError(400, message, param="items")
    if body.item_first:
        return [item + query for item in items]
    return [query + item for item in items]


def _probs(logprobs: list[float], softmax: bool) -> list[float]:
    """The labels' probabilities, or with `softmax` their softmax (over the labels alone)."""
    if not softmax:
        return [math.exp(x) for x in logprobs]
    top = max(logprobs)  # (finite: raw logprobs of finite logits)
    weights = [math.exp(x - top) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]
