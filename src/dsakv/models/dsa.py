"""`DSAForCausalLM`: GLM-5.x (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`) over the pool.

Parameter names mirror the Hugging Face checkpoints (`model.layers.{i}.self_attn.…`), so
the loader maps tensors one to one (routed experts are stacked per layer). Which layers
build an indexer, and whether the MTP draft layer (`model.layers.{N}`) is built, comes
from the `LayerPlan` and nowhere else.

Under pipeline parallelism a rank builds only its stage's parts (`StageParts`): its target
layers, the embedding on the first stage, the final norm, lm_head and the MTP layer on
the last; every other part is a parameterless `MissingLayer`, so names and `layers[i]`
indices stay the checkpoint's. A stage receives the previous stage's hidden rows and the
top-k selections its layers read from earlier full layers (`stages`), and sends its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from dsakv.config import LayerPlan, ModelConfig
from dsakv.config.layer_plan import check_one_draft_layer
from dsakv.distributed.parallel import ParallelState
from dsakv.errors import DsakvError
from dsakv.kernels import TorchBackend, cpu_native
from dsakv.kernels.backend import Block

from .decoder import NORM, DecoderLayer, in_turn, layer_loop
from .forward_batch import ForwardBatch
from .layers import RMSNorm
from .lora import LoraSlots
from .moe import Experts
from .mtp import MTPLayer
from .parallel_layers import ParallelLMHead, VocabParallelEmbedding
from .rope import Rotary
from .stages import MissingLayer, StageParts, receive_stage_input, send_stage_output


class DSAModel(nn.Module):
    """Embedding, the target layers `layers[:N]`, the final norm; with a draft layer in the
    plan, `layers[N]` is the MTP layer (so its parameters carry checkpoint names). Parts
    another pipeline stage holds are `MissingLayer`s (`StageParts`)."""

    def __init__(
        self,
        config: ModelConfig,
        plan: LayerPlan,
        parallel: ParallelState,
        draft_vocab: tuple[bool, bool] = (False, False),
    ) -> None:
        super().__init__()
        parts = StageParts(config, plan, parallel)
        h, n = config.hidden_size, config.num_hidden_layers
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, h, parallel)
            if parts.embed
            else parts.missing("model.embed_tokens", 0)
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, plan, i, parallel)
            if i in parts.layers
            else parts.missing(f"model.layers.{i}", parts.holder(i))
            for i in range(n)
        )
        own_embed, own_head = draft_vocab
        for i in range(n, plan.num_total_layers):
            self.layers.append(
                MTPLayer(config, plan, i, parallel, own_embed=own_embed, own_head=own_head)
                if parts.draft
                else parts.missing(f"model.layers.{i}", parts.last)
            )
        self.norm = (
            RMSNorm(h, config.rms_norm_eps)
            if parts.is_last
            else parts.missing("model.norm", parts.last)
        )
        self.parts = parts


class DSAForCausalLM(nn.Module):
    """The target model, plus the MTP draft layer when the plan has a draft layer.
    Stateless: all KV lives in the pool (the draft layer's at layer N).

    With `parallel` it holds only this rank's shards (DESIGN.md §8); `forward` and
    `forward_draft` still return the full hidden states and `compute_logits` the full-vocab
    logits on every rank of the attention group. Every rank must call them for every step
    (an empty batch included, under DP attention), since they contain collectives. Under
    pipeline parallelism it holds its stage's parts (`StageParts`): `forward` runs its
    layers between the stages' hand-offs, and only the last stage has a head and the MTP
    layer (`forward_logits` gives no logits before it).

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
        check_one_draft_layer(plan)
        self.parallel = parallel or ParallelState.single()
        self.parallel.config.check_model(config)
        self.config, self.plan = config, plan
        self.model = DSAModel(config, plan, self.parallel, draft_vocab)
        parts = self.model.parts
        self.lm_head = (
            ParallelLMHead(config.vocab_size, config.hidden_size, self.parallel)
            if parts.is_last
            else parts.missing("lm_head", parts.last)
        )
        self.tie_head()
        self.rotary = Rotary(config)
        self.ops = TorchBackend()  # the engine's backend replaces it (`use_backend`)
        # This stage's target layers, in order (every target layer with one stage)
        self.target_layers = tuple(self.model.layers[parts.layers.start : parts.layers.stop])
        # Inside `record_routing`, the `[tokens, layers, top_k]` it fills; None outside
        self.routed: torch.Tensor | None = None
        # LoRA adapter slots (`dsakv.models.lora.LoraSlots`; --enable-lora), else None
        self.lora: LoraSlots | None = None
        if dtype is not None or device is not None:
            self.to(device=device, dtype=dtype)
            keep_fp32(self)

    def tie_head(self) -> None:
        """lm_head reads the embedding's weight (`tie_word_embeddings`), on the stage that
        holds the head."""
        if self.config.tie_word_embeddings and self.model.parts.is_last:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the model computes in (its activations'): the norms' weights hold it
        (the first layer's: every pipeline stage has one)."""
        return self.target_layers[0].input_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.target_layers[0].input_layernorm.weight.device

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` belongs to a part this pipeline stage builds (any
        name outside the model's parts, unexpected, counts as held: the loader says)."""
        mod: nn.Module | None = self
        for part in name.split(".")[:-1]:
            mod = getattr(mod, part, None)
            if not isinstance(mod, nn.Module):
                return True
            if isinstance(mod, MissingLayer):
                return False
        return True

    @property
    def num_draft_layers(self) -> int:
        """1 when the MTP layer is built (`forward_draft` runs), else 0."""
        return self.plan.num_draft_layers

    @property
    def mtp(self) -> MTPLayer:
        if not self.num_draft_layers:
            raise DsakvError("this model was loaded without its MTP layer (draft_layers=0)")
        layer = self.model.layers[self.config.num_hidden_layers]
        if isinstance(layer, MissingLayer):
            raise layer.error()
        return layer

    @property
    def built_layers(self) -> tuple[DecoderLayer, ...]:
        """The decoder layers this rank built: its stage's target layers, and the MTP layer
        where it holds it."""
        return tuple(m for m in self.model.layers if isinstance(m, DecoderLayer))

    def use_backend(self, backend: TorchBackend) -> None:
        """Every layer's attention and indexer run their hot ops through `backend`."""
        self.ops = backend
        for layer in self.built_layers:
            layer.self_attn.ops = backend
            if hasattr(layer.self_attn, "indexer"):
                layer.self_attn.indexer.ops = backend
            if hasattr(layer.mlp, "experts"):
                layer.mlp.experts.ops = backend

    @contextlib.contextmanager
    def record_routing(self, tokens: int) -> Iterator[torch.Tensor]:
        """Within it, each `forward` of `tokens` tokens records the experts every target
        MoE layer routed each token to (SGLang's return_routed_experts), into the int32
        `[tokens, num_hidden_layers, top_k]` it yields (a dense layer's rows stay 0, as
        SGLang's). Steps outside it record nothing and pay nothing. The MTP layer's
        routing is not the target's: never recorded. The native layer loop records it as
        the per-layer blocks do (the same bits)."""
        ids = torch.zeros(self.config.routed_shape(tokens), dtype=torch.int32, device=self.device)
        held = self.model.parts.layers
        moe = [(i, self.model.layers[i]) for i in self.config.moe_layers if i in held]
        for i, layer in moe:
            layer.routed = ids[:, i]
        self.routed = ids
        try:
            yield ids
        finally:
            self.routed = None
            for _, layer in moe:
                layer.routed = None

    def forget_addresses(self) -> None:
        """Drop the native forms (`cpu_native`: the layers' blocks, the indexers' inputs, the
        layer loops), which hold the weights' and the pool's addresses: each is made again
        on its next use, after sleep mode moved them (`Engine.resume_memory_occupation`)."""
        for module in self.modules():
            if hasattr(module, "_native"):
                module._native = False
            module.__dict__.pop("_layer_loop", None)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool) -> torch.Tensor:
        """Runs every layer, writing this step's KV into `pool`; returns normed hidden `[T, H]`.

        Under pipeline parallelism, this stage's layers: the first stage embeds, a later one
        takes the previous stage's rows and carried selections, a stage before the last
        sends its own on and returns its (un-normed) output rows."""
        loop = self._loop(batch, pool)
        if loop is not None:
            ids, positions, slots = batch.input_ids, batch.positions, batch.out_slots
            return loop(ids, positions, slots, *batch.token_ctx, routed=self.routed)
        parts, selections = self.model.parts, {}
        if parts.stage == 0:
            x = self.model.embed_tokens(batch.input_ids)
        else:
            x, selections = receive_stage_input(self, batch)
        cos, sin = self.rotary(batch.positions, x.dtype)
        x = in_turn(self.target_layers, x, cos, sin, batch, pool, selections)
        if not parts.is_last:
            send_stage_output(self, batch, x, selections)
            return x
        return self.ops.block(NORM, batch, self.model.norm, x)

    @torch.inference_mode()
    def forward_logits(
        self, batch: ForwardBatch, pool, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and the fp32 logits of its output's `rows` (`compute_logits`): one
        native call where the step has one."""
        loop = self._loop(batch, pool)
        if loop is not None and loop.has_head:
            table, lens = batch.token_ctx
            args = (batch.input_ids, batch.positions, batch.out_slots, table, lens, None, rows)
            return loop(*args, routed=self.routed)
        hidden = self.forward(batch, pool)
        if not self.model.parts.is_last:  # (a stage before the last: no logits here)
            return hidden, None
        return hidden, self.compute_logits(hidden[rows.to(hidden.device)])

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
        self._check_hidden(batch, hidden)
        loop = self._loop(batch, pool, draft=True)
        if loop is not None:
            table, lens = batch.token_ctx
            return loop(batch.input_ids, batch.positions, batch.out_slots, table, lens, hidden)
        embed = getattr(mtp, "embed_tokens", self.model.embed_tokens)
        x = embed(batch.input_ids)
        cos, sin = self.rotary(batch.positions, x.dtype)
        return mtp.draft(x, hidden, cos, sin, batch, pool)

    @torch.inference_mode()
    def draft_chain(
        self,
        batch: ForwardBatch,
        pool,
        hidden: torch.Tensor,
        rows: torch.Tensor,
        want: torch.Tensor,
        chain: torch.Tensor,
    ) -> torch.Tensor | None:
        """`forward_draft` over `batch` (each request's catch-up), then the MTP layer's
        greedy drafts of each request in a chain, in one native call: up to `want[r]` of
        them, from its row `rows[r]` of that step's output on, the chain's positions at
        `chain[r]`'s slots (`[n, W]`, its whole context) -> `[n, max(want)]`, -1 past a
        request's want. None where the step has no native form (the caller chains in
        Python then, over `forward_draft` and `compute_logits`: the same tokens)."""
        self._check_hidden(batch, hidden)
        loop = self._loop(batch, pool, draft=True)
        if loop is None or not loop.has_head:
            return None
        table, lens = batch.token_ctx
        args = (batch.input_ids, batch.positions, batch.out_slots, table, lens, hidden)
        return loop.drafts(*args, rows, want, chain)

    def _check_hidden(self, batch: ForwardBatch, hidden: torch.Tensor) -> None:
        if hidden.shape != (batch.num_tokens, self.config.hidden_size):
            raise ValueError(
                f"hidden is {tuple(hidden.shape)}, expected ({batch.num_tokens}, "
                f"{self.config.hidden_size}) (one h row per draft token)"
            )

    def _loop(self, batch: ForwardBatch, pool, draft: bool = False):
        """The step as one native call (`cpu_native.LayerLoop`): under the deterministic
        mode only (the loop makes its calls), and only for steps whose tokens each attend
        over their own selection (decode, MTP verify and draft rows); prefill chunks keep
        the per-layer path, whose attention widens a shared context once for several
        queries. Made once per pool and kept on the target model or the MTP layer; None
        where some part has no native form, and for a target step with adapter rows (the
        loop has no LoRA slots: its layers' blocks run eager, `lora.adapting`)."""
        short = 0 < max(batch.extend_lens, default=0) <= LOOP_EXTEND  # (DP: an idle rank's 0)
        if not short or batch.hot is not None or not getattr(self.ops, "deterministic", False):
            return None
        if self.parallel.world_size > 1:  # (the loop runs the whole step, no collectives)
            return None
        if not draft and self.lora is not None and self.lora.used:
            return None
        owner = self.mtp if draft else self
        made_for, loop = getattr(owner, "_layer_loop", (None, None))
        if made_for is not pool:
            loop = self._make_loop(pool, draft)
            owner._layer_loop = (pool, loop)
        return loop

    def _make_loop(self, pool, draft: bool):
        embed, head = self.model.embed_tokens, self.lm_head
        if draft:
            mtp = self.mtp
            if not mtp.native_io():
                return None
            embed = getattr(mtp, "embed_tokens", embed)
            norm = mtp.shared_head.norm
            e, h = mtp.enorm, mtp.hnorm
            nextn = (e.weight, h.weight, mtp.eh_proj.weight, e.eps, h.eps)
            head = getattr(mtp.shared_head, "head", head)
        else:
            norm, nextn = self.model.norm, None
        head = head.weight if _reads_in_place(head) else None
        whole = embed.parallel.attn_size == 1
        if not whole or not cpu_native.fits(embed) or not cpu_native.fits(norm):
            return None
        cos_sin = self.rotary.tables(torch.device("cpu"))
        parts = cpu_native.StepParts(embed.weight, cos_sin, (norm.weight, norm.eps), nextn, head)
        return layer_loop((self.mtp,) if draft else self.target_layers, pool, parts)

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


def _reads_in_place(head: nn.Module) -> bool:
    """Whether the layer loop's native head reads `head`'s weight as it is: every vocab row
    on this rank, a kind it reads."""
    return _native_head_fits(head) and head.parallel.attn_size == 1


def _native_head_fits(head: nn.Module) -> bool:
    return isinstance(head, ParallelLMHead) and cpu_native.fits(head)


def _native_head(head: nn.Module, hidden: torch.Tensor):
    """This rank's vocab rows natively, gathered as the eager head's are."""
    if not _native_head_fits(head) or hidden.dtype != torch.float32:
        return NotImplemented
    return head.gather(cpu_native.linear(hidden, head.weight))


# Steps whose requests extend by at most this many tokens (decode, MTP verify and draft
# rows) run as one native call (`DSAForCausalLM._loop`).
LOOP_EXTEND = 16
# The LM head (of the rows sampled from), each row on its own when native.
LM_HEAD = Block(lm_head, _native_head)


def store_matrices(model: nn.Module, dtype: torch.dtype) -> None:
    """The weight matrices (linear layers, stacked experts, embeddings, heads) held in
    `dtype` (a bf16 checkpoint's, as stored) while the rest keeps the compute dtype: every op
    widens them exactly where it reads them, so the model computes what it computes with
    them widened at load, from half the bytes. Call `keep_fp32` after."""
    compute = model.dtype
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
