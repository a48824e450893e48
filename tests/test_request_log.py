"""The request log (`dsakv.server.request_log`): SGLang's --log-requests at each
--log-requests-level and vLLM's --enable-log-requests / --enable-log-outputs / --max-log-len,
as lines on "dsakv.requests" from real servers over one tiny engine: a line when a request
reaches the engine and one when it ends, on every generation route, streamed or aborted;
none by default."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from dsakv.cli import build_parser
from dsakv.cli.args import add_request_log_args, given_flags, request_log_config
from dsakv.engine import EngineConfig
from dsakv.errors import DsakvError
from dsakv.procs import free_port
from dsakv.server import build_app
from dsakv.server.request_log import Output, RequestLogConfig
from dsakv.server.runner import Update

from .serving import TIMEOUT, engine_stops_stepping_at, running, serving

MODEL = "tiny"
# A context past SGLang's level-2 cut (2048) for one byte-token prompt and output each
ENGINE_ARGS = dict(
    kv_cache_dtype="fp32",
    index_k_dtype="fp32",
    num_pages=320,
    page_size=16,
    chunked_prefill_size=512,
    device="cpu",
)
LONG_PROMPT = "ab" * 1100  # 2200 characters (and tokens: the tiny tokenizer's are bytes)
LONG_OUT = 2100
GREEDY = {"temperature": 0, "ignore_eos": True}
KEY = "log-key"


def _flags(*argv: str) -> RequestLogConfig:
    return request_log_config(build_parser().parse_args(["serve", *argv]))


CONFIGS = {
    "level0": _flags("--log-requests", "--log-requests-level", "0"),
    "level1": _flags("--log-requests", "--log-requests-level", "1"),
    "level2": _flags("--log-requests"),
    "level3": _flags("--log-requests", "--log-requests-level", "3"),
    "vllm": _flags("--enable-log-requests", "--enable-log-outputs", "--max-log-len", "5"),
}


@pytest.fixture(scope="module")
def served(glm_tiny):
    """The engine, behind a server without the log (dsakv's default), one per config of
    `CONFIGS`, and one without it that needs the API key `KEY` ("keyed", for
    /configure_logging): {name: base URL}, and the engine."""
    with (
        serving(EngineConfig(model=glm_tiny, **ENGINE_ARGS), served_model_name=MODEL) as (
            base,
            engine,
        ),
        contextlib.ExitStack() as stack,
    ):
        bases = {"off": base}
        for name, config in CONFIGS.items():
            app = build_app(engine, MODEL, request_log=config)
            uv = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
            bases[name] = stack.enter_context(running(uvicorn.Server(uv)))
        app = build_app(engine, MODEL, api_key=KEY)
        uv = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
        bases["keyed"] = stack.enter_context(running(uvicorn.Server(uv)))
        yield bases, engine


@pytest.fixture
def lines(caplog) -> Callable[..., list[str]]:
    """`lines(rid)`: the request log's (received, finished) lines of request `rid`, once
    both are there (a streamed response ends before its call closes); `lines(rid, 1)`:
    its received line, once there."""
    caplog.set_level(logging.DEBUG, logger="dsakv.requests")  # (whatever it would say)

    def of(rid: str, count: int = 2) -> list[str]:
        deadline = time.monotonic() + TIMEOUT
        line = re.compile(rf"(Received|Finished) request {re.escape(rid)}:")
        while True:
            said = [r.getMessage() for r in caplog.records if r.name == "dsakv.requests"]
            got = [x for x in said if line.match(x)]
            if len(got) >= count:
                assert len(got) == count and got[0].startswith("Received"), got
                return got
            assert time.monotonic() < deadline, f"no lines for {rid}: {said}"
            time.sleep(0.02)

    return of


def _post(base: str, path: str, **body) -> httpx.Response:
    r = httpx.post(f"{base}{path}", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r


def test_level_0_logs_ids_routes_and_counts_not_params_or_text(served, lines):
    """Every generation route, under the id its client sees: a completion's generated
    cmpl- id, a chat's X-Request-Id (as chatcmpl-), a /generate rid, a response's resp_
    id; finish reason, token counts and latency, no sampling params, prompt or output."""
    base = served[0]["level0"]
    prompt = "Hello there, tiny model"
    r = _post(base, "/v1/completions", prompt=prompt, max_tokens=4, **GREEDY).json()
    received, finished = lines(r["id"])
    assert r["id"].startswith("cmpl-")
    assert received == f"Received request {r['id']}: route=/v1/completions, n=1"
    usage = r["usage"]
    assert re.fullmatch(
        rf"Finished request {r['id']}: route=/v1/completions, finish_reason=length, "
        rf"prompt_tokens={usage['prompt_tokens']}, completion_tokens=4, "
        r"cached_tokens=\d+, e2e_latency=\d+\.\d{3}s",
        finished,
    )
    messages = [{"role": "user", "content": prompt}]
    chat = httpx.post(
        f"{base}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 3, **GREEDY},
        headers={"X-Request-Id": "mine-1"},
        timeout=TIMEOUT,
    )
    assert chat.json()["id"] == "chatcmpl-mine-1"
    received, finished = lines("chatcmpl-mine-1")
    assert "route=/v1/chat/completions" in received and "completion_tokens=3" in finished
    _post(base, "/generate", text=prompt, rid="g-0", sampling_params={"max_new_tokens": 2})
    received, finished = lines("g-0")
    assert "route=/generate" in received and "completion_tokens=2" in finished
    resp = _post(base, "/v1/responses", input=prompt, max_output_tokens=2, **GREEDY).json()
    received, finished = lines(resp["id"])
    assert resp["id"].startswith("resp_") and "route=/v1/responses" in received
    for line in (received, finished):
        assert prompt not in line and "params" not in line and "output=" not in line
    too_long = {"prompt": prompt, "max_tokens": served[1].engine.max_model_len - 5}
    headers = {"X-Request-Id": "too-long"}
    r = httpx.post(f"{base}/v1/completions", json=too_long, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 400
    _, finished = lines("cmpl-too-long")  # (refused once it reached the engine: an error)
    assert "finish_reason=error," in finished and "maximum context length" in finished


def test_level_1_adds_the_sampling_params(served, lines):
    """Level 1: the params a request set (not the defaults), still no prompt or output;
    n choices, or a beam search's beams, are one request with several outputs."""
    base = served[0]["level1"]
    prompt = "Count the ways"
    r = _post(base, "/v1/completions", prompt=prompt, max_tokens=3, n=2, seed=7, top_k=5).json()
    received, finished = lines(r["id"])
    assert received.endswith(", n=2, params=SamplingParams(max_tokens=3, top_k=5, seed=7)")
    assert "finish_reason=[length, length]" in finished and "completion_tokens=6" in finished
    assert f"prompt_tokens={r['usage']['prompt_tokens']}," in finished  # (once: one prompt)
    beams = {"use_beam_search": True, "n": 2, "max_tokens": 2, "temperature": 0}
    r = _post(base, "/v1/completions", prompt=prompt, **beams).json()
    received, finished = lines(r["id"])
    assert ", beam_width=2, params=SamplingParams(max_tokens=2, temperature=0.0" in received
    assert "finish_reason=[length, length]" in finished and "completion_tokens=4" in finished
    for line in (received, finished):
        assert prompt not in line and "output=" not in line


def _long(base: str, word: int) -> dict:
    """The long request (`LONG_PROMPT`, `LONG_OUT` tokens of "x") through /generate."""
    sp = {"max_new_tokens": LONG_OUT, "logit_bias": {str(word): 100.0}, **GREEDY}
    return _post(base, "/generate", text=LONG_PROMPT, rid=f"long-{base[-5:]}", sampling_params=sp)


def test_level_2_cuts_prompts_and_outputs_at_2048_level_3_logs_them_whole(served, lines):
    """SGLang's level 2: a prompt and an output past 2048 characters logged cut there
    (saying how much more there was); level 3 logs them whole."""
    bases = served[0]
    x = served[1].engine.encode("x", special=False)[0]
    out = _long(bases["level2"], x).json()
    assert out["text"] == "x" * LONG_OUT
    received, finished = lines(out["meta_info"]["id"])
    assert received.endswith(f", prompt={LONG_PROMPT[:2048]!r}...(+152 chars)")
    assert "params=SamplingParams(max_tokens=2100" in received
    assert finished.endswith(f", output={'x' * 2048!r}...(+52 chars)")
    assert "finish_reason=length" in finished and f"completion_tokens={LONG_OUT}" in finished
    out = _long(bases["level3"], x).json()
    received, finished = lines(out["meta_info"]["id"])
    assert received.endswith(f", prompt={LONG_PROMPT!r}")
    assert finished.endswith(f", output={'x' * LONG_OUT!r}")


def test_max_log_len_cuts_what_vllms_flags_log(served, lines):
    """vLLM's --enable-log-requests: the params (its INFO line has no prompt);
    --enable-log-outputs the output, --max-log-len N its first N characters."""
    base = served[0]["vllm"]
    prompt = "A prompt vLLM logs at DEBUG only"
    r = _post(base, "/v1/completions", prompt=prompt, max_tokens=12, **GREEDY).json()
    received, finished = lines(r["id"])
    assert "params=SamplingParams(max_tokens=12, temperature=0.0" in received
    assert prompt not in received
    text = r["choices"][0]["text"]
    assert len(text) > 5
    assert finished.endswith(f", output={text[:5]!r}...(+{len(text) - 5} chars)")


def test_streamed_and_aborted_requests_log_their_end(served, lines):
    """A streamed request's end is logged once its stream is over; an /abort_request and a
    client that hangs up mid-stream end as abort."""
    bases, engine = served
    base = bases["level2"]
    body = {"prompt": "Stream me", "max_tokens": 5, "stream": True, **GREEDY}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=TIMEOUT) as r:
        events = [x for x in r.iter_lines() if x.startswith("data: {")]
        rid = r.headers["x-request-id"]
    received, finished = lines(f"cmpl-{rid}")
    assert "finish_reason=length" in finished and "completion_tokens=5" in finished
    streamed = "".join(c["text"] for e in events for c in json.loads(e[6:])["choices"])
    assert finished.endswith(f", output={streamed!r}")

    long = {"text": "Abort me", "sampling_params": {"max_new_tokens": 400, **GREEDY}}
    with ThreadPoolExecutor(1) as pool, engine_stops_stepping_at(engine, 3):
        done = pool.submit(_post, base, "/generate", rid="to-abort", **long)
        lines("to-abort", 1)  # (in flight: the abort finds it)
        r = httpx.post(f"{base}/abort_request", json={"rid": "to-abort"}, timeout=TIMEOUT)
        assert r.status_code == 200
        assert done.result(TIMEOUT).json()["meta_info"]["finish_reason"]["type"] == "abort"
    _, finished = lines("to-abort")
    assert "finish_reason=abort" in finished

    body = {"prompt": "Leave me", "max_tokens": 500, "stream": True, **GREEDY}
    headers = {"X-Request-Id": "leaving"}
    with (
        engine_stops_stepping_at(engine, 3),
        httpx.Client(timeout=TIMEOUT) as http,
        http.stream("POST", f"{base}/v1/completions", json=body, headers=headers) as r,
    ):
        got = r.iter_lines()  # (referenced: dropping it closes the connection)
        assert next(got).startswith("data: {")
    _, finished = lines("cmpl-leaving")
    assert "finish_reason=abort" in finished


def test_beam_search_aborted_while_waiting_logs_each_beam_aborted(served, lines):
    """A beam search /abort_request ends while its steps wait: its client gets each beam
    as an abort, and so does the log, with the prompt's tokens."""
    base, engine = served[0]["level1"], served[1]
    prompt = "Beam me"
    body = {"prompt": prompt, "use_beam_search": True, "n": 2, "max_tokens": 3, "temperature": 0}
    headers = {"X-Request-Id": "beam-ab"}
    with (
        ThreadPoolExecutor(1) as pool,
        engine_stops_stepping_at(engine, 0),
        httpx.Client(timeout=TIMEOUT) as http,
    ):
        done = pool.submit(http.post, f"{base}/v1/completions", json=body, headers=headers)
        lines("cmpl-beam-ab", 1)  # (in flight: the abort finds it)
        assert http.post(f"{base}/abort_request", json={"rid": "beam-ab"}).status_code == 200
        r = done.result(TIMEOUT)
    assert r.status_code == 200, r.text
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["abort", "abort"]
    _, finished = lines("cmpl-beam-ab")
    tokens = len(engine.engine.prompt_ids(prompt, None, True))
    assert "finish_reason=[abort, abort]," in finished
    assert f"prompt_tokens={tokens}," in finished


def test_a_batch_refused_at_a_later_prompt_logs_its_error(served, lines):
    """A batch whose second prompt is refused (the client's 400): the first prompt's
    output, taken and never read, is an abort, the rest the error with its message."""
    base, engine = served[0]["level0"], served[1]
    body = {"prompt": ["short", "x" * 400], "max_tokens": engine.engine.max_model_len - 200}
    headers = {"X-Request-Id": "batch-refused"}
    r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 400 and "maximum context length" in r.text
    received, finished = lines("cmpl-batch-refused")
    assert "prompts=2, n=1" in received
    assert "finish_reason=[abort, error]," in finished
    assert re.search(r", error=\['', \"This model's maximum context length is", finished)


def test_generate_logs_a_batch_under_the_rids_its_client_gave(served, lines):
    """/generate with a rid per prompt and n > 1 (each sample then has an id of its own):
    logged under the client's rids, as a string rid is."""
    base = served[0]["level0"]
    sp = {"max_new_tokens": 2, "n": 2, **GREEDY}
    outs = _post(base, "/generate", text=["a", "b"], rid=["gr-1", "gr-2"], sampling_params=sp)
    assert len(outs.json()) == 4
    received, finished = lines("gr-1,gr-2")
    assert received == "Received request gr-1,gr-2: route=/generate, prompts=2, n=2"
    assert "finish_reason=[length, length, length, length]" in finished


def test_score_logs_its_items_as_one_call(served, lines, caplog):
    """/v1/score's items, one prompt each through the generation path, logged as one call
    under vLLM's score- id (its X-Request-Id's, else a new one), as the other routes are;
    they were not logged at all. Its completion tokens are its usage's: none."""
    base = served[0]["level1"]
    body = {"query": "Is it ", "items": ["yes", "no"], "label_token_ids": [3, 17]}
    r = httpx.post(f"{base}/v1/score", json=body, headers={"X-Request-Id": "sc-1"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    received, finished = lines("score-sc-1")
    assert received.startswith("Received request score-sc-1: route=/v1/score, prompts=2, n=1")
    assert "token_ids_logprob=[3, 17]" in received  # (level 1: its params)
    tokens = r.json()["usage"]["prompt_tokens"]
    assert f"finish_reason=[length, length], prompt_tokens={tokens}," in finished
    assert r.json()["usage"]["completion_tokens"] == 0  # (the line agrees: it said 2)
    assert f"prompt_tokens={tokens}, completion_tokens=0," in finished
    _post(base, "/v1/score", **body)  # (no X-Request-Id: an id of its own)
    said = [x.getMessage() for x in caplog.records if x.name == "dsakv.requests"]
    assert any(re.match(r"Received request score-[0-9a-f]{32}: route=/v1/score,", x) for x in said)


def test_an_output_keeps_only_what_its_line_shows():
    """A logged output's text is kept only up to the cut (--max-log-len, level 2's 2048):
    the rest is counted, so a long output costs the log no more than its line."""
    cut = Output(True, 5)
    for _ in range(1000):
        cut.add(Update([1, 2], "xy", None, None))
    assert cut.parts == ["xy", "xy", "x"] and cut.dropped == 1995
    assert cut.text() == "'xyxyx'...(+1995 chars)"
    whole, none = Output(True, None), Output(False, 5)
    for out in (whole, none):
        out.add(Update([1], "abc", None, None))
        out.add(Update([2], "def", None, None, finished=True, finish_reason="stop"))
    assert whole.text() == "'abcdef'" and none.parts == [] and none.finish_reason == "stop"


def test_configure_logging_at_run_time(served, lines, caplog):
    """SGLang's /configure_logging on a server started without the log: on at level 0,
    then level 3 (GET too, as SGLang's), then off; a field for what dsakv does not run
    (a request dump) is a 400 unless null, and the route needs the API key."""
    base = served[0]["keyed"]
    auth = {"Authorization": f"Bearer {KEY}"}

    def configure(method: str = "POST", **body) -> httpx.Response:
        url = f"{base}/configure_logging"
        return httpx.request(method, url, json=body, headers=auth, timeout=TIMEOUT)

    def complete(rid: str, prompt: str = "Configure me") -> dict:
        headers = {**auth, "X-Request-Id": rid}
        body = {"prompt": prompt, "max_tokens": 3, **GREEDY}
        r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        return r.json()

    def said(rid: str) -> list[str]:  # (a whole response's call has closed: its lines out)
        return [r.getMessage() for r in caplog.records if rid in r.getMessage()]

    keyless = httpx.post(f"{base}/configure_logging", json={"log_requests": True})
    assert keyless.status_code == 401
    complete("cfg-before")
    assert said("cfg-before") == []
    try:
        assert configure(log_requests=True, log_requests_level=0).status_code == 200
        complete("cfg-0")
        received, finished = lines("cmpl-cfg-0")
        assert received == "Received request cmpl-cfg-0: route=/v1/completions, n=1"
        assert "finish_reason=length" in finished and "output=" not in finished
        assert configure("GET", log_requests_level=3).status_code == 200
        prompt = "Configure me " * 200  # (past level 2's cut: whole at level 3)
        out = complete("cfg-3", prompt)
        received, finished = lines("cmpl-cfg-3")
        assert received.endswith(f", prompt={prompt!r}") and "params=SamplingParams(" in received
        assert finished.endswith(f", output={out['choices'][0]['text']!r}")
        dump = configure(dump_requests_folder="/tmp/dsakv-dump", log_requests_level=0)
        assert dump.status_code == 400
        assert dump.json()["error"]["param"] == "dump_requests_folder"
        assert configure(log_requests_level=4).status_code == 400
        assert configure(dump_requests_folder=None, crash_dump_folder=None).status_code == 200
        complete("cfg-still-3", prompt)  # (the refused calls changed nothing)
        assert lines("cmpl-cfg-still-3")[0].endswith(f", prompt={prompt!r}")
    finally:
        assert configure(log_requests=False).status_code == 200
    complete("cfg-off")
    assert said("cfg-off") == []


def test_off_by_default(served, caplog):
    """No flag, or vLLM's --disable-log-requests (with --max-log-len, which refines a log
    that is not there): the server logs nothing on "dsakv.requests"."""
    assert _flags() == RequestLogConfig() and not RequestLogConfig().on
    assert not _flags("--disable-log-requests", "--max-log-len", "9").on
    caplog.set_level(logging.DEBUG, logger="dsakv.requests")
    base = served[0]["off"]
    _post(base, "/v1/completions", prompt="Quiet", max_tokens=2)
    stream = {"prompt": "Q", "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=stream, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and list(r.iter_lines())
    _post(base, "/generate", text="Quiet", sampling_params={"max_new_tokens": 2})
    time.sleep(0.2)  # (a stream's call closes after its last byte)
    assert [r for r in caplog.records if r.name == "dsakv.requests"] == []


def _parse_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    return err


def test_flags(capsys):
    """SGLang's and vLLM's flags on `serve` and `serve-pd` (which hands them to its
    servers), not on `generate`; a bad level or length is one `error:` line, exit 2, and so
    is --disable-log-requests with a flag that turns the log on."""
    assert _flags("--log-requests") == RequestLogConfig(True, True, True, True, 2048)
    assert _flags("--log-requests", "--log-requests-level", "3", "--max-log-len", "100") == (
        RequestLogConfig(True, True, True, True, 100, level=3, max_log_len=100)
    )
    level_3 = _flags("--log-requests-level", "3")  # (SGLang's: no switch)
    assert level_3 == RequestLogConfig(level=3) and not level_3.on
    assert _flags("--enable-log-requests") == RequestLogConfig(True, True, False, False, level=1)
    assert _flags("--enable-log-outputs") == RequestLogConfig()  # (vLLM's: needs the log)
    pd = ["serve-pd", "--log-requests", "--log-requests-level", "1", "--max-log-len", "64"]
    args = build_parser().parse_args(pd)
    assert given_flags(args, add_request_log_args) == pd[1:]
    assert "invalid choice: 4" in _parse_error(["serve", "--log-requests-level", "4"], capsys)
    assert "--max-log-len: must be an integer >= 0" in _parse_error(
        ["serve", "--max-log-len", "-1"], capsys
    )
    assert "unrecognized arguments: --log-requests" in _parse_error(
        ["generate", "--prompt", "x", "--log-requests"], capsys
    )
    with pytest.raises(DsakvError, match="--disable-log-requests and --enable-log-requests"):
        _flags("--disable-log-requests", "--enable-log-requests")


def test_configured():
    """/configure_logging's changes (`RequestLogConfig.configured`): turned on at the level
    the server was given, at another level as `--log-requests-level` (keeping a
    --max-log-len given), off and on again as it was (vLLM's output texts too)."""
    given_3 = _flags("--log-requests-level", "3")
    assert given_3.configured(True) == _flags("--log-requests", "--log-requests-level", "3")
    assert RequestLogConfig().configured(True) == _flags("--log-requests")
    assert RequestLogConfig().configured(level=3) == RequestLogConfig(level=3)  # (still off)
    vllm = CONFIGS["vllm"]
    assert vllm.configured(False).configured(True) == vllm and not vllm.configured(False).on
    assert vllm.configured(level=3) == _flags(
        "--log-requests", "--log-requests-level", "3", "--max-log-len", "5"
    )
    assert CONFIGS["level2"].configured(level=0) == CONFIGS["level0"]
    assert CONFIGS["level0"].configured() == CONFIGS["level0"]
