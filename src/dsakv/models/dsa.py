"""`DSAForCausalLM`: GLM-5.x (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`) over the pool.

Parameter names mirror the Hugging Face checkpoints (`model.layers.{i}.self_attn.…`), so
the loader maps tensors one to one (routed experts are stacked per layer). Which layers
build an indexer, and whether the MTP draft layer (`model.layers.{N}`) is built, comes
from the `LayerPlan` and nowhere else.
"""

from __future__ import annotations

from itertools import islice

import torch
from torch import nn

from dsakv.config import LayerPlan, ModelConfig
from dsakv.distributed.parallel import ParallelState
from dsakv.errors import DsakvError
from dsakv.kernels import TorchBackend, cpu_native
from dsakv.kernels.backend import Block, check_mode

from .decoder import LAYERS, NORM, DecoderLayer
from .forward_batch import ForwardBatch
from .layers import RMSNorm
from .moe import Experts
from .mtp import MTPLayer
from .parallel_layers import ParallelLMHead, VocabParallelEmbedding
from .rope import Rotary


class DSAModel(nn.Module):
    """Embedding, the target layers `layers[:N]`, the final norm; with a draft layer in the
    plan, `layers[N]` is the MTP layer (so its parameters carry checkpoint names)."""

    def __init__(
        self,
        config: ModelConfig,
        plan: LayerPlan,
        parallel: ParallelState,
        draft_vocab: tuple[bool, bool] = (False, False),
    ) -> None:
        super().__init__()
        n = config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(DecoderLayer(config, plan, i, parallel) for i in range(n))
        own_embed, own_head = draft_vocab
        for i in range(n, plan.num_total_layers):
            self.layers.append(
                MTPLayer(config, plan, i, parallel, own_embed=own_embed, own_head=own_head)
            )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DSAForCausalLM(nn.Module):
    """The target model, plus the MTP draft layer when the plan has a draft layer.
    Stateless: all KV lives in the pool (the draft layer's at layer N).

    With `parallel` it holds only this rank's shards (DESIGN.md §8); `forward` and
    `forward_draft` still return the full hidden states and `compute_logits` the full-vocab
    logits on every rank of the attention group. Every rank must call them for every step
    (an empty batch included, under DP attention), since they contain collectives.

    `draft_vocab` = (own embedding, own head): build the MTP layer's own vocab copies (the
    loader asks for them when the checkpoint has them, then drops those equal to the
    target's).
    """

    def __init__(
        self,
        config: ModelConfig,
        plan: LayerPlan,
        *,
        parallel: ParallelState | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        draft_vocab: tuple[bool, bool] = (False, False),
    ) -> None:
        super().__init__()
        if plan.num_layers != config.num_hidden_layers:
            raise ValueError(
                f"layer plan has {plan.num_layers} layers, model has {config.num_hidden_layers}"
            )
        if plan.num_draft_layers > 1:
            raise DsakvError(
                f"dsakv runs one MTP draft layer (chained); the plan has {plan.num_draft_layers}"
            )
        self.parallel = parallel or ParallelState.single()
        self.parallel.config.check_model(config)
        self.config, self.plan = config, plan
        self.model = DSAModel(config, plan, self.parallel, draft_vocab)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(config)
        self.ops = TorchBackend()  # the engine's backend replaces it (`use_backend`)
        self.target_layers = tuple(islice(self.model.layers, config.num_hidden_layers))
        if dtype is not None or device is not None:
            self.to(device=device, dtype=dtype)
            keep_fp32(self)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its activations'): the norms' weights hold it."""
        return self.model.norm.weight.dtype

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype its weight matrices are held in: `dtype`, or bf16 as the checkpoint
        stores them under fp32 compute (`store_matrices`; an FP8 checkpoint's projections
        are packed uint8 rows beside them, `loader._pack_fp8`)."""
        return self.model.embed_tokens.weight.dtype

    @property
    def num_draft_layers(self) -> int:
        """1 when the MTP layer is built (`forward_draft` runs), else 0."""
        return self.plan.num_draft_layers

    @property
    def mtp(self) -> MTPLayer:
        if not self.num_draft_layers:
            raise DsakvError("this model was loaded without its MTP layer (draft_layers=0)")
        return self.model.layers[self.config.num_hidden_layers]

    def set_attention_mode(self, mode: str) -> None:
        """`absorb` (default: attention on latent rows) or `expand` (per-head K/V first)."""
        if mode not in ("absorb", "expand"):
            raise ValueError(f"attention mode must be 'absorb' or 'expand', got {mode!r}")
        for layer in self.model.layers:
            check_mode(layer.self_attn.ops, mode)
            layer.self_attn.math.mode = mode

    def use_backend(self, backend: TorchBackend) -> None:
        """Every layer's attention and indexer run their hot ops through `backend`."""
        self.ops = backend
        for layer in self.model.layers:
            check_mode(backend, layer.self_attn.mode)
            layer.self_attn.ops = backend
            if hasattr(layer.self_attn, "indexer"):
                layer.self_attn.indexer.ops = backend
            if hasattr(layer.mlp, "experts"):
                layer.mlp.experts.ops = backend

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool) -> torch.Tensor:
        """Runs every layer, writing this step's KV into `pool`; returns normed hidden `[T, H]`."""
        x = self.model.embed_tokens(batch.input_ids)
        cos, sin = self.rotary(batch.positions, x.dtype)
        x = self.ops.block(LAYERS, batch, self, self.target_layers, x, cos, sin, batch, pool)
        return self.ops.block(NORM, batch, self.model.norm, x)

    @torch.inference_mode()
    def forward_draft(self, batch: ForwardBatch, pool, hidden: torch.Tensor) -> torch.Tensor:
        """One MTP step over `batch` (same batching rules as `forward`), writing layer N's
        latent and index-K into `pool`.

        `batch.input_ids` are the tokens to embed (each row's NEXT token), positions and
        slots are the draft positions, `hidden[T, H]` the h rows: the target's final-normed
        hidden (position i pairs token i+1 with h_i), or this layer's own previous output
        when chaining. Returns `shared_head.norm(x)` `[T, H]`: draft logits via
        `compute_logits(..., draft=True)`, and the h of the next chain step.
        """
        mtp = self.mtp
        if hidden.shape != (batch.num_tokens, self.config.hidden_size):
            raise ValueError(
                f"hidden is {tuple(hidden.shape)}, expected ({batch.num_tokens}, "
                f"{self.config.hidden_size}) (one h row per draft token)"
            )
        embed = getattr(mtp, "embed_tokens", self.model.embed_tokens)
        x = embed(batch.input_ids)
        cos, sin = self.rotary(batch.positions, x.dtype)
        return mtp.draft(x, hidden, cos, sin, batch, pool)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, *, draft: bool = False) -> torch.Tensor:
        """`hidden[N, H]` (e.g. `hidden[batch.last_token_indices()]`) -> fp32 logits `[N, vocab]`.

        `draft=True`: through the MTP layer's own head when the checkpoint's differs from
        the target's lm_head (else the same lm_head).
        """
        head = getattr(self.mtp.shared_head, "head", self.lm_head) if draft else self.lm_head
        return self.ops.block(LM_HEAD, hidden.shape[0], head, hidden)


def lm_head(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    return head(hidden)


def _native_head(head: nn.Module, hidden: torch.Tensor):
    # (one rank's vocab rows need their all-gather: the eager head does it)
    whole = isinstance(head, ParallelLMHead) and head.parallel.attn_size == 1
    if not whole or not cpu_native.fits(head) or hidden.dtype != torch.float32:
        return NotImplemented
    return cpu_native.linear(hidden, head.weight)


# The LM head (of the rows sampled from), each row on its own when native.
LM_HEAD = Block(lm_head, _native_head)


def store_matrices(model: nn.Module, dtype: torch.dtype) -> None:
    """The weight matrices (linear layers, stacked experts, embeddings, heads) held in
    `dtype` (a bf16 checkpoint's, as stored) while the rest keeps the compute dtype: every op
    widens them exactly where it reads them, so the model computes what it computes with
    them widened at load, from half the bytes. Call `keep_fp32` after."""
    compute = model.model.norm.weight.dtype
    for mod in model.modules():
        if isinstance(mod, (nn.Linear, Experts, VocabParallelEmbedding, ParallelLMHead)):
            mod.to(dtype)
        if isinstance(mod, VocabParallelEmbedding) and dtype != compute:
            mod.compute_dtype = compute


def keep_fp32(model: nn.Module) -> None:
    """Router weights/bias and indexer weights_proj stay fp32 whatever the model dtype."""
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate") or name.endswith("indexer.weights_proj"):
            mod.float()
