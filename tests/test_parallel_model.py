"""The sharded model (DESIGN.md §8) on 2 CPU ranks (gloo) against the one-rank model:
tp=2, tp=2 with ep=2, and DP attention (different requests per rank, empty batches), on
tiny GLM and DeepSeek-V3.2 checkpoints in fp32; per-rank weight bytes against
`estimate_weight_bytes`; and the loader reading only each rank's (FP8) slices."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from dsakv.config import checkpoint as checkpoint_mod
from dsakv.config.parallel import ParallelConfig
from dsakv.distributed.parallel import (
    ParallelState,
    destroy_parallel,
    init_parallel,
)
from dsakv.errors import DsakvError
from dsakv.memory import estimate_weight_bytes
from dsakv.models import ForwardBatch, load_model, write_tiny_model
from dsakv.models.moe import Experts
from dsakv.models.tiny import TINY_PRESETS

from .model_driver import Request, fp8_block_quantise, make_pool, run_batch

TOL = 1e-4  # measured: max |Δlogit| 3.8e-6 over every step, layout and model
# index_topk 16: every context below is sparse. An odd vocab makes the lm_head and
# embedding split uneven (132 + 131 rows, the second padded).
MODELS = {
    "glm-tiny": TINY_PRESETS["glm-tiny"],
    "deepseek-tiny": {**TINY_PRESETS["deepseek-tiny"], "vocab_size": 263},
}
PARALLEL = {
    "tp2": ParallelConfig(tp=2, timeout_s=60),
    "tp2-ep2": ParallelConfig(tp=2, ep=2, timeout_s=60),
    "dp-attention": ParallelConfig(tp=2, dp_attention=True, timeout_s=60),
}
_rng = random.Random(0)
TOKENS = [[_rng.randrange(256) for _ in range(n)] for n in (43, 23, 53)]
# One engine step per entry: (request, tokens fed). Prefill chunks, a mixed step with
# prefill and decode, then decode; every context passes index_topk, so top-k is exercised.
TP_SCHEDULE = [
    [(0, 24), (1, 20)],
    [(0, 16), (1, 1), (2, 50)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (1, 1), (2, 1)],
    [(0, 1), (2, 1)],
]
# DP attention: each rank its own requests; rank 1 idles first, rank 0 at the end.
DP_SCHEDULES = [
    [[(0, 40)], [(0, 1)], [(0, 1)], [], []],
    [[], [(1, 20), (2, 30)], [(1, 1), (2, 20)], [(1, 1), (2, 1)], [(2, 1)]],
]


def _schedule(parallel: str, rank: int):
    return DP_SCHEDULES[rank] if parallel == "dp-attention" else TP_SCHEDULE


def _run(model, config, plan, schedule) -> list[torch.Tensor]:
    """Teacher-forced: feed `schedule`'s slices of TOKENS; logits of each request's last row."""
    pool = make_pool(config, plan, num_tokens=1024)
    ids = sorted({r for step in schedule for r, _ in step})
    reqs = {r: Request(pool, TOKENS[r], len(TOKENS[r])) for r in ids}
    return [
        run_batch(model, pool, [reqs[r] for r, _ in step], [n for _, n in step])
        for step in schedule
    ]


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _worker(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    init_parallel(PARALLEL["tp2"], rank, f"file://{root}/rdv", torch.device("cpu"))
    out = {}
    try:
        for name, pc in PARALLEL.items():
            state = ParallelState(pc, rank)  # the same two ranks, another layout
            for preset in MODELS:
                model, config, plan = load_model(f"{root}/{preset}", parallel=state)
                out[name, preset] = {
                    "logits": _run(model, config, plan, _schedule(name, rank)),
                    "bytes": _weight_bytes(model),
                }
    finally:
        destroy_parallel()
    torch.save(out, f"{root}/rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-rank spawn runs every layout on both models; also the one-rank references."""
    root = tmp_path_factory.mktemp("parallel")
    for preset, cfg in MODELS.items():
        write_tiny_model(root / preset, cfg)
    mp.spawn(_worker, args=(str(root),), nprocs=2, join=True)
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(2)]
    refs = {}
    for preset in MODELS:
        model, config, plan = load_model(root / preset)
        for name in PARALLEL:
            for rank in range(2):
                refs[name, preset, rank] = _run(model, config, plan, _schedule(name, rank))
    return root, ranks, refs


@pytest.mark.parametrize("preset", MODELS)
@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_logits_match_one_rank(runs, parallel, preset):
    _, ranks, refs = runs
    for rank in range(2):
        got, want = ranks[rank][parallel, preset]["logits"], refs[parallel, preset, rank]
        assert [g.shape for g in got] == [w.shape for w in want]
        for step, (g, w) in enumerate(zip(got, want)):
            assert g.shape[-1] == MODELS[preset]["vocab_size"]  # not the padded split
            err = (g - w).abs().max().item() if g.numel() else 0.0
            print(f"{parallel} {preset} rank {rank} step {step}: max |Δlogit| {err:.1e}")
            assert err < TOL, f"rank {rank} step {step}: max |Δlogit| {err:.2e}"
    if parallel == "dp-attention":  # both ranks ran empty steps and real ones
        counts = [[g.shape[0] for g in ranks[r][parallel, preset]["logits"]] for r in range(2)]
        assert counts == [[1, 1, 1, 0, 0], [0, 2, 2, 2, 1]]


@pytest.mark.parametrize("preset", MODELS)
@pytest.mark.parametrize("parallel", list(PARALLEL))
def test_rank_weight_bytes_match_estimate(runs, parallel, preset):
    root, ranks, _ = runs
    pc = PARALLEL[parallel]
    model, config, plan = load_model(root / preset)
    whole = _weight_bytes(model)
    est = estimate_weight_bytes(config, plan, pc.tp, ep=pc.ep, dp_attention=pc.dp_attention)
    assert estimate_weight_bytes(config, plan).total_bytes == pytest.approx(whole, rel=0.01)
    for rank in range(2):
        measured = ranks[rank][parallel, preset]["bytes"]
        assert measured == pytest.approx(est.total_bytes, rel=0.01)
        assert measured < whole


def test_empty_batch_runs_on_one_rank(runs):
    root, _, _ = runs
    model, config, plan = load_model(root / "glm-tiny")
    batch = ForwardBatch.from_requests([], [])
    hidden = model(batch, make_pool(config, plan, num_tokens=64))
    assert hidden.shape == (0, config.hidden_size)
    assert model.compute_logits(hidden[batch.last_token_indices()]).shape == (0, 264)


# --- sliced loading ------------------------------------------------------------------------


def _fp8_checkpoint(src, dst):
    """The checkpoint with every 2-D projection as 128×128-block e4m3 + `weight_scale_inv`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for k in [k for k in tensors if k.endswith("proj.weight") and tensors[k].dim() == 2]:
        tensors[k], tensors[k + "_scale_inv"], _ = fp8_block_quantise(tensors[k])
    save_file(tensors, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


_safe_open = checkpoint_mod.safe_open


class _RecordingFile:
    """A `safe_open` handle that records every slice read; whole-tensor reads fail."""

    def __init__(self, file, framework, reads: list) -> None:
        self.handle, self.reads = _safe_open(file, framework), reads

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def keys(self):
        return self.handle.keys()

    def get_slice(self, name):
        sl, reads = self.handle.get_slice(name), self.reads

        class Slice:
            def get_shape(self):
                return sl.get_shape()

            def get_dtype(self):
                return sl.get_dtype()

            def __getitem__(self, index):
                reads.append((name, index))
                return sl[index]

        return Slice()


def _expected(full: dict[str, torch.Tensor], model, name: str) -> torch.Tensor:
    """The one-rank parameter `name`, sliced the way this rank's module says it holds it."""
    mod_name, _, leaf = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    whole = full[name]
    if isinstance(mod, Experts):
        (e0, e1), (i0, i1) = mod.expert_range, mod.inter_range
        whole = whole[e0:e1]
        if leaf == "down_proj":
            return whole[:, :, i0:i1]
        inter = mod.intermediate
        return torch.cat([whole[:, i0:i1], whole[:, inter + i0 : inter + i1]], dim=1)
    shard = getattr(mod, "shard", None)
    if shard is None:
        return whole
    part = whole.narrow(shard.dim, shard.start, min(shard.end, shard.full) - shard.start)
    pad = list(part.shape)
    pad[shard.dim] = shard.end - min(shard.end, shard.full)
    return torch.cat([part, part.new_zeros(pad)], dim=shard.dim)


def test_sliced_fp8_load_equals_whole_load_sliced(runs, tmp_path, monkeypatch):
    """Shard boundaries off the 128-blocks (q_b rows at 192, o_proj columns at 64, expert
    intermediate at 16, vocab at 132) still dequantise exactly; experts of the other EP
    group are never read, and no sharded tensor is read whole."""
    root, _, _ = runs
    path = _fp8_checkpoint(root / "glm-tiny", tmp_path / "fp8")
    whole, config, _ = load_model(path)
    full = dict(whole.named_parameters())
    for name, pc in PARALLEL.items():
        for rank in range(2):
            reads: list = []
            monkeypatch.setattr(
                checkpoint_mod, "safe_open", lambda f, fw, reads=reads: _RecordingFile(f, fw, reads)
            )
            model, _, _ = load_model(path, parallel=ParallelState(pc, rank))
            for pname, p in model.named_parameters():
                assert torch.equal(p, _expected(full, model, pname)), (name, rank, pname)
            read = {n: idx for n, idx in reads}
            if pc.ep == 2:
                mine = range(4 * rank, 4 * rank + 4)
                experts = {int(n.split(".")[5]) for n in read if ".experts." in n}
                assert experts == set(mine), (name, rank, experts)
            if not pc.dp_attention:
                q_b = read["model.layers.0.self_attn.q_b_proj.weight"]
                assert q_b[0] == slice(192 * rank, 192 * (rank + 1)), q_b
                scale = read["model.layers.0.self_attn.q_b_proj.weight_scale_inv"]
                assert scale[0] == slice(rank, 2 if rank == 0 else 3), scale  # blocks 0-1 / 1-2


def test_stacked_expert_checkpoint_loads_the_same_slices(runs, tmp_path):
    """Experts already stacked in the checkpoint (`experts.gate_up_proj[E, 2I, H]`) give
    each rank the same parameters as per-expert tensors do."""
    root, _, _ = runs
    src = root / "deepseek-tiny"
    dst = tmp_path / "stacked"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for layer in range(1, 4):
        prefix = f"model.layers.{layer}.mlp.experts"

        def pop(e, part, prefix=prefix):
            return tensors.pop(f"{prefix}.{e}.{part}.weight")

        gate_up = [torch.cat([pop(e, "gate_proj"), pop(e, "up_proj")]) for e in range(8)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack([pop(e, "down_proj") for e in range(8)])
    save_file(tensors, dst / "model.safetensors")
    for pc in PARALLEL.values():
        state = ParallelState(pc, 1)
        per_expert, _, _ = load_model(src, parallel=state)
        stacked, _, _ = load_model(dst, parallel=state)
        want = dict(per_expert.named_parameters())
        for name, p in stacked.named_parameters():
            assert torch.equal(p, want[name]), name


def test_missing_and_unexpected_tensors_per_rank(runs, tmp_path):
    """Each rank checks the tensors it needs: an absent expert 5 is missing for the EP
    group holding experts 4-7 only; an expert id past n_routed_experts is unexpected."""
    root, _, _ = runs
    path = tmp_path / "bad"
    shutil.copytree(root / "glm-tiny", path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    tensors["model.layers.1.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)
    save_file(tensors, path / "model.safetensors")
    for rank in range(2):
        with pytest.raises(DsakvError) as e:
            load_model(path, parallel=ParallelState(PARALLEL["tp2-ep2"], rank))
        msg = str(e.value)
        assert "1 unexpected tensor(s): model.layers.1.mlp.experts.8.up_proj.weight" in msg
        assert ("missing tensor(s): model.layers.1.mlp.experts.5.up_proj.weight" in msg) == (
            rank == 1
        )
