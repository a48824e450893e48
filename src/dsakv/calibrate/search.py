"""Greedy IndexCache pattern search over teacher-forced calibration data.

The model is built once with every layer that has indexer weights running its indexer
(the reference). A candidate is a `LayerPlan`; it runs over the SAME modules, each layer
taking its top-k from the candidate's `topk_source` (`DecoderLayer.forward(...,
topk_source=)`). Layers before the first layer whose selection changes compute exactly
what the current plan computed, so each candidate restarts from the current plan's cached
input to that layer (and its cached selections of earlier layers).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dsakv.config import LayerPlan, ModelConfig
from dsakv.config.checkpoint import checkpoint_files, indexer_layers
from dsakv.errors import DsakvError
from dsakv.memory import CacheLayout, DSAKVPool, plan_capacity
from dsakv.models import DSAForCausalLM, ForwardBatch
from dsakv.models.indexer import StepSelection

# Calibration runs over an exact (fp32) cache: divergence measures sharing, not quantisation.
_POOL_DTYPES = ("fp32", "fp32")
_PAGE = 64
# Pricing bounds (as the CLI's flags): past them a value is a typo, and the planner's
# arithmetic overflows (budget) or builds per-layer tables too large to hold (draft layers).
MAX_KV_BUDGET_GIB = 1e12
MAX_DRAFT_LAYERS = 64


@dataclass(frozen=True)
class Pricing:
    """How a pattern is priced: `dsakv plan`'s cache layout and default KV budget."""

    kv_cache_dtype: str = "fp8_e4m3"
    index_k_dtype: str = "fp8"
    page_size: int = 64
    draft_layers: int = 0
    kv_budget_gib: float = 100.0

    def __post_init__(self) -> None:
        # Checked here, so a bad value fails before the reference run, not at its first price.
        if not 0 < self.kv_budget_gib <= MAX_KV_BUDGET_GIB:
            raise DsakvError(
                f"kv_budget_gib must be in (0, {MAX_KV_BUDGET_GIB:g}] GiB, got {self.kv_budget_gib:g}"
            )
        if not 0 <= self.draft_layers <= MAX_DRAFT_LAYERS:
            raise DsakvError(
                f"draft_layers must be in 0..{MAX_DRAFT_LAYERS}, got {self.draft_layers}"
            )
        if self.page_size < 1:
            raise DsakvError(f"page_size must be >= 1, got {self.page_size}")

    def __call__(self, config: ModelConfig, pattern: str) -> tuple[int, int]:
        """(bytes per token, max_total_num_tokens) of `pattern`, as `dsakv plan` computes them."""
        plan = LayerPlan.from_config(
            config, index_topk_pattern=pattern, draft_layers=self.draft_layers
        )
        layout = CacheLayout.from_plan(
            config, plan, self.kv_cache_dtype, self.index_k_dtype, self.page_size
        )
        cap = plan_capacity(layout, kv_budget_gib=self.kv_budget_gib)
        return layout.bytes_per_token, cap.max_total_num_tokens


@dataclass(frozen=True)
class Step:
    """The plan after one greedy step (step 0: the reference) and what it costs."""

    pattern: str
    shared_layer: int | None  # the layer this step made shared
    kl: float  # mean KL(reference || plan) of next-token distributions
    overlap: tuple[float, ...]  # per layer: top-k used vs the reference's own top-k
    candidates: dict[int, float]  # KL of every layer tried at this step
    bytes_per_token: int
    max_total_num_tokens: int

    @property
    def num_full_layers(self) -> int:
        return self.pattern.count("F")

    def to_json(self) -> dict[str, Any]:
        return {
            "num_full_layers": self.num_full_layers,
            "shared_layer": self.shared_layer,
            "index_topk_pattern": self.pattern,
            "kl": self.kl,
            "bytes_per_token": self.bytes_per_token,
            "max_total_num_tokens": self.max_total_num_tokens,
            "topk_overlap": [round(o, 6) for o in self.overlap],
            "candidates": {str(k): v for k, v in sorted(self.candidates.items())},
        }


@dataclass(frozen=True)
class CalibrationResult:
    plan: LayerPlan
    reference: LayerPlan
    no_indexer_layers: tuple[int, ...]  # no indexer weights in the checkpoint: stay shared
    target_full_layers: int
    history: tuple[Step, ...]
    num_sequences: int
    num_tokens: int
    pricing: Pricing

    @property
    def final(self) -> Step:
        return self.history[-1]

    def to_json(self) -> dict[str, Any]:
        p, f = self.pricing, self.final
        return {
            "index_topk_pattern": self.plan.pattern,
            "indexer_types": list(self.plan.indexer_types),
            "kl": f.kl,
            "bytes_per_token": f.bytes_per_token,
            "max_total_num_tokens": f.max_total_num_tokens,
            "num_full_layers": self.plan.num_full_layers,
            "topk_overlap": [round(o, 6) for o in f.overlap],
            "reference_pattern": self.reference.pattern,
            "no_indexer_layers": list(self.no_indexer_layers),
            "target_full_layers": self.target_full_layers,
            "kv_cache_dtype": p.kv_cache_dtype,
            "index_k_dtype": p.index_k_dtype,
            "page_size": p.page_size,
            "draft_layers": p.draft_layers,
            "kv_budget_gib": p.kv_budget_gib,
            "num_sequences": self.num_sequences,
            "num_tokens": self.num_tokens,
            "history": [s.to_json() for s in self.history],
        }


@dataclass(frozen=True)
class _State:
    """One batch under one plan: each layer's input and the selections of its full layers."""

    inputs: tuple[torch.Tensor, ...]
    selections: dict[int, StepSelection]
    logprobs: torch.Tensor | None  # kept for the reference only


class Runner:
    """Teacher-forced runs of candidate plans over all-full weights, one prefill per batch."""

    def __init__(
        self,
        model: DSAForCausalLM,
        sequences: Sequence[Sequence[int]],
        batch_size: int = 4,
    ) -> None:
        if batch_size < 1:
            raise DsakvError(f"batch_size must be >= 1, got {batch_size}")
        self.model, self.config = model, model.config
        device = model.model.embed_tokens.weight.device
        self.batches = []
        for a in range(0, len(sequences), batch_size):
            seqs = sequences[a : a + batch_size]
            starts = [sum(len(s) for s in seqs[:i]) for i in range(len(seqs))]
            slots = [torch.arange(b, b + len(s)) for b, s in zip(starts, seqs)]
            self.batches.append(ForwardBatch.from_requests(seqs, slots, device=device))
        most = max(b.num_tokens for b in self.batches)
        layout = CacheLayout.from_plan(self.config, model.plan, *_POOL_DTYPES, page_size=_PAGE)
        # Every run rewrites layers >= its start before reading them, so batches share a pool.
        self.pool = DSAKVPool(layout, -(-most // _PAGE), device=device)
        self.reference: list[_State] | None = None  # set once the reference has run
        self.reference_plan = model.plan

    @property
    def num_tokens(self) -> int:
        return sum(b.num_tokens for b in self.batches)

    @torch.inference_mode()
    def run(
        self, plan: LayerPlan, start: int, base: list[_State] | None, bar: Any = None
    ) -> tuple[list[_State], float]:
        """Run `plan` from layer `start` (0 = the embedding) on `base`'s cached inputs;
        returns the new states and the mean KL against the reference."""
        m, n = self.model, self.config.num_hidden_layers
        start = start if base is not None else 0
        out, kl_sum = [], 0.0
        for b, batch in enumerate(self.batches):
            if start == 0:
                x, inputs, sels = m.model.embed_tokens(batch.input_ids), [], {}
            else:
                x, inputs = base[b].inputs[start], list(base[b].inputs[:start])
                sels = {s: v for s, v in base[b].selections.items() if s < start}
            cos, sin = m.rotary(batch.positions, x.dtype)
            for i in range(start, n):
                inputs.append(x)
                x = m.model.layers[i](x, cos, sin, batch, self.pool, sels, plan.topk_source(i))
            logprobs = m.compute_logits(m.model.norm(x)).log_softmax(-1)
            if self.reference is not None:
                ref = self.reference[b].logprobs
                kl_sum += float((ref.exp() * (ref - logprobs)).sum(-1).double().sum())
                logprobs = None
            out.append(_State(tuple(inputs), sels, logprobs))
            if bar is not None:
                bar.update()
        return out, kl_sum / self.num_tokens

    def overlap(self, plan: LayerPlan, states: list[_State]) -> tuple[float, ...]:
        """Per layer, the share of the reference's top-k (the layer's own, or its source's
        where the checkpoint has no indexer there) that the top-k `plan` uses keeps, over
        queries that see more than index_topk positions (1.0 where none do)."""
        assert self.reference is not None
        k, ref_plan = self.config.index_topk, self.reference_plan
        hits = [0] * plan.num_layers
        rows = [0] * plan.num_layers
        for batch, ref, got in zip(self.batches, self.reference, states):
            for i in range(plan.num_layers):
                want_all = ref.selections[ref_plan.topk_source(i)].per_req
                have_all = got.selections[plan.topk_source(i)].per_req
                for r, (want, have) in enumerate(zip(want_all, have_all)):
                    if want is None or have is None or batch.seq_lens[r] <= k:
                        continue
                    a, b = want.positions[k:], have.positions[k:]  # queries at positions >= k
                    mask = torch.zeros(
                        a.shape[0], batch.seq_lens[r], dtype=torch.bool, device=a.device
                    ).scatter_(1, a, True)
                    hits[i] += int(mask.gather(1, b).sum())
                    rows[i] += a.numel()
        return tuple(h / r if r else 1.0 for h, r in zip(hits, rows))


def reference_plan(config: ModelConfig, model_dir: str | Path) -> tuple[LayerPlan, tuple[int, ...]]:
    """Every layer whose checkpoint has indexer weights runs its indexer; the others cannot
    (there is nothing to run), so they stay shared. Layer 0 must have them."""
    names = checkpoint_files(Path(model_dir))
    n = config.num_hidden_layers
    have = indexer_layers(names)
    missing = tuple(i for i in range(n) if i not in have)
    if 0 in missing:
        raise DsakvError(f"{model_dir}: the checkpoint has no indexer weights for layer 0")
    pattern = "".join("S" if i in missing else "F" for i in range(n))
    return LayerPlan.from_config(config, index_topk_pattern=pattern), missing


def _share(config: ModelConfig, plan: LayerPlan, layer: int) -> LayerPlan:
    p = plan.pattern
    return LayerPlan.from_config(config, index_topk_pattern=p[:layer] + "S" + p[layer + 1 :])


def target_full_layers(
    config: ModelConfig,
    reference: LayerPlan,
    pricing: Pricing,
    num_full_layers: int | None = None,
    target_bytes_per_token: int | None = None,
) -> int:
    """The budget as a number of full layers; bytes per token depend only on that number."""
    n = config.num_hidden_layers
    if num_full_layers is not None and target_bytes_per_token is not None:
        raise DsakvError("give --num-full-layers or --target-bytes-per-token, not both")
    if target_bytes_per_token is None:
        m = max(1, n // 4) if num_full_layers is None else num_full_layers
        if not 1 <= m <= n:
            raise DsakvError(f"num_full_layers must be in 1..{n}, got {m}")
        return m
    full = reference.full_layers
    for m in range(len(full), 0, -1):
        keep = set(full[:m])
        pattern = "".join("F" if i in keep else "S" for i in range(n))
        if pricing(config, pattern)[0] <= target_bytes_per_token:
            return m
    raise DsakvError(
        f"target of {target_bytes_per_token} bytes per token is below what 1 full layer costs "
        f"({pricing(config, 'F' + 'S' * (n - 1))[0]})"
    )


def greedy_search(
    runner: Runner,
    reference: LayerPlan,
    target: int,
    *,
    pricing: Pricing,
    seed: int = 0,
    on_step: Callable[[Step], None] | None = None,
) -> list[Step]:
    """From `reference`, repeatedly share the full layer (never layer 0) whose sharing raises
    the KL least, until at most `target` layers are full. Layers are tried in a seeded
    order and exact ties go to the first tried, so a seed fixes the result."""
    config = runner.config
    steps = max(0, reference.num_full_layers - target)
    runs = 1 + sum(reference.num_full_layers - 1 - s for s in range(steps))
    bar = tqdm(total=runs * len(runner.batches), desc="calibrate", unit="run", disable=None)
    rng = random.Random(seed)
    with bar:
        states, _ = runner.run(reference, 0, None, bar)
        runner.reference = states
        plan = reference
        history = [_step(runner, plan, None, 0.0, runner.overlap(plan, states), {}, pricing)]
        if on_step is not None:
            on_step(history[-1])
        while plan.num_full_layers > target:
            order = [i for i in plan.full_layers if i != 0]
            rng.shuffle(order)
            tried: dict[int, float] = {}
            best: tuple[float, int, LayerPlan, list[_State]] | None = None
            for layer in order:
                cand = _share(config, plan, layer)
                cand_states, kl = runner.run(cand, layer, states, bar)
                tried[layer] = kl
                if best is None or kl < best[0]:
                    best = (kl, layer, cand, cand_states)
                bar.set_postfix(full=plan.num_full_layers, best_kl=f"{best[0]:.3g}")
            assert best is not None
            kl, layer, plan, states = best
            overlap = runner.overlap(plan, states)
            history.append(_step(runner, plan, layer, kl, overlap, tried, pricing))
            if on_step is not None:
                on_step(history[-1])
    return history


def _step(
    runner: Runner,
    plan: LayerPlan,
    layer: int | None,
    kl: float,
    overlap: tuple[float, ...],
    tried: dict[int, float],
    pricing: Pricing,
) -> Step:
    bpt, tokens = pricing(runner.config, plan.pattern)
    return Step(plan.pattern, layer, kl, overlap, tried, bpt, tokens)


def calibrate_pattern(
    model_dir: str | Path,
    *,
    data: str | Path | None = None,
    num_full_layers: int | None = None,
    target_bytes_per_token: int | None = None,
    pricing: Pricing | None = None,
    max_seq_len: int | None = None,
    batch_size: int = 4,
    seed: int = 0,
    device: str = "auto",
    dtype: torch.dtype = torch.float32,
    on_step: Callable[[Step], None] | None = None,
) -> CalibrationResult:
    """Load the model with every available indexer, then search greedily to the budget."""
    from dsakv.engine.config import resolve_device
    from dsakv.models import load_model

    from .data import calibration_sequences

    pricing = pricing or Pricing()
    config = ModelConfig.from_hf(model_dir)
    reference, no_indexer = reference_plan(config, model_dir)
    target = target_full_layers(config, reference, pricing, num_full_layers, target_bytes_per_token)
    seqs = calibration_sequences(model_dir, config, data, max_seq_len=max_seq_len, seed=seed)
    model, _, _ = load_model(model_dir, reference, device=resolve_device(device), dtype=dtype)
    runner = Runner(model, seqs, batch_size)
    history = greedy_search(runner, reference, target, pricing=pricing, seed=seed, on_step=on_step)
    final = LayerPlan.from_config(config, index_topk_pattern=history[-1].pattern)
    return CalibrationResult(
        final, reference, no_indexer, target, tuple(history), len(seqs), runner.num_tokens, pricing
    )
