"""SGLang's scoring (`Engine.score`, its POST /v1/score), which reward-model and reranking
clients call: for each item, the probability of each of `label_token_ids` being the next
token after query + item (item + query with `item_first`). One prefill per item and no
decode: each runs for one token, whose logprobs of the labels are `token_ids_logprob`'s
(raw: of the model's logits, as SGLang's at its default temperature 1). `LLM.score` and
the server's route share what is here; each runs the prompts its own way."""

from __future__ import annotations

import math
import reprlib
from collections.abc import Sequence

from dsakv.errors import DsakvError, is_int, is_list

from .sampling import SamplingParams

ScorePrompt = str | list[int]


def score_labels(ids: object, vocab: int) -> tuple[int, ...]:
    """The label token ids, or a `DsakvError` (SGLang's words for one out of vocabulary)."""
    if ids is None or (is_list(ids) and not ids):
        raise DsakvError("label_token_ids is required", "label_token_ids")
    if not is_list(ids) or not all(is_int(t) for t in ids):
        message = f"label_token_ids must be a list of token ids, got {reprlib.repr(ids)}"
        raise DsakvError(message, "label_token_ids")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        message = f"Token ID {bad} is out of vocabulary (vocab size: {vocab})"
        raise DsakvError(message, "label_token_ids")
    return tuple(ids)


def score_prompts(
    query: object, items: object, item_first: bool = False, most: int | None = None
) -> list[ScorePrompt]:
    """Each item's prompt, as SGLang joins them: texts as strings, token ids as lists (one
    item may come alone as a string). `most`: a server's limit on the items (None: none),
    read before their kinds."""
    if not (isinstance(query, str) or _token_ids(query)):
        raise DsakvError("query must be a text or a list of token ids", "query")
    items = [items] if isinstance(items, str) else items
    if not is_list(items):
        raise DsakvError("items must be a text, or a list", "items")
    if most is not None and len(items) > most:
        raise DsakvError(f"at most {most} items per request", "items")
    text = isinstance(query, str)
    if not all(isinstance(i, str) if text else _token_ids(i) for i in items):
        message = "query and items must both be text, or both token ids"
        raise DsakvError(message, "items")
    if text:
        return [item + query if item_first else query + item for item in items]
    return [list(item) + list(query) if item_first else list(query) + list(item) for item in items]


def _token_ids(x: object) -> bool:
    return is_list(x) and all(is_int(t) for t in x)


def score_params(labels: Sequence[int]) -> SamplingParams:
    """One token per prompt, carrying the labels' logprobs (greedy: the token itself is
    never read; the logprobs are of the logits as they are)."""
    return SamplingParams(
        max_tokens=1, temperature=0, logprobs=0, token_ids_logprob=tuple(labels), detokenize=False
    )


def label_probs(logprobs: Sequence[float], softmax: bool) -> list[float]:
    """The labels' probabilities, or with `softmax` their softmax (over the labels alone)."""
    if not softmax:
        return [math.exp(x) for x in logprobs]
    top = max(logprobs)  # (finite: raw logprobs of finite logits)
    weights = [math.exp(x - top) for x in logprobs]
    total = sum(weights)
    return [w / total for w in weights]
