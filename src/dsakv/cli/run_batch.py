"""`dsakv run-batch`: vLLM's `run-batch`, a file of OpenAI batch requests run offline through
the server's own routes (`dsakv.server.batch`), their answers written in input order."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from dsakv.errors import DsakvError

from .args import (
    add_chat_args,
    add_engine_args,
    add_ignored_args,
    add_model_option,
    add_request_log_args,
    add_response_args,
    add_storage_args,
    add_trace_args,
    engine_config_from_args,
    request_log_config,
    response_defaults,
    trace_config,
)


def _cmd_run_batch(args: argparse.Namespace) -> int:
    import asyncio

    from dsakv.server import make_server
    from dsakv.server.batch import read_batch_file, succeeded

    lines = read_batch_file(args.input_file)  # (a bad file: one error line, before loading)
    config = engine_config_from_args(args)
    request_log, defaults = request_log_config(args), response_defaults(args)
    tracing = trace_config(args, args.collect_detailed_traces)
    tmp = _temp_beside(args.output_file)  # (writable, checked now, before the model loads)
    try:
        # `dsakv serve`'s server, never started: the lines run through its app's routes
        server, async_engine = make_server(
            config,
            served_model_name=args.served_model_name,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            chat_template=args.chat_template,
            log_level="warning",
            request_log=request_log,
            defaults=defaults,
            tracing=tracing,
        )
        try:
            records = asyncio.run(_run(server.config.app, lines))
        finally:
            async_engine.shutdown()
            async_engine.close_engine()
        with open(tmp or args.output_file, "w", encoding="utf-8") as out:
            out.writelines(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
        if tmp is not None:
            os.replace(tmp, args.output_file)  # (whole, or as it was: never half written)
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    failed = sum(not succeeded(record) for record in records)
    print(
        f"ran {len(records)} requests ({len(records) - failed} answered, {failed} failed): "
        f"{args.output_file}"
    )
    return 0


def _temp_beside(path: str) -> str | None:
    """A new file beside `path` the answers are written to, then moved over it; None where
    `path` is no regular file (a pipe, /dev/stdout: written to at the end). A path that
    cannot be written is one error, before the model loads."""
    if os.path.exists(path) and not os.path.isfile(path):
        if not os.access(path, os.W_OK):
            raise DsakvError(f"cannot write {path}")
        return None
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        open(tmp, "x").close()  # (as any new file: the umask's mode)
    except OSError as e:
        raise DsakvError(f"cannot write {path}: {e.strerror or e}") from None
    return tmp


async def _run(app: Any, lines: list) -> list[dict[str, Any]]:
    from tqdm import tqdm

    from dsakv.server.batch import BatchRunner

    # (the app's lifespan, as `dsakv serve` runs it: what the app holds ends with the run)
    async with app.router.lifespan_context(app):
        with tqdm(total=len(lines), unit="req", desc="Running batch") as bar:
            results = await BatchRunner(app).run(lines, done=lambda *_: bar.update())
    return [r for r in results if r is not None]  # (all of them: only a stop leaves one None)


def add_commands(sub: Any) -> None:
    p = sub.add_parser(
        "run-batch",
        help="run a file of OpenAI batch requests offline (vLLM's run-batch)",
        description="Run every request of an OpenAI batch file (JSONL: custom_id, method, "
        "url, body; url /v1/chat/completions, /v1/completions or /v1/score) through the "
        "server's routes, all at once, and write each answer (or error) as a line of the "
        "output file, in input order.",
    )
    p.add_argument("model", nargs="?", help="model directory or tiny preset (default: embedded)")
    add_model_option(p)
    p.add_argument("-i", "--input-file", required=True, help="the batch file (JSONL)")
    p.add_argument("-o", "--output-file", required=True, help="where the answers go (JSONL)")
    add_chat_args(p)
    add_engine_args(p)
    add_storage_args(p)
    add_request_log_args(p)
    add_response_args(p)
    add_trace_args(p)
    add_ignored_args(p, serve=True)
    p.set_defaults(func=_cmd_run_batch)
