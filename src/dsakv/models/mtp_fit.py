"""Fitting the tiny models' MTP layer (DESIGN.md §9).

A random MTP layer accepts almost nothing, so `write_tiny_model(..., mtp="fit")` distils
one from the target: the target (dsakv's own engine, the model that will be served)
greedily continues seeded prompts, recording its final-normed hidden `h_i` and logits at
every position; then the MTP layer learns to predict the target's token i+2 from
(token i+1, h_i). Training runs on transformers' decoder layer (`DraftBlock`), which has
autograd; dsakv's modules are inference-only. `DraftBlock` is also the dense reference
the tests hold `forward_draft` to.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .forward_batch import ForwardBatch

_HF_CLASSES = {  # model_type -> (module, class prefix)
    "glm_moe_dsa": ("glm_moe_dsa", "GlmMoeDsa"),
    "deepseek_v32": ("deepseek_v32", "DeepseekV32"),
}
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _hf_class(model_type: str, name: str) -> type:
    module, prefix = _HF_CLASSES[model_type]
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(mod, prefix + name)


def draft_hf_config(config: Any) -> Any:
    """The target's transformers config extended by one full layer N (the MTP layer)."""
    ext = copy.deepcopy(config)
    n = config.num_hidden_layers
    ext.num_hidden_layers = n + 1
    if getattr(config, "indexer_types", None) is not None:
        ext.indexer_types = [*config.indexer_types, "full"]
    ext.mlp_layer_types = [
        *config.mlp_layer_types,
        "dense" if n < config.first_k_dense_replace else "sparse",
    ]
    ext._attn_implementation = "eager"  # the one that applies the top-k mask densely
    ext._experts_implementation = "eager"
    return ext


class DraftBlock(nn.Module):
    """The MTP layer on transformers' decoder layer, run densely over whole sequences:
    `shared_head.norm(layer(eh_proj(cat([enorm(embeds), hnorm(hidden)]))))`.

    `checkpoint_tensors` / `load_checkpoint_tensors` convert to and from the checkpoint's
    `model.layers.{N}.*` names (per-expert tensors, as real checkpoints ship them).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        ext = draft_hf_config(config)
        self.n = config.num_hidden_layers
        h, eps = config.hidden_size, config.rms_norm_eps
        norm = _hf_class(config.model_type, "RMSNorm")
        self.layer = _hf_class(config.model_type, "DecoderLayer")(ext, self.n)
        self.enorm, self.hnorm = norm(h, eps), norm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = norm(h, eps)
        self.rotary = _hf_class(config.model_type, "RotaryEmbedding")(ext)

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.n}."

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """`embeds`, `hidden` `[B, S, H]` at positions 0..S-1 (causal) -> `[B, S, H]`."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        s = x.shape[1]
        positions = torch.arange(s, device=x.device)[None]
        future = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        mask = torch.zeros(s, s, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill(future, torch.finfo(x.dtype).min)[None, None]
        out = self.layer(
            x,
            attention_mask=mask,
            position_ids=positions,
            position_embeddings=self.rotary(x, positions),
        )
        return self.shared_head.norm(out[0] if isinstance(out, tuple) else out)

    def _named(self) -> dict[str, torch.Tensor]:
        """Checkpoint-relative names (experts still stacked) -> tensors."""
        out = {}
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if name.startswith("rotary."):
                continue
            out[name.removeprefix("layer.")] = t
        return out

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """`model.layers.{N}.*` -> tensor, routed experts split per expert."""
        out = {}
        for name, t in self._named().items():
            t = t.detach()
            if name == _EXPERTS[0]:
                gate, up = t.chunk(2, dim=1)
                for e in range(t.shape[0]):
                    out[f"{self.prefix}mlp.experts.{e}.gate_proj.weight"] = gate[e]
                    out[f"{self.prefix}mlp.experts.{e}.up_proj.weight"] = up[e]
            elif name == _EXPERTS[1]:
                for e in range(t.shape[0]):
                    out[f"{self.prefix}mlp.experts.{e}.down_proj.weight"] = t[e]
            else:
                out[self.prefix + name] = t
        return {k: v.contiguous() for k, v in out.items()}

    @torch.no_grad()
    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """The inverse of `checkpoint_tensors` (extra names, e.g. embed copies, ignored)."""
        for name, t in self._named().items():
            if name == _EXPERTS[0]:
                for e in range(t.shape[0]):
                    parts = [
                        f"{self.prefix}mlp.experts.{e}.{p}_proj.weight" for p in ("gate", "up")
                    ]
                    t[e].copy_(torch.cat([tensors[p] for p in parts]))
            elif name == _EXPERTS[1]:
                for e in range(t.shape[0]):
                    t[e].copy_(tensors[f"{self.prefix}mlp.experts.{e}.down_proj.weight"])
            else:
                t.copy_(tensors[self.prefix + name])

    @torch.no_grad()
    def init_from(self, hf_model: nn.Module, indexer_source: int, seed: int) -> None:
        """Start from a copy of the target's last layer (its indexer from the nearest full
        layer when the last is shared), a random eh_proj and perturbed norms."""
        layers = hf_model.model.layers
        mine = self.layer.state_dict()
        for src_index in (indexer_source, len(layers) - 1):  # indexer first, then the rest
            for name, t in layers[src_index].state_dict().items():
                if name in mine and mine[name].shape == t.shape:
                    mine[name] = t.float().clone()
        self.layer.load_state_dict(mine)
        self.shared_head.norm.weight.copy_(hf_model.model.norm.weight.float())
        g = torch.Generator().manual_seed(seed)
        std = hf_model.config.initializer_range
        self.eh_proj.weight.copy_(std * torch.randn(self.eh_proj.weight.shape, generator=g))
        for norm in (self.enorm, self.hnorm):
            norm.weight.copy_(1 + 0.1 * torch.randn(norm.weight.shape, generator=g))


# --- target rollouts (dsakv's engine) --------------------------------------------------------


@dataclass(frozen=True)
class Rollouts:
    """Greedy target continuations: `tokens[B, S]` (prompt then continuation) and the
    target's final-normed `hidden[B, S, H]` and fp32 `logits[B, S, V]` at every position."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    logits: torch.Tensor
    prompt_len: int


def _pool(model, tokens_per_req: int, reqs: int):
    from dsakv.memory import CacheLayout, DSAKVPool

    page = 16
    layout = CacheLayout.from_plan(
        model.config, model.plan, kv_cache_dtype="fp32", index_k_dtype="fp32", page_size=page
    )
    pages = -(-tokens_per_req // page)
    return DSAKVPool(layout, pages * reqs), pages * page


@torch.inference_mode()
def target_rollouts(model, prompts: torch.Tensor, new_tokens: int) -> Rollouts:
    """`prompts[B, P]` greedily continued by `model` for `new_tokens`, in one batch."""
    b, p = prompts.shape
    s = p + new_tokens
    pool, stride = _pool(model, s, b)
    slots = [torch.arange(r * stride, r * stride + s) for r in range(b)]
    tokens = prompts.tolist()
    batch = ForwardBatch.from_requests(tokens, [sl[:p] for sl in slots])
    hidden = [model(batch, pool).view(b, p, -1)]
    for i in range(new_tokens):
        nxt = model.compute_logits(hidden[-1][:, -1]).argmax(-1).tolist()
        for row, t in zip(tokens, nxt):
            row.append(t)
        batch = ForwardBatch.from_requests([[t] for t in nxt], [sl[: p + i + 1] for sl in slots])
        hidden.append(model(batch, pool).view(b, 1, -1))
    h = torch.cat(hidden, dim=1)
    logits = model.compute_logits(h.flatten(0, 1)).view(b, s, -1)
    return Rollouts(torch.tensor(tokens), h.float(), logits, p)


# --- fitting ---------------------------------------------------------------------------------


def seeded_prompts(g: torch.Generator, n: int, length: int, bos: int) -> torch.Tensor:
    """`n` seeded prompts: BOS, then printable ASCII bytes."""
    body = torch.randint(32, 127, (n, length - 1), generator=g)
    return torch.cat([torch.full((n, 1), bos), body], dim=1)


def draft_block(hf_model: nn.Module, seed: int) -> DraftBlock:
    """An unfitted MTP layer (`mtp="random"`): the target's last layer, random eh_proj."""
    n = hf_model.config.num_hidden_layers
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        block = DraftBlock(hf_model.config)
    finally:
        torch.random.set_rng_state(state)
    block.init_from(hf_model, _topk_source(hf_model.config, n - 1), seed)
    return block


def _topk_source(config: Any, layer: int) -> int:
    """The layer whose indexer `layer` uses, as the one LayerPlan decides it."""
    from dsakv.config import LayerPlan, ModelConfig

    return LayerPlan.from_config(ModelConfig.from_hf(config.to_dict())).topk_source(layer)


def fit_draft(
    hf_model: nn.Module,
    model,
    seed: int,
    *,
    prompts: int | None = None,
    prompt_lens: tuple[int, ...] = (16, 32, 48, 64),
    new_tokens: int = 32,
    steps: int = 60,
    batch: int = 32,
    lr: float = 1e-2,
) -> DraftBlock:
    """Distil the MTP layer from the target `model` (dsakv, fp32) on its own greedy
    continuations of seeded prompts: cross-entropy against the target's token i+2 at the
    continuation pairs (token i+1, h_i), i >= the prompt's last position (the prompt pairs
    are context only), the target's embedding and lm_head frozen; Adam with a one-cycle
    schedule over random minibatches of sequences. Many short rollouts, few passes: a few
    epochs over a few sequences overfit them. The prompts come in each of `prompt_lens`
    (equal shares): a tiny random target settles into a few dozen tokens, and which ones
    depends on the prompt's length, so one length leaves the draft blind to tokens that
    requests of another length produce all the time. `prompts` defaults to fewer rollouts
    for deeper targets (they cost target forwards), so every preset fits in well under a
    minute on CPU."""
    if prompts is None:
        prompts = min(256, max(batch, 2048 // model.config.num_hidden_layers))
    g = torch.Generator().manual_seed(seed)
    bos = hf_model.config.bos_token_id or 0
    embed = model.model.embed_tokens.weight.detach().float()
    head = model.lm_head.weight.detach().float()
    groups = []  # per prompt length: (token inputs, hidden inputs, labels, first position)
    for i, length in enumerate(prompt_lens):
        n = prompts // len(prompt_lens) + (i < prompts % len(prompt_lens))
        roll = target_rollouts(model, seeded_prompts(g, n, length, bos), new_tokens)
        first = length - 1
        groups.append(
            (
                F.embedding(roll.tokens[:, 1:], embed),
                roll.hidden[:, :-1].clone(),  # out of inference mode: autograd may save it
                roll.logits[:, 1 + first :].argmax(-1).clone(),
                first,
            )
        )
    block = draft_block(hf_model, seed)
    params = [p for name, p in block.named_parameters() if ".indexer." not in name]
    opt = torch.optim.Adam(params, lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        x_tok, x_h, labels, first = groups[step % len(groups)]
        rows = torch.randperm(x_tok.shape[0], generator=g)[:batch]
        opt.zero_grad()
        logits = F.linear(block(x_tok[rows], x_h[rows])[:, first:], head)
        F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten()).backward()
        opt.step()
        schedule.step()
    return block.eval()
