"""vLLM's `vllm serve` flags `dsakv serve` takes with their meaning: CORS (every origin by
default, as vLLM's and SGLang's servers), TLS, --root-path, --response-role,
--return-tokens-as-token-ids, --enable-force-include-usage, --kv-cache-memory-bytes and
--override-generation-config; the switches for what dsakv does anyway taken and ignored; the
values it cannot honour one `error:` line, exit 2. serve-pd hands the servers' flags to its
servers, the front door's (CORS, TLS, root path) to its router."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import time

import httpx
import pytest

from dsakv.cli import build_parser, engine_config_from_args, main
from dsakv.config.model import served_sampling_defaults
from dsakv.engine import EngineConfig
from dsakv.procs import free_port
from dsakv.server.http_config import HTTPConfig
from dsakv.server.openai_format import ResponseDefaults
from dsakv.server.request_log import RequestLogConfig

from .conftest import assert_taken_and_ignored
from .conftest import cli_config as _config
from .conftest import cli_error_line as _error_line
from .serving import TIMEOUT, serving

ENGINE_ARGS = dict(
    kv_cache_dtype="fp32", index_k_dtype="fp32", num_pages=64, page_size=16, device="cpu"
)
KEY = "k"
AUTH = {"Authorization": f"Bearer {KEY}"}
OVERRIDES = {"temperature": 0.0, "max_new_tokens": 6}
ORIGIN = "https://app.example"
PREFLIGHT = {"Access-Control-Request-Method": "POST"}
MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def served(glm_tiny):
    """A server with vLLM's flags set: --api-key, --root-path /proxy, --response-role bot,
    --return-tokens-as-token-ids, --enable-force-include-usage and
    --override-generation-config (greedy, 6 tokens at most); CORS at vLLM's defaults."""
    config = EngineConfig(model=glm_tiny, override_generation_config=OVERRIDES, **ENGINE_ARGS)
    defaults = ResponseDefaults("bot", tokens_as_ids=True, force_include_usage=True)
    http = HTTPConfig(root_path="/proxy")
    log = RequestLogConfig.from_flags(log_requests=True, log_requests_level=0)
    with serving(config, api_key=KEY, http=http, defaults=defaults, request_log=log) as served:
        yield served


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key (openssl's)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate with")
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    cmd = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    cmd += ["-keyout", key, "-out", cert, "-subj", "/CN=127.0.0.1"]
    cmd += ["-addext", "subjectAltName=IP:127.0.0.1"]
    subprocess.run(cmd, check=True, capture_output=True, timeout=TIMEOUT)
    return cert, key


@pytest.fixture(scope="module")
def tls(glm_tiny, cert):
    """A server over TLS (--ssl-certfile, --ssl-keyfile) whose CORS allows one origin with
    credentials: yields its https URL and a client trusting its certificate."""
    http = HTTPConfig(
        allowed_origins=(ORIGIN,),
        allow_credentials=True,
        ssl_certfile=cert[0],
        ssl_keyfile=cert[1],
    )
    with serving(EngineConfig(model=glm_tiny, **ENGINE_ARGS), http=http) as (base, _):
        trusted = ssl.create_default_context(cafile=cert[0])
        with httpx.Client(verify=trusted, timeout=TIMEOUT) as client:
            yield base.replace("http://", "https://"), client


def _post(base: str, path: str, **body) -> dict:
    r = httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(base: str, path: str, **body) -> list[dict]:
    with httpx.stream(
        "POST", base + path, json={**body, "stream": True}, headers=AUTH, timeout=TIMEOUT
    ) as r:
        assert r.status_code == 200
        events = [x for x in r.iter_lines() if x.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    return [json.loads(x[6:]) for x in events[:-1]]


# --- CORS ------------------------------------------------------------------------------------


def test_a_browsers_preflight_is_answered_for_any_origin_by_default(served):
    """vLLM's CORS defaults (origins, methods, headers "*"): a browser's preflight before a
    keyed chat request is answered without the key, allowing its method and headers, and the
    request's answer (a 401 too) carries the origin a browser needs to read it."""
    base, _ = served
    headers = {"Origin": "http://localhost:3000", **PREFLIGHT}
    headers["Access-Control-Request-Headers"] = "authorization,content-type"
    counted = 'dsakv_http_requests_total{endpoint="/v1/chat/completions"'
    before = httpx.get(f"{base}/metrics", timeout=TIMEOUT).text.count(counted)
    r = httpx.options(f"{base}/v1/chat/completions", headers=headers, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    # (a browser's question before its call, not a call: /metrics counts none)
    assert httpx.get(f"{base}/metrics", timeout=TIMEOUT).text.count(counted) == before
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert r.headers["access-control-allow-headers"] == "authorization,content-type"
    keyless = httpx.get(f"{base}/v1/models", headers={"Origin": ORIGIN}, timeout=TIMEOUT)
    assert keyless.status_code == 401
    assert keyless.headers["access-control-allow-origin"] == "*"


def test_allowed_origins_restrict_cors_to_them(tls):
    """--allowed-origins '["https://app.example"]' with --allow-credentials: that origin's
    preflight is allowed (with credentials), another's refused."""
    base, client = tls
    r = client.options(f"{base}/v1/completions", headers={"Origin": ORIGIN, **PREFLIGHT})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert r.headers["access-control-allow-credentials"] == "true"
    other = {"Origin": "https://evil.example", **PREFLIGHT}
    r = client.options(f"{base}/v1/completions", headers=other)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


# --- TLS, root path ---------------------------------------------------------------------------


def test_tls_serves_https(tls):
    """--ssl-certfile / --ssl-keyfile: the API over https, the certificate the one given."""
    base, client = tls
    assert base.startswith("https://")
    r = client.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    with pytest.raises(httpx.ConnectError):  # (a client not trusting it refuses it)
        httpx.get(f"{base}/health", timeout=TIMEOUT)


def test_root_path_routes_requests_with_the_prefix_or_without(served, caplog):
    """--root-path /proxy (FastAPI's root_path, as vLLM sets it): behind a proxy that keeps
    the prefix or strips it, a request reaches its route; the key is checked, the probes
    stay open and /metrics and the request log name the route, as without it."""
    base, _ = served
    caplog.set_level("INFO", logger="dsakv.requests")
    for path in ("/proxy/v1/models", "/v1/models"):
        r = httpx.get(base + path, headers=AUTH, timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["data"][0]["id"], path
    assert httpx.get(f"{base}/proxy/v1/models", timeout=TIMEOUT).status_code == 401
    assert httpx.get(f"{base}/proxy/health", timeout=TIMEOUT).status_code == 200
    body = {"prompt": "Hi", "max_tokens": 1}
    assert _post(base, "/proxy/v1/completions", **body)["usage"]["completion_tokens"] == 1
    text = httpx.get(f"{base}/proxy/metrics", timeout=TIMEOUT).text
    assert 'endpoint="/v1/models",status="200"} 2.0' in text, text
    assert 'endpoint="/v1/completions",status="200"} ' in text
    routes = {m.split("route=")[1].split(",")[0] for m in caplog.messages if "route=" in m}
    assert routes == {"/v1/completions"}, caplog.messages


# --- what requests leave out --------------------------------------------------------------------


def test_response_role_names_the_reply(served):
    """--response-role bot: the reply's role, whole and streamed (vLLM's
    get_chat_request_role, under add_generation_prompt)."""
    base, _ = served
    r = _post(base, "/v1/chat/completions", messages=MESSAGES, max_tokens=2)
    assert r["choices"][0]["message"]["role"] == "bot"
    chunks = _stream(base, "/v1/chat/completions", messages=MESSAGES, max_tokens=2)
    assert chunks[0]["choices"][0]["delta"]["role"] == "bot"


def test_tokens_are_token_ids_by_default_unless_the_request_says(served):
    """--return-tokens-as-token-ids: logprobs name each token "token_id:N" on completions and
    chat; a request's own return_tokens_as_token_ids false names them by their text."""
    base, _ = served
    body = {"prompt": "Hi", "max_tokens": 3, "logprobs": 1}
    tokens = _post(base, "/v1/completions", **body)["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 3 and all(t.startswith("token_id:") for t in tokens), tokens
    own = _post(base, "/v1/completions", **body, return_tokens_as_token_ids=False)
    assert not any(t.startswith("token_id:") for t in own["choices"][0]["logprobs"]["tokens"])
    chat = _post(
        base, "/v1/chat/completions", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=1
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"][:9] for c in content] == ["token_id:"] * 2
    assert all(c["top_logprobs"][0]["token"].startswith("token_id:") for c in content)


def test_every_stream_ends_with_usage(served):
    """--enable-force-include-usage: a stream gets the usage whatever its stream_options say
    (even include_usage false): on each chunk, its choice's tokens so far, and a usage
    chunk at the end (completions and chat; vLLM's since its PR #37923)."""
    base, _ = served
    off = {"stream_options": {"include_usage": False}}
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": MESSAGES, **off}),
    ):
        chunks = _stream(base, path, **body, max_tokens=3, ignore_eos=True)
        assert chunks[-1]["choices"] == [], path
        assert chunks[-1]["usage"]["completion_tokens"] == 3, path
        running = [c["usage"] for c in chunks[:-1] if c["choices"]]
        assert running and all(u is not None for u in running), path


def test_generation_config_overrides_are_the_defaults_not_a_requests_own(served):
    """--override-generation-config '{"temperature": 0, "max_new_tokens": 6}': a request
    leaving temperature out samples greedily (two seeds, one text), one giving its own
    samples (two seeds, two texts); max_new_tokens is the default length and, as vLLM's,
    the most a request gets."""
    base, async_engine = served
    assert async_engine.engine.model_config.sampling_defaults == {
        "temperature": 0.0,
        "max_tokens": 6,
    }
    body = {"prompt": "Once upon a time", "ignore_eos": True}
    greedy = [_post(base, "/v1/completions", **body, seed=s) for s in (1, 2)]
    assert greedy[0]["choices"][0]["text"] == greedy[1]["choices"][0]["text"]
    assert greedy[0]["usage"]["completion_tokens"] == 6  # (completions' own default: 16)
    hot = [_post(base, "/v1/completions", **body, seed=s, temperature=1.5) for s in (1, 2)]
    assert hot[0]["choices"][0]["text"] != hot[1]["choices"][0]["text"]
    assert _post(base, "/v1/completions", **body, max_tokens=3)["usage"]["completion_tokens"] == 3
    assert _post(base, "/v1/completions", **body, max_tokens=9)["usage"]["completion_tokens"] == 6


def test_overrides_go_over_the_models_generation_config():
    """vLLM's get_diff_sampling_param: the overrides over generation_config.json's defaults
    (--generation-config auto) or over none (vllm); a null drops the model's value."""
    model = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 100}
    over = '{"temperature": 0.2, "top_p": null, "max_new_tokens": 8}'
    assert served_sampling_defaults(model, "auto", over) == {"temperature": 0.2, "max_tokens": 8}
    assert served_sampling_defaults(model, "vllm", {"top_k": 5}) == {"top_k": 5}
    assert served_sampling_defaults(model, "auto", None) == model


# --- the command line -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, gib",
    [
        ("536870912", 0.5),
        ("512M", 0.5),
        ("2G", 2.0),
        ("1.5g", 1.5e9 / 2**30),
        ("25.6k", 25600 / 2**30),
    ],
)
def test_kv_cache_memory_bytes_sizes_the_pool(glm_tiny, size, gib):
    """vLLM's --kv-cache-memory-bytes N (its suffixes: k decimal, K binary): the device KV
    pool of N bytes, dsakv's --kv-budget-gib N / 2^30, which serve-pd hands its servers;
    --gpu-memory-utilization beside it is ignored, as vLLM ignores it then."""
    from dsakv.cli.args import add_engine_args, given_flags

    flags = ["--kv-cache-memory-bytes", size]
    assert _config("serve", glm_tiny, *flags).kv_budget_gib == pytest.approx(gib)
    both = _config("serve", glm_tiny, *flags, "--gpu-memory-utilization", "0.9")
    assert (both.kv_budget_gib, both.gpu_memory_utilization) == (pytest.approx(gib), None)
    args = build_parser().parse_args(["serve-pd", glm_tiny, *flags])
    engine_config_from_args(args)
    passed = given_flags(args, add_engine_args)
    assert passed == ["--kv-budget-gib", str(gib)]
    assert _config("serve", glm_tiny, *passed).kv_budget_gib == pytest.approx(gib)


def test_sglangs_token_cap_goes_over_the_bytes_vllm_sizes_the_pool_with(glm_tiny):
    """SGLang's --max-total-tokens caps whatever sizes the pool, vLLM's byte count too (it
    was refused as a second size): both reach the config, and serve-pd's servers."""
    from dsakv.cli.args import add_engine_args, given_flags

    flags = ["--kv-cache-memory-bytes", "1G", "--max-total-tokens", "4096"]
    config = _config("serve", glm_tiny, *flags)
    assert (config.kv_budget_gib, config.max_total_tokens) == (1.0, 4096)
    args = build_parser().parse_args(["serve-pd", glm_tiny, *flags])
    engine_config_from_args(args)
    passed = _config("serve", glm_tiny, *given_flags(args, add_engine_args))
    assert (passed.kv_budget_gib, passed.max_total_tokens) == (1.0, 4096)


def test_vllm_switches_for_what_dsakv_does_anyway_change_nothing(glm_tiny, capsys):
    """vLLM's switches for what dsakv does without them, and the values that ask for it
    (one API server, no CPU weight offload, xgrammar, its own processes): taken, the engine
    unchanged; the server's by serve and serve-pd, not generate."""
    engine = ["--async-scheduling", "--no-async-scheduling", "--cpu-offload-gb", "0.0"]
    engine += ["--distributed-executor-backend", "mp", "--compilation-config", '{"level": 3}']
    server = [["--enable-prompt-tokens-details"], ["--enable-server-load-tracking"]]
    server += [["--enable-sleep-mode"], ["--disable-frontend-multiprocessing"]]
    server += [["--disable-fastapi-docs"], ["--api-server-count", "1"], ["-asc", "1"]]
    server += [["--structured-outputs-config.backend", "xgrammar"], ["--enable-reasoning"]]
    server += [["--guided-decoding-backend", "xgrammar"], ["-asc", "01"]]
    server += [
        ["--structured-outputs-config.backend", "auto"],
        ["--guided-decoding-backend", "auto"],
    ]
    assert_taken_and_ignored(glm_tiny, engine, server, capsys)


# vLLM's StructuredOutputsConfig with every key dsakv takes and ignores (its defaults, and
# the switches for what dsakv does anyway: compact JSON, one backend with no fallback)
STRUCTURED = {
    "backend": "auto",
    "disable_fallback": True,
    "disable_any_whitespace": True,
    "disable_additional_properties": False,
    "reasoning_parser": "",
    "reasoning_parser_plugin": "",
    "enable_in_reasoning": False,
}


@pytest.mark.parametrize(
    "spec", [STRUCTURED, {"backend": "xgrammar", "disable_any_whitespace": False}, {}]
)
def test_vllms_structured_outputs_config_json_is_taken(glm_tiny, spec, capsys):
    """vLLM's --structured-outputs-config JSON: only its dotted .backend was taken (the JSON
    was read as that flag's abbreviation: "dsakv takes xgrammar, got '{...}'"). xgrammar or
    auto and the keys for what dsakv does anyway are taken, the engine unchanged."""
    flag = ["--structured-outputs-config", json.dumps(spec)]
    assert_taken_and_ignored(glm_tiny, [], [flag], capsys)


def test_structured_outputs_configs_reasoning_parser_is_the_servers(glm_tiny, monkeypatch):
    """Its reasoning_parser is vLLM's --reasoning-parser: the server gets it (the same one
    given twice is one); serve-pd, whose servers parse the model type's way, refuses it."""
    from dsakv.server import serve

    got = {}
    monkeypatch.setattr(serve, "run_server", lambda config, **kw: got.update(kw))
    flag = ["--structured-outputs-config", '{"reasoning_parser": "deepseek_v3"}']
    for more in ([], ["--reasoning-parser", "deepseek_v3"]):
        assert main(["serve", glm_tiny, "--port", str(free_port()), *flag, *more]) == 0
        assert got.pop("reasoning_parser") == "deepseek_v3"
    with pytest.raises(SystemExit) as exc:
        sys.exit(main(["serve-pd", glm_tiny, "--port", str(free_port()), *flag]))
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--distributed-executor-backend", "ray"], ["dsakv takes mp or uni", "no Ray", "'ray'"]),
        (["--api-server-count", "4"], ["--api-server-count/-asc: dsakv takes 1", "'4'"]),
        (["-asc", "2"], ["--api-server-count/-asc: dsakv takes 1", "'2'"]),
        (["--cpu-offload-gb", "8"], ["dsakv takes 0", "every weight on the device"]),
        (["--guided-decoding-backend", "outlines"], ["dsakv takes xgrammar", "'outlines'"]),
        (["--structured-outputs-config.backend", "guidance"], ["dsakv takes xgrammar"]),
        (
            ["--structured-outputs-config", '{"backend": "guidance"}'],
            ["--structured-outputs-config: backend: dsakv takes xgrammar or auto", "'guidance'"],
        ),
        (
            ["--structured-outputs-config", '{"backend": "xgrammar"}']
            + ["--structured-outputs-config.backend", "xgrammar"],
            ["--structured-outputs-config and --structured-outputs-config.backend: give one"],
        ),
        (
            ["--structured-outputs-config", '{"disable_additional_properties": true}'],
            ["disable_additional_properties is the guidance backend's"],
        ),
        (
            ["--structured-outputs-config", '{"enable_in_reasoning": true}'],
            ["enable_in_reasoning: dsakv enforces a grammar once the reasoning is over"],
        ),
        (
            ["--structured-outputs-config", '{"reasoning_parser_plugin": "p.py"}'],
            ["runs no plugin code", "--reasoning-parser"],
        ),
        (
            ["--structured-outputs-config", '{"reasoning_parser": "qwen3"}'],
            ["unknown reasoning parser 'qwen3'"],
        ),
        (
            ["--structured-outputs-config", '{"reasoning_parser": "glm45"}']
            + ["--reasoning-parser", "none"],
            ["reasoning_parser 'glm45' and --reasoning-parser 'none': give one"],
        ),
        (
            ["--structured-outputs-config", '{"whitespace_pattern": " "}'],
            ["unknown key(s) whitespace_pattern"],
        ),
        (
            ["--structured-outputs-config", '{"disable_fallback": 1}'],
            ["disable_fallback must be true or false, got 1"],
        ),
        (["--structured-outputs-config", "xgrammar"], ["must be a JSON object"]),
        (["--tool-parser-plugin", "my_parser.py"], ["runs no plugin code", "--tool-call-parser"]),
        (["--hf-overrides", '{"num_hidden_layers": 2}'], ["does not rewrite the model's config"]),
        (["--kv-cache-memory-bytes", "1G", "--kv-budget-gib", "1"], ["both size the KV pool"]),
        (["--kv-cache-memory-bytes", "1G", "--num-pages", "8"], ["and --num-pages both size"]),
        (["--kv-cache-memory-bytes", "1.5G"], ["must be a number of bytes", "'1.5G'"]),
        (["--kv-cache-memory-bytes", "0"], ["must be a number of bytes >= 1"]),
        (["--override-generation-config", "{"], ["--override-generation-config: not JSON"]),
        (["--override-generation-config", '{"temprature": 1}'], ["'temprature': not a sampl"]),
        (["--override-generation-config", '{"top_p": "x"}'], ["top_p must be a number or null"]),
        (["--override-generation-config", '{"temperature": -1}'], ["temperature must be a finite"]),
        (["--allowed-origins", "https://a.example"], ["must be a JSON list of strings"]),
        (["--allowed-headers", '["x", 1]'], ["--allowed-headers: must be a JSON list"]),
        (["--ssl-keyfile", "key.pem"], ["--ssl-keyfile needs --ssl-certfile"]),
        (["--ssl-ca-certs", "ca.pem"], ["--ssl-ca-certs needs --ssl-certfile"]),
        (
            ["--ssl-certfile", "c.pem", "--ssl-cert-reqs", "2"],
            ["--ssl-cert-reqs 2 checks clients' certificates against --ssl-ca-certs"],
        ),
        (
            ["--ssl-certfile", "/nonexistent/cert.pem"],
            ["/nonexistent/cert.pem: not a PEM", "No such"],
        ),
        (["--ssl-cert-reqs", "3"], ["--ssl-cert-reqs: invalid choice"]),
        (["--root-path", "proxy"], ["--root-path must start with /"]),
        (["--response-role", ""], ["--response-role must not be empty"]),
    ],
)
def test_values_dsakv_cannot_honour_are_one_error_line(glm_tiny, flags, words, capsys):
    """vLLM's values asking for what dsakv does not do (Ray, several API servers, CPU
    offload, another grammar backend, plugins, config rewrites), sizes that contradict, and
    bad CORS / TLS / root path values: one line, before anything listens or loads."""
    err = _error_line(["serve", glm_tiny, "--port", str(free_port()), *flags], capsys)
    assert all(w in err for w in words), err


def test_serve_hands_the_flags_to_its_server(glm_tiny, cert, monkeypatch):
    """`dsakv serve`: the CORS, TLS, root path and response flags reach the server."""
    from dsakv.server import serve

    got = {}
    monkeypatch.setattr(serve, "run_server", lambda config, **kw: got.update(kw))
    argv = ["serve", glm_tiny, "--port", str(free_port()), "--allowed-origins", f'["{ORIGIN}"]']
    argv += ["--allowed-methods", '["GET", "POST"]', "--allow-credentials", "--root-path", "/p"]
    argv += ["--ssl-certfile", cert[0], "--ssl-keyfile", cert[1], "--response-role", "bot"]
    argv += ["--return-tokens-as-token-ids", "--enable-force-include-usage"]
    assert main(argv) == 0
    assert got["http"] == HTTPConfig(
        allowed_origins=(ORIGIN,),
        allowed_methods=("GET", "POST"),
        allow_credentials=True,
        ssl_certfile=cert[0],
        ssl_keyfile=cert[1],
        root_path="/p",
    )
    assert got["defaults"] == ResponseDefaults("bot", True, True)


def test_serve_pd_gives_the_router_the_front_doors_flags_and_the_servers_theirs(
    glm_tiny, monkeypatch
):
    """serve-pd: CORS, TLS and the root path are its router's (the front door; the servers
    listen on loopback behind it), the response defaults and the generation overrides its
    servers' (the decode server's answers are relayed)."""
    from dsakv.disagg import launch

    started = []
    monkeypatch.setattr(launch, "serve_pd", lambda *a, **kw: started.append((a, kw)))
    over = '{"temperature": 0.5}'
    argv = ["serve-pd", glm_tiny, "--port", str(free_port()), "--allowed-origins", f'["{ORIGIN}"]']
    argv += ["--root-path", "/p", "--response-role", "bot", "--return-tokens-as-token-ids"]
    argv += ["--enable-force-include-usage", "--override-generation-config", over]
    assert main(argv) == 0
    ((args, kw),) = started
    flags = args[1]
    assert kw["http"] == HTTPConfig(allowed_origins=(ORIGIN,), root_path="/p")
    assert " ".join(flags).count("--response-role bot --return-tokens-as-token-ids ") == 1
    assert "--enable-force-include-usage" in flags
    i = flags.index("--override-generation-config")
    assert json.loads(flags[i + 1]) == {"temperature": 0.5}
    assert not any(f in flags for f in ("--allowed-origins", "--root-path"))


def test_serve_pd_servers_answer_no_browser(glm_tiny):
    """serve-pd's servers listen on loopback behind the router: their command turns CORS
    off (no origin), so a page in a browser on the host cannot call them directly; an app
    with no allowed origin sends no CORS header at all."""
    from fastapi import FastAPI

    from dsakv.cli.args import http_config
    from dsakv.disagg.launch import serve_command

    argv = serve_command(glm_tiny, "decode", free_port(), free_port(), [])
    args = build_parser().parse_args(argv[argv.index("serve") :])
    config = http_config(args)
    assert config.allowed_origins == ()
    app = FastAPI()
    app.add_api_route("/v1/models", lambda: {"data": []}, methods=["GET"])
    config.install(app)

    async def preflight() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            headers = {"Origin": ORIGIN, "Access-Control-Request-Method": "GET"}
            await client.options("/v1/models", headers=headers)
            return await client.get("/v1/models", headers={"Origin": ORIGIN})

    import asyncio

    r = asyncio.run(preflight())
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_the_router_serves_tls_and_cors(cert, tmp_path):
    """`dsakv router` (serve-pd's front door) with --ssl-certfile / --ssl-keyfile and
    --allowed-origins: its probes over https, a preflight from that origin allowed, from
    another refused."""
    port = free_port()
    cmd = [sys.executable, "-m", "dsakv.cli", "router", "--port", str(port)]
    cmd += ["--ssl-certfile", cert[0], "--ssl-keyfile", cert[1]]
    cmd += ["--allowed-origins", f'["{ORIGIN}"]']
    log = tmp_path / "router.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(verify=ssl.create_default_context(cafile=cert[0]), timeout=5) as c:
            deadline = time.monotonic() + TIMEOUT
            while True:
                try:
                    r = c.get(f"{base}/liveness")
                    break
                except httpx.HTTPError:
                    assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                    time.sleep(0.2)
            assert r.status_code == 200
            r = c.options(f"{base}/v1/chat/completions", headers={"Origin": ORIGIN, **PREFLIGHT})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
            other = {"Origin": "https://evil.example", **PREFLIGHT}
            assert c.options(f"{base}/v1/chat/completions", headers=other).status_code == 400
    finally:
        proc.terminate()
        proc.wait(TIMEOUT)
    assert f"dsakv: router at https://127.0.0.1:{port}/v1" in log.read_text()


def test_a_root_path_of_slash_is_no_prefix():
    """`--root-path /` (FastAPI takes it: no prefix) is no prefix, not a refusal."""
    assert HTTPConfig(root_path="/").root_path == ""
