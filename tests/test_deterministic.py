"""Deterministic inference (the CPU default; `--enable-deterministic-inference` requires
it): a request's tokens and logprobs are bit-identical however the engine happened to run
it (batch, chunking, cache path, threads, MTP, PD).

Every test runs the default caches (fp8_e4m3 latent, fp8 index-K), on glm-tiny as it is
(index_topk 16: sparse past 16 tokens) and, where the selection matters, on a dense copy
(index_topk above every context). With the batched path (`enable_deterministic_inference=
False`) every one of these comparisons fails: a step over 64 tokens rounds its GEMMs
otherwise, which moves fp8 bytes at rounding midpoints, logprobs, and sparse selections.
"""

from __future__ import annotations

import concurrent.futures
import copy
import random
import subprocess
import sys

import httpx
import pytest
import torch

from dsakv import LLM
from dsakv.config.presets import TINY_PRESETS
from dsakv.engine import Engine, EngineConfig, SamplingParams
from dsakv.engine import disagg as pd
from dsakv.errors import DsakvError
from dsakv.models.forward_batch import ForwardBatch
from dsakv.models.tiny import default_model_dir, write_tiny_model

from .conftest import flat_logprobs
from .serving import TIMEOUT, serving

# 1,024 pages: the context the model's positions allow (16,384 tokens) and no more (the
# default, the CPU's KV budget, is ~1.2 GB a pool: the file's engines held 17 GB at once)
DET = dict(enable_deterministic_inference=True, device="cpu", page_size=16, num_pages=1024)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=16, temperature=0.8, seed=11, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def sparse() -> str:
    """glm-tiny with its fitted MTP layer (the cached preset the other tests share)."""
    return str(default_model_dir("glm-tiny"))


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> str:
    cfg = copy.deepcopy(TINY_PRESETS["glm-tiny"])
    cfg["index_topk"] = 4096
    return str(write_tiny_model(tmp_path_factory.mktemp("dense"), cfg, seed=0, mtp="none"))


@pytest.fixture(params=["sparse", "dense"])
def model(request) -> str:
    return request.getfixturevalue(request.param)


def _engine(model: str, **kw) -> Engine:
    return Engine(EngineConfig(model=model, **{**DET, **kw}))


def _prompts(n: int, seed: int, lo: int = 5, hi: int = 120) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _run(engine: Engine, prompts, params=GREEDY, arrivals=None):
    """Every prompt's (tokens, logprobs, top logprobs); `arrivals[i]`: the step at which
    prompt i joins (default: all at once)."""
    arrivals = arrivals or [0] * len(prompts)
    reqs: dict[int, object] = {}
    step = 0
    while len(reqs) < len(prompts) or engine.has_unfinished():
        for i, at in enumerate(arrivals):
            if at <= step and i not in reqs:
                p = params[i] if isinstance(params, list) else params
                reqs[i] = engine.add_request(prompts[i], p)
        engine.step()
        step += 1
    engine.check_integrity()
    return [_out(reqs[i]) for i in range(len(prompts))]


def _out(req):
    return req.output_ids, req.logprobs, req.top_logprobs


PROBE = _prompts(1, seed=99, lo=90, hi=90)[0]


def test_pressure_case_24_of_24(model):
    """The issue's case: 24 requests sharing a 150-token prefix, greedy, on a roomy pool and
    on a 40-page pool with 32-token chunks, the prefix cache and retractions."""
    rng = random.Random(0)
    prefix = [rng.randrange(3, 250) for _ in range(150)]
    prompts = [
        prefix + [rng.randrange(3, 250) for _ in range(rng.randint(1, 30))] for _ in range(24)
    ]
    params = SamplingParams(**_kw(GREEDY, 32))
    roomy = _run(_engine(model, num_pages=400, enable_prefix_cache=False), prompts, params)
    tight = _engine(model, num_pages=40, chunked_prefill_size=32)
    got = _run(tight, prompts, params)
    c = tight.counters()
    assert c["retractions"] > 0 and c["prefix_hit_tokens"] > 0
    assert sum(a == b for a, b in zip(roomy, got)) == 24


def test_batch_size_composition_and_arrival(model):
    """A greedy and a seeded probe alone, among 31 others of other lengths, and among
    another 31 arriving over the run."""
    probes = [PROBE, PROBE[:70]]
    alone = [_run(_engine(model), [p], [par])[0] for p, par in zip(probes, (GREEDY, SEEDED))]
    others = _prompts(30, seed=1)
    mixed = _run(_engine(model), [*probes, *others], [GREEDY, SEEDED, *[GREEDY] * 30])
    assert mixed[:2] == alone
    later = _prompts(30, seed=2, hi=200)
    arrivals = [3, 7] + [random.Random(i).randrange(0, 12) for i in range(30)]
    params = [GREEDY, SEEDED] + [SEEDED if i % 2 else GREEDY for i in range(30)]
    staggered = _run(_engine(model, chunked_prefill_size=64), [*probes, *later], params, arrivals)
    assert staggered[:2] == alone


def test_chunk_sizes_and_prefill_vs_decode(model):
    """Chunks of 32 and 256 tokens and the whole prompt give one output; a token computed
    by a prefill scores exactly as the same token computed by a decode step."""
    runs = [_run(_engine(model, chunked_prefill_size=c), [PROBE])[0] for c in (32, 256, 4096)]
    assert runs[0] == runs[1] == runs[2]
    tokens, logprobs, tops = runs[0]
    # The prompt extended by the first 8 decoded tokens: those are now prefilled.
    again = _run(_engine(model), [PROBE + tokens[:8]], SamplingParams(**_kw(GREEDY, 8)))[0]
    assert again == (tokens[8:], logprobs[8:], tops[8:])


def _kw(p: SamplingParams, max_tokens: int) -> dict:
    return dict(
        max_tokens=max_tokens,
        temperature=p.temperature,
        seed=p.seed,
        ignore_eos=True,
        logprobs=p.logprobs,
    )


def test_host_tier_and_l3_tier(sparse, tmp_path):
    """Prefix KV back from the host tier, and from L3 storage in a fresh engine, gives the
    tokens of a cold run."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 250) for _ in range(96)]
    prompts = [
        prefix + [rng.randrange(3, 250) for _ in range(rng.randint(3, 20))] for _ in range(6)
    ]
    params = SamplingParams(**_kw(GREEDY, 48))
    cold = _run(_engine(sparse, enable_prefix_cache=False), prompts, params)
    host = _engine(sparse, num_pages=16, host_pool_gib=0.05, chunked_prefill_size=32)
    assert _run(host, prompts, params) == cold
    c = host.counters()
    assert c["retractions_to_host"] > 0 and c["host_bytes_to_device"] > 0
    l3 = dict(hicache_storage_backend="file", hicache_storage_dir=str(tmp_path / "l3"))
    writer = _engine(sparse, chunked_prefill_size=48, **l3)
    assert _run(writer, prompts[:1], params) == cold[:1]
    writer.close()
    reader = _engine(sparse, **l3)
    assert _run(reader, prompts[1:], params) == cold[1:]
    assert reader.counters()["l3_hit_tokens"] > 0
    reader.close()


def test_pd_matches_colocated(sparse):
    """Prefill on one engine, KV over Mooncake, decode on another: the colocated tokens and
    logprobs (the first token's logprob is the prefill side's)."""
    from dsakv.disagg.transfer import KVTransfer, PeerBuffer

    prompts = _prompts(4, seed=7, lo=20, hi=80)
    want = _run(_engine(sparse), prompts)
    prefill, decode = _engine(sparse, chunked_prefill_size=32), _engine(sparse)
    src, dst = KVTransfer(prefill.pool), KVTransfer(decode.pool)
    peer = [PeerBuffer.of(d) for d in dst.buffers]
    try:
        for p, (tokens, logprobs, _) in zip(prompts, want):
            first = prefill.add_request(p, SamplingParams(**_kw(GREEDY, 1)))
            pd.hold(prefill, first)
            while prefill.has_unfinished():
                prefill.step()
            req = pd.reserve(decode, p, GREEDY)
            src.write(dst.session, peer, first.pages, req.pages, len(p))
            pd.release_held(prefill, first)
            pd.start_decoding(decode, req, first.output_ids[0])
            while decode.has_unfinished():
                decode.step()
            assert first.logprobs == logprobs[:1]
            assert req.output_ids == tokens and req.logprobs == logprobs[1:]
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_mtp_on_and_off(sparse, params):
    """MTP's verify rows compute the logits plain decode does: same tokens and logprobs."""
    prompts, params = _prompts(6, seed=3, lo=8, hi=70), SamplingParams(**_kw(params, 40))
    off = _run(_engine(sparse), prompts, params)
    mtp = _engine(sparse, speculative_algorithm="mtp", speculative_num_steps=3)
    assert _run(mtp, prompts, params) == off
    assert mtp.counters()["spec_accepted_tokens"] > 0


def test_one_and_two_threads(sparse):
    prompts = [PROBE, *_prompts(5, seed=4)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(_engine(sparse, chunked_prefill_size=64), prompts)
        torch.set_num_threads(2)
        two = _run(_engine(sparse), prompts)
    finally:
        torch.set_num_threads(before)
    assert one == two


def test_server_probe_beside_random_traffic(sparse):
    """Through the HTTP server: one probe, alone and beside two rounds of other random
    concurrent requests, gets the same text and logprobs."""
    body = dict(model="m", prompt=PROBE, max_tokens=12, temperature=0.8, seed=5, logprobs=1)
    body["ignore_eos"] = True
    config = EngineConfig(model=sparse, **DET)
    with (
        serving(config, served_model_name="m") as (base, _),
        httpx.Client(base_url=base, timeout=TIMEOUT) as http,
    ):

        def complete(b):
            r = http.post("/v1/completions", json=b)
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            return c["text"], c["logprobs"]["token_logprobs"]

        alone = complete(body)
        for seed in (1, 2):
            traffic = [
                dict(body, prompt=p, max_tokens=random.Random(seed * 31 + i).randint(4, 20))
                for i, p in enumerate(_prompts(8, seed=seed, hi=150))
            ]
            with concurrent.futures.ThreadPoolExecutor(9) as pool:
                futures = [pool.submit(complete, b) for b in traffic[:4]]
                probe = pool.submit(complete, body)
                futures += [pool.submit(complete, b) for b in traffic[4:]]
                assert probe.result() == alone
                for f in futures:
                    f.result()


@pytest.mark.parametrize(
    ("ranks", "sums"),
    [
        (dict(tp=4, ep=2), "tp 4, ep 2"),
        (dict(tp=2, dp_attention=True, speculative_algorithm="mtp"), "tp 2, ep 1, dp attention"),
    ],
    ids=["tp4-ep2", "dp-attention-mtp"],
)
def test_across_ranks(sparse, ranks, sums):
    """A probe alone and among 12 others (a 90-token prefill step, then one of ~800), on
    ranks: the blocks run natively on each rank's part (under --ep 2 its experts' whole),
    their sums in rank order (at 4 ranks gloo's ring adds in an order that moves with the
    batch: with it this fails, as it does on the batched path), the FFN of DP attention
    over every rank's tokens."""
    probe, others = PROBE, _prompts(12, seed=3)

    def outs(llm, prompts):
        got = [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        return [(o.token_ids, flat_logprobs(o.logprobs, o.token_ids, 3)) for o in got]

    kw = {**DET, "num_pages": 256, "enable_prefix_cache": False}
    with LLM(sparse, **kw, **ranks) as llm:
        # (L3 and PD pair it only with an engine whose sums split alike)
        assert llm.engine.compute.endswith(f"|sums over {sums}")
        alone = outs(llm, [probe])[0]
        assert outs(llm, [*others[:6], probe, *others[6:]])[6] == alone


def test_refusals_name_what_is_missing(sparse):
    with pytest.raises(DsakvError, match="cpu backend only.*torch"):
        _engine(sparse, attention_backend="torch")
    with pytest.raises(DsakvError, match="bfloat16"):
        EngineConfig(model=sparse, enable_deterministic_inference=True, dtype="bfloat16")
    cmd = [sys.executable, "-m", "dsakv.cli", "generate", sparse, "--prompt", "hi"]
    cmd += ["--enable-deterministic-inference", "--attention-backend", "torch"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("error: --enable-deterministic-inference runs on the cpu")
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_hisparse_on_fp8_caches_equals_the_roomy_pool(sparse):
    """HiSparse hot buffers (rows missed and copied in from the host) change where a row is
    read from, not its bytes or its order: with the flag, exact on the fp8 caches too."""
    prompts = _prompts(6, seed=8, lo=60, hi=120)
    want = _run(_engine(sparse, num_pages=64), prompts)
    hot = _engine(
        sparse, num_pages=12, enable_hisparse=True, hisparse_config={"host_to_device_ratio": 8}
    )
    assert _run(hot, prompts) == want
    assert hot.counters()["hisparse_misses"] > 0


def test_on_by_default_where_it_runs_and_off_on_request(sparse):
    """The per-token path is measured no slower on a CPU (`dsakv bench
    --enable-deterministic-inference`), so it is the default there; False keeps the batched
    path; where it cannot run (bf16 weights, the torch backend) the default quietly keeps
    the batched path while True is refused (above)."""
    assert _engine(sparse, enable_deterministic_inference=None).backend.deterministic
    assert not _engine(sparse, enable_deterministic_inference=False).backend.deterministic
    for kw in (dict(dtype="bfloat16"), dict(attention_backend="torch")):
        e = Engine(EngineConfig(model=sparse, device="cpu", **kw))
        assert not e.deterministic and not getattr(e.backend, "deterministic", False)
    cmd = [sys.executable, "-m", "dsakv.cli", "generate", sparse, "--prompt", "hi"]
    cmd += ["--enable-deterministic-inference", "--disable-deterministic-inference"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not allowed with argument" in done.stderr


@pytest.mark.parametrize(
    "caches",
    [("fp8_e4m3", "fp8"), ("fp8_ds_mla", "bf16"), ("bf16", "fp32"), ("fp32", "fp8")],
    ids=lambda c: "-".join(c),
)
def test_layer_loop_gives_the_per_layer_bits(sparse, monkeypatch, caches):
    """Decode and MTP verify steps run the target in one native call (`LayerLoop`), and
    the MTP layer's catch-up and its whole chain of drafts in another (`drafts`); they make
    the per-layer path's calls, so outputs are the same bits, on every latent and index-K
    encoding, greedy and seeded, with MTP drafts accepted."""
    from dsakv.kernels import cpu_native
    from dsakv.models import dsa

    calls, chains = [], []
    loop_call, drafts = cpu_native.LayerLoop.__call__, cpu_native.LayerLoop.drafts

    def counted(self, ids, *args, **kw):
        calls.append(ids.shape[0])
        return loop_call(self, ids, *args, **kw)

    def chained(self, *args):
        out = drafts(self, *args)
        chains.append(out.shape)
        return out

    monkeypatch.setattr(cpu_native.LayerLoop, "__call__", counted)
    monkeypatch.setattr(cpu_native.LayerLoop, "drafts", chained)
    kv, index_k = caches
    prompts = _prompts(4, seed=5, lo=10, hi=60)
    params = [GREEDY, SEEDED, GREEDY, SEEDED]
    kw = dict(kv_cache_dtype=kv, index_k_dtype=index_k, speculative_algorithm="mtp")
    looped = _run(_engine(sparse, **kw), prompts, params)
    assert calls and max(calls) > len(prompts)  # verify rows: several tokens a request
    assert chains  # the MTP layer's catch-up and drafts
    monkeypatch.setattr(dsa, "LOOP_EXTEND", 0)
    n, m = len(calls), len(chains)
    per_layer = _run(_engine(sparse, **kw), prompts, params)
    assert (len(calls), len(chains)) == (n, m)
    assert looped == per_layer


def test_layer_loop_refuses_what_is_out_of_range_and_writes_nothing(sparse):
    """The step's one native call (`LayerLoop`) and the draft chain check every token id,
    position, sampled row and slot before any store: a bad one raises IndexError and leaves
    the pool's bytes as they were."""
    engine = _engine(sparse, speculative_algorithm="mtp", num_pages=8)
    model, pool = engine.runner.model, engine.pool
    config = model.config
    slots = torch.arange(8, dtype=torch.long)
    batch = ForwardBatch.from_requests([[5]], [slots])
    with torch.inference_mode():
        loop, draft = model._loop(batch, pool), model._loop(batch, pool, draft=True)
        assert loop is not None and draft is not None and draft.has_head
        before = [pool.latent_data(i).clone() for i in range(config.num_hidden_layers + 1)]
        table, lens = slots[None], torch.tensor([8])
        pos, out = torch.tensor([7]), torch.tensor([7])
        h = torch.zeros(1, config.hidden_size)
        tok, first, far = torch.tensor([5]), torch.tensor([0]), config.max_position_embeddings
        bad = [
            lambda: loop(torch.tensor([config.vocab_size]), pos, out, table, lens),
            lambda: loop(torch.tensor([-1]), pos, out, table, lens),
            lambda: loop(tok, torch.tensor([far]), out, table, lens),
            lambda: loop(tok, pos, torch.tensor([pool.num_tokens]), table, lens),
            lambda: loop(tok, pos, out, table, lens, None, torch.tensor([1])),  # row 1 of 1
            lambda: draft.drafts(tok, pos, out, table, lens, h, first, torch.tensor([3]), table),
        ]
        for call in bad:
            with pytest.raises(IndexError, match="out of range"):
                call()
        assert all(torch.equal(a, pool.latent_data(i)) for i, a in enumerate(before))
        hidden, logits = loop(tok, pos, out, table, lens, None, first)
        assert hidden.shape == (1, config.hidden_size) and logits.shape == (1, config.vocab_size)
