"""The engine across ranks (gloo on CPU): `LLM(tp=2)`, expert parallel, DP attention, the
host tier under TP, bad flag combinations, and `dsakv serve --tp 2` end to end."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import pytest

from dsakv import LLM, SamplingParams
from dsakv.models.tiny import TINY_PRESETS, write_tiny_model

from .conftest import cli_error_line, flat_logprobs
from .serving import free_port

EXACT = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", device="cpu", page_size=16)
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _dense_topk(preset: str) -> dict:
    """The preset with index_topk covering every context here: exact equality is fair."""
    return {**TINY_PRESETS[preset], "index_topk": 1024}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    return {
        "glm": str(write_tiny_model(root / "glm", _dense_topk("glm-tiny"))),
        "deepseek": str(write_tiny_model(root / "deepseek", _dense_topk("deepseek-tiny"))),
        "glm-sparse": str(write_tiny_model(root / "glm-sparse", "glm-tiny")),
    }


def _rank_counters(engine) -> list[dict[str, float]]:
    """Each rank's own counters as of the last step (a `DPEngine` sums them in `counters`)."""
    return [r.counters for r in engine._reports]


def _prompts(n: int, seed: int = 0, lo: int = 8, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _generate(model: str, prompts, params=GREEDY, **kw) -> tuple[list[list[int]], dict]:
    with LLM(model, **{**EXACT, "num_pages": 48, **kw}) as llm:
        outs = llm.generate(prompts, params)
        llm.engine.check_integrity()
        counters = llm.engine.counters()
        if kw.get("dp_attention"):
            counters["per_rank"] = _rank_counters(llm.engine)
    return [o.token_ids for o in outs], counters


@pytest.fixture(scope="module")
def reference(models):
    prompts = _prompts(6)
    return prompts, {name: _generate(path, prompts)[0] for name, path in models.items()}


@pytest.mark.parametrize("model", ["glm", "deepseek"])
@pytest.mark.parametrize(
    "parallel",
    [dict(tp=2), dict(tp=2, ep=2), dict(tp=2, dp_attention=True)],
    ids=["tp2", "tp2-ep2", "dp-attention"],
)
def test_greedy_tokens_equal_one_rank(models, reference, model, parallel):
    prompts, ref = reference
    tokens, counters = _generate(models[model], prompts, **parallel)
    assert tokens == ref[model]
    if parallel.get("dp_attention"):
        # Each rank has its own pool: the aggregate holds twice the pages, and both served.
        assert counters["pages_total"] == 2 * 48
        assert [c["finished_requests"] > 0 for c in counters["per_rank"]] == [True, True]
        # Every rank's pool has the elided layout's bytes per token (the LayerPlan's).
        from dsakv.memory import CacheLayout

        layout = CacheLayout.for_model(models[model], "fp32", "fp32", 16)
        cell = layout.bytes_per_token
        assert [c["bytes_per_token"] for c in counters["per_rank"]] == [cell, cell]
        if layout.plan.num_shared_layers:  # (deepseek-tiny shares nothing)
            assert cell < layout.dense().bytes_per_token
        assert sum(c["finished_requests"] for c in counters["per_rank"]) == len(prompts)


def test_tp_with_host_tier_retraction_and_prefix_cache(models, reference):
    """Rank 0's host-tier copies are replayed on rank 1's pool replica: retraction to the
    host and back, and prefix hits, still give the one-rank tokens."""
    prompts, ref = reference
    shared = prompts[0][:32]
    batch = prompts + [shared + p[:8] for p in prompts[1:4]]
    one, _ = _generate(models["glm"], batch, num_pages=12, host_pool_gib=0.01)
    two, counters = _generate(models["glm"], batch, num_pages=12, host_pool_gib=0.01, tp=2)
    assert two == one
    assert two[: len(prompts)] == ref["glm"]
    assert counters["retractions_to_host"] > 0 and counters["prefix_hit_tokens"] > 0


@pytest.mark.parametrize(
    "parallel",
    [
        dict(tp=2),
        dict(tp=2, dp_attention=True),
        # (one machine: the ranks map one host latent, which the read fills; index-K is shared)
        dict(tp=2, enable_hisparse=True, hisparse_config={"host_to_device_ratio": 8}),
    ],
    ids=["tp2", "dp-attention", "tp2-hisparse"],
)
def test_a_restart_across_ranks_reads_the_l3_store(models, tmp_path, parallel):
    """Under TP rank 0 alone reads stored pages into its pool and gives them to the other
    ranks' replicas as it writes them: without that, rank 1 attends over pages it never got
    and the tokens differ from the cold run's. Under DP attention each rank has a tier."""
    prompt = _prompts(1, seed=7, lo=150, hi=150)  # 9 full pages of 16 + 6 tokens
    store = dict(parallel, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path))
    runs = []
    for _ in range(2):
        model = models["glm-sparse" if "enable_hisparse" in parallel else "glm"]
        with LLM(model, **{**EXACT, "num_pages": 48, **store}) as llm:
            tokens = llm.generate(prompt, GREEDY)[0].token_ids
            llm.engine.check_integrity()
            runs.append((tokens, llm.engine.counters()))
    (cold, first), (warm, second) = runs
    assert warm == cold
    # (the finished request's pages are stored too: 173 tokens fill 10)
    assert first["l3_hits"] == 0 and len(list(tmp_path.glob("*/*.kv"))) == 10
    assert second["l3_hits"] == 9 and second["prefix_hit_tokens"] == 9 * 16
    assert second["computed_tokens"] == 150 - 9 * 16 + GREEDY.max_tokens - 1


def test_the_other_ranks_take_the_leaders_heartbeat():
    """Rank 0's leader says NOOP after a quiet while (a quarter of the group's timeout, 30 s
    by default) so the other ranks' waits never time out; their loop must take it (it read
    every message as (kind, host copies, ...): an idle `serve --tp 2` died in 30 s)."""
    from types import SimpleNamespace

    from dsakv.distributed.leader import NOOP, STOP
    from dsakv.engine.model_runner import ModelRunner

    said = iter([NOOP, NOOP, STOP])
    rank1 = SimpleNamespace(parallel=SimpleNamespace(broadcast_object=lambda: next(said)))
    ModelRunner.serve(rank1)
    assert next(said, None) is None  # (it read up to the STOP)


def test_sparse_config_agreement(models, reference):
    """index_topk 16 < context: TP changes reduction order, so a near-tie in the indexer can
    pick another row. Measured: every token agreed on this workload."""
    prompts, ref = reference
    tokens, _ = _generate(models["glm-sparse"], prompts, tp=2)
    pairs = [(a, b) for x, y in zip(tokens, ref["glm-sparse"]) for a, b in zip(x, y)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    print(f"tp=2 vs tp=1 greedy token agreement, index_topk 16: {agree:.4f}")
    assert agree >= 0.9, agree


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "3"], "num_attention_heads (4) is not divisible by --tp (3)"),
        (["--tp", "2", "--ep", "4"], "--ep 4 is larger than --tp 2"),
        (["--dp-attention"], "--dp-attention needs --tp N"),
        (["--tp", "2", "--ep", "3"], "larger than --tp"),
        (["--tp", "2", "--dist-init-addr", "127.0.0.1:99999"], "port 1..65535"),  # (traceback)
        (["--tp", "2", "--dist-init-addr", "127.0.0.1:0"], "port 1..65535"),  # (hung)
        (["--tp", "2", "--nnodes", "2"], "--nnodes > 1 needs --dist-init-addr HOST:PORT"),
    ],
)
def test_bad_parallel_flags_are_one_error_line(models, flags, message, capsys):
    """(Refused before any rank starts: in this process.)"""
    line = cli_error_line(["generate", models["glm"], "--prompt", "hi", *flags], capsys)
    assert message in line


def test_a_budget_every_rank_refuses_is_one_error_line(models):
    """Found by every rank after spawning: rank 1 printed it too, and the watchdog a line
    (a process of its own: what its ranks and its logging write reach its stderr)."""
    flags = ["--tp", "2", "--kv-budget-gib", "0.000001"]
    r = subprocess.run(
        [sys.executable, "-m", "dsakv.cli", "generate", models["glm"], "--prompt", "hi", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "the KV budget holds less than one page" in lines[0], r.stderr


def test_a_dist_init_addr_in_use_is_one_error_line(models):
    """This node hosts rank 0's rendezvous on --dist-init-addr's port: one in use was rank
    0's EADDRINUSE after every rank had started, under rank 1's C++ stacks from pinging
    what held the port (exit 1). Now it is checked first, as a busy --port is."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        addr = f"127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "dsakv.cli", "generate", models["glm"], "--prompt", "hi"]
        r = subprocess.run(
            [*cmd, "--tp", "2", "--dist-init-addr", addr],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: --dist-init-addr {addr}: rank 0's rendezvous cannot ")
    assert f":{port}: Address already in use" in lines[0]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _ranks(pid: int) -> list[int]:
    """The rank processes `pid` started (children of its forkserver), by their name."""
    ranks, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            todo.append(child)
            with contextlib.suppress(FileNotFoundError):
                if Path(f"/proc/{child}/comm").read_text().startswith("dsakv-rank"):
                    ranks.append(child)
    return ranks


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def test_serve_tp2_answers_openai_and_dies_cleanly_with_a_rank(models):
    import httpx
    from openai import OpenAI

    port = free_port()
    cmd = [sys.executable, "-m", "dsakv.cli", "serve", models["glm"], "--port", str(port)]
    cmd += ["--tp", "2", "--num-pages", "32", "--kv-cache-dtype", "fp32"]
    cmd += ["--index-k-dtype", "fp32", "--device", "cpu"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("server did not come up: " + server.stderr.read())
        client = OpenAI(base_url=f"{base}/v1", api_key="x")
        with LLM(models["glm"], **EXACT, num_pages=32) as llm:
            want = llm.generate("The sky", SamplingParams(max_tokens=8, temperature=0)).pop()
        got = client.completions.create(model="glm", prompt="The sky", max_tokens=8, temperature=0)
        assert got.choices[0].text == want.text
        chat = client.chat.completions.create(
            model="glm", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0
        )
        m = chat.choices[0].message  # (the tiny GLM thinks first, as GLM-5)
        assert (m.content or "") + (getattr(m, "reasoning_content", None) or "")
        stream = client.completions.create(
            model="glm", prompt="The sky", max_tokens=8, temperature=0, stream=True
        )
        assert "".join(c.choices[0].text for c in stream) == want.text
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert "dsakv_" in metrics

        rank1 = _ranks(server.pid)
        children = _children(server.pid) + rank1  # (the forkserver and resource tracker too)
        assert len(rank1) == 1, children
        os.kill(rank1[0], signal.SIGKILL)
        code = server.wait(timeout=60)
        err = server.stderr.read()
        assert code != 0
        assert "rank 1 died (signal 9, SIGKILL)" in err, err
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in children), "orphaned rank processes"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_rank_killed_while_serve_starts_is_one_error_line(models):
    """kill -9 of rank 1 while `dsakv serve --tp 2` starts: exit 1 and one line saying so
    (it was exit 2, the code for bad input, blaming a missing `if __name__ == "__main__":`
    guard, which the CLI has)."""
    cmd = [sys.executable, "-m", "dsakv.cli", "serve", models["glm"], "--port", str(free_port())]
    cmd += ["--tp", "2", "--num-pages", "32", "--device", "cpu"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        rank1: list[int] = []
        while not rank1 and time.monotonic() < deadline and server.poll() is None:
            rank1 = _ranks(server.pid)
            time.sleep(0.02)
        assert rank1, "rank 1 was not started"
        os.kill(rank1[0], signal.SIGKILL)
        out, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    lines = err.strip().splitlines()
    assert server.returncode == 1 and len(lines) == 1, err
    assert lines[0] == "error: rank 1 died during startup (signal 9, SIGKILL)", err
    assert "serving" not in out


def _generate_cli(model: str, *extra: str, env: dict | None = None) -> list[str]:
    return [
        sys.executable, "-m", "dsakv.cli", "generate", model, "--prompt", "The sky",
        "--max-tokens", "6", "--json", "--num-pages", "16", "--kv-cache-dtype", "fp32",
        "--index-k-dtype", "fp32", "--device", "cpu", *extra,
    ]  # fmt: skip


def test_two_nodes_on_one_machine_and_torchrun(models):
    """`--nnodes 2 --node-rank K --dist-init-addr` (one rank per "node"), and torchrun's
    environment, give the one-rank output; every process exits 0."""
    import json

    want = subprocess.run(_generate_cli(models["glm"]), capture_output=True, text=True)
    assert want.returncode == 0, want.stderr
    expected = json.loads(want.stdout)[0]["token_ids"]

    addr = f"127.0.0.1:{free_port()}"
    nodes = [
        subprocess.Popen(
            _generate_cli(
                models["glm"], "--tp", "2", "--nnodes", "2", "--node-rank", str(k),
                "--dist-init-addr", addr,
            ),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for k in (0, 1)
    ]  # fmt: skip
    outs = [p.communicate(timeout=180) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [o[1] for o in outs]
    assert json.loads(outs[0][0])[0]["token_ids"] == expected
    assert outs[1][0] == ""  # node 1 only follows

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(free_port()), "-m", "dsakv.cli"]
    r = subprocess.run(
        torchrun + _generate_cli(models["glm"], "--tp", "2")[3:],
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)[0]["token_ids"] == expected


def test_llm_tp2_in_a_script_with_and_without_a_main_guard(models, tmp_path):
    """Spawned ranks re-run the script's top level: without an `if __name__ == "__main__"`
    guard rank 1 dies at once and rank 0 waited for it forever; now that is an error saying
    why. With the guard the run is clean: no rank leaves a semaphore behind (tqdm's lock in
    ranks that end with os._exit made the resource tracker warn at every exit). A script
    read from stdin is refused before any rank starts."""
    body = f"with LLM({models['glm']!r}, tp=2, **{EXACT!r}) as llm:\n"
    body += "    print(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].token_ids)\n"
    head = "from dsakv import LLM, SamplingParams\n"
    runs = {}
    for name, text in {
        "bare": head + body,
        "guarded": head + "if __name__ == '__main__':\n" + textwrap.indent(body, "    "),
    }.items():
        (tmp_path / f"{name}.py").write_text(text)
        runs[name] = subprocess.run([sys.executable, f"{name}.py"], cwd=tmp_path,
                                    capture_output=True, text=True, timeout=240)  # fmt: skip
    bare, guarded = runs["bare"], runs["guarded"]
    assert bare.returncode != 0 and "__main__" in bare.stderr.strip().splitlines()[-1]
    assert "bootstrapping phase" not in bare.stderr  # rank 1 leaves without a traceback
    assert guarded.returncode == 0 and len(eval(guarded.stdout)) == 4, guarded.stderr
    assert "leaked" not in guarded.stderr, guarded.stderr
    # Read from stdin (`python - < guarded.py`) rank 1 could not import it: "rank 1 exited
    # with code 1 during startup", the cause only in its traceback; now one error, at once.
    piped = subprocess.run([sys.executable, "-"], input=(tmp_path / "guarded.py").read_text(),
                           cwd=tmp_path, capture_output=True, text=True, timeout=240)  # fmt: skip
    last = piped.stderr.strip().splitlines()[-1]
    assert piped.returncode == 1 and "was read from standard input: save it to a file" in last
    assert "Process" not in piped.stderr  # (no rank started)


def test_an_llm_left_open_still_lets_the_script_exit(models, tmp_path):
    """`LLM(tp=2)` never closed: the interpreter's exit hung forever (multiprocessing joined
    rank 1, which waited for rank 0). A closed one refuses to generate, with a reason (it
    raised torch's "Default process group has not been initialized"). A second multi-rank
    `LLM` while one is open is refused before it spawns a rank (it spawned its ranks, then
    died in torch's `init_process_group`, "initialize the default process group twice");
    the open one still generates, and after a close a new one starts."""
    script = f"""import multiprocessing as mp
from dsakv import LLM, SamplingParams
from dsakv.errors import DsakvError
if __name__ == "__main__":
    closed = LLM({models["glm"]!r}, tp=2, **{EXACT!r})
    closed.close()
    try:
        closed.generate([[1, 2, 3]])
    except DsakvError as e:
        print("refused:", e)
    llm = LLM({models["glm"]!r}, tp=2, **{EXACT!r})
    ranks = len(mp.active_children())
    try:
        LLM({models["glm"]!r}, tp=2, dp_attention=True, **{EXACT!r})
    except DsakvError as e:
        print("second:", e, len(mp.active_children()) == ranks)
    print(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].token_ids)
"""
    (tmp_path / "left_open.py").write_text(script)
    r = subprocess.run([sys.executable, "left_open.py"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=240)  # fmt: skip
    assert r.returncode == 0, r.stderr
    refused, second, tokens = r.stdout.strip().splitlines()
    assert refused == "refused: this LLM was closed; make a new one"
    assert second == (
        "second: one multi-rank engine per process: close the other first "
        "(`with LLM(...) as llm:` or `llm.close()`) True"
    )
    assert len(eval(tokens)) == 4


def test_dp_attention_carries_grammar_and_prompt_logprobs(models):
    """Requests that run on rank 1 come back with their prompt logprobs and their
    grammar-constrained tokens as on one rank; a bad grammar is refused on rank 0 before
    any rank sees it, and the engine keeps serving. Seeded samples are the one-rank ones
    while unseeded choices differ across ranks (each rank's generator started from one
    seed: n=2 gave two copies), and rank 1's TTFT counts from arrival on rank 0."""
    import json

    from dsakv.errors import DsakvError

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = SamplingParams(
        max_tokens=16, temperature=0, grammar=("json_schema", json.dumps(schema)),
        prompt_logprobs=1,
    )  # fmt: skip
    prompts = _prompts(4, seed=3)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True)
    results, seeded = {}, {}
    for name, kw in (("one", {}), ("dp", {"tp": 2, "dp_attention": True})):
        with LLM(models["glm"], **EXACT, num_pages=48, **kw) as llm:
            for _ in range(3):  # (a lone surrogate: the tokenizer's TypeError, a 500)
                with pytest.raises(DsakvError, match="bad_words"):
                    llm.engine.add_request([1, 2], SamplingParams(bad_words=["\ud800"]))
            if kw:
                with pytest.raises(DsakvError):
                    llm.engine.add_request([1, 2], SamplingParams(grammar=("json_schema", "{")))
                for _ in range(3):  # (routed to rank 1 unchecked, it ended that rank's loop)
                    with pytest.raises(DsakvError, match="stop_token_ids"):
                        llm.engine.add_request([1, 2], SamplingParams(stop_token_ids=(10**6,)))
                engine = llm.engine
                assert engine._assigned_tokens == [0, 0]  # (refused: not routing weight)
                (a, b) = llm.generate([prompts[0]], sampled)[0].outputs
                assert a.token_ids != b.token_ids  # one choice per rank
                reqs = [engine.add_request(p, GREEDY) for p in prompts[:2]]
                assert len(engine._adds) == 1  # one of them on rank 1
                time.sleep(0.3)  # queued before the step that starts both
                engine.step()
                assert all(r.metrics.ttft >= 0.3 for r in reqs), [r.metrics.ttft for r in reqs]
                for r in reqs:
                    engine.abort(r.rid)
            seeded[name] = [
                [c.token_ids for c in o.outputs]
                for o in llm.generate(prompts[:2], replace(sampled, seed=5))
            ]
            outs = llm.generate(prompts, params)
            if kw:
                ranks = _rank_counters(engine)
                assert all(c["finished_requests"] > 0 for c in ranks)
                assert engine.counters()["steps"] == ranks[0]["steps"] == ranks[1]["steps"]
                # A grammar with no way on ends its request alone, on either rank, with
                # its error (rank 1's reached rank 0 without it).
                dead = SamplingParams(max_tokens=8, temperature=0, grammar=("regex", r"ab[^\s\S]"))
                for o in llm.generate(prompts[:2], dead):
                    assert o.finish_reason == "error" and "cannot be completed" in o.error
        results[name] = [
            (o.token_ids, flat_logprobs(o.prompt_logprobs, o.prompt_token_ids)) for o in outs
        ]
    assert seeded["dp"] == seeded["one"]
    for (tok_dp, lp_dp), (tok_one, lp_one) in zip(results["dp"], results["one"]):
        assert tok_dp == tok_one
        assert lp_dp[0] is None and lp_one[0] is None
        # Another batch on each rank sums in another order: equal to float noise.
        assert lp_dp[1:] == pytest.approx(lp_one[1:], abs=1e-4)


def test_dp_attention_delivers_an_abort_while_nothing_else_runs(models):
    """An abort of a request on rank 1 is queued for the next step; with nothing else left
    the engine must still say it has work (a server steps only then), or rank 1 kept the
    request and its pages until another request came. `max_running_requests` caps the
    server, not each rank (SGLang divides it by dp_size): 2 ran 4 on two ranks."""
    from dsakv.engine.config import EngineConfig
    from dsakv.errors import DsakvError

    with pytest.raises(DsakvError, match="less than one request per rank"):
        EngineConfig(models["glm"], tp=2, dp_attention=True, max_running_requests=1)
    kw = dict(num_pages=48, tp=2, dp_attention=True, max_running_requests=2)
    with LLM(models["glm"], **EXACT, **kw) as llm:
        e = llm.engine
        long = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)
        reqs = [e.add_request(p, long) for p in _prompts(4, seed=7)]
        for _ in range(3):
            e.step()
        assert [c["running_requests"] for c in _rank_counters(e)] == [1, 1]
        assert e.counters()["waiting_requests"] == 2
        remote = [r for r in reqs if r.rid in e._remote]
        for r in remote:
            e.abort(r.rid)
        assert remote and e.has_unfinished()  # the abort still has to reach rank 1
        e.step()
        rank1 = _rank_counters(e)[1]
        assert rank1["running_requests"] == 0 and rank1["pages_used"] == rank1["pages_cached"]
        # Rank 0's own abort frees its request with no step after it: the gauges say so
        # (they summed rank 0's last report, a running request, until the next request).
        before = e.counters()["aborted_requests"]
        for r in reqs:
            e.abort(r.rid)
        assert not e.has_unfinished()
        c = e.counters()
        assert (c["running_requests"], c["waiting_requests"]) == (0, 0)
        assert c["pages_used"] == c["pages_cached"]
        assert c["aborted_requests"] - before == len(reqs) - len(remote) > 0
        assert all(r.finish_reason == "abort" for r in reqs)


def _sleep_on_rank(engine, kept, seconds: float) -> float:
    """A call a rank runs on a thread of its own (as a PD prefill server's KV write)."""
    time.sleep(seconds)
    return seconds


def test_dp_attention_paused_collects_a_ranks_call_before_an_update(models):
    """A rank's call that ends while generation is paused (no step brings its outcome)
    keeps neither a cache flush nor a weight update off: rank 0 asks for it."""
    with LLM(models["glm"], **EXACT, num_pages=48, tp=2, dp_attention=True) as llm:
        e = llm.engine
        call = e.on_rank_later(1, 7, _sleep_on_rank, 0.2)
        e.paused = True
        deadline = time.monotonic() + 60
        while not e.flush_cache():
            assert time.monotonic() < deadline, "the paused engine stayed busy"
            time.sleep(0.05)
        assert call.result(timeout=0) == 0.2
        assert e.update_weights(models["glm"])
        e.paused = False


@pytest.mark.parametrize("host", [None, 0.01], ids=["recompute", "host-tier"])
def test_dp_attention_pause_retract_frees_every_ranks_pages(models, reference, host):
    """SGLang's pause "retract" under DP attention (it was refused): every rank gives back
    the pages of the requests it schedules, which then compute their KV again, or reload it
    from the rank's host tier: greedy tokens are the one-rank ones. While so paused, with
    nothing running on any rank, /flush_cache drops every rank's prefix cache (it was
    refused too)."""
    prompts, ref = reference
    kw = dict(num_pages=48, tp=2, dp_attention=True, host_pool_gib=host or 0)
    with LLM(models["glm"], **EXACT, **kw) as llm:
        e = llm.engine
        reqs = [e.add_request(p, GREEDY) for p in prompts]
        for _ in range(4):
            e.step()
        running = [c["running_requests"] for c in _rank_counters(e)]
        assert all(n > 0 for n in running)
        e.retract_all()
        e.paused = True  # (the server's /pause_generation "retract")
        assert not e.local.scheduler.running and len(e.local.scheduler.waiting) == running[0]
        e._on_rank(None, "poll")  # (the other ranks' loads now)
        assert all(c["pages_cached"] > 0 for c in e.rank_counters())
        assert e.flush_cache()
        e._on_rank(None, "poll")
        assert [c["pages_cached"] for c in e.rank_counters()] == [0, 0]
        e.paused = False
        while e.has_unfinished():
            e.step()
        e.check_integrity()
        per_rank = _rank_counters(e)
        assert [c["retractions"] for c in per_rank] == running
        if host:
            assert [c["retractions_to_host"] for c in per_rank] == running
    assert [r.output_ids for r in reqs] == ref["glm"]


def _paused_update(llm: LLM, prompts, source: str) -> tuple[list[list[int]], list[int]]:
    """Each prompt's greedy tokens with `source`'s weights loaded after a few steps, under
    the requests paused in place, with the second one aborted and two more added meanwhile
    (the aborted one's tokens left out, the added ones' last); each one's output length
    when paused."""
    e = llm.engine
    reqs = [e.add_request(p, GREEDY) for p in prompts]
    for _ in range(4):
        e.step()
    e.paused = True  # (the server's /pause_generation in place)
    assert e.flush_cache() is False  # (they hold their KV)
    gone = reqs.pop(1)
    at = [len(r.output_ids) for r in reqs]
    e.abort(gone.rid)
    reqs += [e.add_request(p, GREEDY) for p in _prompts(2, seed=5)]
    if e.parallel.world_size > 1:  # (each rank runs some; rank 1's abort and add wait)
        assert all(c["running_requests"] > 0 for c in _rank_counters(e))
        assert e._aborts and e._adds
    assert e.update_weights(source)
    e.paused = False
    while e.has_unfinished():
        e.step()
    e.check_integrity()
    assert gone.finish_reason == "abort"
    return [r.output_ids for r in reqs], at


def test_dp_attention_updates_weights_under_requests_paused_in_place(models, reference, tmp_path):
    """A weight update under requests paused in place on both ranks (it was refused): every
    rank loads it under its own, with an abort and an add queued for rank 1 meanwhile (they
    reach it with the step after); the same checkpoint keeps the one-rank tokens, another
    one's are those of a one-rank engine updated at the same step."""
    prompts, ref = reference
    other = str(write_tiny_model(tmp_path / "glm-1", _dense_topk("glm-tiny"), seed=1))
    kw = dict(num_pages=48, tp=2, dp_attention=True)
    with LLM(models["glm"], **EXACT, **kw) as llm:
        same, _ = _paused_update(llm, prompts, models["glm"])
        assert same[:5] == ref["glm"][:1] + ref["glm"][2:]
        assert llm.engine.flush_cache()  # (the same prompts' prefix hits would change steps)
        tokens, at = _paused_update(llm, prompts, other)
    with LLM(models["glm"], **EXACT, num_pages=48) as one:
        want, one_at = _paused_update(one, prompts, other)
    assert at == one_at and tokens == want
    assert all(0 < n < GREEDY.max_tokens for n in at)
    for t, r, n in zip(tokens, ref["glm"][:1] + ref["glm"][2:], at):
        assert t[:n] == r[:n] and t != r  # (each went on with the new weights, every rank)


@pytest.mark.parametrize(
    "parallel", [dict(tp=2), dict(tp=2, dp_attention=True)], ids=["tp2", "dp-attention"]
)
def test_mtp_across_ranks_keeps_greedy_tokens(models, reference, parallel):
    """The draft layer is sharded like the target's layers and its forwards go to every
    rank (in lockstep under DP attention); greedy tokens stay the one-rank tokens."""
    prompts, ref = reference
    tokens, counters = _generate(models["glm"], prompts, speculative_algorithm="mtp", **parallel)
    assert tokens == ref["glm"]
    assert counters["spec_verify_steps"] > 0


def _in_own_group(cmd: list[str], **kw) -> subprocess.Popen:
    """`cmd` as a terminal's foreground job: a process group of its own (which the signals
    below reach as a whole) and SIGINT's default action."""

    def setup() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.setpgrp()

    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=setup, **kw)  # fmt: skip


def test_ctrl_c_to_the_group_during_llm_generate(models, tmp_path):
    """A terminal's Ctrl-C reaches every process of the job, the spawned rank too: it killed
    rank 1, and generate raised gloo's "Connection closed by peer", not KeyboardInterrupt,
    leaving the LLM dead. Now rank 1 ignores it; the call is interrupted after its step and
    the LLM generates again."""
    script = f"""import os, signal, threading
from dsakv import LLM, SamplingParams
if __name__ == "__main__":
    greedy = SamplingParams(max_tokens=2, temperature=0)
    with LLM({models["glm"]!r}, tp=2, **{EXACT!r}) as llm:
        print(llm.generate([[1, 2, 3]], greedy)[0].token_ids, flush=True)
        threading.Timer(0.5, os.killpg, (os.getpgrp(), signal.SIGINT)).start()
        try:
            llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=5000, ignore_eos=True))
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        print(llm.generate([[1, 2, 3]], greedy)[0].token_ids)
"""
    (tmp_path / "ctrl_c.py").write_text(script)
    proc = _in_own_group([sys.executable, "ctrl_c.py"], cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err
    first, interrupted, again = out.strip().splitlines()
    assert interrupted == "interrupted" and again == first, out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_tp2_stops_cleanly_on_a_signal_to_the_group(models, sig):
    """Ctrl-C, `timeout`, systemd's KillMode=control-group signal every process of the job:
    the rank 1 they killed made it 'rank 1 died (signal 15, SIGTERM)' or a gloo error, exit 1.
    Now `dsakv serve --tp 2` stops as with one rank: exit 130 / 143, no error line."""
    cmd = [sys.executable, "-m", "dsakv.cli", "serve", models["glm"], "--port", str(free_port())]
    server = _in_own_group(cmd + ["--tp", "2", "--num-pages", "32", "--device", "cpu"])
    try:
        for line in server.stdout:
            if "serving" in line:
                break
        os.killpg(server.pid, sig)
        _, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert server.returncode == 128 + sig, err
    assert "rank" not in err and "error" not in err, err


# Imported by every process that has `tmp_path` on its path, a forkserver and its ranks too:
# rank 1 is the one that dies.
JOIN_KILLS_RANK1 = """import multiprocessing, os, signal
import torch.distributed as dist
join = dist.init_process_group

def dying(*args, **kw):
    if multiprocessing.current_process().name == "dsakv-rank1":
        os.kill(os.getpid(), signal.SIGKILL)
    return join(*args, **kw)

dist.init_process_group = dying
"""


def test_a_rank_dying_before_the_group_forms_fails_at_once(models, tmp_path):
    """Rank 1 killed as it joins torch.distributed's group (the OOM killer, a crash): rank 0
    waited in the rendezvous for the whole 120 s timeout. Now `LLM(tp=2)` raises RankDied
    and the CLI (here `--pp-size 2`) says so in one line, exit 1, within seconds."""
    (tmp_path / "sitecustomize.py").write_text(JOIN_KILLS_RANK1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    script = f"""import sys
from dsakv import LLM
from dsakv.engine.launch import RankDied
if __name__ == "__main__":
    try:
        LLM({models["glm"]!r}, tp=2, **{EXACT!r})
    except RankDied as e:
        print(e)
"""
    (tmp_path / "dies.py").write_text(script)
    lib = subprocess.run([sys.executable, "dies.py"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert lib.stdout.strip() == "rank 1 died during startup (signal 9, SIGKILL)", lib.stderr
    # (Under --pp-size a rank is named with its stage, which holds layers of its own.)
    cli = subprocess.run(_generate_cli(models["glm"], "--pp-size", "2"), env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert cli.returncode == 1, cli.stderr
    assert cli.stderr.strip() == "error: rank 1 (stage 1) died during startup (signal 9, SIGKILL)"


def test_a_rank_whose_launcher_is_gone_exits_quietly():
    """SIGTERM to the launcher while rank 1 starts: rank 1's hello to it met a closed pipe,
    a 15-line BrokenPipeError traceback. Now it leaves without a word."""
    script = """import multiprocessing as mp, os
from dsakv.engine.launch import _Inherited, _rank_main, _Stdio
if __name__ == "__main__":
    ctx = mp.get_context("forkserver")
    recv, send = ctx.Pipe(duplex=False)
    recv.close()  # the launcher's end: gone
    args = (None, 1, "tcp://127.0.0.1:1", send, _Inherited(dict(os.environ), None), _Stdio())
    rank = ctx.Process(target=_rank_main, args=args)
    rank.start()
    rank.join()
    print(rank.exitcode)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert r.stdout == "1\n" and r.stderr == "", r.stderr


def test_closing_a_multi_rank_llm_puts_back_the_excepthook(models):
    """torch's process group wraps sys.excepthook ("[rank0]: " before each line); it was
    never put back, so each LLM(tp=2) made in a process added one more prefix. With a rank
    killed, generate raised gloo's error and so did close, which never gave back the
    process's one multi-rank engine: no LLM(tp=2) could be made in it again."""
    import multiprocessing as mp

    from dsakv.engine.launch import RankDied

    before = sys.excepthook
    for kill in (True, False):
        with LLM(models["glm"], **EXACT, num_pages=16, tp=2) as llm:
            assert sys.excepthook is not before  # (torch's, while the group lives)
            if kill:
                (rank1,) = [p for p in mp.active_children() if p.name == "dsakv-rank1"]
                os.kill(rank1.pid, signal.SIGKILL)
                rank1.join(10)
                with pytest.raises(RankDied, match="this engine cannot run"):
                    llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert sys.excepthook is before


FAULT = """
import multiprocessing
from dsakv.engine.model_runner import ModelRunner

forward = ModelRunner._forward

def failing(self, *args, **kw):
    if multiprocessing.current_process().name == "dsakv-rank1":
        raise ValueError("a fault injected on rank 1")
    return forward(self, *args, **kw)

ModelRunner._forward = failing
"""


def test_a_rank_raising_in_a_step_is_named_with_its_error(models, tmp_path):
    """Rank 1 raising in a step broke rank 0's collective as it exited, a poll before the
    launcher's watch saw the exit: generate raised gloo's "Connection closed by peer", and
    the rank's own error was never shown. (The fault: a sitecustomize, which a script's
    forkserver imports, and so its ranks.)"""
    (tmp_path / "sitecustomize.py").write_text(FAULT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    script = f"""from dsakv import LLM
from dsakv.engine.launch import RankDied
if __name__ == "__main__":
    with LLM({models["glm"]!r}, num_pages=16, tp=2, **{EXACT!r}) as llm:
        try:
            llm.generate([[1, 2, 3]], use_tqdm=False)
        except RankDied as e:
            print(e)
"""
    (tmp_path / "fault.py").write_text(script)
    r = subprocess.run([sys.executable, "fault.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert "rank 1 failed: ValueError: a fault injected on rank 1" in r.stdout, r.stderr


SAYS_ENV = """
import multiprocessing, os, sys
from dsakv.engine.model_runner import ModelRunner

forward = ModelRunner._forward

def saying(self, *args, **kw):
    if multiprocessing.current_process().name == "dsakv-rank1":
        print("rank 1 sees", os.environ.get("DSAKV_TEST_MARK"), _state(), file=sys.stderr,
              flush=True)  # fmt: skip
    return forward(self, *args, **kw)


def _state():
    import resource

    umask = os.umask(0)
    os.umask(umask)
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return f"umask {umask:o} nofile {nofile} nice {os.nice(0)} cpus {sorted(os.sched_getaffinity(0))}"

ModelRunner._forward = saying
"""


def test_a_rank_takes_the_launchers_state_and_the_users_forkserver_keeps_its_own(models, tmp_path):
    """The forkserver a process's first multi-rank engine starts keeps the environment, stderr,
    umask, CPU affinity, resource limits and niceness it was started with (under pytest,
    stderr is a finished test's capture); the ranks of a later engine must see the
    launcher's as they are when they start. The ranks' forkserver was multiprocessing's
    shared one: the user's own forkserver children after an engine had SIGINT and SIGTERM
    blocked (`terminate()` did nothing, a Pool's exit hung) and lost the user's preloads."""
    (tmp_path / "sitecustomize.py").write_text(SAYS_ENV)
    (tmp_path / "users_preload.py").write_text("")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    script = f"""import multiprocessing as mp, os, resource, signal, sys
from dsakv import LLM

def report():
    blocked = sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))
    print("user's child blocks", blocked, "preloaded", "users_preload" in sys.modules)

if __name__ == "__main__":
    users = mp.get_context("forkserver")
    users.set_forkserver_preload(["users_preload"])
    LLM({models["glm"]!r}, num_pages=16, tp=2, **{EXACT!r}).close()  # (starts the forkserver)
    os.environ["DSAKV_TEST_MARK"] = "later"
    os.umask(0o027)
    resource.setrlimit(resource.RLIMIT_NOFILE, (1000, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    os.nice(1)
    os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
    saved = os.dup(2)
    os.dup2(os.open("later.err", os.O_WRONLY | os.O_CREAT), 2)
    with LLM({models["glm"]!r}, num_pages=16, tp=2, **{EXACT!r}) as llm:
        llm.generate([[1, 2, 3]], use_tqdm=False)
    os.dup2(saved, 2)
    child = users.Process(target=report)
    child.start()
    child.join()
"""
    (tmp_path / "later.py").write_text(script)
    r = subprocess.run([sys.executable, "later.py"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "rank 1 sees" not in r.stderr, r.stderr
    cpu = min(os.sched_getaffinity(0))
    want = f"rank 1 sees later umask 27 nofile 1000 nice {os.nice(0) + 1} cpus [{cpu}]"
    assert want in (tmp_path / "later.err").read_text()
    assert r.stdout.strip() == "user's child blocks [] preloaded True"


def test_a_request_a_dp_peer_cannot_start_ends_alone(models):
    """Rank 0 checks a request before a peer gets it (`Engine.check_request`); one that
    fails on the peer anyway (here: sent unchecked) ends with its error instead of ending
    that rank's loop, and with it every rank. (One rank's engine stands in for the peer.)"""
    from dsakv.engine.dp import _Reporter

    with LLM(models["glm"], **EXACT, num_pages=16) as llm:
        peer = _Reporter(llm.engine)
        bad = SamplingParams(max_tokens=2, bad_words=["\ud800"])
        peer.apply(("step", [(0, 10**9, [1, 2, 3], bad), (0, 10**9 + 1, [1, 2], GREEDY)], [], []))
        report = peer.report(llm.engine.step())
        (up,) = [u for u in report.updates if u["rid"] == 10**9]
        assert up["finish_reason"] == "error" and "bad_words" in up["error"], up
        assert [u["rid"] for u in report.updates] == [10**9, 10**9 + 1]
