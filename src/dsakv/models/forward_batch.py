"""`ForwardBatch`: one engine step, flattened (prefill chunks and decode tokens mixed).

Request `r` contributes `extend_lens[r]` consecutive tokens; they sit at positions
`seq_lens[r] - extend_lens[r] .. seq_lens[r] - 1` of that request, so a decode token is
simply an extend of length 1. `req_slots[r]` maps every position of the request (this
step's tokens included) to its pool token slot; the model gathers context through it.

Under HiSparse the latent has its own device slot space (DESIGN.md §13): `latent_out_slots`
and `latent_req_slots` say where this step's latent rows go and where an extending
request's context latent is, and `hot` (the engine's `HotBuffers` step) maps a decode
request's top-k positions to device slots. Without HiSparse they are `out_slots`,
`req_slots` and None.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence


@dataclass(frozen=True, eq=False)
class ExtendCtx:
    """Every multi-token chunk of a step at once (`ForwardBatch.extend_rows`, in order):
    `slots` holds their requests' context slots one after another (`latent_slots` the
    same in the latent's own slot space: HiSparse's device slots), query e's context is
    `slots[start[e] : start[e] + lens[e]]` (`max_len` the longest, on the host), and
    `positions[e]` is its position. int32, as the one-request kernel wrappers take them
    (one compiled specialisation for both)."""

    slots: torch.Tensor
    latent_slots: torch.Tensor
    start: torch.Tensor
    lens: torch.Tensor
    max_len: int
    positions: torch.Tensor


@dataclass(eq=False)
class ForwardBatch:
    """What the engine hands the model for one step."""

    input_ids: torch.Tensor  # LongTensor[T]
    positions: torch.Tensor  # LongTensor[T], absolute position of each token in its request
    out_slots: torch.Tensor  # LongTensor[T], pool slot each token's KV is written to
    extend_lens: list[int]  # tokens of each request in this step (1 for decode)
    seq_lens: list[int]  # each request's context length after this step
    req_slots: list[
        torch.Tensor
    ]  # per request: LongTensor[seq_len], slots of positions 0..seq_len-1
    hot: Any = None  # HiSparse: the step's latent slots; resolves decode top-k to them

    def __post_init__(self) -> None:
        # Where latent rows go and where an extending request's latent is: the pool slots,
        # or under HiSparse the device latent slots the hot step chose.
        self.latent_out_slots = self.out_slots if self.hot is None else self.hot.out_slots
        self.latent_req_slots = self.req_slots if self.hot is None else self.hot.req_slots
        n = len(self.extend_lens)
        if len(self.seq_lens) != n or len(self.req_slots) != n:
            raise ValueError(
                f"extend_lens ({n}), seq_lens ({len(self.seq_lens)}) and req_slots "
                f"({len(self.req_slots)}) must have one entry per request"
            )
        t = self.input_ids.shape[0]
        if (
            sum(self.extend_lens) != t
            or self.positions.shape[0] != t
            or self.out_slots.shape[0] != t
        ):
            raise ValueError(
                f"sum(extend_lens)={sum(self.extend_lens)}, input_ids {t}, positions "
                f"{self.positions.shape[0]} and out_slots {self.out_slots.shape[0]} must agree"
            )
        for r, (e, s, slots) in enumerate(zip(self.extend_lens, self.seq_lens, self.req_slots)):
            if not 1 <= e <= s or slots.shape[0] != s:
                raise ValueError(
                    f"request {r}: extend_len {e}, seq_len {s}, {slots.shape[0]} req_slots "
                    "(need 1 <= extend_len <= seq_len == len(req_slots))"
                )

    @property
    def num_reqs(self) -> int:
        return len(self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @cached_property
    def prefix_lens(self) -> list[int]:
        """Context each request already had in the pool before this step."""
        return [s - e for s, e in zip(self.seq_lens, self.extend_lens)]

    @cached_property
    def extend_starts(self) -> list[int]:
        """Offset of each request's first token in the flattened batch."""
        starts, acc = [], 0
        for e in self.extend_lens:
            starts.append(acc)
            acc += e
        return starts

    def last_token_indices(self) -> torch.Tensor:
        """Index of each request's last token in the batch (the rows to compute logits for)."""
        ends = [s + e - 1 for s, e in zip(self.extend_starts, self.extend_lens)]
        return torch.tensor(ends, dtype=torch.long, device=self.input_ids.device)

    @property
    def is_decode_only(self) -> bool:
        return all(e == 1 for e in self.extend_lens)

    @cached_property
    def decode_reqs(self) -> list[int]:
        """Requests with one new token this step; attention batches them together."""
        return [r for r, e in enumerate(self.extend_lens) if e == 1]

    @cached_property
    def extend_reqs(self) -> list[int]:
        """Requests with a multi-token chunk this step (prefill); the backend attends them
        all at once (`extend_ctx`) or a request at a time."""
        return [r for r, e in enumerate(self.extend_lens) if e > 1]

    @cached_property
    def extend_rows(self) -> torch.Tensor | None:
        """Rows of the multi-token chunks' tokens in the flattened batch; None when the
        step holds nothing else (all rows)."""
        if not self.decode_reqs:
            return None
        lens = torch.tensor(self.extend_lens)
        rows = torch.arange(self.num_tokens)[(lens > 1).repeat_interleave(lens)]
        return rows.to(self.input_ids.device)

    @cached_property
    def extend_ctx(self) -> ExtendCtx:
        """The multi-token chunks' contexts flattened for one varlen launch; built once per
        step, shared by every layer."""
        reqs = self.extend_reqs
        ctx_lens = [self.seq_lens[r] for r in reqs]
        offsets = [0, *accumulate(ctx_lens)][:-1]
        per_token = torch.tensor([self.extend_lens[r] for r in reqs])
        table = torch.tensor([offsets, ctx_lens], dtype=torch.int32)
        e = int(per_token.sum())
        # One copy; each row 16-byte aligned, as a fresh tensor is (Triton specialises on it)
        meta = torch.zeros(2, -(-e // 4) * 4, dtype=torch.int32)
        meta[:, :e] = table.repeat_interleave(per_token, dim=1)
        meta = meta.to(self.input_ids.device)[:, :e]
        rows = self.extend_rows
        slots = _joined([self.req_slots[r] for r in reqs])
        latent = self.latent_req_slots is self.req_slots
        return ExtendCtx(
            slots=slots,
            latent_slots=slots if latent else _joined([self.latent_req_slots[r] for r in reqs]),
            start=meta[0],
            lens=meta[1],
            max_len=max(ctx_lens),
            positions=(self.positions if rows is None else self.positions[rows]).int(),
        )

    @cached_property
    def decode_tokens(self) -> torch.Tensor:
        """Rows of the decode requests' tokens in the flattened batch."""
        rows = [self.extend_starts[r] for r in self.decode_reqs]
        return torch.tensor(rows, dtype=torch.long, device=self.input_ids.device)

    @cached_property
    def decode_visible(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every padded position of `decode_ctx` `[B, W]` and whether it is inside its
        request's context; built once per step for the layers that attend everything."""
        table, lens = self.decode_ctx
        positions = torch.arange(table.shape[1], device=table.device).expand_as(table)
        return positions, positions < lens[:, None]

    @cached_property
    def decode_ctx(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode requests' context slots padded to `[B, max_len]` (pad = slot of position 0)
        and their context lengths `[B]`; built once per step, shared by every layer."""
        slots = [self.req_slots[r] for r in self.decode_reqs]
        lens = torch.tensor([s.shape[0] for s in slots], dtype=torch.long)
        return padded_slots(slots).to(self.input_ids.device), lens.to(self.input_ids.device)

    @cached_property
    def token_ctx(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's context: its request's slots padded to `[T, max_len]` (as
        `decode_ctx`) and its visible length (position + 1) `[T]`."""
        if self.is_decode_only:
            return self.decode_ctx
        if self.num_reqs == 1:  # (an MTP verify at one request: no padding, no gather)
            return self.req_slots[0].expand(self.num_tokens, -1), self.positions + 1
        table = padded_slots(self.req_slots).to(self.input_ids.device)
        rows = [r for r, e in enumerate(self.extend_lens) for _ in range(e)]
        return table[torch.tensor(rows, device=table.device)], self.positions + 1

    @classmethod
    def padded_decode(
        cls,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_slots: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
    ) -> ForwardBatch:
        """A decode-only batch over fixed-width device buffers, what a CUDA graph captures:
        every request looks `W = table.shape[1]` long to Python, so no branch depends on a
        real length; `lens[B]` masks on the device. Padding rows have `lens` 0 and
        `out_slots` −1 (the store kernels skip them)."""
        b, width = table.shape
        fb = cls(input_ids, positions, out_slots, [1] * b, [width] * b, list(table))
        fb.__dict__["decode_ctx"] = (table, lens)
        fb.__dict__["decode_tokens"] = torch.arange(b, device=input_ids.device)
        return fb

    @classmethod
    def from_requests(
        cls,
        new_tokens: Sequence[Sequence[int]],
        req_slots: Sequence[torch.Tensor | Sequence[int]],
        device: torch.device | str | None = None,
        hot: Any = None,
    ) -> ForwardBatch:
        """Build a batch from each request's new tokens and the slots of its whole context.

        `req_slots[r]` covers positions `0..seq_len-1`; the last `len(new_tokens[r])` of them
        are where this step's tokens go. Handy for tests and simple drivers. Under HiSparse
        (`hot`) a decoding request's tokens (a verify's) are decode rows of their own.
        """
        if hot is not None:
            new_tokens, req_slots = hot.decode_rows(new_tokens, req_slots)
        ids, pos, outs, ext, seqs, slots_list = [], [], [], [], [], []
        for toks, slots in zip(new_tokens, req_slots, strict=True):
            slots_t = torch.as_tensor(slots, dtype=torch.long, device=device)
            s, e = slots_t.shape[0], len(toks)
            ids.extend(int(t) for t in toks)
            pos.extend(range(s - e, s))
            outs.append(slots_t[s - e :])
            ext.append(e)
            seqs.append(s)
            slots_list.append(slots_t)
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(pos, dtype=torch.long, device=device),
            out_slots=torch.cat(outs) if outs else torch.zeros(0, dtype=torch.long, device=device),
            extend_lens=ext,
            seq_lens=seqs,
            req_slots=slots_list,
            hot=hot,
        )


def _joined(slots: list[torch.Tensor]) -> torch.Tensor:
    return slots[0] if len(slots) == 1 else torch.cat(slots)


def padded_slots(slots: Sequence[torch.Tensor]) -> torch.Tensor:
    """Slot lists stacked into `[n, longest]`, each padded with its own position 0's slot
    (a real slot, masked by length wherever it is read)."""
    if not slots:
        return torch.zeros(0, 0, dtype=torch.long)
    table = pad_sequence(list(slots), batch_first=True, padding_value=-1)
    return torch.where(table < 0, table[:, :1], table)  # (slots are >= 0)
