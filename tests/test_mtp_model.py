"""The MTP draft layer (DESIGN.md §9): `load_model(..., draft_layers=1)` and
`DSAForCausalLM.forward_draft` against a dense reference (transformers' decoder layer with
the checkpoint's weights), its own latent and index-K at layer N of the real pool, the
checkpoint's own vocab copies, the missing-layer error, the fitted tiny MTP layer's
agreement with the target, and tp=2 / DP attention against one rank."""

from __future__ import annotations

import logging
import random
import shutil

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dsakv.config.presets import BOS_ID, TINY_PRESETS
from dsakv.distributed.parallel import ParallelState, destroy_parallel, init_parallel
from dsakv.errors import DsakvError
from dsakv.memory import CacheLayout, DSAKVPool
from dsakv.models import ForwardBatch, load_model, write_tiny_model
from dsakv.models.mtp_fit import (
    DraftBlock,
    Rollouts,
    draft_block,
    fit_draft,
    seeded_prompts,
    target_rollouts,
)
from dsakv.models.tiny import default_model_dir, hf_config, random_hf_model

from .model_driver import PAGE, Request, make_pool
from .test_parallel_model import PARALLEL

TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """glm-tiny with its fitted MTP layer, glm-tiny with an unfitted one (same target),
    deepseek-tiny (MTP layer with its own embed/head copies, equal to the target's)."""
    root = tmp_path_factory.mktemp("mtp")
    return {
        "glm-tiny": default_model_dir("glm-tiny"),  # cached, MTP layer fitted
        "glm-random": write_tiny_model(root / "glm-random", "glm-tiny", mtp="random"),
        "deepseek-tiny": write_tiny_model(root / "deepseek", "deepseek-tiny"),
    }


def _reference(path, preset: str, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The MTP layer run densely by transformers' decoder layer: pairs (t_{i+1}, h_i)."""
    tensors = load_file(path / "model.safetensors")
    block = DraftBlock(hf_config(preset))
    block.load_checkpoint_tensors(tensors)
    embeds = F.embedding(torch.tensor(tokens[1:]), tensors["model.embed_tokens.weight"])
    with torch.no_grad():
        return block.eval()(embeds[None], hidden[None, :-1])[0]


@pytest.mark.parametrize("preset", ["glm-tiny", "deepseek-tiny"])
def test_forward_draft_matches_dense_reference(ckpts, preset):
    """Two requests drafted in chunks, then mixed with decodes (contexts past index_topk,
    so the draft layer's own top-k is exercised); every row within 1e-4 of the reference.
    The draft layer writes latent and index-K at layer N; the target never touches it."""
    model, config, plan = load_model(ckpts[preset], draft_layers=1)
    n = config.num_hidden_layers
    assert model.num_draft_layers == 1 and plan.num_total_layers == n + 1
    assert not hasattr(model.mtp, "embed_tokens")  # the copies equal the target's: dropped
    rng = random.Random(1)
    seqs = [[rng.randrange(256) for _ in range(k)] for k in (41, 29)]
    pool = make_pool(config, plan, num_tokens=512)
    reqs = [Request(pool, s, len(s)) for s in seqs]
    hidden = []  # the target's h for every position, prefilled in the same slots
    for req in reqs:
        new, slots = req.step()
        hidden.append(model(ForwardBatch.from_requests([new], [slots]), pool))
    layer_n = pool.gather_latent(n, torch.cat([r.all_slots for r in reqs]))
    assert not layer_n.any()  # the target's forward leaves the draft layer's cache alone
    refs = [_reference(ckpts[preset], preset, s, h) for s, h in zip(seqs, hidden)]

    schedule = [[(0, 24)], [(0, 6), (1, 20)], [(0, 1), (1, 4)]] + [[(0, 1), (1, 1)]] * 4
    schedule += [[(0, 1)]] * 5
    done = [0, 0]
    for step in schedule:
        toks, slots, rows = [], [], []
        for r, k in step:
            a, b = done[r], done[r] + k
            toks.append(seqs[r][a + 1 : b + 1])  # position i embeds token i+1 ...
            slots.append(reqs[r].all_slots[:b])
            rows.append(hidden[r][a:b])  # ... with h_i
            done[r] = b
        out = model.forward_draft(ForwardBatch.from_requests(toks, slots), pool, torch.cat(rows))
        got = out.split([k for _, k in step])
        for (r, k), g in zip(step, got):
            want = refs[r][done[r] - k : done[r]]
            err = (g - want).abs().max().item()
            assert err < TOL, f"{preset} request {r} rows {done[r] - k}..{done[r]}: {err:.2e}"
    assert done == [40, 28]
    draft_slots = torch.cat([reqs[0].all_slots[:40], reqs[1].all_slots[:28]])
    assert pool.gather_latent(n, draft_slots).abs().sum(-1).gt(0).all()
    assert pool.gather_index_k(n, draft_slots).abs().sum(-1).gt(0).all()
    logits = model.compute_logits(out, draft=True)
    assert torch.equal(logits, model.compute_logits(out))  # no own head: the target's


def test_draft_pool_owns_index_k_and_glm52_bytes(ckpts):
    """GLM-5.2 fp8/fp8 with one draft layer: the real pool is pages × 64 × 48,408 bytes;
    layer 78 owns index-K, shared layers none. The tiny model's pool likewise."""
    layout = CacheLayout.for_model("glm-5.2", draft_layers=1)
    pool = DSAKVPool(layout, num_pages=3)
    assert pool.nbytes == 3 * 64 * 48_408
    plan = layout.plan
    assert plan.num_shared_layers == 57 and pool.has_index_k(78)
    assert [i for i in range(79) if pool.has_index_k(i)] == [*plan.full_layers, 78]
    _, config, plan = load_model(ckpts["glm-tiny"], draft_layers=1)
    tiny = make_pool(config, plan, num_tokens=64)
    assert [i for i in range(9) if tiny.has_index_k(i)] == [0, 1, 4, 6, 8]


def test_missing_mtp_layer_is_one_clear_error(tmp_path):
    path = write_tiny_model(tmp_path / "none", "glm-tiny", mtp="none")
    with pytest.raises(DsakvError) as e:
        load_model(path, draft_layers=1)
    msg = str(e.value)
    assert "has no MTP layer (model.layers.8.*" in msg and "speculative decoding needs one" in msg
    assert "\n" not in msg
    model, config, _ = load_model(path)  # without speculation it loads as before
    assert config.num_nextn_predict_layers == 0 and model.num_draft_layers == 0
    with pytest.raises(DsakvError, match="without its MTP layer"):
        model.forward_draft(ForwardBatch.from_requests([], []), None, torch.zeros(0, 64))


def test_mtp_tensors_skipped_without_speculation(ckpts, caplog):
    names = [k for k in load_file(ckpts["deepseek-tiny"] / "model.safetensors")]
    mtp = [k for k in names if k.startswith("model.layers.4.")]
    with caplog.at_level(logging.INFO, logger="dsakv.models.loader"):
        model, _, plan = load_model(ckpts["deepseek-tiny"])
    assert f"and {len(mtp)} draft/MTP tensors" in caplog.text
    assert plan.num_draft_layers == 0 and len(model.model.layers) == 4
    assert "model.layers.4.embed_tokens.weight" in mtp and len(mtp) > 40


def test_own_mtp_head_is_used_when_it_differs(ckpts, tmp_path):
    path = tmp_path / "own-head"
    shutil.copytree(ckpts["deepseek-tiny"], path)
    tensors = load_file(path / "model.safetensors")
    head = torch.randn(tensors["lm_head.weight"].shape, generator=torch.Generator().manual_seed(0))
    tensors["model.layers.4.shared_head.head.weight"] = head
    save_file(tensors, path / "model.safetensors")
    model, _, _ = load_model(path, draft_layers=1)
    assert hasattr(model.mtp.shared_head, "head") and not hasattr(model.mtp, "embed_tokens")
    h = torch.randn(3, 64)
    assert torch.allclose(model.compute_logits(h, draft=True), h @ head.t(), atol=1e-5)
    assert not torch.allclose(model.compute_logits(h), h @ head.t(), atol=1e-2)


@torch.inference_mode()
def _draft_agreement(model, roll: Rollouts, steps: int) -> tuple[list[float], float]:
    """How often the MTP chain's top-1 is the target's greedy token, as the engine would
    draft it: `rates[k]` = P(draft k+1 right | drafts 1..k right), and the mean leading
    right drafts of a `steps` chain. Step 1 pairs (t_{i+1}, h_i) at position i over the
    whole sequence (one extend); step k continues each chain at position i+k-1 with the
    true token t_{i+k} and the previous step's output as h, writing scratch slots so every
    chain sees the step-1 draft KV as its context. Positions i from the last prompt token on."""
    b, s = roll.tokens.shape
    p, n = roll.prompt_len, s - 1
    chains = [(r, i) for r in range(b) for i in range(p - 1, n)]
    stride = -(-(n + (n - p + 1) * (steps - 1)) // PAGE) * PAGE  # slots per request
    pool = make_pool(model.config, model.plan, stride * b)
    ctx = [torch.arange(r * stride, r * stride + n) for r in range(b)]
    batch = ForwardBatch.from_requests(roll.tokens[:, 1:].tolist(), ctx)
    h_in = roll.hidden[:, :n].flatten(0, 1).to(model.dtype)
    out = model.forward_draft(batch, pool, h_in).view(b, n, -1)
    target = roll.logits.argmax(-1)  # [B, S]: the target's token j+1, predicted at j
    pred = model.compute_logits(out.flatten(0, 1), draft=True).argmax(-1).view(b, n)
    right = torch.stack([pred[r, i] == target[r, i + 1] for r, i in chains])
    h = torch.stack([out[r, i] for r, i in chains])
    alive, rates, accepted = right.clone(), [right.float().mean().item()], right.long()
    for k in range(2, steps + 1):
        live = [j for j, (_, i) in enumerate(chains) if i + k <= n]
        toks = [[int(roll.tokens[chains[j][0], chains[j][1] + k])] for j in live]
        slots = []
        for j in live:
            r, i = chains[j]
            scratch = r * stride + n + (i - p + 1) * (steps - 1) + torch.arange(k - 1)
            slots.append(torch.cat([ctx[r][: i + 1], scratch]))
        batch = ForwardBatch.from_requests(toks, slots)
        h_k = model.forward_draft(batch, pool, h[live])
        pred = model.compute_logits(h_k, draft=True).argmax(-1)
        ok = torch.zeros_like(right)
        ok[live] = pred == torch.stack([target[chains[j][0], chains[j][1] + k] for j in live])
        h = h.clone()
        h[live] = h_k
        both = alive & ok
        rates.append(both.sum().item() / max(alive[live].sum().item(), 1))
        alive = both
        accepted = accepted + alive.long()
    full = [j for j, (_, i) in enumerate(chains) if i + steps <= n]
    return rates, accepted[full].float().mean().item()


def test_fitted_mtp_agrees_with_the_target(ckpts):
    """On held-out greedy continuations (prompts the fit never saw), the fitted draft's
    top-1 is the target's next-next token far more often than the unfitted one's
    (measured: 0.65 vs 0.002 at step 1)."""
    rates = {}
    for name in ("glm-tiny", "glm-random"):
        model, _, _ = load_model(ckpts[name], draft_layers=1)
        g = torch.Generator().manual_seed(1234)
        roll = target_rollouts(model, seeded_prompts(g, 16, 16, BOS_ID), 32)
        rates[name] = _draft_agreement(model, roll, steps=2)
    (fit, fit_accepted), (rnd, rnd_accepted) = rates["glm-tiny"], rates["glm-random"]
    print(f"step agreement fit {fit} random {rnd}")
    assert fit[0] > 0.5 and rnd[0] < 0.1
    assert fit_accepted > 0.8 > 0.1 > rnd_accepted


def test_fit_is_deterministic(ckpts):
    """Same seed, same MTP layer (a short fit: the same code path as `mtp="fit"`)."""
    hf = random_hf_model(hf_config("glm-tiny"), 0)
    model, _, _ = load_model(ckpts["glm-random"])
    a, b = (
        fit_draft(hf, model, 5, prompts=8, new_tokens=8, steps=2, batch=4).checkpoint_tensors()
        for _ in range(2)
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    unfitted = draft_block(hf, 5).checkpoint_tensors()
    eh = "model.layers.8.eh_proj.weight"
    assert not torch.equal(a[eh], unfitted[eh])


# --- tp=2 and DP attention against one rank ---------------------------------------------------

_rng = random.Random(0)
TOKENS = [[_rng.randrange(256) for _ in range(n)] for n in (44, 24, 54)]
# (request, tokens) per step: the target extends, then the draft layer runs the same
# positions (pairs with the next token). Prefill chunks, mixed prefill + decode, decode.
TP_SCHEDULE = [[(0, 24), (1, 20)], [(0, 16), (1, 1), (2, 50)], [(0, 1), (1, 1), (2, 1)]]
DP_SCHEDULES = [  # each rank its own requests; rank 1 idles first, rank 0 at the end
    [[(0, 40)], [(0, 1)], [], []],
    [[], [(1, 20), (2, 30)], [(1, 1), (2, 20)], [(2, 1)]],
]


def _schedule(parallel: str, rank: int):
    return DP_SCHEDULES[rank] if parallel == "dp-attention" else TP_SCHEDULE


def _draft_run(model, config, plan, schedule) -> list[torch.Tensor]:
    """Per step: the draft layer's output rows and their draft logits (fp32)."""
    pool = make_pool(config, plan, num_tokens=1024)
    ids = sorted({r for step in schedule for r, _ in step})
    reqs = {r: Request(pool, TOKENS[r], len(TOKENS[r])) for r in ids}
    outs = []
    for step in schedule:
        parts = [reqs[r].step(k) for r, k in step]
        slots = [p[1] for p in parts]
        hidden = model(ForwardBatch.from_requests([p[0] for p in parts], slots), pool)
        nxt = [TOKENS[r][reqs[r].done - k + 1 : reqs[r].done + 1] for r, k in step]
        out = model.forward_draft(ForwardBatch.from_requests(nxt, slots), pool, hidden)
        outs.append(torch.cat([out, model.compute_logits(out, draft=True)], dim=-1))
    return outs


def _worker(rank: int, root: str, models: list[str]) -> None:
    torch.set_num_threads(1)
    init_parallel(PARALLEL["tp2"], rank, f"file://{root}/rdv", torch.device("cpu"))
    out = {}
    try:
        for name, pc in PARALLEL.items():
            state = ParallelState(pc, rank)
            for m in models:
                model, config, plan = load_model(f"{root}/{m}", parallel=state, draft_layers=1)
                out[name, m] = _draft_run(model, config, plan, _schedule(name, rank))
    finally:
        destroy_parallel()
    torch.save(out, f"{root}/rank{rank}.pt")


def test_forward_draft_sharded_matches_one_rank(ckpts, tmp_path):
    """tp=2, tp=2 + ep=2 and DP attention (empty draft batches on an idle rank) give the
    one-rank draft outputs and logits; the DeepSeek model has an odd vocab (uneven
    embedding / head splits) and its own, different MTP head (vocab-parallel too)."""
    shutil.copytree(ckpts["glm-tiny"], tmp_path / "glm")
    cfg = {**TINY_PRESETS["deepseek-tiny"], "vocab_size": 263}
    ds = write_tiny_model(tmp_path / "deepseek", cfg)
    tensors = load_file(ds / "model.safetensors")
    head = tensors["model.layers.4.shared_head.head.weight"]
    tensors["model.layers.4.shared_head.head.weight"] = head.flip(0).contiguous()
    save_file(tensors, ds / "model.safetensors")
    models = ["glm", "deepseek"]
    mp.spawn(_worker, args=(str(tmp_path), models), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for m in models:
        model, config, plan = load_model(tmp_path / m, draft_layers=1)
        for name in PARALLEL:
            for rank in range(2):
                want = _draft_run(model, config, plan, _schedule(name, rank))
                got = ranks[rank][name, m]
                assert [g.shape for g in got] == [w.shape for w in want]
                for step, (g, w) in enumerate(zip(got, want)):
                    err = (g - w).abs().max().item() if g.numel() else 0.0
                    assert err < TOL, f"{name} {m} rank {rank} step {step}: {err:.2e}"


def test_draft_rows_do_not_depend_on_the_batch(ckpts):
    """The cpu backend's deterministic path runs the MTP layer's NextN input (enorm, hnorm,
    eh_proj) and output norm as native blocks like the layer's own, each row on its own: a
    request's draft outputs are the same bits alone as beside other requests, and within
    1e-4 of the eager blocks."""
    from dsakv.kernels.backend import CpuBackend

    model, config, plan = load_model(ckpts["glm-tiny"], draft_layers=1)
    pool = make_pool(config, plan, num_tokens=512)
    model.use_backend(CpuBackend(pool.layout, deterministic=True))
    assert model.mtp.native_io()
    rng = random.Random(3)
    g = torch.Generator().manual_seed(3)
    seqs = [[rng.randrange(256) for _ in range(k)] for k in (21, 30, 12)]
    reqs = [Request(pool, s, len(s)) for s in seqs]
    hidden = [torch.randn(len(s), config.hidden_size, generator=g) for s in seqs]

    def draft(rs: list[int], a: int) -> list[torch.Tensor]:
        """Rows a.. of requests `rs` (a draft step of each), in one batch."""
        toks = [seqs[r][a + 1 :] for r in rs]
        slots = [reqs[r].all_slots[: len(seqs[r]) - 1] for r in rs]
        h = torch.cat([hidden[r][a : len(seqs[r]) - 1] for r in rs])
        out = model.forward_draft(ForwardBatch.from_requests(toks, slots), pool, h)
        return list(out.split([len(t) for t in toks]))

    for r in range(3):  # each context's draft KV, alone
        draft([r], 0)
    alone = [draft([r], len(seqs[r]) - 2)[0] for r in range(3)]  # one row each
    together = draft([0, 1, 2], 8)  # rows 8.. of each, beside the others
    for r in range(3):
        assert torch.equal(together[r][-1], alone[r][0])
    eager = CpuBackend(pool.layout)
    eager.native = False
    model.use_backend(eager)
    for r in range(3):
        assert (draft([r], len(seqs[r]) - 2)[0] - alone[r][0]).abs().max() < TOL
