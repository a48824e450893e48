"""`run_server`: build the engine, the bridge and the app, and serve them with uvicorn.

The listening socket comes first (`Listener`), before the engine loads, as vLLM binds
its own: a port taken meanwhile used to fail in uvicorn's words after minutes of loading,
once "serving" had been printed. "serving" is printed once uvicorn serves the socket."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from dsakv.engine import EngineConfig
from dsakv.engine.launch import create_engine
from dsakv.errors import DsakvError
from dsakv.procs import AppServer, Listener, exit_on_sigterm

from .app import build_app
from .chat import ChatParsers
from .http_config import HTTPConfig
from .openai_format import ResponseDefaults
from .parsers import resolve_parsers
from .request_log import RequestLogConfig
from .runner import AsyncEngine, Bridge, EngineThread
from .tracing import TraceConfig


def model_names(
    model: str, served: str | Sequence[str] | None = None
) -> tuple[list[str], list[str]]:
    """(The names /v1/models lists, the first reported; other names a request may use) for
    a model served from the directory `model`: the served names (vLLM's
    `--served-model-name` takes several) and no other, as vLLM's; without them the
    directory's name, and the path as given and resolved (vLLM's and SGLang's default
    name, which scripts written for them send), and a tiny preset's cache its preset's name
    too (`dsakv serve glm-tiny` is asked for model "glm-tiny")."""
    names = ([served] if served else []) if isinstance(served, str) else list(served or ())
    if not all(names):
        raise DsakvError("a served model name must not be empty")
    if names:
        return names, []
    aliases = [str(model), str(Path(model).resolve())]
    return [Path(model).name or str(model)], aliases + _preset_of(Path(model))


def check_serving(
    config: EngineConfig,
    served_model_name: str | Sequence[str] | None = None,
    tool_call_parser: str | None = "auto",
    reasoning_parser: str | None = "auto",
    http: HTTPConfig | None = None,
) -> tuple[list[str], list[str]]:
    """What `make_server` refuses before the engine loads: parser names, TLS files, the
    served names (`model_names`, returned) and an adapter named as the base. `dsakv
    serve`'s follower ranks' processes run it too, so every process fails alike at once,
    not rank 0 alone while the others wait out the rendezvous."""
    resolve_parsers("", tool_call_parser, reasoning_parser)
    (http or HTTPConfig()).check_files()
    names, aliases = model_names(config.model, served_model_name)
    for name, _ in config.lora_modules:  # (before loading: a request naming it is the base's)
        if name in (*names, *aliases):
            raise DsakvError(f"--lora-modules: the adapter name {name!r} is the base model's")
    return names, aliases


def _preset_of(model: Path) -> list[str]:
    """The tiny preset whose cache `model` is (`tiny.default_model_dir`'s note), if any."""
    try:
        preset = json.loads((model / ".complete").read_text()).get("preset")
    except (OSError, ValueError, AttributeError):
        return []
    return [preset] if isinstance(preset, str) and preset else []


def make_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | Sequence[str] | None = None,
    log_level: str = "info",
    access_log: bool = True,
    tool_call_parser: str | None = "auto",
    reasoning_parser: str | None = "auto",
    bridge: Bridge | None = None,
    listener: Listener | None = None,
    chat_template: str | None = None,
    request_log: RequestLogConfig | None = None,
    http: HTTPConfig | None = None,
    defaults: ResponseDefaults | None = None,
    tracing: TraceConfig | None = None,
) -> tuple[uvicorn.Server, AsyncEngine]:
    """The server `run_server` runs, not yet started (tests drive it on a thread). Parser
    names: "auto" (the model type's own), "none", or one of `parsers.TOOL_PARSERS` /
    `parsers.REASONING_PARSERS`. `bridge`: what the app talks to (default: a plain
    `AsyncEngine`). `listener`: the sockets to serve, taken earlier (else uvicorn binds
    `host:port` when it starts). `chat_template`: replaces the tokenizer's
    (`load_chat_template`). `served_model_name`: one name or several (`model_names`).
    `log_level` and `access_log` (a line per request) are uvicorn's; `request_log` the
    generation requests' own log (default: none). `http`: CORS, TLS and the root path
    (`HTTPConfig`); `defaults`: what requests leave out (`ResponseDefaults`); `tracing`:
    where the requests' spans go (`TraceConfig`; default: none)."""
    http = http or HTTPConfig()
    names, aliases = check_serving(
        config, served_model_name, tool_call_parser, reasoning_parser, http
    )
    # Built on the thread that will step it: one OpenMP team in the process (`EngineThread`).
    thread = EngineThread()
    try:
        engine = thread.call(lambda: create_engine(config, exit_on_rank_death=True))
        if chat_template is not None:
            if engine.tokenizer is None:
                thread.call(engine.close)
                raise DsakvError("--chat-template needs a tokenizer; this model has none")
            engine.tokenizer.chat_template = chat_template  # what chat and /tokenize render
        async_engine = (bridge or AsyncEngine)(engine, thread)
    except BaseException:
        thread.close()  # a no-op once the step loop started
        raise
    parsers = ChatParsers.for_engine(engine, tool_call_parser, reasoning_parser)
    app = build_app(
        async_engine,
        names,
        api_key=api_key,
        chat_parsers=parsers,
        aliases=aliases,
        request_log=request_log,
        http=http,
        defaults=defaults,
        tracing=tracing,
    )
    async_engine.attach(app)
    uv = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=5,
        **http.uvicorn_kwargs(),
    )
    sockets = listener.sockets if listener is not None else None
    return AppServer(uv, async_engine, sockets), async_engine


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | Sequence[str] | None = None,
    tool_call_parser: str | None = "auto",
    reasoning_parser: str | None = "auto",
    bridge: Bridge | None = None,
    listener: Listener | None = None,
    chat_template: str | None = None,
    log_level: str = "info",
    access_log: bool = True,
    request_log: RequestLogConfig | None = None,
    http: HTTPConfig | None = None,
    defaults: ResponseDefaults | None = None,
    tracing: TraceConfig | None = None,
) -> None:
    """Serve `config`'s model over the OpenAI API until interrupted (`dsakv serve`). The
    port is taken before the engine loads (`listener`, else `Listener(host, port)` now);
    `log_level` and `access_log` are uvicorn's, `request_log` the requests' own log, `http`
    CORS, TLS and the root path, `defaults` what requests leave out, `tracing` where the
    requests' spans go."""
    listener = listener or Listener(host, port)
    try:
        server, async_engine = make_server(
            config,
            host,
            port,
            api_key,
            served_model_name,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            bridge=bridge,
            listener=listener,
            chat_template=chat_template,
            log_level=log_level,
            access_log=access_log,
            request_log=request_log,
            http=http,
            defaults=defaults,
            tracing=tracing,
        )
    except BaseException:
        listener.close()
        raise
    shown = f"[{host}]" if ":" in host else host
    name = server.config.app.state.model_name
    scheme = (http or HTTPConfig()).scheme
    server.banner = f"dsakv: serving {name!r} at {scheme}://{shown}:{port}/v1"
    # uvicorn re-raises the SIGTERM it caught once it has stopped: make that an exception,
    # so the engine still closes (the L3 storage tier writes what it holds) on `kill`.
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, exit_on_sigterm) if main else None
    try:
        server.run()
    finally:
        listener.close()
        if main:
            signal.signal(signal.SIGTERM, previous)
        async_engine.shutdown()
        async_engine.close_engine()
