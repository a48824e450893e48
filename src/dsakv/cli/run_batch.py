"""`dsakv run-batch`: vLLM's `run-batch`, a file of OpenAI batch requests run offline through
the server's own routes (`dsakv.server.batch`), their answers written in input order."""

from __future__ import annotations

import argparse
import json
from typing import Any

from dsakv.errors import DsakvError

from .args import (
    add_engine_args,
    add_ignored_args,
    add_model_option,
    add_request_log_args,
    add_response_args,
    add_storage_args,
    engine_config_from_args,
    request_log_config,
    response_defaults,
)
from .serve import add_chat_args


def _cmd_run_batch(args: argparse.Namespace) -> int:
    import asyncio

    from dsakv.server import make_server
    from dsakv.server.batch import read_batch_file

    lines = read_batch_file(args.input_file)  # (a bad file: one error line, before loading)
    config = engine_config_from_args(args)
    request_log, defaults = request_log_config(args), response_defaults(args)
    try:  # (writable, checked now; what it holds is kept until the answers replace it)
        out = open(args.output_file, "a", encoding="utf-8")  # noqa: SIM115 - held below
    except OSError as e:
        raise DsakvError(f"cannot write {args.output_file}: {e.strerror or e}") from None
    with out:
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
        )
        try:
            records = asyncio.run(_run(server.config.app, lines))
        finally:
            async_engine.shutdown()
            async_engine.close_engine()
        if out.seekable():  # (not a pipe)
            out.truncate(0)  # (appended: written from its start on)
        for record in records:
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
    failed = sum(record["error"] is not None for record in records)
    print(
        f"ran {len(records)} requests ({len(records) - failed} answered, {failed} failed): "
        f"{args.output_file}"
    )
    return 0


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
    add_ignored_args(p, serve=True)
    p.set_defaults(func=_cmd_run_batch)
