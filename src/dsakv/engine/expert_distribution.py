"""SGLang's expert distribution recorder (`--expert-distribution-recorder-mode`, its
/start_, /stop_ and /dump_expert_distribution_record): how many tokens each MoE layer routed
to each expert over a window, the counts EPLB reads, as `Engine`'s mixin. It reuses the
routing `return_routed_experts` records (`DSAForCausalLM.record_routing`): while a window
is open every step records it (eager, off the CUDA graphs). Under MTP the target's verify
pass counts every drafted token, rejected ones too, as SGLang's does; only the MTP layer's
own pass is not counted (SGLang's NextN pass runs outside its recorder too)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import deque
from typing import Any

import torch

from dsakv.errors import DsakvError

from .ranks import gather_outcome, said

log = logging.getLogger(__name__)

# This mixin's calls that every rank runs (`Engine.every_rank_call`)
EXPERT_DISTRIBUTION_CALLS = (
    "start_expert_record_here",
    "stop_expert_record_here",
    "dump_expert_record_here",
)


class ExpertRecord:
    """One rank's window: in "stat" mode each step's `[layers, experts]` counts (the last
    `buffer_size` steps; < 0: all, SGLang's), in "per_token" mode each step's routed ids."""

    def __init__(self, mode: str, buffer_size: int, layers: int, experts: int, moe: range):
        self.mode, self.layers, self.experts = mode, layers, experts
        self.moe = moe  # (`ModelConfig.moe_layers`: the layers that route, the last ones)
        self.buffer_size = buffer_size
        self.steps: deque[torch.Tensor] = deque(maxlen=buffer_size if buffer_size > 0 else None)
        self.records: list[dict[str, Any]] = []  # (per_token)

    def add(self, routed: torch.Tensor, ran: list[tuple[int, list[int]]], pass_id: int) -> None:
        """A step's routing `[tokens, layers, top_k]` (its real tokens only), over `ran`:
        each request's (first position, tokens) in row order. `pass_id`: the engine's
        forward passes before this one (SGLang's `forward_pass_id`, rising across windows:
        its EPLB reader refuses one seen twice in a directory)."""
        (n, _, k), first = routed.shape, self.moe.start
        ids = routed[:, first:].transpose(0, 1).reshape(len(self.moe), n * k).long()
        counts = torch.zeros(self.layers, self.experts, dtype=torch.int32, device=routed.device)
        counts[first:].scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
        if self.mode == "stat":
            self.steps.append(counts)
            return
        topk = routed.transpose(0, 1).cpu().clone()
        topk[:first] = -1  # (a dense layer routes nothing: SGLang's -1)
        self.records.append(
            dict(
                forward_pass_id=pass_id,
                input_ids=[t for _, tokens in ran for t in tokens],
                positions=[p + i for p, tokens in ran for i in range(len(tokens))],
                extend_seq_lens=[len(tokens) for _, tokens in ran],
                topk_ids_of_layer=topk,
                misc_objects=[],
                global_physical_count=counts.cpu(),
            )
        )

    def step_counts(self) -> torch.Tensor:
        """The window's steps' counts, `[steps, layers, experts]` int32 on the host."""
        if not self.steps:
            return torch.zeros(0, self.layers, self.experts, dtype=torch.int32)
        return torch.stack(list(self.steps)).cpu()

    def logical_count(self, ranks: list[torch.Tensor | None]) -> torch.Tensor:
        """SGLang's `logical_count` of every rank's `step_counts` (None: a rank that steps
        nothing of its own, plain TP's followers), summed step by step (DP attention's
        ranks step together): `[steps, layers, experts]`, a bounded buffer's shape
        `[buffer_size, ...]`, its unused steps zero."""
        counts = [c for c in ranks if c is not None]
        steps = max(max(c.shape[0] for c in counts), self.buffer_size)
        total = torch.zeros(steps, self.layers, self.experts, dtype=torch.int32)
        for c in counts:
            total[: c.shape[0]] += c
        return total


def _dump_dir() -> str:
    return os.environ.get("SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR") or "/tmp"


class ExpertDistributionMixin:
    """`Engine`'s recorder. Its host holds `expert_record` (the window, open or stopped and
    not dumped yet; None: none kept) and `recording` (whether steps add to it: what `_step`
    checks), None and False from `Engine.__init__`, the recorder's settings and the model's
    shape (`config`, `model_config`), and runs calls on every rank (`_on_every_rank`,
    `parallel`)."""

    expert_record: ExpertRecord | None
    recording: bool

    def _check_expert_recorder(self) -> None:
        if not self.model_config.has_moe:
            raise DsakvError(
                "expert distribution recording needs an MoE model: this one routes no token"
            )
        if self.config.expert_distribution_recorder_mode is None:
            raise DsakvError(
                "expert distribution recording is off: start the server with "
                "--expert-distribution-recorder-mode stat (or per_token)"
            )

    def start_expert_distribution_record(self) -> None:
        """SGLang's /start_expert_distribution_record: count every step's routing from now
        on (a window open already starts over)."""
        self._check_expert_recorder()
        self._on_every_rank("start_expert_record_here")

    def stop_expert_distribution_record(self) -> None:
        """SGLang's /stop_expert_distribution_record: stop counting (the counts are kept for
        the dump)."""
        self._check_expert_recorder()
        self._on_every_rank("stop_expert_record_here")

    def dump_expert_distribution_record(self) -> list[str]:
        """SGLang's /dump_expert_distribution_record: write what was counted (and start the
        counts over) under $SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR (default /tmp), as
        SGLang's files: "stat" one `expert_distribution_recorder_{time}.pt`, every rank's
        counts summed; "per_token" one `..._{time}_{rank}.pt` per rank that routes its own
        tokens. The paths written. A rank that cannot write is the server's fault, not the
        request's: an OSError (the server's 500), every rank's counts kept for another dump."""
        self._check_expert_recorder()
        outcome = self._on_every_rank("dump_expert_record_here", _dump_dir(), str(time.time()))
        if isinstance(outcome, str):
            raise OSError(f"the expert distribution was not saved (its counts are kept): {outcome}")
        return outcome

    def start_expert_record_here(self) -> None:
        if self.recording:  # (SGLang's warning, and its fresh start)
            log.warning(
                "expert distribution: already recording, starting over (forget to dump? "
                "/stop_ and /dump_expert_distribution_record first)"
            )
        self.expert_record, self.recording = self._new_expert_record(), True

    def _new_expert_record(self) -> ExpertRecord:
        c, m = self.config, self.model_config
        return ExpertRecord(
            c.expert_distribution_recorder_mode,
            c.expert_distribution_recorder_buffer_size,
            m.num_hidden_layers,
            m.n_routed_experts,
            m.moe_layers,
        )

    def stop_expert_record_here(self) -> None:
        if not self.recording:
            log.warning("expert distribution: not recording (start with /start_expert_...)")
        self.recording = False

    def dump_expert_record_here(self, out_dir: str, stamp: str) -> list[str] | str:
        """This rank's part of a dump: "stat" gathers every rank's counts (each rank's own
        tokens under DP attention; under plain TP only rank 0 steps, the others count 0)."""
        m, p = self.model_config, self.parallel
        # (never started: SGLang's dump of an empty window)
        rec = self.expert_record or self._new_expert_record()
        own = p.is_driver or p.config.dp_attention  # (it steps tokens of its own)
        mine = rec.step_counts() if rec.mode == "stat" and own else None
        counts = p.all_gather_objects(mine)
        path, why = None, None
        try:
            os.makedirs(out_dir, exist_ok=True)
            if rec.mode == "stat" and p.is_driver:
                data = dict(
                    rank=0,
                    logical_count=rec.logical_count(counts),
                    average_utilization_rate_over_window=None,
                )
                path = _save_new(data, out_dir, f"expert_distribution_recorder_{stamp}")
            elif rec.mode == "per_token" and own:
                records = [dict(rank=p.rank, gatherer_key="primary", **r) for r in rec.records]
                experts = torch.arange(m.n_routed_experts, dtype=torch.int32)
                trivial = experts.expand(m.num_hidden_layers, -1).clone()
                data = dict(records=records, last_physical_to_logical_map=trivial)
                path = _save_new(data, out_dir, f"expert_distribution_recorder_{stamp}_{p.rank}")
        except Exception as e:  # noqa: BLE001 - every rank hears it
            why = said(e)
        outcome = gather_outcome(p, path, why)
        if isinstance(outcome, str):  # (all or nothing: the counts wait for a dump that lands)
            if path is not None:
                with contextlib.suppress(OSError):
                    os.remove(path)
            return outcome
        # (dumped: a window still open starts over)
        self.expert_record = self._new_expert_record() if self.recording else None
        paths = [q for q in outcome if q is not None]
        if p.is_driver:
            log.info("expert distribution saved: %s", ", ".join(paths))
        return paths


def _save_new(data: dict, out_dir: str, name: str) -> str:
    """`torch.save` to `out_dir/name.pt`, or `name_1.pt`, ...: never over another dump
    (servers sharing a directory may dump within one tick of `time.time()`)."""
    path, n = os.path.join(out_dir, f"{name}.pt"), 0
    while True:
        try:
            with open(path, "xb") as f:
                torch.save(data, f)
            return path
        except FileExistsError:
            n += 1
            path = os.path.join(out_dir, f"{name}_{n}.pt")
