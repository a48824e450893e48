"""Prefill/decode disaggregation under `--tp 2`: a prefill server sends rank 0's pool (every
rank's is a replica), and a decode server gives the pages it was written (under HiSparse: the
index-K pages and host latent rows) to every rank's replica as the request starts decoding
(`ModelRunner.share_kv`). Without that share rank 1 attends over pages it never received, so
the outputs below differ from one `dsakv serve --tp 2`'s.

glm-tiny is sparse (index_topk 16); with host_to_device_ratio 8 a HiSparse buffer holds 32
tokens, so the longer prompts miss. fp32 caches and one request at a time (the same schedule
as the single server's: TP's torch path is not batch-invariant) make outputs bit-equal. Every
test sends prompts of its own, so no prefix hit changes a schedule."""

from __future__ import annotations

import random
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from dsakv.models.tiny import write_tiny_model

from .conftest import cli_error_line
from .serving import (
    TIMEOUT,
    ServerProcess,
    routing,
    scrape_metrics,
    servers_at_once,
    start_decode,
    start_prefill,
    wait_idle,
)
from .test_vllm_pd import prefill_first, then_decode

EXACT = ["--kv-cache-dtype", "fp32", "--index-k-dtype", "fp32", "--page-size", "8"]
FLAGS = [*EXACT, "--num-pages", "64", "--device", "cpu"]
TP2 = ["--tp", "2"]
HISPARSE = ["--enable-hisparse", "--hisparse-config", '{"host_to_device_ratio": 8}']
GREEDY = {"temperature": 0, "ignore_eos": True, "max_tokens": 12}
# One rank on the CPU runs the per-token path by default, two ranks the batched one: KV of
# other bits, which a decode server refuses ("different KV layouts: compute").
TP1_AS_TP2 = ["--disable-deterministic-inference"]
START_S = 240  # (eleven processes load at once on a small machine)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random token ids of these lengths (a seed per test: no prompt is another's prefix)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 250) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_model(tmp_path_factory.mktemp("glm-tiny"), preset="glm-tiny", seed=0))


@pytest.fixture(scope="module")
def servers(tiny, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """Prefill servers at --tp 2 and --tp 1 (computing as two ranks do), decode servers at
    --tp 2 without and with HiSparse, and one `dsakv serve --tp 2` as reference (HiSparse's
    equal to it one request at a time: tests/test_hisparse_tp.py); all start at once, so
    their loads overlap."""
    root = tmp_path_factory.mktemp("disagg_tp")
    procs: dict[str, ServerProcess] = {}
    with servers_at_once(procs, START_S) as healthy:
        procs["prefill"], _ = start_prefill(root, "prefill", tiny, *FLAGS, *TP2)
        procs["prefill_tp1"], _ = start_prefill(root, "prefill_tp1", tiny, *FLAGS, *TP1_AS_TP2)
        procs["decode"] = start_decode(root, "decode", tiny, *FLAGS, *TP2)
        procs["decode_hs"] = start_decode(root, "decode_hs", tiny, *FLAGS, *TP2, *HISPARSE)
        procs["plain"] = ServerProcess(root, "plain", tiny, *FLAGS, *TP2)
        yield healthy()


def _greedy(base: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy token ids and their logprobs, one request at a time."""
    out = []
    for prompt in prompts:
        body = {"model": "m", "prompt": prompt, "logprobs": 0, "return_token_ids": True}
        r = httpx.post(f"{base}/v1/completions", json={**body, **GREEDY}, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append((choice["token_ids"], choice["logprobs"]["token_logprobs"]))
    return out


def _transferred(base: str) -> float:
    return scrape_metrics(base)["dsakv_kv_transfer_tokens_total"]


def _through_router(prefill: str, decode: str, prompts: list[list[int]]) -> list[tuple]:
    """`_greedy` through a router over one prefill and one decode server, which took every
    prompt's KV over the transfer (none of it came from a prefix hit); both end idle and
    leak-free (on the decode server: every rank's HiSparse replica alike)."""
    before = _transferred(decode)
    with routing([prefill], [decode]) as base:
        got = _greedy(base, prompts)
    assert _transferred(decode) - before == sum(map(len, prompts))
    wait_idle(prefill)
    wait_idle(decode)
    return got


# --- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_pd_still_refuses_pp_in_one_line(tiny, mode, capsys):
    flags = ["--disaggregation-mode", mode, "--pp-size", "2"]
    err = cli_error_line(["serve", tiny, "--device", "cpu", *flags], capsys)
    assert "--disaggregation-mode does not run with --pp-size > 1 yet" in err, err


# --- a PD pair against one server ---------------------------------------------------------------


def test_pd_under_tp2_equals_one_tp2_server_bit_for_bit(servers):
    """Prompts of one partial page, one whole page, several pages with a partial last one."""
    prompts = _prompts(1, [5, 8, 29, 47])
    got = _through_router(servers.prefill, servers.decode, prompts)
    assert got == _greedy(servers.plain, prompts)  # (tokens and logprobs)


def test_hisparse_decode_under_tp2_equals_one_hisparse_server(servers):
    """A --tp 2 --enable-hisparse decode server (prefill --tp 2) takes prompts past its
    32-token buffer: every rank's index-K pages and host latent rows are rank 0's, so it
    answers as one `serve --tp 2` (as `--enable-hisparse` does), and its hot buffers missed."""
    prompts = _prompts(2, [61, 90, 119])
    got = _through_router(servers.prefill, servers.decode_hs, prompts)
    assert got == _greedy(servers.plain, prompts)
    m = scrape_metrics(servers.decode_hs)
    assert m["dsakv_hisparse_misses_total"] > 0 and m["dsakv_hisparse_hot_buffers"] == 0


def test_a_tp1_prefill_server_feeds_a_tp2_decode_server(servers):
    """Every rank holds the whole MLA latent, so a --tp 1 prefill server's KV serves a
    --tp 2 decode server. The prompt's KV was computed at another TP's summation order, so
    only the tokens are compared exactly; the logprobs agree closely."""
    prompts = _prompts(3, [13, 40])
    got = _through_router(servers.prefill_tp1, servers.decode, prompts)
    want = _greedy(servers.plain, prompts)
    assert [ids for ids, _ in got] == [ids for ids, _ in want]
    for (_, lp), (_, ref) in zip(got, want, strict=True):
        assert lp == pytest.approx(ref, abs=1e-4)


# --- vLLM's P/D protocol ------------------------------------------------------------------------


def test_vllm_kv_transfer_params_carry_the_prefill_servers_tp_size(servers):
    """The prefill answer's kv_transfer_params say its real tp_size; the --tp 2 decode
    server takes either server's, and answers as the single server."""
    for prefill, tp_size, seed in ((servers.prefill, 2, 4), (servers.prefill_tp1, 1, 5)):
        (prompt,) = _prompts(seed, [21])
        body = {"model": "m", "prompt": prompt, "return_token_ids": True, **GREEDY}
        kv = prefill_first(prefill, "/v1/completions", body)["kv_transfer_params"]
        assert kv["tp_size"] == tp_size and len(kv["remote_block_ids"]) == 3
        r = then_decode(servers.decode, "/v1/completions", body, kv)
        assert r.status_code == 200, r.text
        want = httpx.post(f"{servers.plain}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.json()["choices"][0]["token_ids"] == want.json()["choices"][0]["token_ids"]
        wait_idle(prefill)
    wait_idle(servers.decode)
