"""`dsakv router`'s active health checks (SGLang router's `--health-check-*` flags): each
server probed while no client sends anything, unhealthy after the failure threshold's
failed probes in a row (passed over by routing meanwhile, as /workers and /metrics tell),
healthy again after the success threshold's passed ones; off with --disable-health-check.
The servers are our own (FastAPI apps): a prefill server whose /health flips between 200
and 503, and before each answer notes what the router tells of its health then (so the
probe the router's state changed after is known without timing anything)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import fields

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Response

from dsakv.cli import build_parser, main
from dsakv.cli.disagg import health_config
from dsakv.disagg import launch
from dsakv.disagg.policy import PolicyConfig
from dsakv.disagg.router import HealthConfig
from dsakv.server.auth import require_api_key

from .conftest import cli_error_line
from .serving import TIMEOUT, free_port, routing, running, scrape_metrics

COMPLETIONS = "/v1/completions"
FAST = HealthConfig(interval_s=0.05, timeout_s=5.0, failure_threshold=3, success_threshold=2)


class _Flaky:
    """A prefill server whose /health answers `answer`'s status; with `answer`'s router
    URL, each probe first notes whether that router tells it healthy (`/workers`): the
    router has then heard every earlier probe's answer. (One attribute: a probe reads both
    at once.)"""

    def __init__(self, generate: Callable[[], dict] | None = None) -> None:
        self.answer: tuple[int, str | None] = (200, None)
        self.url = ""  # (its URL, once serving)
        self.seen: list[tuple[int, bool]] = []  # (the status answered, healthy before it)
        self.app = FastAPI()
        self.app.get("/disagg/info")(lambda: {"mode": "prefill", "bootstrap_port": 1})
        self.app.get("/health")(self.health)
        self.app.post(COMPLETIONS)(generate or (lambda: {}))

    def health(self) -> Response:  # (sync: on a thread, so it may ask the router)
        status, router = self.answer
        if router is not None:
            self.seen.append((status, _healthy(router, self.url)))
        return Response(status_code=status)


def _fake_decode(generate: Callable[[], dict] | None = None) -> FastAPI:
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    app.post(COMPLETIONS)(generate or (lambda: {"choices": []}))
    return app


@contextmanager
def _serving(app: FastAPI) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(app, port=free_port(), log_level="warning"))
    with running(server) as base:
        yield base


def _healthy(router: str, url: str, key: str | None = None) -> bool:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    listed = httpx.get(f"{router}/workers", headers=headers, timeout=TIMEOUT).json()["workers"]
    return {w["url"]: w["is_healthy"] for w in listed}[url]


def _until(done) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not done():
        assert time.monotonic() < deadline, "the health checks never got there"
        time.sleep(0.02)


def _post(base: str) -> None:
    r = httpx.post(f"{base}{COMPLETIONS}", json={"prompt": "hi"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text


def _metric(base: str, name: str, **labels: str) -> float:
    """The router's sample of `name` with `labels` (0 if absent)."""
    return scrape_metrics(base, labels=True).get((name, tuple(sorted(labels.items()))), 0)


def _checks(base: str, kind: str, result: str) -> float:
    return _metric(base, "smg_worker_health_checks_total", result=result, worker_type=kind)


def test_a_server_failing_its_health_checks_is_passed_over_until_it_passes_again():
    """A prefill server (of two) whose /health turns 503: unhealthy from its third failed
    probe on (not before), with no request sent; /workers and /metrics say so, and round
    robin sends it nothing meanwhile. Its /health back to 200: healthy from its second
    passed probe on, and it takes requests again. Each probe counted by result."""
    flaky = _Flaky()
    with ExitStack() as stack:
        p0 = flaky.url = stack.enter_context(_serving(flaky.app))
        p1 = stack.enter_context(_serving(_Flaky().app))
        d = stack.enter_context(_serving(_fake_decode()))
        policy = PolicyConfig(policy="round_robin")
        base = stack.enter_context(routing([p0, p1], [d], policy=policy, health=FAST))
        flaky.answer = (503, base)
        _until(lambda: len(flaky.seen) >= 4)
        flaky.answer = (503, None)
        assert flaky.seen[:4] == [(503, True)] * 3 + [(503, False)]
        for name in ("smg_worker_health", "sgl_router_worker_health"):
            assert _metric(base, name, worker=p0) == 0, name
            assert _metric(base, name, worker=p1) == 1, name
        assert _checks(base, "prefill", "failure") >= 4
        health = httpx.get(f"{base}/health", timeout=TIMEOUT)
        assert health.status_code == 503 and p0 in health.text, health.text
        for _ in range(4):
            _post(base)
        sent = "sgl_router_pd_prefill_requests_total"
        assert (_metric(base, sent, worker=p0), _metric(base, sent, worker=p1)) == (0, 4)

        flaky.seen.clear()
        flaky.answer = (200, base)
        _until(lambda: len(flaky.seen) >= 3)
        flaky.answer = (200, None)
        assert flaky.seen[:3] == [(200, False)] * 2 + [(200, True)]
        assert _metric(base, "smg_worker_health", worker=p0) == 1
        for _ in range(2):
            _post(base)
        assert (_metric(base, sent, worker=p0), _metric(base, sent, worker=p1)) == (1, 5)
        assert _checks(base, "prefill", "success") >= 3


def test_a_dead_server_is_found_without_a_request_and_the_checks_can_be_off():
    """A decode server that is not there: unhealthy after the failure threshold's probes,
    no request sent. With the checks disabled (SGLang's --disable-health-check) a server
    failing its /health is never probed: healthy until a contact says otherwise."""
    dead = f"http://127.0.0.1:{free_port()}"
    flaky = _Flaky()
    with _serving(flaky.app) as p, routing([p], [dead], health=FAST) as base:
        _until(lambda: not _healthy(base, dead))
        assert _checks(base, "decode", "failure") >= 3
        assert _healthy(base, p)
    off = HealthConfig(interval_s=0.01, enabled=False)
    with _serving(flaky.app) as p, routing([p], [dead], health=off) as base:
        flaky.url, flaky.answer = p, (503, base)
        time.sleep(0.3)  # (30 intervals: none probes)
        assert flaky.seen == [] and _healthy(base, p) and _healthy(base, dead)
        assert _checks(base, "prefill", "failure") == _checks(base, "decode", "failure") == 0


def test_the_flags_are_sglang_routers():
    """SGLang router's health flags, names and defaults (sglang-router's own parser, the
    dev extra's), make the router's `HealthConfig`; bad values are one error line."""
    router_args = pytest.importorskip("sglang_router.router_args")
    defaults = router_args.RouterArgs()
    ours = health_config(build_parser().parse_args(["router"]))
    assert ours == HealthConfig()
    sglang = {
        "interval_s": defaults.health_check_interval_secs,
        "timeout_s": defaults.health_check_timeout_secs,
        "failure_threshold": defaults.health_failure_threshold,
        "success_threshold": defaults.health_success_threshold,
        "endpoint": defaults.health_check_endpoint,
        "enabled": not defaults.disable_health_check,
    }
    assert {f.name: getattr(ours, f.name) for f in fields(HealthConfig)} == sglang
    argv = ["router", "--health-check-interval-secs", "0.5", "--health-check-timeout-secs", "2",
            "--health-failure-threshold", "5", "--health-success-threshold", "1",
            "--health-check-endpoint", "/ping", "--disable-health-check"]  # fmt: skip
    given = HealthConfig(0.5, 2, 5, 1, "/ping", enabled=False)
    assert health_config(build_parser().parse_args(argv)) == given


@pytest.mark.parametrize(
    "args, message",
    [
        (["--health-check-interval-secs", "0"], "argument --health-check-interval-secs: must be"),
        (["--health-check-timeout-secs", "x"], "argument --health-check-timeout-secs: must be"),
        (["--health-failure-threshold", "0"], "argument --health-failure-threshold: must be"),
        (["--health-success-threshold", "1.5"], "argument --health-success-threshold: must be"),
        (["--health-check-endpoint", "health"], "the health check endpoint must be a path"),
    ],
)
def test_bad_health_flags_are_one_error_line(args, message, capsys):
    line = cli_error_line(["router", "--port", str(free_port()), *args], capsys)
    assert line.startswith(f"error: {message}"), line


def test_a_probe_failing_outside_http_counts_as_failed_and_the_checks_go_on():
    """An endpoint httpx cannot even make a URL of (InvalidURL is no HTTPError): each probe
    fails, counted, and the server turns unhealthy; before, the first such probe ended the
    checks for good, silently (nothing counted, every server healthy for ever)."""
    odd = HealthConfig(interval_s=0.05, failure_threshold=3, endpoint="/health\x00")
    with (
        _serving(_Flaky().app) as p,
        _serving(_fake_decode()) as d,
        routing([p], [d], health=odd) as base,
    ):
        _until(lambda: _checks(base, "prefill", "failure") >= 4)
        assert not _healthy(base, p) and not _healthy(base, d)
        assert _checks(base, "prefill", "success") == 0


def test_serve_pd_gives_its_router_the_health_flags(glm_tiny, monkeypatch, capsys):
    """`dsakv serve-pd` takes `dsakv router`'s health flags for its router's checks of its
    two servers, a bad one an error line before they start (before: no such flags, and its
    router always ran SGLang's defaults). (Its servers here: processes that only sleep.)"""
    started = []
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(launch, "serve_command", lambda *args: sleeper)
    monkeypatch.setattr(launch, "wait_healthy", lambda *args: None)
    monkeypatch.setattr(launch, "run_router_on", lambda *a, **kw: started.append(kw["health"]))
    argv = ["serve-pd", glm_tiny, "--port", str(free_port()), "--health-check-interval-secs",
            "0.5", "--health-check-timeout-secs", "2", "--health-failure-threshold", "5",
            "--health-success-threshold", "1", "--health-check-endpoint", "/ping",
            "--disable-health-check"]  # fmt: skip
    assert main(argv) == 0
    assert started == [HealthConfig(0.5, 2, 5, 1, "/ping", enabled=False)]
    argv = ["serve-pd", glm_tiny, "--port", str(free_port()), "--health-check-endpoint", "x"]
    line = cli_error_line(argv, capsys)
    assert line.startswith("error: the health check endpoint must be a path"), line
    assert len(started) == 1


def _keyed(app: FastAPI, key: str) -> FastAPI:
    """`app` as a server started with `--api-key key`: its /v1/models needs the key (the
    servers' own check, `require_api_key`), its /health does not."""
    app.get("/v1/models")(lambda: {"object": "list", "data": []})
    require_api_key(app, key)
    return app


def test_the_health_checks_carry_the_routers_api_key():
    """A server started with --api-key, probed at --health-check-endpoint /v1/models (which
    needs the key): the router's probes send its own --api-key as a Bearer token, as
    SGLang's router gives its key to the workers it starts with, and the server passes
    them (before: no key, a 401 every time, and the server unhealthy for good)."""
    key = "sk-probes"
    checks = HealthConfig(interval_s=0.05, failure_threshold=1, endpoint="/v1/models")
    with (
        _serving(_keyed(_Flaky().app, key)) as p,
        _serving(_keyed(_fake_decode(), key)) as d,
        routing([p], [d], api_key=key, health=checks) as base,
    ):
        assert httpx.get(f"{p}/v1/models", timeout=TIMEOUT).status_code == 401  # (keyless)
        checked = lambda kind: sum(_checks(base, kind, r) for r in ("success", "failure"))  # noqa: E731
        _until(lambda: min(checked("prefill"), checked("decode")) >= 2)
        assert _checks(base, "prefill", "failure") == _checks(base, "decode", "failure") == 0
        assert _healthy(base, p, key) and _healthy(base, d, key)


def test_health_answers_what_the_checks_found_as_workers_and_metrics_do():
    """With the checks on, the router's /health is SGLang router's: the health its checks
    keep, which /workers and /metrics tell too, with no probe of its own. A server failing
    its /health that no check has probed yet (the failure threshold not reached): healthy
    in all three (before: /health asked it itself, answered 503 and marked it unhealthy
    at once, ahead of the threshold). Unhealthy once the checks find it so: in all three."""
    flaky = _Flaky()
    unprobed = HealthConfig(interval_s=3600)  # (no check while this test runs)
    with (
        _serving(flaky.app) as p,
        _serving(_fake_decode()) as d,
        routing([p], [d], health=unprobed) as base,
    ):
        flaky.url, flaky.answer = p, (503, base)
        for _ in range(2):
            health = httpx.get(f"{base}/health", timeout=TIMEOUT)
            assert health.json() == {"status": "ok"}, health.text
        assert flaky.seen == []  # (never asked)
        assert _healthy(base, p) and _metric(base, "smg_worker_health", worker=p) == 1
    flaky = _Flaky()
    with (
        _serving(flaky.app) as p,
        _serving(_fake_decode()) as d,
        routing([p], [d], health=FAST) as base,
    ):
        flaky.url, flaky.answer = p, (503, base)
        _until(lambda: not _healthy(base, p))
        health = httpx.get(f"{base}/health", timeout=TIMEOUT)
        assert health.status_code == 503, health.text
        assert health.json()["unhealthy"] == [f"{p}: failed its health checks"]
        assert _metric(base, "smg_worker_health", worker=p) == 0


def test_health_probes_a_server_only_a_contact_found_down():
    """With the checks on, a server a request found down (a failed contact, not the checks'
    threshold) is probed by /health: still down, it stays unhealthy (503, "unreachable");
    back on its port, it is healthy in /health, /workers and /metrics at once, with no
    request to it and no check run (before: /health kept answering 503 until a request to
    it succeeded or the checks' success threshold passed, 1-2 minutes at the defaults)."""
    port = free_port()
    dead = f"http://127.0.0.1:{port}"
    flaky = _Flaky()
    unprobed = HealthConfig(interval_s=3600)  # (no check while this test runs)
    with _serving(_fake_decode()) as d, routing([dead], [d], health=unprobed) as base:
        r = httpx.post(f"{base}{COMPLETIONS}", json={"prompt": "hi"}, timeout=TIMEOUT)
        assert r.status_code == 502 and dead in r.text, r.text
        for _ in range(2):  # (its probe failing keeps the mark)
            health = httpx.get(f"{base}/health", timeout=TIMEOUT)
            assert health.status_code == 503, health.text
            assert health.json()["unhealthy"] == [f"{dead}: unreachable"]
            assert not _healthy(base, dead)
        server = uvicorn.Server(uvicorn.Config(flaky.app, port=port, log_level="warning"))
        with running(server):
            flaky.url, flaky.answer = dead, (200, base)
            health = httpx.get(f"{base}/health", timeout=TIMEOUT)
            assert health.json() == {"status": "ok"}, health.text
            assert flaky.seen == [(200, False)]  # (one probe, /health's, while unhealthy)
            assert _healthy(base, dead) and _metric(base, "smg_worker_health", worker=dead) == 1
            assert _checks(base, "prefill", "success") == 0  # (no check counted it)


def test_a_request_a_prefill_server_takes_clears_its_mark_as_a_decode_servers_does():
    """A prefill server the checks found down, taking a request: its answer clears its mark
    at once, as a decode server's does (README: "or a request it takes"), in /workers,
    /health and /metrics alike. Its pick (its bootstrap asked) cleared it, but a failed
    probe marked it again while it ran the prompt; it answers once it has, its /health
    passing by then (too few times for the checks to clear it). Before, only the decode server was
    healthy after the request's 200."""
    prefilled = threading.Event()

    def prefill() -> dict:  # (sync: on a thread, so it may ask the router)
        _until(lambda: not _healthy(base, p))  # (a probe failed since its pick)
        flaky.url, flaky.answer = p, (200, base)
        _until(lambda: flaky.seen)  # (the router heard every failed probe: none comes after)
        prefilled.set()
        return {}

    def decode() -> dict:  # (a decode server answers once it has the prompt's KV)
        assert prefilled.wait(TIMEOUT)
        return {"choices": []}

    flaky = _Flaky(prefill)
    checks = HealthConfig(interval_s=0.05, failure_threshold=2, success_threshold=10**6)
    with (
        _serving(flaky.app) as p,
        _serving(_fake_decode(decode)) as d,
        routing([p], [d], health=checks) as base,
    ):
        flaky.answer = (503, None)
        _until(lambda: not _healthy(base, p))
        _post(base)
        _until(lambda: _healthy(base, p))
        assert _healthy(base, d)
        assert httpx.get(f"{base}/health", timeout=TIMEOUT).json() == {"status": "ok"}
        assert _metric(base, "smg_worker_health", worker=p) == 1
