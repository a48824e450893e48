"""LoRA adapters loaded and unloaded while the server runs: vLLM's `POST
/v1/load_lora_adapter` and `/v1/unload_lora_adapter`, SGLang's `/load_lora_adapter` and
`/unload_lora_adapter`, each in its server's answer shape, over one pair of engine calls
made between steps (`Engine.load_lora`, `Engine.unload_lora`). vLLM takes them only under
VLLM_ALLOW_RUNTIME_LORA_UPDATING; here --enable-lora is the one switch: without it they
are a 400 saying so. Under --api-key they need the key, as the other admin routes."""

from __future__ import annotations

import contextlib
import os

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict

from dsakv.errors import DsakvError
from dsakv.models.lora import CONFIG_FILE, WEIGHTS_FILE

from .handlers import Handlers
from .protocol import APIError
from .submit import refusal


class LoadLoRARequest(BaseModel):
    """vLLM's `LoadLoRAAdapterRequest` and SGLang's `LoadLoRAAdapterReqInput`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: an adapter of that name is replaced
    pinned: bool = False  # SGLang's: dsakv pins none (`_load`)


class UnloadLoRARequest(BaseModel):
    """vLLM's `UnloadLoRAAdapterRequest` (its lora_int_id ignored: dsakv names adapters
    only) and SGLang's `UnloadLoRAAdapterReqInput`."""

    model_config = ConfigDict(strict=True, extra="ignore")
    lora_name: str


def add_lora_routes(app: FastAPI, api: Handlers) -> None:
    async def load_vllm(body: LoadLoRARequest) -> Response:
        if api.engine.engine.config.enable_lora and body.lora_path and _no_adapter(body.lora_path):
            raise APIError(  # (vLLM's 404 and words for a path holding no adapter)
                404,
                f"Loading lora {body.lora_name} failed: No adapter found for {body.lora_path}",
                type="NotFoundError",
                param="lora_path",
            )
        await _load(api, body)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload_vllm(body: UnloadLoRARequest) -> Response:
        if api.engine.engine.config.enable_lora and body.lora_name not in api.loras:
            raise APIError(  # (vLLM's 404 and words)
                404,
                f"The lora adapter '{body.lora_name}' cannot be found.",
                type="NotFoundError",
                param="lora_name",
            )
        await _unload(api, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    async def load_sglang(body: LoadLoRARequest) -> Response:
        return await _sglang(api, _load(api, body))

    async def unload_sglang(body: UnloadLoRARequest) -> Response:
        return await _sglang(api, _unload(api, body.lora_name))

    app.add_api_route("/v1/load_lora_adapter", load_vllm, methods=["POST"])
    app.add_api_route("/v1/unload_lora_adapter", unload_vllm, methods=["POST"])
    app.add_api_route("/load_lora_adapter", load_sglang, methods=["POST"])
    app.add_api_route("/unload_lora_adapter", unload_sglang, methods=["POST"])


def _no_adapter(path: str) -> bool:
    """Whether `path` holds no PEFT adapter's files at all (vLLM's 404 "No adapter found";
    what is there and cannot be served is the engine's 400). `os.path.isfile`: a path no
    file system takes (too long, a NUL) holds none, not a 500."""
    return not all(os.path.isfile(os.path.join(path, n)) for n in (CONFIG_FILE, WEIGHTS_FILE))


async def _load(api: Handlers, body: LoadLoRARequest) -> None:
    """`body.lora_path` served as `body.lora_name` (the engine reads and checks it: a bad
    adapter is its 400), or in place of the adapter of that name (`load_inplace`: one
    engine call, `Engine.replace_lora`: a bad adapter leaves the old one served, and
    requests on the old one finish on its weights)."""
    name, path = body.lora_name, body.lora_path
    _check_enabled(api)
    if not name or not path:
        raise APIError(400, "lora_name and lora_path must be non-empty", param="lora_name")
    if api.is_base_name(name):  # (a request naming it runs the base model)
        raise APIError(400, f"{name!r} is the base model's name", param="lora_name")
    if body.pinned:
        raise APIError(
            400,
            "pinned: dsakv keeps no adapter in a slot of its own (slots go to the adapters "
            "running requests use, least recently used first)",
            param="pinned",
        )
    if body.load_inplace and name in api.loras:
        await _engine_call(api, lambda e: e.replace_lora(name, path))
    else:
        await _engine_call(api, lambda e: e.load_lora(name, path))


async def _unload(api: Handlers, name: str) -> None:
    """Adapter `name` no longer served: requests running on it finish, new ones naming it
    are the 404 of a model not served."""
    _check_enabled(api)
    await _engine_call(api, lambda e: e.unload_lora(name))


async def _engine_call(api: Handlers, fn) -> None:
    """`fn(engine)` between steps, then the adapters the engine serves read back into
    `api.loras`, whatever `fn` did; its `DsakvError` a 400, a stopped engine a 503."""
    try:
        await api.engine.call(fn)
    except (DsakvError, RuntimeError) as e:
        raise refusal(e, "lora_name") from None
    finally:
        with contextlib.suppress(RuntimeError):  # (a stopped engine serves nothing)
            api.loras = dict(await api.engine.call(lambda e: e.loras()))


def _check_enabled(api: Handlers) -> None:
    if not api.engine.engine.config.enable_lora:
        raise APIError(
            400,
            "this server serves no LoRA adapters: start it with --enable-lora (dsakv's "
            "switch for loading them at run time too: no VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
        )


async def _sglang(api: Handlers, done) -> Response:
    """SGLang's answer to a load or unload: success, its error message, and the adapters
    loaded (name -> path); a 400 when it failed."""
    try:
        await done
    except APIError as e:
        if e.status >= 500:
            raise
        body = {"success": False, "error_message": e.message, "loaded_adapters": api.loras}
        return JSONResponse(body, status_code=400)
    return JSONResponse({"success": True, "error_message": "", "loaded_adapters": api.loras})
