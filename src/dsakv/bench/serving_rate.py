"""`dsakv bench --serving`: decode rate in process vs through a real `dsakv serve` process.

Why: the server once decoded at half the in-process rate on the same model (issue 20: the
engine was built on one thread and stepped on another, which left two OpenMP teams in the
process). This section runs both side by side on the same model, engine arguments, prompts
and torch thread count, so any gap the serving path adds shows up as a ratio.

Decode rate, both sides alike: a batch of `n` requests is submitted at once; `t0` is when
the last of them got its first token (every prompt is prefilled), `t1` when the last token
arrived; rate = output tokens that arrived after `t0` / (`t1` - `t0`). In process, a token
"arrives" when the engine step that made it returns; through the server, when its streamed
chunk reaches the client (`/v1/completions`, `stream: true`). Every request asks for
`logprobs: 0` on both sides: each chunk then lists its tokens, so the client can count
them even where the text is held back (partial UTF-8). Greedy, `ignore_eos`, so every
request produces exactly `output_len` tokens.

Requests run in rounds that alternate in-process and server measurements, so background
load drifts affect both; each figure is the median over `repeats` rounds, and the CPU cores
each side used while decoding (and the whole machine's busy cores) are recorded to judge
how quiet the machine was.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dsakv.errors import DsakvError
from dsakv.kernels.cpu_ops import compile_warmup_s
from dsakv.procs import free_port, stop_process

TARGET_RATIO = 0.9  # the server decodes within 10% of the in-process rate
SERVED_NAME = "bench"


@dataclass(frozen=True)
class ServingSizes:
    """The workload: `concurrency` requests at once per measurement, each `prompt_len`
    prompt tokens and `output_len` output tokens; `repeats` rounds per concurrency."""

    concurrency: tuple[int, ...] = (1, 32)
    prompt_len: int = 128
    output_len: int = 128
    repeats: int = 1

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise DsakvError(f"concurrency must be >= 1 requests, got {self.concurrency}")
        if self.prompt_len < 1 or self.output_len < 2 or self.repeats < 1:
            raise DsakvError("prompt_len >= 1, output_len >= 2 and repeats >= 1 are needed")


DEFAULT = ServingSizes()
QUICK = ServingSizes(concurrency=(1, 8), output_len=32)


def run_serving_rate(
    model: str | None = None,
    *,
    quick: bool = False,
    sizes: ServingSizes | None = None,
    engine_args: dict[str, Any] | None = None,
    threads: int | None = None,
    seed: int = 0,
    startup_timeout_s: float = 600.0,
    json_path: str | None = None,
    print_summary: bool = False,
) -> dict[str, Any]:
    """Decode tokens/s for each concurrency, in process (`LLM`) and through `dsakv serve`,
    and their ratio (server / in-process). `engine_args`: `EngineConfig` fields for both
    sides (e.g. `attention_backend="torch"`), passed to the server as its flags. `threads`:
    torch threads on both sides (default: this process's, which the server is given as
    `OMP_NUM_THREADS`)."""
    from dsakv.engine import LLM, EngineConfig
    from dsakv.models.tiny import resolve_model_dir

    sizes = sizes or (QUICK if quick else DEFAULT)
    engine_args = dict(engine_args or {})
    path = resolve_model_dir(model, "glm-bench")
    config = EngineConfig.from_kwargs(path, **engine_args)  # bad args fail before loading
    flags = serve_flags(config, engine_args)
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    n_threads = torch.get_num_threads()
    start, compiling = time.perf_counter(), compile_warmup_s()
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {"in_process": {}, "server": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="dsakv-serving-") as tmp:
            server = ServeProcess(path, flags, n_threads, Path(tmp) / "serve.log")
            try:
                llm = LLM(config)  # loads while the server process loads too
                try:
                    _warm_in_process(llm)
                    server.wait_ready(startup_timeout_s)
                    server.warm()
                    for k, n in enumerate(sizes.concurrency):
                        for r in range(sizes.repeats):
                            prompts = _prompts(n, sizes.prompt_len, seed + 1000 * k + r)
                            a = _in_process(llm, prompts, sizes.output_len)
                            b = server.measure(prompts, sizes.output_len)
                            runs["in_process"].setdefault(str(n), []).append(a)
                            runs["server"].setdefault(str(n), []).append(b)
                finally:
                    llm.close()
            finally:
                server.stop()
    finally:
        torch.set_num_threads(saved_threads)
    result = _report(runs, sizes)
    result["meta"] = {
        "model": path,
        "engine_args": engine_args,
        "serve_flags": flags,
        "quick": quick,
        "sizes": asdict(sizes),
        "torch_threads": n_threads,
        "cpus": _cpus(),
        "seed": seed,
        "definition": "output tokens arriving after the last request's first token / "
        "time from then to the last token (greedy, ignore_eos, logprobs=0)",
        "wall_s": time.perf_counter() - start,
        # torch.compile warm-up in process (the warm-up request's, before any measured
        # round; the server's is inside its own warm-up request): reported, not counted.
        "compile_warmup_s": compile_warmup_s() - compiling,
    }
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2))
    if print_summary:
        print(summary(result))
    return result


def serve_flags(config: Any, engine_args: dict[str, Any]) -> list[str]:
    """`dsakv serve` flags giving exactly `config` (built from `engine_args`): checked by
    parsing them with the real CLI, so both sides of the comparison run the same engine."""
    from dsakv.cli import build_parser, engine_config_from_args

    flags: list[str] = []
    switches = _switches()
    # A JSON object or list (--engine-arg parses JSON) goes as its JSON, not Python's repr;
    # `dsakv serve` keeps that text, so the config it gets is compared with the text too
    texts = {k: json.dumps(v) for k, v in engine_args.items() if isinstance(v, (dict, list))}
    config = replace(config, **texts)
    for name, value in engine_args.items():
        if name in switches:  # (a value no switch gives is caught below, as not the same)
            flag = switches[name].get(value) if isinstance(value, bool) else None
            flags += [flag] if flag else []
        elif value is not None:
            flags += [f"--{name.replace('_', '-')}", texts.get(name, str(value))]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = build_parser().parse_args(["serve", config.model, *flags])
    except SystemExit:
        message = err.getvalue().strip().removeprefix("error: ")
        raise DsakvError(f"engine args not expressible as `dsakv serve` flags: {message}") from None
    served = engine_config_from_args(args)
    if served != config:
        diff = sorted(k for k in asdict(config) if getattr(config, k) != getattr(served, k, None))
        raise DsakvError(f"`dsakv serve` would not get the same {', '.join(diff)}")
    return flags


def _switches() -> dict[str, dict[bool, str]]:
    """`EngineConfig` fields set by a switch: field -> {the value it sets: the switch}, read
    from the CLI's own definitions (a list kept here missed the switches added since)."""
    from dsakv.cli.args import OFF_FLAGS, actions, add_engine_args, add_storage_args

    out: dict[str, dict[bool, str]] = {}
    for action in actions(add_engine_args) + actions(add_storage_args):
        if action.nargs == 0 and action.help != argparse.SUPPRESS:
            field, value = OFF_FLAGS.get(action.dest, (action.dest, action.const))
            out.setdefault(field, {})[value] = action.option_strings[0]
    return out


# --- workload ----------------------------------------------------------------------------------


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Seeded token-id prompts, distinct per request (no shared prefix pages)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(length)] for _ in range(n)]


def _params(output_len: int) -> Any:
    from dsakv.engine import SamplingParams

    return SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True, logprobs=0)


# Warm-up batches, in process and through the server: a batch of one, then two requests
# decoding together, so that with torch.compile both specialisations (one request, a few)
# compile here rather than in a measured round's last steps.
WARM_BATCHES = ([list(range(1, 9))], [list(range(1, 9)), list(range(2, 10))])
WARM_TOKENS = 4


def _warm_in_process(llm: Any) -> None:
    """One-time allocations and first-call costs, as the server's `warm` requests."""
    for batch in WARM_BATCHES:
        llm.generate(batch, _params(WARM_TOKENS), use_tqdm=False)


def _in_process(llm: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """Step the engine on this thread until the batch is done (what `LLM.generate` does),
    timing each step's tokens."""
    engine = llm.engine
    params = _params(output_len)
    sent = time.perf_counter()
    reqs = [engine.add_request(p, params) for p in prompts]
    first: dict[int, float] = {}
    t0 = t1 = 0.0
    at_t0 = 0
    usage0 = None
    while engine.has_unfinished():
        engine.step()
        t1 = time.perf_counter()
        for r in reqs:
            if r.output_ids and r.rid not in first:
                first[r.rid] = t1
        if usage0 is None and len(first) == len(reqs):
            t0, at_t0, usage0 = t1, sum(len(r.output_ids) for r in reqs), _usage(os.getpid())
    total = sum(len(r.output_ids) for r in reqs)
    ttfts = [t - sent for t in first.values()]
    return _figures(len(reqs), total, total - at_t0, t0, t1, ttfts, usage0, _usage(os.getpid()))


def _figures(
    n: int,
    total: int,
    decode_tokens: int,
    t0: float,
    t1: float,
    ttfts: list[float],
    usage0: tuple[float, float] | None,
    usage1: tuple[float, float] | None,
    client: tuple[tuple[float, float] | None, tuple[float, float] | None] = (None, None),
) -> dict[str, Any]:
    span = t1 - t0
    out: dict[str, Any] = {
        "requests": n,
        "output_tokens": total,
        "decode_tokens": decode_tokens,
        "decode_s": span,
        "decode_tokens_per_s": decode_tokens / span if span > 0 else None,
        "mean_ttft_s": statistics.mean(ttfts) if ttfts else None,
        "cpu_cores": None,
        "machine_busy_cores": None,
    }
    if usage0 and usage1 and span > 0:
        out["cpu_cores"] = (usage1[0] - usage0[0]) / span
        out["machine_busy_cores"] = (usage1[1] - usage0[1]) / span
    c0, c1 = client
    if c0 and c1 and span > 0:
        out["client_cpu_cores"] = (c1[0] - c0[0]) / span
    return out


# --- the server --------------------------------------------------------------------------------


class ServeProcess:
    """A `dsakv serve` subprocess on a free loopback port, its log in a file."""

    def __init__(self, model: str, flags: list[str], threads: int, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "dsakv.cli", "serve", model, "--port", str(self.port)]
        argv += ["--served-model-name", SERVED_NAME, *flags]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with open(log, "w") as f:
            self.proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DsakvError(f"dsakv serve exited with {self.proc.returncode}: {self._tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            time.sleep(0.2)
        raise DsakvError(f"dsakv serve did not start in {timeout_s:.0f} s: {self._tail()}")

    def warm(self) -> None:
        for batch in WARM_BATCHES:
            asyncio.run(self._batch(batch, WARM_TOKENS))

    def measure(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        return asyncio.run(self._batch(prompts, output_len))

    async def _batch(self, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
        """Stream every prompt at once; time each chunk's tokens on arrival."""
        import httpx

        n = len(prompts)
        first: dict[int, float] = {}
        arrivals: list[tuple[float, int]] = []
        mark: dict[str, Any] = {}

        async def one(client: httpx.AsyncClient, i: int) -> int:
            body = {
                "model": SERVED_NAME,
                "prompt": prompts[i],
                "max_tokens": output_len,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 0,
                "stream": True,
            }
            got = 0
            async with client.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise DsakvError(f"dsakv serve answered {r.status_code}: {r.text[:300]}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise DsakvError(f"dsakv serve failed a request: {chunk['error']}")
                    tokens = sum(
                        len((c.get("logprobs") or {}).get("tokens") or []) for c in chunk["choices"]
                    )
                    if not tokens:
                        continue
                    now = time.perf_counter()
                    arrivals.append((now, tokens))
                    got += tokens
                    if i not in first:
                        first[i] = now
                        if len(first) == n:  # every prompt prefilled: decoding from here
                            mark.update(t0=now, server=_usage(self.proc.pid))
                            mark.update(client=_usage(os.getpid()))
            return got

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=httpx.Timeout(None), limits=limits) as client:
            sent = time.perf_counter()
            counts = await asyncio.gather(*(one(client, i) for i in range(n)))
        usage1, client1 = _usage(self.proc.pid), _usage(os.getpid())
        if any(c != output_len for c in counts):
            raise DsakvError(f"expected {output_len} tokens per request, got {counts}")
        t0, t1 = mark["t0"], max(t for t, _ in arrivals)
        decode = sum(k for t, k in arrivals if t > t0)
        ttfts = [t - sent for t in first.values()]
        client = (mark["client"], client1)
        return _figures(n, sum(counts), decode, t0, t1, ttfts, mark["server"], usage1, client)

    def stop(self) -> None:
        stop_process(self.proc, 30)

    def _tail(self) -> str:
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(lines[-5:]) or "(empty log)"


# --- figures -----------------------------------------------------------------------------------


def _report(runs: dict[str, dict[str, list[dict[str, Any]]]], sizes: ServingSizes) -> dict:
    """Medians per side and concurrency, every run kept, and the server / in-process ratio."""
    out: dict[str, Any] = {"in_process": {}, "server": {}, "ratios": {}}
    for side in ("in_process", "server"):
        for n, rows in runs[side].items():
            out[side][n] = {**_median(rows), "runs": rows}
    for n in out["server"]:
        a = out["in_process"][n]["decode_tokens_per_s"]
        b = out["server"][n]["decode_tokens_per_s"]
        out["ratios"][n] = b / a if a and b else None
    out["target"] = {
        "ratio": TARGET_RATIO,
        "met": {n: (r is not None and r >= TARGET_RATIO) for n, r in out["ratios"].items()},
    }
    return out


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = rows[0].keys()
    out = {}
    for k in keys:
        values = [r[k] for r in rows if r.get(k) is not None]
        out[k] = statistics.median(values) if values else None
    return out


def summary(r: dict[str, Any]) -> str:
    """The table `dsakv bench --serving` prints."""
    m = r["meta"]
    args = ", ".join(f"{k}={v}" for k, v in m["engine_args"].items()) or "defaults"
    lines = [
        f"dsakv bench --serving{' --quick' if m['quick'] else ''} — {m['model']}, "
        f"torch threads {m['torch_threads']} of {m['cpus']} cpus, engine args: {args}, "
        f"{m['wall_s']:.0f} s"
        + (
            f", torch.compile warm-up {m['compile_warmup_s']:.1f} s"
            if m.get("compile_warmup_s")
            else ""
        ),
        f"decode tokens/s ({m['definition']}); "
        f"{m['sizes']['prompt_len']}-token prompts, {m['sizes']['output_len']} output tokens",
        f"{'requests':>9}{'in-process':>12}{'dsakv serve':>13}{'ratio':>8}"
        f"{'cpu in-proc':>13}{'cpu server':>12}{'machine':>9}",
    ]
    for n, ratio in r["ratios"].items():
        a, b = r["in_process"][n], r["server"][n]
        met = "ok" if r["target"]["met"][n] else f"< {r['target']['ratio']}"
        lines.append(
            f"{n:>9}{_num(a['decode_tokens_per_s']):>12}{_num(b['decode_tokens_per_s']):>13}"
            f"{_num(ratio, 3):>8}{_num(a['cpu_cores']):>13}{_num(b['cpu_cores']):>12}"
            f"{_num(b['machine_busy_cores']):>9}  {met}"
        )
    lines.append(
        "cpu: cores each side used while decoding; machine: busy cores during the server run "
        "(more than the server's + the client's means other load)"
    )
    return "\n".join(lines)


def _num(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


# --- helpers -----------------------------------------------------------------------------------


def _usage(pid: int) -> tuple[float, float] | None:
    """(CPU seconds process `pid` used so far, busy CPU seconds of the whole machine); None
    where /proc is not there (the rates are measured all the same)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        machine = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, IndexError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    busy = sum(machine) - machine[3] - machine[4]  # everything but idle and iowait
    return (int(stat[11]) + int(stat[12])) / tick, busy / tick


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
