"""SGLang's native `/generate` API, which SGLang clients, RL frameworks (slime, AReaL, verl's
sglang rollout) and sglang-router call: SGLang's request (`GenerateReqInput`, its
`sampling_params` names) and response shapes (`text`, `output_ids`, `meta_info`), over the
OpenAI handlers' plumbing (`Handlers`): the same sampling params (less generation_config's
defaults, which SGLang applies to its chat route alone), submission, disconnect aborts and
SSE streaming; its `/abort_request`, with which those frameworks stop their rollouts, and
`/update_weights_from_disk` (with `/get_weight_version`, `/update_weight_version`), with
which they load the trained weights between rollouts, and `/pause_generation` /
`/continue_generation` around them (partial rollouts)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsakv.distributed.weight_sync import GroupUpdate, WeightGroup
from dsakv.engine import SamplingParams
from dsakv.errors import DsakvError

from .handlers import Handlers
from .openai_format import json_logprob
from .params import SGLANG_NOT_RUN, prompt_list, request_salt
from .protocol import APIError, ClientId, GenerationRequest, new_id
from .rows import routed_base64, row_params
from .sessions import SessionParams, SessionRefused, Turn
from .submit import Result, refusal, sse_event

_DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's


class GenerateRequest(BaseModel):
    """SGLang's `GenerateReqInput`, the fields dsakv runs (null: SGLang's default). Its
    fields that dsakv does not run are refused unless left off (`_NOT_RUN`); unknown ones
    are ignored, as in the OpenAI routes (routers add their own)."""

    model_config = ConfigDict(strict=True, extra="allow")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: ClientId | list[ClientId] | None = None
    stream: bool | None = False
    # (these three: one for all prompts, or a list of one per prompt)
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None  # -1: from the last prompt token (no scoring)
    top_logprobs_num: int | list[int] | None = None
    # the ids whose logprobs each position reports: one list for all prompts, or one each
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool | None = False
    # the prefix-cache salt (`params.request_salt`): SGLang's extra_key, and vLLM's cache_salt
    # (one for all prompts, or a list of one per prompt)
    extra_key: str | list[str] | None = None
    cache_salt: str | list[str] | None = None
    priority: int | None = None  # (every prompt's; under priority scheduling only)
    # SGLang's, where the server's --enable-return-routed-experts / --enable-return-hidden-
    # states allow them (`_with_rows`): the experts each token was routed to (from
    # routed_experts_start_len) and each token's last hidden state (one for all prompts, or
    # a list of one each), in meta_info once the output ends
    return_routed_experts: bool | None = False
    routed_experts_start_len: int | None = 0
    return_hidden_states: bool | list[bool] | None = False
    # SGLang's: the input follows an earlier request of an open session (`sessions`)
    session_params: SessionParams | None = None
    # SGLang's: the LoRA adapter each prompt runs on, by its name (null: the base model;
    # one for all prompts, or a list of one each)
    lora_path: str | list[str | None] | None = None


# GenerateReqInput's fields that change what is generated or returned, not run here.
_NOT_RUN = (
    "input_embeds",
    "image_data",
    "video_data",
    "audio_data",
    "positional_embed_overrides",
    *SGLANG_NOT_RUN,  # (the /v1 routes refuse them too)
    "max_thinking_tokens",
    "require_reasoning",
    "return_sampling_mask",
    "return_flat_raw_top_logprobs",
    "return_indexer_topk",
    "return_entropy",
)


class AbortRequest(BaseModel):
    """SGLang's `AbortReq` as its /abort_request reads it: a `rid`, or `abort_all`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    rid: str | None = None
    abort_all: bool | None = False


class ConfigureLoggingRequest(BaseModel):
    """SGLang's `ConfigureLoggingReq`, the request log's switch and level (null: as it is);
    its fields for what dsakv does not run (request and crash dumps, another log format,
    the server's log level) are refused unless null (`_LOGGING_NOT_RUN`)."""

    model_config = ConfigDict(strict=True, extra="allow")
    log_requests: bool | None = None
    log_requests_level: Literal[0, 1, 2, 3] | None = None
    log_requests_format: Literal["text"] | None = None  # (SGLang's default; "json" not run)


_LOGGING_NOT_RUN = (
    "log_level",
    "dump_requests_folder",
    "dump_requests_threshold",
    "dump_requests_exclude_meta_keys",
    "crash_dump_folder",
)


class UpdateWeightsRequest(BaseModel):
    """SGLang's `UpdateWeightFromDiskReqInput`, the fields dsakv runs (its others, such as
    is_async or keep_pause, are ignored: the update waits unless generation is paused, and
    flushes the cache)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    abort_all_requests: bool = False


class MemoryOccupationRequest(BaseModel):
    """SGLang's `ReleaseMemoryOccupationReqInput` / `ResumeMemoryOccupationReqInput`: the
    tags ("weights", "kv_cache", "cuda_graph"; null or none: all)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    tags: list[str] | None = None


class InitWeightsUpdateGroupRequest(BaseModel):
    """SGLang's `InitWeightsUpdateGroupReqInput` (`WeightGroup`)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class UpdateWeightsFromDistributedRequest(BaseModel):
    """SGLang's `UpdateWeightsFromDistributedReqInput` (`GroupUpdate`), the fields dsakv runs."""

    model_config = ConfigDict(strict=True, extra="ignore")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    group_name: str = "weight_update_group"


class PauseGenerationRequest(BaseModel):
    """SGLang's `PauseGenerationReqInput`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightVersionRequest(BaseModel):
    """SGLang's `UpdateWeightVersionReqInput`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    new_version: str
    abort_all_requests: bool = True


class GetWeightsByNameRequest(BaseModel):
    """SGLang's `GetWeightsByNameReqInput`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    truncate_size: int = 100


class ProfileRequest(BaseModel):
    """SGLang's `ProfileReqInput`, the fields dsakv runs (its others are ignored, but a
    `start_step`, which would change what is recorded)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    output_dir: str | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    start_step: int | None = None


# The load formats dsakv reads: safetensors checkpoints (SGLang's default "auto" too).
_LOAD_FORMATS = (None, "auto", "safetensors")


class SGLangSamplingParams(BaseModel):
    """SGLang's `sampling_params` (null: its default). A key SGLang does not have is a 400,
    and so is one it has that dsakv does not run, unless null (`_refuse_not_run`)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    n: int | None = None
    sampling_seed: int | None = None
    logit_bias: dict[str, float] | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # A fast (tokenizers) tokenizer's decode has no such option, so SGLang's does nothing
    # with it either: taken, as RL frameworks send it.
    spaces_between_special_tokens: bool | None = None
    # SGLang's, not run here: a 400 unless left unset (null, or empty or 0 as SGLang's
    # clients send them: sgl.gen sends stop_regex: [])
    stop_regex: Any = None
    custom_params: Any = None
    # this request's tokens N at a time to its stream (0 or null: the server's
    # --stream-interval)
    stream_interval: int | None = Field(default=None, ge=0, strict=True)


_SAMPLING_NOT_RUN = ("stop_regex", "custom_params")
_GRAMMAR_KEYS = ("regex", "json_schema", "ebnf", "structural_tag")

# The OpenAI names `Handlers.sampling_params` checks under, and SGLang's for them.
_SGLANG_NAMES = {
    "max_tokens": "max_new_tokens",
    "min_tokens": "min_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
    "logprobs": "top_logprobs_num",
    "prompt_logprobs": "top_logprobs_num",
    "response_format": "json_schema",
    "structured_outputs": "structural_tag",
}
_OPENAI_WORDS = re.compile(r"\b(" + "|".join(_SGLANG_NAMES) + r")\b")


def add_generate_route(app: FastAPI, api: Handlers) -> None:
    """`POST`/`PUT /generate` (SGLang takes both), `POST /abort_request`, the weight
    routes, pausing and `/configure_logging`, behind the API key as the /v1 routes."""

    async def generate(body: GenerateRequest, raw: Request) -> Response:
        return await _generate(api, body, raw)

    async def abort_request(body: AbortRequest) -> Response:
        """SGLang's: `abort_all` aborts every generation in flight (the /v1 routes' too),
        else `rid` those it names (a /generate output's `meta_info.id`, or the rid a prompt
        was given: its n samples too); a 200 either way, an unknown rid changes nothing.
        Each ends as it stands, finish_reason abort (`_finish_reason`)."""
        if body.abort_all:
            api.in_flight.abort_all()
        elif body.rid:
            api.in_flight.abort(body.rid)
        return Response(status_code=200)

    async def configure_logging(body: ConfigureLoggingRequest | None = None) -> Response:
        """SGLang's: the request log turned on or off, or set to another level, at run time
        (`RequestLogConfig.configured`), for the calls that open from then on."""
        b = body or ConfigureLoggingRequest()
        for name in _LOGGING_NOT_RUN:
            if (b.model_extra or {}).get(name) is not None:
                raise APIError(400, f"{name} is not supported by this server", param=name)
        log = api.in_flight.log
        log.configure(log.config.configured(b.log_requests, b.log_requests_level))
        return Response(status_code=200)

    async def update_weights_from_disk(body: UpdateWeightsRequest) -> Response:
        """SGLang's: `model_path` loaded in place of the served weights once the generation
        calls in flight end (aborted first with `abort_all_requests`; new ones wait; while
        generation is paused, at once: the paused ones go on with it), the prefix cache dropped, `weight_version` reported from then on. A checkpoint that does
        not fit (another architecture, weights stored otherwise) or fails to load is a 400
        with success false, the served weights unchanged. num_paused_requests: the paused
        requests the update ran under."""
        if body.load_format not in _LOAD_FORMATS:
            ok, message = False, f"load_format {body.load_format!r} is not supported (safetensors)"
        else:
            ok, message = await api.update_weights(
                body.model_path, body.abort_all_requests, body.weight_version
            )
        paused = await api.paused_requests() if ok else 0
        return JSONResponse(
            {"success": ok, "message": message, "num_paused_requests": paused},
            status_code=200 if ok else 400,
        )

    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest) -> Response:
        """SGLang's: every engine rank joins the trainer's process group (it answers once
        the trainer has joined too), over which /update_weights_from_distributed then
        receives its tensors."""
        ok, message = await api.join_weight_group(WeightGroup(**body.model_dump()))
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)

    async def update_weights_from_distributed(
        body: UpdateWeightsFromDistributedRequest,
    ) -> Response:
        """SGLang's: the trainer broadcasts the tensors `names` lists (checkpoint names, some
        or all of the model's) over the group, and they are copied into the served weights
        as /update_weights_from_disk copies a checkpoint (waiting for the calls in flight,
        unless paused; on every rank; one that does not fit changes nothing)."""
        if body.load_format not in (None, "auto"):
            ok, message = False, f"load_format {body.load_format!r} is not supported"
        else:
            update = GroupUpdate(
                body.group_name,
                tuple(body.names),
                tuple(body.dtypes),
                tuple(tuple(shape) for shape in body.shapes),
                body.flush_cache,
            )
            ok, message = await api.update_weights(
                update, body.abort_all_requests, body.weight_version
            )
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)

    async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupRequest) -> Response:
        ok, message = await api.leave_weight_group(body.group_name)
        return JSONResponse({"success": ok, "message": message}, status_code=200 if ok else 400)

    async def pause_generation(body: PauseGenerationRequest | None = None) -> dict[str, str]:
        """SGLang's: new generation calls wait until /continue_generation, and those in flight
        are aborted (mode "abort", the default), paused with their KV ("in_place") or paused
        with their KV given back, to compute again ("retract")."""
        await api.pause_generation((body or PauseGenerationRequest()).mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation() -> dict[str, str]:
        await api.continue_generation()
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def pause(
        mode: Literal["abort", "wait", "keep"] = Query("abort"),
        wait_for_inflight_requests: bool = Query(False),
        clear_cache: bool = Query(True),
    ) -> dict[str, str]:
        """vLLM's /pause, the same pause as /pause_generation: "abort" (its default), "wait"
        (for the calls in flight to end) or "keep" (SGLang's "in_place"); then, unless
        kept, the prefix cache dropped (clear_cache, as vLLM's)."""
        if wait_for_inflight_requests:  # (vLLM's, deprecated for mode "wait")
            mode = "wait"
        await api.pause_generation("in_place" if mode == "keep" else mode)
        if clear_cache and mode != "keep":
            with contextlib.suppress(APIError):  # (a prefill server's hand-offs hold pages)
                await api.flush_cache()
        return {"status": "paused"}

    async def resume() -> dict[str, str]:
        await api.continue_generation()
        return {"status": "resumed"}

    async def is_paused() -> dict[str, bool]:
        return {"is_paused": api.generation_paused}

    async def get_weight_version() -> dict[str, str]:
        return {"weight_version": api.weight_version}

    async def release_memory_occupation(body: MemoryOccupationRequest | None = None) -> Response:
        """SGLang's: free the tags' memory for a trainer on the same device, the weights
        kept in host memory (`Engine.release_memory_occupation`); a 400 while requests run
        or wait, and generation calls are a 503 until /resume_memory_occupation."""
        tags = (body or MemoryOccupationRequest()).tags
        await _memory_call(api, tags, lambda e: e.release_memory_occupation(tags))
        return JSONResponse({"success": True, "message": "Memory released."})

    async def resume_memory_occupation(body: MemoryOccupationRequest | None = None) -> Response:
        tags = (body or MemoryOccupationRequest()).tags
        await _engine_call(api, lambda e: e.resume_memory_occupation(tags))
        return JSONResponse({"success": True, "message": "Memory resumed."})

    async def sleep(level: int = Query(1)) -> Response:
        """vLLM's sleep mode: level 1 frees the KV cache and keeps the weights in host
        memory, level 2 drops them too (`Engine.sleep`); /wake_up brings them back."""
        await _memory_call(api, None, lambda e: e.sleep(level))
        return Response(status_code=200)

    async def wake_up(tags: Annotated[list[str] | None, Query()] = None) -> Response:
        """vLLM's: `?tags=weights&tags=kv_cache` (none: everything)."""
        await _engine_call(api, lambda e: e.wake_up(tags))
        return Response(status_code=200)

    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": await _engine_call(api, lambda e: e.is_sleeping())}

    async def update_weight_version(body: UpdateWeightVersionRequest) -> dict[str, Any]:
        """SGLang's: only the name /generate reports (aborting every call in flight unless
        `abort_all_requests` is false)."""
        if body.abort_all_requests:
            api.in_flight.abort_all()
        api.weight_version = body.new_version
        return {
            "success": True,
            "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version,
        }

    async def get_weights_by_name(body: GetWeightsByNameRequest) -> Response:
        """SGLang's: the first `truncate_size` rows of checkpoint tensor `name` as served,
        fp32 nested lists (`Engine.get_weights_by_name`: every rank's slices together);
        a name the model lacks is a 400."""
        rows = await _engine_call(
            api, lambda e: e.get_weights_by_name(body.name, body.truncate_size)
        )
        return JSONResponse(rows)

    async def start_profile(body: ProfileRequest | None = None) -> Response:
        """SGLang's (vLLM's: POST, no body): torch.profiler on every rank until /stop_profile
        or `num_steps` engine steps (`Engine.start_profile`); a 400 while one runs."""
        b = body or ProfileRequest()
        if b.start_step is not None:
            raise APIError(400, "start_step is not supported", param="start_step")
        args = (b.output_dir, b.num_steps, b.activities, b.with_stack, b.record_shapes)
        await _engine_call(api, lambda e: e.start_profile(*args))
        return Response("Start profiling.\n", media_type="text/plain")

    async def stop_profile() -> Response:
        """Every rank writes its trace (`.trace.json.gz`); a 400 with no profile running, a
        trace that cannot be written the server's 500 (its OSError)."""
        await _engine_call(api, lambda e: e.stop_profile())
        return Response("Stop profiling. This will take some time.\n", media_type="text/plain")

    async def start_expert_distribution_record() -> Response:
        """SGLang's: count the experts each MoE layer routes tokens to (a 400 on a server
        started without --expert-distribution-recorder-mode)."""
        await _engine_call(api, lambda e: e.start_expert_distribution_record())
        return Response("Start recording the expert distribution.\n", media_type="text/plain")

    async def stop_expert_distribution_record() -> Response:
        await _engine_call(api, lambda e: e.stop_expert_distribution_record())
        return Response("Stop recording the expert distribution.\n", media_type="text/plain")

    async def dump_expert_distribution_record() -> Response:
        """Write the counts under $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR (SGLang's files);
        a rank that cannot is the server's 500 (its OSError), the counts kept."""
        await _engine_call(api, lambda e: e.dump_expert_distribution_record())
        return Response("Dump expert distribution record.\n", media_type="text/plain")

    app.add_api_route("/generate", generate, methods=["POST", "PUT"])
    app.add_api_route("/abort_request", abort_request, methods=["POST"])
    app.add_api_route("/configure_logging", configure_logging, methods=["GET", "POST"])
    app.add_api_route("/update_weights_from_disk", update_weights_from_disk, methods=["POST"])
    app.add_api_route("/init_weights_update_group", init_weights_update_group, methods=["POST"])
    app.add_api_route(
        "/update_weights_from_distributed", update_weights_from_distributed, methods=["POST"]
    )
    app.add_api_route(
        "/destroy_weights_update_group", destroy_weights_update_group, methods=["POST"]
    )
    app.add_api_route("/pause_generation", pause_generation, methods=["POST"])
    app.add_api_route("/continue_generation", continue_generation, methods=["POST"])
    app.add_api_route("/pause", pause, methods=["POST"])  # (vLLM's names for them)
    app.add_api_route("/resume", resume, methods=["POST"])
    app.add_api_route("/is_paused", is_paused, methods=["GET"])
    app.add_api_route("/get_weight_version", get_weight_version, methods=["GET"])
    app.add_api_route("/update_weight_version", update_weight_version, methods=["POST"])
    app.add_api_route("/get_weights_by_name", get_weights_by_name, methods=["GET", "POST"])
    for path, route in (
        ("/release_memory_occupation", release_memory_occupation),
        ("/resume_memory_occupation", resume_memory_occupation),
    ):
        app.add_api_route(path, route, methods=["GET", "POST"])  # (SGLang's)
    app.add_api_route("/sleep", sleep, methods=["POST"])  # (vLLM's)
    app.add_api_route("/wake_up", wake_up, methods=["POST"])
    app.add_api_route("/is_sleeping", is_sleeping, methods=["GET"])
    app.add_api_route("/start_profile", start_profile, methods=["GET", "POST"])
    app.add_api_route("/stop_profile", stop_profile, methods=["GET", "POST"])
    for path, route in (
        ("/start_expert_distribution_record", start_expert_distribution_record),
        ("/stop_expert_distribution_record", stop_expert_distribution_record),
        ("/dump_expert_distribution_record", dump_expert_distribution_record),
    ):
        app.add_api_route(path, route, methods=["GET", "POST"])  # (SGLang's)


async def _engine_call(api: Handlers, fn: Any) -> Any:
    """`fn(engine)` between steps; its `DsakvError` a 400, a stopped engine a 503."""
    try:
        return await api.engine.call(fn)
    except (DsakvError, RuntimeError) as e:
        raise refusal(e, None) from None


async def _memory_call(api: Handlers, tags: list[str] | None, fn: Any) -> None:
    """A release (`fn(engine)`) as `_engine_call` runs it; the KV cache is not released on
    a prefill or decode server, whose peer registered the pool's addresses."""
    if api.disaggregated and (not tags or "kv_cache" in tags):
        raise APIError(
            400,
            "a prefill or decode server does not release its KV cache: its peers hold the "
            'pool\'s registered addresses (release only the weights: tags ["weights"])',
            param="tags",
        )
    await _engine_call(api, fn)


@dataclass(frozen=True)
class _LogprobAsk:
    """What `return_logprob` asks for: input logprobs from prompt position `start` (-1:
    the last one, which nothing scores), the top `top_n`, those of `token_ids` (None:
    none; `token_ids_logprob`), and each token's text. `prompt`:
    False on a prefill server, whose input logprobs would come twice: sglang-router
    prepends them to the decode server's, which has them all (`dsakv router`, and
    sglang-router's streams, pass the decode server's alone)."""

    start: int
    top_n: int
    texts: _TokenTexts
    prompt: bool = True
    token_ids: tuple[int, ...] | None = None


async def _generate(api: Handlers, body: GenerateRequest, raw: Request) -> Response:
    began = time.perf_counter()
    _refuse_not_run(body)
    try:
        api.engine.engine.check_priority(body.priority)
    except DsakvError as e:
        raise APIError(400, str(e), param=e.param) from None
    prompts, single, prompt_field = _prompts(body)
    samplings = _samplings(body.sampling_params, len(prompts), single)
    n = samplings[0].n or 1
    if any((s.n or 1) != n for s in samplings):
        raise APIError(
            400, "n must be the same in every sampling_params", param="sampling_params.n"
        )
    with _in_sglang_terms():  # (before prompts * n of anything is made)
        api.check_n(n)
    rids = _rids(body.rid, len(prompts), n, single)
    given_rids = _given_rids(body.rid, len(prompts), single)
    turn = api.sessions.turn(body.session_params, len(prompts), n, api.disaggregated)
    asks = _logprob_asks(api, body, len(prompts), n)
    salts = [
        request_salt(c, k)
        for c, k in zip(
            _per_prompt(body.cache_salt, "cache_salt", len(prompts), n),
            _per_prompt(body.extra_key, "extra_key", len(prompts), n),
        )
    ]
    loras = [  # (a list with n > 1 too: SGLang repeats it per sample, `_normalize_lora_paths`)
        api.adapter(name, "lora_path") if name else None
        for name in _per_prompt(body.lora_path, "lora_path", len(prompts), 1)
    ]
    # Opened before its prompts are tokenized and its grammar compiled, so that an abort
    # meanwhile is not lost (SGLang registers the rid first too); a rid in flight is a 400
    names = [{rid, given_rids[i // n]} - {None} for i, rid in enumerate(rids)]
    # (the request log's: the client's rids, else the outputs' own)
    shown = body.rid if isinstance(body.rid, str) else ",".join(body.rid or rids)
    await api.weights_ready()
    call = api.in_flight.open(names, shown=shown, raw=raw)
    try:
        if turn is not None:  # (its whole input: the logprob_start_len check is on it)
            prompts[0] = await _session_prompt(api, turn, prompts[0], prompt_field)
        for i, ask in enumerate(asks):
            if ask is not None and ask.start >= 0:  # check it against the prompt's length
                prompts[i] = await _prompt_ids(api, prompts[i], ask.start, prompt_field)
        with _in_sglang_terms():
            if isinstance(body.sampling_params, list) or len(set(asks)) > 1:
                params = [await _params(api, s, a) for s, a in zip(samplings, asks)]
            else:
                params = [await _params(api, samplings[0], asks[0])] * len(prompts)
            params = [
                dataclasses.replace(
                    p,
                    cache_salt=p.cache_salt if s is None else s,
                    priority=body.priority,
                    lora_name=lora,
                )
                for p, s, lora in zip(params, salts, loras)
            ]
            params = _with_rows(body, params, n)
            # (the context check only where the client gave max_new_tokens, as SGLang's)
            given = ["max_new_tokens" if s.max_new_tokens is not None else None for s in samplings]
        if turn is not None:  # (now a node of its session: its output is `turn.result`)
            prompts[0] = api.sessions.start(turn, rids[0], params[0].max_tokens, call)
        with _in_sglang_terms():
            streams = await api.submit_all(prompts, params, n, raw, given, prompt_field, call=call)
        if turn is not None:  # (taken: what it replaces is dropped only now)
            api.sessions.took(turn)
    except SessionRefused as e:  # (SGLang's abort: streamed, an output that says so)
        api.in_flight.close(call)
        if not body.stream:
            raise
        out = _output(rids[0], e.result(), None, began, api.weight_version)
        out["meta_info"]["finish_reason"] = e.finish_reason()
        return api.stream_response(_one(sse_event(out)), [])
    except BaseException:  # (from here `collect_all` or `stream_response` closes it)
        api.in_flight.close(call)
        raise
    batch = not single or n > 1  # (outputs prompt-major: prompt i's sample j is i * n + j)

    if body.stream:
        so_far = [Result() for _ in streams] if turn is None else [turn.result]

        async def events() -> AsyncIterator[str]:
            async for i, u in api.merged_updates(streams):
                so_far[i].add(u)  # SGLang streams the output so far (cumulative)
                out = _output(rids[i], so_far[i], asks[i // n], began, api.weight_version)
                yield sse_event({**out, "index": i} if batch else out)

        return api.stream_response(events(), streams, call)

    results = await api.collect_all(streams, raw, call, None if turn is None else [turn.result])
    version = api.weight_version
    outs = [
        _output(rid, r, asks[i // n], began, version)
        for i, (rid, r) in enumerate(zip(rids, results))
    ]
    return JSONResponse(outs if batch else outs[0])


# --- request -----------------------------------------------------------------------------------


def _refuse_not_run(body: GenerateRequest) -> None:
    extra = body.model_extra or {}
    for name in _NOT_RUN:
        if extra.get(name):  # (null, false, 0 or empty: left off)
            raise APIError(400, f"{name} is not supported by this server", param=name)


def _prompts(body: GenerateRequest) -> tuple[list[str | list[int]], bool, str]:
    """The prompts, whether they came as one (not a list), and the field they came in."""
    if (body.text is None) == (body.input_ids is None):
        raise APIError(400, "give exactly one of text and input_ids", param="text")
    name = "text" if body.text is not None else "input_ids"
    value = body.text if body.text is not None else body.input_ids
    if not value and not isinstance(value, str):  # ("" is a text its tokenizer may add to)
        raise APIError(400, f"{name} is empty", param=name)
    try:
        prompts = prompt_list(value)
    except APIError as e:
        raise APIError(e.status, e.message, param=name) from None
    return prompts, isinstance(value, str) or isinstance(value[0], int), name


def _samplings(
    given: dict[str, Any] | list[dict[str, Any]] | None, count: int, single: bool
) -> list[SGLangSamplingParams]:
    """One `SGLangSamplingParams` per prompt: one dict for all, or a list of one each."""
    if not isinstance(given, list):
        return [_sampling(given or {})] * count
    if single or len(given) != count:
        raise APIError(
            400,
            f"sampling_params must be one object, or a list of one per prompt ({count})",
            param="sampling_params",
        )
    return [_sampling(d) for d in given]


def _sampling(given: dict[str, Any]) -> SGLangSamplingParams:
    try:
        sp = SGLangSamplingParams.model_validate(given)
    except ValidationError as e:
        first = e.errors()[0]
        name = ".".join(["sampling_params", *(str(x) for x in first["loc"][:1])])
        if first["type"] == "extra_forbidden":
            message = f"{name} is not one of SGLang's sampling params"
            raise APIError(400, message, param=name) from None
        raise APIError(400, f"{name}: {first['msg']}", param=name) from None
    for key in _SAMPLING_NOT_RUN:
        if getattr(sp, key):
            name = f"sampling_params.{key}"
            raise APIError(400, f"{name} is not supported by this server", param=name)
    return sp


def _rids(rid: str | list[str] | None, prompts: int, n: int, single: bool) -> list[str]:
    """Each output's `meta_info.id`, as SGLang names them: the one `rid` of a single prompt;
    `rid_i`, or the list's own, in a batch; a new one for each sample when n > 1."""
    if isinstance(rid, list):
        if single and n == 1:
            raise APIError(400, "rid must be a string for one prompt", param="rid")
        if len(rid) != prompts:
            raise APIError(400, f"rid must have one id per prompt ({prompts})", param="rid")
        twice = next((x for i, x in enumerate(rid) if x in rid[:i]), None)
        if twice is not None:  # (SGLang's words, as for a rid in flight)
            raise APIError(400, f"Duplicate request ID detected: {twice}", param="rid")
    if n > 1 or rid is None:
        return [new_id() for _ in range(prompts * n)]
    return _given_rids(rid, prompts, single)


def _given_rids(rid: str | list[str] | None, prompts: int, single: bool) -> list[str | None]:
    """Each prompt's rid as the client named it, which /abort_request takes for all its
    samples too (with n > 1 each has an id of its own; SGLang drops the prompt's rid then,
    and an abort naming it does nothing)."""
    if rid is None:
        return [None] * prompts
    if isinstance(rid, list):
        return list(rid)
    return [rid] if single else [f"{rid}_{i}" for i in range(prompts)]


def _logprob_asks(
    api: Handlers, body: GenerateRequest, prompts: int, n: int
) -> list[_LogprobAsk | None]:
    """Each prompt's `_LogprobAsk` (None: no logprobs)."""
    wanted = _per_prompt(body.return_logprob, "return_logprob", prompts, n)
    starts = _per_prompt(body.logprob_start_len, "logprob_start_len", prompts, n)
    tops = _per_prompt(body.top_logprobs_num, "top_logprobs_num", prompts, n)
    by_ids = _token_ids_logprob(body.token_ids_logprob, prompts, n)
    if not any(wanted):
        return [None] * prompts
    texts = _TokenTexts(api.engine.engine.tokenizer if body.return_text_in_logprobs else None)
    prefill = api.engine.server_info().get("disaggregation_mode") == "prefill"
    asks: list[_LogprobAsk | None] = []
    for want, start, top, ids in zip(wanted, starts, tops, by_ids):
        start = -1 if start is None else start
        if want and start < -1:
            raise APIError(
                400, f"logprob_start_len must be -1 or >= 0, got {start}", param="logprob_start_len"
            )
        ask = _LogprobAsk(start, top or 0, texts, prompt=not prefill, token_ids=ids)
        asks.append(ask if want else None)
    return asks


def _token_ids_logprob(
    value: list[int] | list[list[int]] | None, prompts: int, n: int
) -> list[tuple[int, ...] | None]:
    """Each prompt's `token_ids_logprob`, as SGLang normalises it: one list of ids for all
    prompts, or a list of one list each (not with n > 1); an empty list is none, but one
    prompt's empty list asks for no ids (SGLang's: an empty list per position)."""
    name = "token_ids_logprob"
    if not value:
        return [None] * prompts
    one = not isinstance(value[0], list)
    each = [value] * prompts if one else _per_prompt(value, name, prompts, n)
    if any(t < 0 for ids in each for t in ids):
        raise APIError(400, f"{name} must be token ids (>= 0)", param=name)
    return [tuple(ids) for ids in each]


def _with_rows(body: GenerateRequest, params: list[SamplingParams], n: int) -> list[SamplingParams]:
    """Each prompt's params asking for SGLang's rows: `return_routed_experts` (from
    `routed_experts_start_len`) and `return_hidden_states` (one for all prompts, or a list of
    one each). The engine refuses them where its flags do not allow them (SGLang's words)."""
    hidden = _per_prompt(body.return_hidden_states, "return_hidden_states", len(params), n)
    try:
        return [dataclasses.replace(p, **row_params(body, h)) for p, h in zip(params, hidden)]
    except DsakvError as e:
        raise APIError(400, str(e), param=e.param) from None


def _per_prompt(value: Any, name: str, prompts: int, n: int) -> list[Any]:
    """One value per prompt, as SGLang's `GenerateReqInput` normalises them: one for all,
    or a list of one each (not with n > 1)."""
    if not isinstance(value, list):
        return [value] * prompts
    if len(value) != prompts:
        raise APIError(
            400, f"{name} must be one value, or a list of one per prompt ({prompts})", param=name
        )
    if n > 1:
        raise APIError(400, f"{name} cannot be a list with n > 1", param=name)
    return value


async def _session_prompt(
    api: Handlers, turn: Turn, prompt: str | list[int], name: str
) -> list[int]:
    """The request's whole input in its session (`Sessions.prompt`), from its own tokens."""
    ids = await _prompt_ids(api, prompt, 0, name)
    tokenizer = api.engine.engine.tokenizer
    return api.sessions.prompt(turn, ids, None if tokenizer is None else tokenizer.bos_token_id)


async def _one(event: str) -> AsyncIterator[str]:
    yield event


async def _prompt_ids(api: Handlers, prompt: str | list[int], start: int, name: str) -> list[int]:
    """The prompt's token ids, which must reach past `logprob_start_len` (SGLang's check)."""
    try:
        ids = await asyncio.to_thread(api.engine.engine.prompt_ids, prompt)
    except DsakvError as e:
        raise APIError(400, str(e), param=e.param or name) from None
    if start > len(ids):  # (the prompt's length: no input logprobs, as SGLang's)
        raise APIError(
            400,
            f"logprob_start_len ({start}) must be at most the prompt's {len(ids)} tokens",
            param="logprob_start_len",
        )
    return ids


async def _params(
    api: Handlers, sp: SGLangSamplingParams, ask: _LogprobAsk | None
) -> SamplingParams:
    """`sp` as the engine's `SamplingParams`, built and checked by `Handlers.sampling_params` (and
    its grammar compiled) as for /v1/completions, under OpenAI's names, but as SGLang's
    /generate: no generation_config defaults, max_new_tokens null runs to the context's
    end (left out: 128), and output logprobs of the processed logits."""
    skip = {
        "max_new_tokens",
        "min_new_tokens",
        "structural_tag",
        "spaces_between_special_tokens",
        "stream_interval",  # (set below: not a GenerationRequest field)
    }
    fields = sp.model_dump(exclude_none=True, exclude=skip | set(_SAMPLING_NOT_RUN))
    if sp.min_new_tokens is not None:
        fields["min_tokens"] = sp.min_new_tokens
    if sp.structural_tag is not None:
        fields["structured_outputs"] = {"structural_tag": sp.structural_tag}
    if ask is not None and ask.start >= 0:  # score the prompt (SGLang's input logprobs)
        fields["prompt_logprobs"] = ask.top_n
    body = GenerationRequest.model_validate(fields)
    logprobs = None if ask is None else ask.top_n
    null = sp.max_new_tokens is None and "max_new_tokens" in sp.model_fields_set
    params = api.sampling_params(
        body,
        sp.max_new_tokens,
        api.engine.engine.max_model_len if null else _DEFAULT_MAX_NEW_TOKENS,
        logprobs,
        "top_logprobs_num",
        "max_new_tokens",
        min_max_tokens=0,  # (SGLang's prefill-only request: scores the prompt)
        generation_config=False,
    )
    # SGLang's: processed logprobs, and the repetition penalty on the output's tokens only
    params = dataclasses.replace(params, logprobs_mode="processed", repetition_penalty_prompt=False)
    if sp.stream_interval:
        params = dataclasses.replace(params, stream_interval=sp.stream_interval)
    if ask is not None and ask.start >= 0:  # (the cache may serve the prefix before it)
        params = dataclasses.replace(params, prompt_logprobs_start=ask.start)
    if ask is not None and ask.token_ids is not None:  # (checked against the vocabulary later)
        params = dataclasses.replace(params, token_ids_logprob=ask.token_ids)
    grammar = next((k for k in _GRAMMAR_KEYS if getattr(sp, k) is not None), None)
    return await api.ready_grammar(params, grammar and f"sampling_params.{grammar}")


@contextlib.contextmanager
def _in_sglang_terms() -> Iterator[None]:
    """The OpenAI handlers' errors, naming SGLang's fields instead of OpenAI's."""
    try:
        yield
    except APIError as e:
        param = _SGLANG_NAMES.get(e.param or "", e.param)
        if param in SGLangSamplingParams.model_fields:
            param = f"sampling_params.{param}"
        message = _OPENAI_WORDS.sub(lambda m: _SGLANG_NAMES[m[1]], e.message)
        raise APIError(e.status, message, e.type, param, e.code) from None


# --- response ----------------------------------------------------------------------------------


def _output(
    rid: str, r: Result, ask: _LogprobAsk | None, began: float, version: str
) -> dict[str, Any]:
    """One output in SGLang's shape, from what it has so far, by weights `version`."""
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_reason(r),
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": r.cached_tokens,
        "weight_version": version,  # (slime's router reads it)
    }
    if r.finish_reason is not None:
        meta["e2e_latency"] = time.perf_counter() - began
    if ask is not None:
        meta.update(_logprobs(r, ask))
    if r.routed_experts is not None:
        meta["routed_experts"] = routed_base64(r.routed_experts)
    if r.hidden_states is not None:  # (SGLang's: the prompt's rows, then one per output)
        rows = r.hidden_states.tolist()
        meta["hidden_states"] = [rows[: r.prompt_tokens], *rows[r.prompt_tokens :]]
    return {"text": r.text, "output_ids": list(r.token_ids), "meta_info": meta}


def _finish_reason(r: Result) -> dict[str, Any] | None:
    """SGLang's finish reason (`BaseFinishReason.to_json`): a stop names what matched, the
    stop string or token, or else the EOS token that ended it (the last output token)."""
    if r.finish_reason is None:
        return None
    if r.finish_reason == "length":
        return {"type": "length", "length": r.completion_tokens}
    if r.finish_reason == "stop":
        last = r.token_ids[-1] if r.token_ids else None
        return {"type": "stop", "matched": r.stop_reason if r.stop_reason is not None else last}
    if r.abort_asked == "waiting":  # (/abort_request's; SGLang's words: slime reads them)
        return {"type": "abort", "message": "Abort in waiting queue"}
    if r.abort_asked is not None:  # (SGLang's `FINISH_ABORT()`)
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    return {"type": "abort", "message": "the request was aborted"}


def _logprobs(r: Result, ask: _LogprobAsk) -> dict[str, Any]:
    """SGLang's `[logprob, token id, text or null]` triples: the output's, and the prompt's
    from `logprob_start_len` (its first one null, as SGLang's; none from a prefill server),
    with the top ones and those of `token_ids_logprob` if asked."""
    first = r.first
    prompt = (first.prompt_token_ids if first else None) or []
    scores = (first.prompt_logprobs if first else None) or []
    tops = (first.prompt_top_logprobs if first else None) or []
    start = ask.start if ask.start >= 0 else max(len(prompt) - 1, 0)
    span = range(start + 1, len(scores))  # (empty where the prompt was not scored)
    text = ask.texts
    inputs = _triples([None, *(json_logprob(scores[p]) for p in span)], prompt[start:], text)
    first_top = [None] if start < len(prompt) else []  # (start at the prompt's end: none)
    out: dict[str, Any] = {
        "input_token_logprobs": inputs if ask.prompt else [],
        "output_token_logprobs": _triples([json_logprob(x) for x in r.logprobs], r.token_ids, text),
    }
    if ask.top_n > 0:
        top_inputs = [*first_top, *(_top(tops[p], text) for p in span)]
        out["input_top_logprobs"] = top_inputs if ask.prompt else []
        out["output_top_logprobs"] = [_top(top, text) for top in r.top_logprobs]
    if ask.token_ids is not None:  # (as the top ones: [logprob, id, text] per asked id)
        ids = list(ask.token_ids)
        by_id = (first.prompt_token_ids_logprobs if first else None) or []
        by_id = by_id if ids else [None] * len(scores)  # (no ids asked: none gathered)
        id_inputs = [*first_top, *(_triples(_lps(by_id[p]), ids, text) for p in span)]
        out["input_token_ids_logprobs"] = id_inputs if ask.prompt else []
        outputs = r.token_ids_logprobs if ids else [None] * len(r.token_ids)
        out["output_token_ids_logprobs"] = [_triples(_lps(x), ids, text) for x in outputs]
    return out


def _lps(values: list[float] | None) -> list[float]:
    return [json_logprob(x) for x in values or ()]


def _triples(logprobs: list[float | None], ids: list[int], text: _TokenTexts) -> list[list]:
    return [[x, t, s] for x, t, s in zip(logprobs, ids, text(ids))]


def _top(top: list[tuple[int, float]] | None, text: _TokenTexts) -> list[list]:
    top = top or []
    return _triples([json_logprob(x) for _, x in top], [t for t, _ in top], text)


class _TokenTexts:
    """`return_text_in_logprobs`: each token's text decoded alone, as SGLang's (so one
    decode per distinct token, kept); null without it or without a tokenizer."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.known: dict[int, str] = {}

    def __call__(self, ids: list[int]) -> list[str | None]:
        if self.tokenizer is None:
            return [None] * len(ids)
        new = list({t for t in ids if t not in self.known})
        if new:
            self.known.update(zip(new, self.tokenizer.batch_decode([[t] for t in new])))
        return [self.known[t] for t in ids]
