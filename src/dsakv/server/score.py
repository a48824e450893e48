"""SGLang's scoring API, `POST /v1/score`, which reward-model and reranking clients call:
per item, the labels' next-token probabilities after query + item, as `dsakv.engine.score`
defines them (`LLM.score` runs the same); here each item is one prompt through the
server's generation path, whose /abort_request reaches it."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from dsakv.engine.score import label_probs, score_labels, score_params, score_prompts
from dsakv.errors import DsakvError

from .handlers import Handlers
from .params import MAX_PROMPTS
from .protocol import APIError, new_id
from .submit import Result


class ScoringRequest(BaseModel):
    """SGLang's `ScoringRequest` (its other fields are ignored, as SGLang's own are)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None
    lora_path: Any = None  # (SGLang's adapter name, as on the other /v1 routes)


def add_score_route(app: FastAPI, api: Handlers) -> None:
    """`POST /v1/score`, behind the API key as the other generation routes."""

    async def score(body: ScoringRequest, raw: Request) -> Response:
        return await _score(api, body, raw)

    app.add_api_route("/v1/score", score, methods=["POST"])


async def _score(api: Handlers, body: ScoringRequest, raw: Request) -> Response:
    api.check_model(body.model)
    try:  # (`dsakv.engine.score`, which `LLM.score` runs too)
        labels = score_labels(body.label_token_ids, api.engine.engine.model_config.vocab_size)
        prompts = score_prompts(body.query, body.items, body.item_first, MAX_PROMPTS)
    except DsakvError as e:
        raise APIError(400, str(e), param=e.param) from None
    lora = api.lora_name(body)  # (its adapter's scores: `model`'s, or lora_path's)
    results = await _run(api, prompts, labels, lora, raw) if prompts else []  # (none: [])
    used = sum(r.prompt_tokens for r in results)
    return JSONResponse(
        {
            "scores": [label_probs(r.token_ids_logprobs[0], body.apply_softmax) for r in results],
            "model": lora or api.model_name,
            "usage": {"prompt_tokens": used, "completion_tokens": 0, "total_tokens": used},
            "object": "scoring",
        }
    )


async def _run(
    api: Handlers,
    prompts: list[str | list[int]],
    labels: tuple[int, ...],
    lora: str | None,
    raw: Request,
) -> list[Result]:
    """Each prompt run for its one token (on adapter `lora`, None: the base model), whose
    logprobs of `labels` it carries."""
    params = dataclasses.replace(score_params(labels), lora_name=lora)
    await api.weights_ready()
    # (/abort_request's abort_all reaches it; the request log names it as vLLM's /score does)
    shown = f"score-{raw.headers.get('x-request-id') or new_id()}"
    call = api.in_flight.open([()] * len(prompts), shown=shown, raw=raw, completion=False)
    streams = await api.submit_all(
        prompts, [params] * len(prompts), 1, raw, [None] * len(prompts), "items", call=call
    )
    results = await api.collect_all(streams, raw, call)
    if any(not r.token_ids_logprobs for r in results):  # (aborted before its token)
        raise APIError(503, "the request was aborted before it was scored", type="server_error")
    return results
