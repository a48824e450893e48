"""What one pipeline stage hands the next with each step (DESIGN.md §2 across stages): the
hidden rows `[T, H]` in the model's dtype, then, for each full layer before the next
stage whose top-k a layer from there on reads (`LayerPlan.carried_sources`), that
selection as int32 `[T, index_topk]` (`indexer.wire_rows`). The receiver knows T from
the step and every shape from the config, so nothing else travels.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .forward_batch import ForwardBatch
from .indexer import StepSelection, from_wire, wire_rows

if TYPE_CHECKING:
    from .dsa import DSAForCausalLM


def send_stage_output(
    model: DSAForCausalLM, x: torch.Tensor, selections: dict[int, StepSelection]
) -> None:
    """This stage's output rows and the selections the next stage reads, to the next
    stage's same TP rank."""
    parts, topk = model.model.parts, model.config.index_topk
    sources = model.plan.carried_sources(parts.stages[parts.stage + 1].start)
    model.parallel.send_next([x, *(wire_rows(selections[s], topk) for s in sources)])


def receive_stage_input(
    model: DSAForCausalLM, batch: ForwardBatch
) -> tuple[torch.Tensor, dict[int, StepSelection]]:
    """The previous stage's output rows and the carried selections, by source layer."""
    sources = model.plan.carried_sources(model.model.parts.layers.start)
    t, c = batch.num_tokens, model.config
    like = [((t, c.hidden_size), model.dtype)] + [((t, c.index_topk), torch.int32)] * len(sources)
    x, *rows = model.parallel.recv_prev(like, model.device)
    return x, {s: from_wire(s, batch, c.index_topk, r) for s, r in zip(sources, rows)}
