"""Pipeline stages in the model (DESIGN.md §2 across stages): which parts a rank's stage
builds (`StageParts`; another stage's a `MissingLayer`), and what one stage hands the next
with each step: the hidden rows `[T, H]` in the model's dtype, then, for each full layer
before the next stage whose top-k a layer from there on reads
(`LayerPlan.carried_sources`), that selection as int32 `[T, index_topk]` (`wire_rows`).
The receiver knows T from the step and every shape from the config, so nothing else
travels; both ends read the message's shapes and dtypes from `_wire`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from dsakv.config import LayerPlan, ModelConfig
from dsakv.config.layer_plan import builds_embedding
from dsakv.distributed.parallel import ParallelState, Wire
from dsakv.errors import DsakvError

from .forward_batch import ForwardBatch
from .indexer import StepSelection, scored, step_selection

if TYPE_CHECKING:
    from .dsa import DSAForCausalLM


class MissingLayer(nn.Module):
    """A part of the model another pipeline stage holds (vLLM's PPMissingLayer): no
    parameters, so the parts this stage holds keep their checkpoint names and indices;
    running it is an error naming the stage that holds it."""

    def __init__(self, name: str, stage: int, here: int) -> None:
        super().__init__()
        self.name, self.stage, self.here = name, stage, here

    def error(self) -> DsakvError:
        """Why this part does not run here: the stage that holds it."""
        return DsakvError(
            f"{self.name} is held by pipeline stage {self.stage}, not by this rank's stage "
            f"{self.here}"
        )

    def forward(self, *args, **kwargs):
        raise self.error()


class StageParts:
    """Which parts of the model a rank's pipeline stage builds (all of them with one stage):
    its target layers; the embedding on the first stage, and on the last where the MTP
    layer or a tied lm_head reads it; the final norm, lm_head and the MTP layer on the
    last."""

    def __init__(self, config: ModelConfig, plan: LayerPlan, parallel: ParallelState) -> None:
        self.stages = parallel.config.stage_layers(config.num_hidden_layers)
        self.stage, self.last = parallel.stage, len(self.stages) - 1
        self.layers = self.stages[self.stage]
        self.is_last = self.stage == self.last  # (the final norm and lm_head here)
        self.draft = self.is_last and plan.num_draft_layers > 0
        self.embed = builds_embedding(
            first=self.stage == 0,
            last=self.is_last,
            draft=self.draft,
            tied=config.tie_word_embeddings,
        )

    def holder(self, layer: int) -> int:
        """The stage that runs `layer` (a draft layer: the last)."""
        return next((s for s, r in enumerate(self.stages) if layer in r), self.last)

    def missing(self, name: str, stage: int) -> MissingLayer:
        return MissingLayer(name, stage, self.stage)


def send_stage_output(
    model: DSAForCausalLM,
    batch: ForwardBatch,
    x: torch.Tensor,
    selections: dict[int, StepSelection],
) -> None:
    """This stage's output rows and the selections the next stage reads, to the next
    stage's same TP rank."""
    parts, topk = model.model.parts, model.config.index_topk
    sources = model.plan.carried_sources(parts.stages[parts.stage + 1].start)
    rows = [wire_rows(selections[s], topk) for s in sources]
    model.parallel.send_next([x, *rows], _wire(model, batch, len(sources)))


def receive_stage_input(
    model: DSAForCausalLM, batch: ForwardBatch
) -> tuple[torch.Tensor, dict[int, StepSelection]]:
    """The previous stage's output rows and the carried selections, by source layer."""
    sources = model.plan.carried_sources(model.model.parts.layers.start)
    like = _wire(model, batch, len(sources))
    x, *rows = model.parallel.recv_prev(like, model.device)
    topk = model.config.index_topk
    return x, {s: from_wire(s, batch, topk, r) for s, r in zip(sources, rows)}


def _wire(model: DSAForCausalLM, batch: ForwardBatch, selections: int) -> Wire:
    """The hand-off's shapes and dtypes, the sender's and the receiver's alike: the hidden
    rows in the model's dtype, then `selections` int32 top-k rows."""
    t, c = batch.num_tokens, model.config
    return [((t, c.hidden_size), model.dtype)] + [((t, c.index_topk), torch.int32)] * selections


def wire_rows(sel: StepSelection, topk: int) -> torch.Tensor:
    """The positions a step's selection scored as int32 `[T, topk]`, one row per token of the
    step (−1 where a token's positions were not scored): what a pipeline stage sends on
    for the next stage's layers that read it (`from_wire`)."""
    b = sel.batch
    long, decode = scored(b, topk) or ((), False)
    rows = torch.full((b.num_tokens, topk), -1, dtype=torch.int32, device=b.positions.device)
    for r in long:
        start, e = b.extend_starts[r], b.extend_lens[r]
        rows[start : start + e] = sel.per_req[r].positions
    if decode:
        rows[b.decode_tokens] = sel.decode.positions.to(torch.int32)
    return rows


def from_wire(layer: int, batch: ForwardBatch, topk: int, rows: torch.Tensor) -> StepSelection:
    """`wire_rows`' selection back as the `StepSelection` the sending stage had."""
    scoring = scored(batch, topk)
    long, decodes = scoring or ((), False)
    chosen = decode = None
    if long:
        parts = [rows[batch.extend_starts[r] :][: batch.extend_lens[r]] for r in long]
        chosen = (parts[0] if len(parts) == 1 else torch.cat(parts)).long()
    if decodes:
        decode = rows[batch.decode_tokens].long()
    return step_selection(layer, batch, scoring, chosen, decode)
