"""The OpenAI routes' handlers (`Handlers`): /v1/completions, /v1/chat/completions (and what
/v1/responses shares of it: `start_chat`), /tokenize and the model cards. How a request
becomes params (`params`), reaches the engine and is read back (`submit`), and the calls
that change what the engine serves (`admin`) are its mixins, as the engine's are."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from dsakv.engine import SamplingParams
from dsakv.engine.chat_format import has_chat_format
from dsakv.engine.info import engine_info
from dsakv.errors import DsakvError
from dsakv.metrics import ServerMetrics

from .admin import WEIGHT_VERSION, AdminMixin
from .chat import (
    ChatParsers,
    PreparedChat,
    chat_delta,
    chat_message,
    echo_content,
    prepare_chat,
    reply_role,
)
from .openai_format import (
    CUT_SHORT,
    CompletionChoice,
    ResponseDefaults,
    chat_logprobs,
    chunk_usage,
    finish_reason,
    last_hidden,
    prompt_logprobs,
    sglang_extras,
    sglext,
    stream_usage,
    token_ids,
    usage_of,
)
from .params import GRAMMAR_WORKERS, RequestParamsMixin, grammar_field, prompt_list
from .protocol import (
    HEADER_SAFE,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    TokenizeRequest,
    new_id,
)
from .request_log import RequestLog, RequestLogConfig
from .runner import AsyncEngine, RequestStream
from .sessions import Sessions
from .submit import Call, InFlight, Result, SubmitMixin, sse_event
from .tracing import RequestTracer


@dataclass(frozen=True)
class ChatRun:
    """A chat request the engine took (`Handlers.start_chat`): how to read its output back,
    its choices' streams, its /abort_request entry, and (streamed, with return_token_ids)
    the prompt's token ids."""

    prep: PreparedChat
    streams: list[RequestStream]
    call: Call
    params: SamplingParams
    prompt_ids: list[int] | None = None
    as_ids: bool = False  # logprobs' tokens as "token_id:N" (vLLM's return_tokens_as_token_ids)


class Handlers(AdminMixin, RequestParamsMixin, SubmitMixin):
    """What every route calls: the engine, its served names, the calls in flight and the
    state the mixins share (made here only), so that /generate, /v1/responses and
    /v1/score run a request exactly as the OpenAI routes do."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        model_names: Sequence[str],
        metrics: ServerMetrics,
        chat_parsers: ChatParsers,
        aliases: Sequence[str] = (),
        request_log: RequestLogConfig | None = None,
        defaults: ResponseDefaults | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        self.engine = async_engine
        self.tracer = tracer  # (`SubmitMixin`; closed with the app)
        self.defaults = defaults or ResponseDefaults()
        self.model_names = list(model_names)
        self.model_name = self.model_names[0]  # what responses report
        self.created = int(time.time())  # (the cards' creation time: one answer, asked twice)
        self._accepted = frozenset((*self.model_names, *aliases))
        # The LoRA adapters served, name -> path, as the engine last told (at start, then
        # after each load or unload: `lora`): what a request's `model` may name too
        config = async_engine.engine.config
        self.loras: dict[str, str] = dict(async_engine.engine.loras()) if config.enable_lora else {}
        self.metrics = metrics
        self.chat_parsers = chat_parsers
        self.in_flight = InFlight(async_engine, RequestLog(request_log))
        self.sessions = Sessions(self.in_flight)  # SGLang's (/generate's session_params)
        # SGLang's model_update_lock: generation calls start while `_serving` is set (an
        # update clears it, then waits for the calls in flight), one update at a time.
        self.weight_version = WEIGHT_VERSION
        self._serving = asyncio.Event()
        self._serving.set()
        self._updating = asyncio.Lock()
        # SGLang's is_pause: generation calls start while it is set (`pause_generation`)
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._grammars_lock = threading.Lock()  # the engine builds its GrammarCache lazily
        # Grammars compile on threads of their own: schemas slow to compile (seconds each,
        # and xgrammar cannot stop one) queue behind each other, not other requests' prompts
        self._compiles = ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="dsakv-grammar")

    async def close(self) -> None:
        """End the grammar compile threads with the app (its lifespan: `build_app`), or each
        app built in a process leaves its own behind: compiles queued are dropped, one
        running is waited for (xgrammar cannot stop it), off the event loop; the last
        spans are sent."""
        await asyncio.to_thread(self._compiles.shutdown, cancel_futures=True)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)

    async def completion(self, body: CompletionRequest, raw: Request) -> Response:
        """Completions for every prompt of the request, `n` choices each (choice index
        `prompt * n + j`). With `echo`, each choice starts with its prompt, and with
        `logprobs` too, the prompt tokens' teacher-forced logprobs (the first is null) come
        before the generated ones; `max_tokens: 0` then only scores the prompt."""
        self.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        n = self._n(body)
        if body.best_of is not None and body.best_of < n:  # OpenAI's and vLLM's words
            raise APIError(400, "best_of must be greater than or equal to n", param="best_of")
        if body.best_of not in (None, n):
            raise APIError(400, "best_of must equal n (no server-side ranking)", param="best_of")
        prompts = prompt_list(body.prompt)
        echo = bool(body.echo)
        # vLLM's CompletionRequest: max_tokens left out is 16; an explicit null, up to the
        # context's end (what chat gets either way)
        null = "max_tokens" in body.model_fields_set and body.max_tokens is None
        most = self.engine.engine.max_model_len if null else 16
        params = self.sampling_params(
            body, body.max_tokens, most, body.logprobs, "logprobs", min_max_tokens=0 if echo else 1
        )
        # vLLM's: echo with logprobs scores the prompt too (unless prompt_logprobs says how),
        # and the choices then carry its prompt_logprobs
        scored = body.prompt_logprobs is not None or (echo and body.logprobs is not None)
        if body.prompt_logprobs is None and echo and body.logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
        beam = self._beam(body, params)
        if body.truncation_side == "right":
            cut = [await self._first_tokens(p, params, body.add_special_tokens) for p in prompts]
            prompts, params = cut, dataclasses.replace(params, truncate_prompt_tokens=None)
        given = "max_tokens" if body.max_tokens is not None else None
        count = len(prompts)
        named = _request_id(body, raw)
        base = named or new_id()
        await self.weights_ready()
        # Opened before the grammar compiles: an abort meanwhile ends it once compiled
        names = [_names(named)] * (count * n)
        call = self.in_flight.open(names, "request_id", f"cmpl-{base}", raw)
        try:
            params = await self.ready_grammar(params, grammar_field(body))
            if beam is not None:
                streams = await self._submit_beams(
                    prompts, params, beam, raw, given, special=body.add_special_tokens, call=call
                )
            else:
                streams = await self.submit_all(
                    prompts,
                    [params] * count,
                    n,
                    raw,
                    [given] * count,
                    special=body.add_special_tokens,
                    call=call,
                )
        except BaseException:  # (from here `collect_all` or `stream_response` closes it)
            self.in_flight.close(call)
            raise
        keep = params.truncate_prompt_tokens
        if keep is not None and keep <= 0:  # (-1: as many as the context leaves room for)
            keep = self.engine.engine.max_model_len - 1
        as_ids = self.defaults.as_ids(body)
        choices = [
            CompletionChoice(i, s, prompts[i // n], echo, keep, as_ids)
            for i, s in enumerate(streams)
        ]
        rid, created = f"cmpl-{base}", int(time.time())
        head = {
            "id": rid,
            "object": "text_completion",
            "created": created,
            "model": self.served_name(params),
        }
        want_logprobs, ids = body.logprobs is not None, bool(body.return_token_ids)
        tokenizer = self.engine.engine.tokenizer

        if body.stream:
            usage, running = stream_usage(body, self.defaults.force_include_usage)

            async def events() -> AsyncIterator[str]:
                totals, ended = Result(), {}
                async for i, u in self.merged_updates(streams):
                    c = choices[i]
                    text = c.echo_text(u, tokenizer) + u.text
                    lp = c.logprobs(u) if want_logprobs else None
                    wanted = (lp and lp["tokens"]) or (ids and (u.token_ids or u.prompt_token_ids))
                    if not (text or u.finished or wanted):
                        continue  # held-back text and nobody wants the tokens yet
                    choice = {
                        "index": i,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": finish_reason(u),
                        "stop_reason": u.stop_reason,
                        **(token_ids(u) if ids else {}),
                    }
                    yield sse_event({**head, "choices": [choice], **chunk_usage(usage, running, u)})
                    if u.finished:
                        ended[i] = u
                        totals.completion_tokens += u.completion_tokens
                        if i % n == 0:  # (each prompt once: its first choice ran it)
                            totals.prompt_tokens += u.prompt_tokens
                            totals.cached_tokens += u.cached_tokens
                for chunk in sglang_extras(body, ended, usage, running, chat=False):
                    yield sse_event({**head, **chunk})
                if usage:
                    yield sse_event({**head, "choices": [], "usage": usage_of(totals)})

            return self.stream_response(events(), streams, call, _id_header(base))

        results = await self.collect_all(streams, raw, call)
        out = []
        for c, r in zip(choices, results):
            u = r.as_update()
            out.append(
                {
                    "index": c.index,
                    "text": c.echo_text(u, tokenizer) + r.text,
                    "logprobs": c.logprobs(u) if want_logprobs else None,
                    "finish_reason": r.finish_reason,
                    "stop_reason": r.stop_reason,
                    **({"prompt_logprobs": prompt_logprobs(u)} if scored else {}),
                    **(token_ids(u) if ids else {}),
                    **({"hidden_states": last_hidden(r)} if body.return_hidden_states else {}),
                }
            )
        total = Result(
            prompt_tokens=sum(r.prompt_tokens for r in results[::n]),
            completion_tokens=sum(r.completion_tokens for r in results),
            cached_tokens=sum(r.cached_tokens for r in results[::n]),
        )
        answer = {**head, "choices": out, "usage": usage_of(total), **sglext(body, results)}
        answer.update(self.engine.reply_extras())  # (a PD prefill server's: where its KV waits)
        return JSONResponse(answer, headers=_id_header(base))

    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        named = _request_id(body, raw)
        base = named or new_id()
        run = await self.start_chat(body, raw, named, f"chatcmpl-{base}")
        prep, streams, call, n = run.prep, run.streams, run.call, len(run.streams)
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        ids, thinking = bool(body.return_token_ids), body.include_reasoning is not False
        as_ids, tracked = run.as_ids, run.params.logprob_token_ids is not None
        role = reply_role(body, self.defaults.response_role)
        echo = echo_content(body, role)
        rid, created = f"chatcmpl-{base}", int(time.time())
        head = {
            "id": rid,
            "object": "chat.completion.chunk",
            "created": created,
            "model": self.served_name(run.params),
        }

        if body.stream:
            usage, running = stream_usage(body, self.defaults.force_include_usage)

            async def events() -> AsyncIterator[str]:
                for i in range(n):
                    opening = {
                        "index": i,
                        "delta": {"role": role, "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    start = Result(prompt_tokens=streams[i].prompt_tokens)  # no tokens yet
                    first = {"prompt_token_ids": run.prompt_ids} if i == 0 and ids else {}
                    chunk = {**head, **first, "choices": [opening]}
                    yield sse_event({**chunk, **chunk_usage(usage, running, start)})
                for i in range(n if echo else 0):  # (vLLM's: after the role chunks)
                    said = {"index": i, "delta": {"content": echo}, "logprobs": None}
                    start = Result(prompt_tokens=streams[i].prompt_tokens)
                    chunk = {**head, "choices": [{**said, "finish_reason": None}]}
                    yield sse_event({**chunk, **chunk_usage(usage, running, start)})
                parsers = [prep.output_parser() for _ in range(n)]  # one per choice
                held = [""] * n  # SGLang's stream_reasoning false: each one's, until over
                totals, ended = Result(), {}
                async for i, u in self.merged_updates(streams):
                    parser = parsers[i]
                    cut = finish_reason(u) in CUT_SHORT
                    d = parser.feed(u.text, final=u.finished, cut=cut)
                    if body.stream_reasoning is False:
                        held[i] += d.reasoning
                        r = parser.reasoning_parser
                        if u.finished or r is None or r.done:
                            d, held[i] = dataclasses.replace(d, reasoning=held[i]), ""
                        else:
                            d = dataclasses.replace(d, reasoning="")
                    delta = chat_delta(d, thinking)
                    if not (delta or u.finished or ((top_n is not None or ids) and u.token_ids)):
                        continue  # held-back text and nobody wants the tokens yet
                    lp = chat_logprobs(u, as_ids, tracked) if top_n is not None else None
                    if not (delta or u.finished):
                        delta = {"content": ""}
                    reason = prep.finish_reason(parser, finish_reason(u))
                    choice = {
                        "index": i,
                        "delta": delta,
                        "logprobs": lp,
                        "finish_reason": reason,
                        "stop_reason": u.stop_reason,
                        **({"token_ids": u.token_ids} if ids else {}),
                    }
                    yield sse_event({**head, "choices": [choice], **chunk_usage(usage, running, u)})
                    if u.finished:
                        ended[i] = u
                        totals.prompt_tokens = u.prompt_tokens
                        totals.completion_tokens += u.completion_tokens
                        if i == 0:  # (the prompt's: the forks found it cached)
                            totals.cached_tokens = u.cached_tokens
                for chunk in sglang_extras(body, ended, usage, running, chat=True):
                    yield sse_event({**head, **chunk})
                if usage:
                    yield sse_event({**head, "choices": [], "usage": usage_of(totals)})

            return self.stream_response(events(), streams, call, _id_header(base))

        results = await self.collect_all(streams, raw, call)
        choices = []
        for i, r in enumerate(results):  # n choices of one prompt
            parser = prep.output_parser()
            parser.feed(r.text, final=True, cut=r.finish_reason in CUT_SHORT)
            message = {**chat_message(parser, thinking), "role": role}
            if echo:
                message["content"] = echo + (message["content"] or "")
            choices.append(
                {
                    "index": i,
                    "message": message,
                    "logprobs": (
                        chat_logprobs(r.as_update(), as_ids, tracked) if top_n is not None else None
                    ),
                    "finish_reason": prep.finish_reason(parser, r.finish_reason),
                    "stop_reason": r.stop_reason,
                    **({"token_ids": r.token_ids} if ids else {}),
                    **({"hidden_states": last_hidden(r)} if body.return_hidden_states else {}),
                }
            )
        total = Result(
            prompt_tokens=results[0].prompt_tokens,
            completion_tokens=sum(r.completion_tokens for r in results),
            cached_tokens=results[0].cached_tokens,
        )
        out = {**head, "object": "chat.completion", "choices": choices, "usage": usage_of(total)}
        out.update(sglext(body, results))
        out.update(self.engine.reply_extras())  # (as a completion's)
        if body.prompt_logprobs is not None:  # vLLM's: the response's, not a choice's
            out["prompt_logprobs"] = prompt_logprobs(results[0].as_update())
        if ids:
            out["prompt_token_ids"] = results[0].as_update().prompt_token_ids
        return JSONResponse(out, headers=_id_header(base))

    async def start_chat(
        self,
        body: ChatCompletionRequest,
        raw: Request,
        name: str | None = None,
        shown: str | None = None,
    ) -> ChatRun:
        """A chat request's prompt rendered (tools, reasoning: `prepare_chat`) and its `n`
        choices handed to the engine: what /v1/chat/completions and /v1/responses share.
        The caller owns the run's streams and call from here (`collect_all`,
        `stream_response`). `name`: the client's request id (`_request_id`); `shown`: the
        response's id (default `name`: a Responses API response's), for the request log."""
        self.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        tokenizer = self.engine.engine.tokenizer
        model_type = self.engine.engine.model_config.model_type
        if not has_chat_format(tokenizer, model_type):
            raise APIError(400, "this model has no chat template; use /v1/completions")
        prep = prepare_chat(body, tokenizer, self.chat_parsers, model_type)  # tools, reasoning
        prompt = prep.prompt
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        # No max_tokens: generate until the context is full (the engine stops at its limit).
        params = self.sampling_params(
            body, max_tokens, self.engine.engine.max_model_len, top_n, "top_logprobs", param
        )
        grammar_param = grammar_field(body)
        if prep.grammar is not None:  # tool_choice forces a call
            if params.grammar is not None:
                raise APIError(
                    400,
                    "a required or named tool_choice cannot be combined with another grammar",
                    param="tool_choice",
                )
            params = dataclasses.replace(params, grammar=prep.grammar)
            grammar_param = "tools"
        # Structured output is the answer's (`content`): where the model reasons first, the
        # grammar starts once the reasoning is over, whichever field asked for it (vLLM's
        # reasoning parsers; SGLang's ReasonerGrammarBackend, for its regex / ebnf /
        # json_schema and structural tags too); /generate keeps a grammar over the whole
        # output. A forcing tool_choice's tag holds the reasoning itself (`prepare_chat`
        # gives it reasoning "disabled").
        n = self._n(body)
        beam = self._beam(body, params)
        given = param if max_tokens is not None else None
        special = body.add_special_tokens  # (vLLM's: none, the template holds its own)
        if body.truncation_side == "right":  # (the rendered prompt's first tokens, as vLLM's)
            prompt = await self._first_tokens(prompt, params, special)
            params = dataclasses.replace(params, truncate_prompt_tokens=None)
        await self.weights_ready()
        call = self.in_flight.open([_names(name)] * n, "request_id", shown or name, raw)
        streams: list[RequestStream] = []
        prompt_ids = None
        try:
            params = await self.ready_grammar(params, grammar_param, prep.reasoning)
            if beam is not None:
                streams = await self._submit_beams(
                    [prompt], params, beam, raw, given, "messages", special, call=call
                )
            else:
                streams = await self.submit_all(
                    [prompt], [params], n, raw, [given], "messages", special, call=call
                )
            if body.stream and body.return_token_ids:  # (vLLM's first chunk carries them)
                keep = params.truncate_prompt_tokens
                prompt_ids = await asyncio.to_thread(
                    self.engine.engine.prompt_ids, prompt, keep, special
                )
        except BaseException:
            for s in streams:
                self.engine.abort(s)
            self.in_flight.close(call)
            raise
        as_ids = self.defaults.as_ids(body)
        return ChatRun(prep, streams, call, params, prompt_ids, as_ids)

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        """vLLM's /tokenize: the ids /v1/completions (`prompt`) or /v1/chat/completions
        (`messages`, through the chat template) would run."""
        self.check_model(body.model)
        e = self.engine.engine
        if e.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.messages is not None:
            if not body.messages:
                raise APIError(400, "messages is empty", param="messages")
            chat = ChatCompletionRequest(
                messages=body.messages,
                tools=body.tools,
                chat_template_kwargs=body.chat_template_kwargs,
                chat_template=body.chat_template,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
            )
            try:
                model_type = e.model_config.model_type
                text = prepare_chat(chat, e.tokenizer, self.chat_parsers, model_type).prompt
                tokens = e.encode(text, special=bool(body.add_special_tokens))
            except DsakvError as err:
                raise APIError(400, str(err), param="messages") from None
        else:
            try:
                special = True if body.add_special_tokens is None else body.add_special_tokens
                tokens = e.encode(body.prompt, special=special)
            except DsakvError as err:
                raise APIError(400, str(err), param="prompt") from None
        return {"tokens": tokens, "count": len(tokens), "max_model_len": e.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        e = self.engine.engine
        if e.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        vocab = e.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens must be in 0..{vocab - 1}", param="tokens")
        text = e.tokenizer.decode(body.tokens)
        return {"prompt": text, "text": text}  # (vLLM's key, SGLang's)

    def model_cards(self) -> list[dict[str, Any]]:
        """/v1/models' cards: the base model's names', then each LoRA adapter's."""
        return [self.model_card(name) for name in [*self.model_names, *self.loras]]

    def model_card(self, name: str) -> dict[str, Any]:
        """A served name's card, as /v1/models lists it and /v1/models/{model} returns it:
        OpenAI's fields, and Anthropic's (`type`, `display_name`, `created_at`), so the
        Anthropic SDK's `models.list` and `retrieve` read the same routes. An adapter's, as
        vLLM's: its path the `root`, the base model's served name its `parent`."""
        if (adapter := self.adapter_of(name)) is not None:
            card = self.model_card(self.model_name)
            shown = {"id": adapter, "display_name": adapter, "root": self.loras[adapter]}
            return {**card, **shown, "parent": self.model_name}
        name = name if name in self.model_names else self.model_name  # (an alias: the first)
        e, now = self.engine.engine, self.created
        return {
            "id": name,
            "object": "model",
            "created": now,
            "owned_by": "dsakv",
            "root": e.config.model,
            "max_model_len": e.max_model_len,
            "type": "model",
            "display_name": name,
            "created_at": datetime.fromtimestamp(now, timezone.utc).isoformat(),
        }

    def model_info(self) -> dict[str, Any]:
        """SGLang's `/model_info` shape (sglang-router reads `model_type` from it)."""
        e = self.engine.engine
        return {
            "model_path": e.weights_path,  # (as SGLang's, the last update's)
            "tokenizer_path": None if e.tokenizer is None else e.config.tokenizer or e.config.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": e.model_config.model_type,
        }

    async def server_info(self) -> dict[str, Any]:
        """SGLang's `/server_info` shape: the engine's settings (`dsakv.engine.info`, what
        `LLM.get_server_info` returns) with the server's own: its served name (what its
        /v1/models lists) and PD role."""
        counters = await self.engine.counters()  # (the last ones during a long step)
        info = engine_info(self.engine.engine, counters, self.model_name)
        return {**info, **self.engine.server_info()}

    def check_model(self, model: str | None) -> None:
        """A 404 for a `model` this server does not serve: neither a name of the base
        model's nor a LoRA adapter's (`adapter_of`)."""
        if model is not None and model not in self._accepted and self.adapter_of(model) is None:
            served = repr(self.model_name)
            if self.loras:
                served += f" and the LoRA adapters {', '.join(map(repr, self.loras))}"
            raise APIError(
                404,
                f"model {model!r} does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )

    def is_base_name(self, name: str) -> bool:
        """Whether `name` names the base model (a served name, or an alias of them)."""
        return name in self._accepted

    def adapter_of(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names (vLLM's: its name; SGLang's `base:adapter` too),
        None for the base model or a name not served."""
        if model in self.loras:
            return model
        base, colon, name = (model or "").rpartition(":")
        return name if colon and base in self._accepted and name in self.loras else None

    def lora_name(self, body: GenerationRequest) -> str | None:
        """The adapter a request runs on (`SamplingParams.lora_name`; None: the base model):
        the one its `model` names, else SGLang's `lora_path` (an adapter's name; a list,
        one per prompt, is /generate's: `adapter`)."""
        named, path = self.adapter_of(body.model), body.lora_path
        if not path:  # (null or empty: SGLang's unset)
            return named
        if not isinstance(path, str):
            raise APIError(400, "lora_path must be an adapter's name here", param="lora_path")
        if named not in (None, path):
            raise APIError(
                400,
                f"model names the adapter {named!r} and lora_path {path!r}: give one",
                param="lora_path",
            )
        return self.adapter(path, "lora_path")

    def adapter(self, name: str, param: str) -> str:
        """`name` as a loaded adapter's (SGLang's `lora_path`), else the 400 naming `param`."""
        if not self.engine.engine.config.enable_lora:
            raise APIError(
                400,
                f"{param}: this server serves no LoRA adapters (start it with --enable-lora)",
                param=param,
            )
        if name not in self.loras:
            raise APIError(400, f"LoRA adapter {name!r} is not loaded", param=param)
        return name

    def served_name(self, params: SamplingParams) -> str:
        """The model a response reports: its adapter's name (vLLM's), else the base's."""
        return params.lora_name or self.model_name


def _request_id(body: GenerationRequest, raw: Request) -> str | None:
    """The client's id for a request, vLLM's: its X-Request-Id header, else the body's
    `request_id` (the response's id is "cmpl-" or "chatcmpl-" and it). Like a /generate
    rid it names the request for /abort_request, one call's at a time. A body id that
    cannot be the X-Request-Id header it comes back in is a 400 before anything runs."""
    named = raw.headers.get("x-request-id")
    if named:
        return named
    if body.request_id and not HEADER_SAFE.fullmatch(body.request_id):
        raise APIError(
            400,
            "request_id must be printable ASCII without leading or trailing spaces "
            f"(it is sent back as the X-Request-Id header), got {body.request_id!r}",
            param="request_id",
        )
    return body.request_id or None


def _names(name: str | None) -> tuple[str, ...]:
    return (name,) if name else ()


def _id_header(base: str) -> dict[str, str]:
    """The response's id as its X-Request-Id header (vLLM's, with
    --enable-request-id-headers)."""
    return {"X-Request-Id": base}
