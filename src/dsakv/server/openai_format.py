"""The engine's outputs in OpenAI's response shapes (and vLLM's and SGLang's fields on
them): usage, completions' and chat's logprobs, prompt logprobs, token ids, hidden states
and routed experts; JSON has no -inf, so logprobs are clamped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .protocol import GenerationRequest
from .rows import routed_base64
from .runner import RequestStream, Update
from .submit import Result

_MIN_LOGPROB = -9999.0  # JSON has no -inf


# Finish reasons that cut the output short: a tool call still open there is reported
# unclosed, not closed with the arguments written so far.
CUT_SHORT = ("length", "repetition")


def finish_reason(u: Update) -> str | None:
    return u.finish_reason if u.finished else None


@dataclass(frozen=True)
class ResponseDefaults:
    """vLLM's server-wide defaults for what a completions or chat request leaves out: the
    reply's role under add_generation_prompt (`--response-role`), logprobs' tokens as
    "token_id:N" (`--return-tokens-as-token-ids`; a request's own field wins), and the
    usage on every stream's chunks and at its end, whatever its `stream_options` say
    (`--enable-force-include-usage`: `stream_usage`)."""

    response_role: str = "assistant"
    tokens_as_ids: bool = False
    force_include_usage: bool = False

    def as_ids(self, body: GenerationRequest) -> bool:
        own = body.return_tokens_as_token_ids
        return self.tokens_as_ids if own is None else own


def stream_usage(body: GenerationRequest, force: bool = False) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage on every chunk): `stream_options.include_usage`, and
    with it vLLM's `continuous_usage_stats` (each chunk: its choice's tokens so far); `force`
    (vLLM's --enable-force-include-usage) both, whatever the request asks, as vLLM's
    `should_include_usage` since its PR #37923."""
    if force:
        return True, True
    opts = body.stream_options
    usage = bool(opts and opts.include_usage)
    return usage, usage and bool(opts and opts.continuous_usage_stats)


def chunk_usage(usage: bool, running: bool, u: Update | Result) -> dict[str, Any]:
    """A streamed chunk's `usage` field: absent without include_usage, else null, or with
    continuous_usage_stats its choice's tokens so far."""
    if not usage:
        return {}
    return {"usage": usage_of(u) if running else None}


def usage_of(u: Update | Result) -> dict[str, Any]:
    """OpenAI's usage; `prompt_tokens_details.cached_tokens`: the prompt tokens the prefix
    cache held."""
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def json_logprob(x: float) -> float:
    x = float(x)
    return x if x > _MIN_LOGPROB else _MIN_LOGPROB  # -inf and NaN too


def _completion_logprobs(u: Update, as_ids: bool = False) -> dict[str, Any]:
    tops = u.top_logprobs or []
    texts = list(u.texts or [""] * len(u.token_ids))
    scores = u.logprobs or []
    alts = _or_blank(u.top_texts, tops)
    if as_ids:
        texts, alts = _id_texts(u.token_ids), [_id_texts(t for t, _ in top) for top in tops]
    return {
        "tokens": texts,
        "token_logprobs": [json_logprob(x) for x in scores],
        "top_logprobs": [_top_dict(*z) for z in zip(tops, alts, texts, scores)],
    }


def _id_texts(ids: Iterable[int]) -> list[str]:
    """vLLM's return_tokens_as_token_ids: logprobs name each token "token_id:N" (a token
    that is part of a character has no text of its own)."""
    return [f"token_id:{t}" for t in ids]


def _or_blank(texts: list[list[str]] | None, tops: list) -> list[list[str]]:
    """Token texts, or "" for each where the model has no tokenizer."""
    return texts if texts is not None else [[""] * len(top or ()) for top in tops]


def _top_dict(
    top: list[tuple[int, float]], texts: list[str], chosen: str, chosen_logprob: float
) -> dict[str, float]:
    """Completions' {token text: logprob}: the top `logprobs` tokens and the chosen one (the
    sampled token, or the prompt's under echo), so up to logprobs + 1 entries, as OpenAI's
    legacy completions and vLLM give them (`logprobs: 0`: the chosen token alone). Where two
    tokens add the same text (two bytes of one unfinished character both add "") the
    likelier one keeps it, so the max stays the top-1 logprob."""
    out: dict[str, float] = {}
    for (_, x), s in zip(top, texts):
        out.setdefault(s, json_logprob(x))
    out.setdefault(
        chosen, json_logprob(chosen_logprob)
    )  # (ranked below every top one, or among them)
    return out


def token_ids(u: Update) -> dict[str, list[int] | None]:
    """vLLM's `return_token_ids` on a completions choice: the prompt's ids (in its first
    update) and the ids this update adds."""
    return {"prompt_token_ids": u.prompt_token_ids, "token_ids": u.token_ids}


def sglext(body: GenerationRequest, ended: Iterable[Update | Result]) -> dict[str, Any]:
    """SGLang's `sglext` of a /v1 response (or its stream's last chunk before usage): the
    routed experts of the first choice that has them (SGLang's are per request, taken from
    its first output, n > 1 too), where asked for; empty (no field) otherwise."""
    if not body.return_routed_experts:
        return {}
    rows = next((r.routed_experts for r in ended if r.routed_experts is not None), None)
    encoded = routed_base64(rows) if rows is not None else ""
    return {"sglext": {"routed_experts": encoded}} if encoded else {}


def sglang_extras(
    body: GenerationRequest, ended: dict[int, Update], usage: bool, running: bool, chat: bool
) -> Iterator[dict[str, Any]]:
    """SGLang's stream chunks after the choices' own (before the usage chunk): each ended
    choice's hidden state (only those that have rows: an aborted one has none), then the
    response's `sglext`; under include_usage each has `usage` as every chunk does (null,
    or with continuous_usage_stats a choice's its tokens)."""
    for i, u in sorted(ended.items()) if body.return_hidden_states else ():
        if u.hidden_states is None:
            continue
        state = last_hidden(u)
        said: dict[str, Any] = {"index": i, "text": "", "hidden_states": state}
        if chat:
            said = {"index": i, "delta": {"hidden_states": state}}
        said.update(logprobs=None, finish_reason=None)
        yield {"choices": [said], **chunk_usage(usage, running, u)}
    if ext := sglext(body, [u for _, u in sorted(ended.items())]):
        yield {"choices": [], **ext, **({"usage": None} if usage else {})}


def last_hidden(r: Update | Result) -> list[float] | None:
    """SGLang's /v1 `hidden_states` of a choice (`process_hidden_states_from_ret`): of its
    meta_info rows (the prompt's as one, then one per output token but the last) the last
    one, the state that gave its last token; [] where only the prompt's are there."""
    if r.hidden_states is None:
        return None
    return r.hidden_states[-1].tolist() if len(r.hidden_states) > r.prompt_tokens else []


def prompt_logprobs(u: Update) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token (null for the first), {token id: its
    logprob, rank and text} for the token itself and its top alternatives."""
    ids = u.prompt_token_ids or []
    texts = u.prompt_texts or [None] * len(ids)
    tops = u.prompt_top_logprobs or [None] * len(ids)
    alts = u.prompt_top_texts or [[None] * len(top or ()) for top in tops]
    out: list[dict[str, dict[str, Any]] | None] = []
    for p, (token, x) in enumerate(zip(ids, u.prompt_logprobs or [None] * len(ids))):
        if x is None:
            out.append(None)
            continue
        entry = {
            str(token): {
                "logprob": json_logprob(x),
                "rank": u.prompt_ranks[p],
                "decoded_token": texts[p],
            }
        }
        for rank, ((t, y), s) in enumerate(zip(tops[p] or (), alts[p]), 1):
            entry.setdefault(str(t), {"logprob": json_logprob(y), "rank": rank, "decoded_token": s})
        out.append(entry)
    return out


def chat_logprobs(u: Update, as_ids: bool = False, tracked: bool = False) -> dict[str, Any]:
    """`as_ids`: tokens named "token_id:N" (`_id_texts`); a chosen token's `bytes` stay its
    text's, its top ones' are the name's, as vLLM gives them. `tracked`: vLLM's
    `logprob_token_ids`, whose `top_logprobs` are the chosen token, then the asked ones
    (without it)."""

    def entry(s: str, x: float) -> dict[str, Any]:
        return {"token": s, "logprob": json_logprob(x), "bytes": list(s.encode("utf-8"))}

    tops = u.top_logprobs or []
    texts = u.texts or [""] * len(u.token_ids)
    alts = _or_blank(u.top_texts, tops)
    names = _id_texts(u.token_ids) if as_ids else texts
    if as_ids:
        alts = [_id_texts(t for t, _ in top) for top in tops]
    content = []
    for t, s, name, x, top, a in zip(u.token_ids, texts, names, u.logprobs or [], tops, alts):
        listed = [entry(b, y) for (i, y), b in zip(top, a) if not (tracked and i == t)]
        content.append(
            {
                **entry(s, x),
                "token": name,
                "top_logprobs": [entry(name, x)] + listed if tracked else listed,
            }
        )
    return {"content": content}


@dataclass
class CompletionChoice:
    """One completions choice: with `echo`, its first update also carries the prompt."""

    index: int
    stream: RequestStream
    prompt: str | list[int]
    echo: bool
    keep: int | None = None  # truncate_prompt_tokens, in tokens
    as_ids: bool = False  # return_tokens_as_token_ids (`_id_texts`)
    offset: int = 0  # text_offset of the next token

    def echo_text(self, u: Update, tokenizer: Any) -> str:
        """The prompt that ran: a text prompt as given, unless truncate_prompt_tokens may
        have cut it; then, as token ids are, its kept tokens decoded (what prompt_tokens
        and the logprobs' tokens and offsets describe)."""
        if not self.echo or u.prompt_token_ids is None:
            return ""
        ids = u.prompt_token_ids
        if isinstance(self.prompt, str) and (self.keep is None or len(ids) < self.keep):
            return self.prompt
        return tokenizer.decode(ids) if tokenizer is not None else ""

    def logprobs(self, u: Update) -> dict[str, Any]:
        """This update's `logprobs` block (prompt tokens first when echoing)."""
        prompt: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        shown: list[str] = []  # (the tokens' texts, for text_offset, whatever they are named)
        if self.echo and u.prompt_token_ids is not None:
            scored = u.prompt_logprobs or [None] * len(u.prompt_token_ids)
            tops = u.prompt_top_logprobs or [None] * len(u.prompt_token_ids)
            alts = u.prompt_top_texts or _or_blank(None, tops)
            texts = shown = list(u.prompt_texts or [""] * len(u.prompt_token_ids))
            if self.as_ids:
                texts = _id_texts(u.prompt_token_ids)
                alts = [_id_texts(t for t, _ in top or ()) for top in tops]
            prompt = {
                "tokens": texts,
                "token_logprobs": [None if x is None else json_logprob(x) for x in scored],
                "top_logprobs": [
                    None if top is None or x is None else _top_dict(top, a, s, x)
                    for top, a, s, x in zip(tops, alts, texts, scored)
                ],
            }
        gen = _completion_logprobs(u, self.as_ids)
        out = {k: prompt[k] + gen[k] for k in ("tokens", "token_logprobs", "top_logprobs")}
        out["text_offset"] = []
        for s in shown + list(u.texts or [""] * len(u.token_ids)):
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out
