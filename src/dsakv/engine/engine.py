"""`Engine`: the step loop. Scheduler → model forward over the paged pool → sampler.

Its arguments are `EngineConfig` (`config`); what runs between steps on every rank comes
with its mixins: sleep mode (`sleep`), weight updates (`weight_update`), profiles
(`profiler`), the expert distribution (`expert_distribution`), their outcomes read alike
(`ranks`)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import reprlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from itertools import accumulate
from pathlib import Path
from typing import Any

import torch

from dsakv.config import HiSparseConfig, LayerPlan, ModelConfig
from dsakv.config.checkpoint import model_identity
from dsakv.config.hisparse import writes_host_latent
from dsakv.distributed import weight_sync
from dsakv.distributed.parallel import ParallelState, destroy_parallel, is_dist_error
from dsakv.distributed.weight_sync import WeightGroup
from dsakv.errors import ConfigError, DsakvError, PromptTooLong, is_int, load_json, one_line
from dsakv.kernels import cpu_native, select_backend
from dsakv.memory import CacheLayout, plan_capacity, plan_hisparse
from dsakv.memory.allocator import PageAllocator
from dsakv.memory.capacity import (
    GIB,
    HostTierPlan,
    check_holds_a_page,
    host_tier_pages,
    node_sums,
    rank_host_bytes,
    stage_kv_budget_bytes,
)
from dsakv.memory.host import HostPool
from dsakv.memory.pool import DSAKVPool, check_fits, host_memory_bytes
from dsakv.memory.release import Stash
from dsakv.memory.storage import storage_namespace
from dsakv.metrics import STEP_TOKEN_BOUNDS, STEP_TOKEN_KEYS, LoraRequests, bucket_index

from .config import MAX_GRAPH_BATCH, EngineConfig, has_tokenizer, resolve_device
from .cuda_graph import DecodeGraphs
from .detokenizer import TokenTexts, chars_per_token
from .expert_distribution import EXPERT_DISTRIBUTION_CALLS, ExpertDistributionMixin
from .grammar import GrammarCache
from .hisparse import HotBuffers
from .kv_events import KVEventPublisher
from .l3 import L3Cache, zero_counters
from .lora import LoraRef, LoraRegistry
from .model_runner import ModelRunner
from .prefix_cache import PrefixCache
from .profiler import PROFILE_CALLS, ProfilerMixin
from .ranks import gather_outcome, said
from .request import Capture, Request, link_choices
from .sampling import (
    THINK_MARKERS,
    Sampler,
    SamplingParams,
    ThinkingBudget,
    allow,
    bad_word_ids,
    ban,
    banned_words_next,
    bias_tensors,
    finite_rows,
    gather_ids,
    gather_logprobs,
    penalize,
    processed_logprobs,
    token_mask,
)
from .scheduler import Scheduler, SchedulerConfig
from .sleep import SLEEP_CALLS, SleepMixin
from .speculative import Drafter, MTPDrafter, NGramDrafter, verify
from .weight_update import WEIGHT_CALLS, WeightUpdateMixin

log = logging.getLogger(__name__)
# What sizes the device pool, for its errors
POOL_FLAGS = "--kv-budget-gib, --num-pages, --max-total-tokens, --mem-fraction-static"


class RankDied(DsakvError):
    """Another rank of this engine died or failed (not bad input): the CLI exits 1."""

    exit_code = 1


def keep_freed_memory() -> None:
    """Ask glibc to keep freed heap memory instead of trimming it back to the OS.

    A CPU decode step allocates and frees tens of MB of temporaries per layer; by default
    glibc returns that memory after each free and the next step page-faults it back in,
    which measured as ~40% of step time. Blocks up to 32 MB (glibc's largest mmap
    threshold) come from the heap too: setting the trim threshold freezes the mmap
    threshold at 128 KB, and a 10 MB block of gathered rows (32 requests) was then mapped
    and faulted in afresh on every call, 4-6× slower. A no-op where glibc is absent.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
        libc.mallopt(_M_TOP_PAD, 64 << 20)
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)
    except (OSError, AttributeError):
        pass


# What `Engine.every_rank_call` runs on every rank: each mixin's calls
_EVERY_RANK = frozenset(
    SLEEP_CALLS
    + WEIGHT_CALLS
    + PROFILE_CALLS
    + EXPERT_DISTRIBUTION_CALLS
    + ("read_lora_on_rank", "drop_lora_on_rank", "hisparse_replicas", "gathered_integrity")
    + ("stage_layer_counters",)  # (rank 0's counters under --pp-size)
    # (DP attention's /flush_cache, pause "retract", and the pause itself)
    + ("gathered_flush", "retract_all", "set_paused")
)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc mallopt parameters


def _synced_clock(device: torch.device) -> float:
    """`perf_counter` once the device has run what was queued on it: a forward pass timed as
    it ran, not as it was launched (--collect-detailed-traces model: two syncs a step)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _time_step(
    batch: list[tuple[Request, int]], scheduling: float, scheduled: float, forward: float
) -> None:
    """Add a step's times to each request it ran (`collect_detailed_traces`): `scheduling`
    the scheduler's, the run from `scheduled` to now, `forward` the model's forward pass."""
    run = time.perf_counter() - scheduled
    for req, _ in batch:
        m = req.metrics
        m.scheduler_time += scheduling
        m.execute_time += run
        m.forward_time += forward


def _current_gpu(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` as the thread's current GPU for a step: `set_device` at build time holds
    for the building thread only, and an engine stepped on another launched on GPU 0."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclass
class EngineStats:
    """Counters the server's /metrics and the benchmark read."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    computed_tokens: int = 0  # tokens run through the model (prefill chunks + decode)
    finished_requests: int = 0
    aborted_requests: int = 0
    steps: int = 0
    step_time_s: float = 0.0
    draft_tokens: int = 0  # drafts verified (MTP or n-gram)
    accepted_tokens: int = 0  # ... and kept
    verify_steps: int = 0  # request-steps that verified drafts
    decode_steps: int = 0  # request-steps past the prompt (each one target pass for it)
    # steps that ran tokens, by how many: one count a bucket of `STEP_TOKEN_BOUNDS` (+Inf
    # last); under DP summed over the ranks, where `steps` is rank 0's (`DPEngine.counters`)
    step_tokens: list[int] = field(default_factory=lambda: [0] * len(STEP_TOKEN_KEYS))

    def ran(self, tokens: int) -> None:
        """A step ran `tokens` through the model."""
        self.computed_tokens += tokens
        if tokens:  # (an idle DP rank's step)
            self.step_tokens[bucket_index(STEP_TOKEN_BOUNDS, tokens)] += 1


class Engine(SleepMixin, WeightUpdateMixin, ProfilerMixin, ExpertDistributionMixin):
    """Owns the model, the KV pool, the allocator, the prefix cache and the scheduler.

    Under tensor parallelism one `Engine` runs on every rank over that rank's shards and
    pool replica; rank 0's schedules and samples, and the others replay its model calls
    (`ModelRunner.serve`). Under pipeline parallelism a rank's engine holds its stage's
    layers and a pool of them only (`CacheLayout.for_stage`), of the page count every
    stage holds. Under DP attention each rank schedules its own requests
    (`dsakv.engine.dp`).
    """

    def __init__(
        self,
        config: EngineConfig,
        parallel: ParallelState | None = None,
        device: torch.device | None = None,
    ) -> None:
        from dsakv.models.loader import load_model, torch_dtype

        self.config = config
        self.parallel = parallel or ParallelState.single()
        self.device = device or resolve_device(config.device)
        self._timed = config.detailed_traces  # what each step times per request (`_step`)
        if self.device.type == "cpu":
            keep_freed_memory()
        else:  # Triton launches, graph captures and events use the thread's current GPU
            torch.cuda.set_device(self.device)
        auto = "float32" if self.device.type == "cpu" else "bfloat16"
        dtype = torch_dtype(auto if config.dtype == "auto" else config.dtype)
        torch.manual_seed(config.seed)
        # The layout first: a cache this model cannot have is refused before any weight loads.
        model_config = ModelConfig.from_hf(config.model)
        draft_layers = 1 if config.speculative_algorithm == "mtp" else 0
        plan = LayerPlan.from_config(
            model_config, draft_layers=draft_layers, **config.plan_overrides
        )
        # Every layer's (what the model costs a token: /metrics, counters, the logs) and
        # the pool's (this pipeline stage's layers only; the same with one stage).
        self.model_layout = CacheLayout.from_plan(
            model_config,
            plan,
            config.kv_cache_dtype,
            config.index_k_dtype,
            config.page_size,
            config.elide_index_k,
        )
        stage = self.parallel.stage_layers(model_config.num_hidden_layers)
        self.layout = self.model_layout.for_stage(stage)
        # Before the weights: a broken tokenizer fails in a second, not after the load.
        self.tokenizer = _load_tokenizer(config.tokenizer or config.model)
        if config.tokenizer is not None and len(self.tokenizer) > model_config.vocab_size:
            raise DsakvError(
                f"--tokenizer {config.tokenizer} has {len(self.tokenizer)} tokens, more than "
                f"the model's vocabulary of {model_config.vocab_size}: its ids past "
                f"{model_config.vocab_size - 1} could not run (another model's tokenizer?)"
            )
        # Found here, not on the first text prompt: it decodes every vocab entry (0.35-0.8 s
        # for a 150k vocabulary), which on the step loop would stall every running request.
        self.chars_per_token = chars_per_token(self.tokenizer)
        # Outputs decoded whole each token (`_decode_output`): no fast tokenizer to stream
        self._decodes_whole = getattr(self.tokenizer, "backend_tokenizer", None) is None
        # a CPU computes in fp32 over a bf16 checkpoint's matrices as stored (half the
        # bytes a memory-bound decode step reads, the same outputs)
        self._stored = dict(
            dtype=dtype, as_stored=config.dtype == "auto" and self.device.type == "cpu"
        )
        self.weights_path = config.model  # the checkpoint the weights came from
        # trainers' groups for weight updates (`join_weight_group`): name -> (spec, group)
        self.weight_groups: dict[str, tuple[WeightGroup, Any]] = {}
        # The pool's size where no weights set it (all but --mem-fraction-static): a HiSparse
        # host latent past the machine is refused before they load.
        self.hisparse = self._hisparse_config(model_config)
        sizes = None if config.mem_fraction_static else self._num_pages()
        # (SGLang's total for --mem-fraction-static: what the GPU has free before the load)
        self._free_before_load = self._free_gpu() if config.mem_fraction_static else None
        self.model, self.model_config, self.plan = load_model(
            config.model, plan, device=self.device, parallel=self.parallel, **self._stored
        )
        # LoRA adapters' slots on every targeted layer, before any native form is made (a
        # step with adapter rows runs those layers eager: `lora.adapting`); which adapter is
        # where: rank 0's `LoraRegistry`
        self.lora: LoraRegistry | None = None
        if config.enable_lora:
            from dsakv.models.lora import LoraSlots

            self.model.lora = LoraSlots(
                self.model,
                config.max_loras,
                config.max_lora_rank,
                config.lora_target_modules,
                config.fully_sharded_loras,
            )
            self.lora = LoraRegistry(config.max_loras, config.max_cpu_loras)
            for name, path in config.lora_modules:  # (every rank loads them as it starts)
                self.lora.check_new(name)
                self._read_lora(name, path, at_start=True)
        try:
            self.model_config = self._served(self.model_config)
        except DsakvError as e:
            raise ConfigError(f"{config.model}/generation_config.json: {e}") from None
        if config.enable_return_routed_experts and not self.model_config.has_moe:
            raise DsakvError(
                "--enable-return-routed-experts needs an MoE model: this one routes no token"
            )
        if config.expert_distribution_recorder_mode and not self.model_config.has_moe:
            raise DsakvError(
                "--expert-distribution-recorder-mode needs an MoE model: this one routes no token"
            )
        if self.model_config.sampling_defaults:
            log.info(
                "requests that leave them out get generation_config.json's %s "
                "(--generation-config vllm: SamplingParams' own)",
                self.model_config.sampling_defaults,
            )
        num_pages, latent_pages = sizes or self._num_pages()
        self.max_model_len = self._max_model_len(num_pages * config.page_size)
        try:
            self.pool = DSAKVPool(self.layout, num_pages, self.device, latent_pages=latent_pages)
        except ConfigError as e:  # (too little memory for it: which flags size it)
            raise ConfigError(f"{e}: ask for a smaller pool ({POOL_FLAGS})") from None
        c = self.model_config
        self.deterministic = self._deterministic(dtype)
        self.backend = select_backend(
            config.attention_backend,
            self.device,
            self.layout,
            n_heads=c.num_attention_heads // self.parallel.attn_size,
            index_heads=c.index_n_heads,
            index_topk=c.index_topk,
            compile=config.enable_torch_compile,  # (one rank: `EngineConfig` refuses more)
            deterministic=self.deterministic,
        )
        self.model.use_backend(self.backend)
        # How the KV is computed: engines that differ here compute other bytes, so they
        # share no L3 pages and do not pair as prefill and decode servers. Under --enable-lora
        # a step with adapter rows runs the torch blocks, so its base rows' KV is not the
        # per-token path's bits: such an engine promises no batch invariance. Over ranks the
        # per-token bits are those of one split of the sums (o_proj's, the FFN's).
        invariant = self.deterministic and not config.enable_lora
        self.compute = f"{dtype}|{self.backend.name}|deterministic={invariant}"
        if invariant and self.parallel.tp_size > 1:  # (its bits hold for one split of the sums)
            pc = self.parallel.config
            dp = ", dp attention" if pc.dp_attention else ""
            self.compute += f"|sums over tp {pc.tp}, ep {pc.ep}{dp}"
        self.allocator = PageAllocator(num_pages, config.page_size)
        self.stats = EngineStats()
        # (when, output tokens) where the last two windows began: `counters`' gen_throughput
        self._gen_marks = [(time.monotonic(), 0)] * 2
        self.requests: dict[int, Request] = {}
        # Generation paused (the server's /pause_generation, in place or retracted): a
        # weight update or a cache flush then runs under the requests it holds, as SGLang's.
        self.paused = False
        # Sleep mode (`release_memory_occupation`): the tags released, what brings each back,
        # and after weights were discarded (vLLM's level 2) this rank's parts of them not
        # loaded again yet (None: none discarded).
        self.released: set[str] = set()
        self._stashes: dict[str, list[Stash]] = {}
        self._unloaded: dict[str, set[Any]] | None = None
        self.on_close: list[Callable[[], None]] = []  # e.g. joining the other ranks
        # Which rank died and how, once known (the launcher's watchdog says; None: unknown).
        self.rank_failure: Callable[[], str | None] = lambda: None
        self.profiler = None  # /start_profile's, on every rank (`ProfilerMixin`)
        # /start_expert_distribution_record's window, on every rank (`ExpertDistributionMixin`)
        self.expert_record, self.recording = None, False
        self._grammars: GrammarCache | None = None
        self.host, self.hot = self._tiers()
        self.l3: L3Cache | None = None
        try:
            self._build_loop(config)
            self.kv_events = self._kv_event_publisher()
        except BaseException:  # (graph capture, the MTP drafter): no L3 threads left behind
            if self.l3 is not None:
                self.l3.abandon()
            raise
        self._log_startup()

    def _build_loop(self, config: EngineConfig) -> None:
        """The model runner (its CUDA graphs captured), L3 storage tier, prefix cache,
        scheduler, sampler and MTP drafter, over the pool and its tiers."""
        stages = self.parallel.config.stage_layers(self.model_config.num_hidden_layers)
        self.runner = ModelRunner(
            self.model,
            self.pool,
            self.host,
            self.parallel,
            self.device,
            self._decode_graphs(),
            on_every_rank=self.every_rank_call,
            hot_buffers=self.hot,
            stage_page_bytes=[self.model_layout.for_stage(r).bytes_per_page for r in stages],
        )
        self.l3 = self._storage_tier()
        self.cache = PrefixCache(self.allocator, self.host, self.l3)
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.page_size,
                config.chunked_prefill_size,
                self._rank_max_running(),
                config.enable_prefix_cache,
                priority_sign=config.priority_sign,
                preemption_threshold=config.preemption_threshold,
                longest_prefix_first=config.scheduling_policy == "lpm",
            ),
            self.allocator,
            self.cache,
            self.host,
            self.l3,
            self.hot,
            self.lora,
        )
        # Under DP attention each rank samples its own requests: unseeded ones would draw
        # the same tokens on every rank from one seed. (TP ranks sample nothing but rank 0's.)
        dp_rank = self.parallel.rank if self.parallel.config.dp_attention else 0
        self.sampler = Sampler(self.device, config.seed + dp_rank)
        self.drafter: Drafter | None = None
        steps = config.max_drafts
        if config.speculative_algorithm == "ngram":
            self.drafter = NGramDrafter(steps, self.max_model_len, *config.ngram_window)
        elif config.speculative_algorithm == "mtp":
            self.drafter = MTPDrafter(
                self.runner,
                self.scheduler,
                steps,
                self.max_model_len,
                lockstep=self.parallel.config.dp_attention,
                grammars=lambda: self.grammars,
            )

    def _kv_event_publisher(self) -> KVEventPublisher | None:
        """vLLM's and SGLang's KV cache events (`--kv-events-config`), published by each
        scheduler: rank 0 under tensor parallelism (the other ranks' caches mirror its), each
        rank under DP attention, on the endpoint's port plus its rank (vLLM's DP ranks')."""
        events = self.config.kv_events
        dp = self.parallel.config.dp_attention
        if events is None or (self.parallel.rank != 0 and not dp):
            return None
        publisher = KVEventPublisher(events, self.parallel.rank if dp else 0, self.config.page_size)
        self.cache.events = []
        return publisher

    def publish_kv_events(self) -> None:
        """Hand what the prefix cache recorded since the last call to the publisher's thread
        (once a step, and after calls that run between steps: a flush, a weight update)."""
        if self.kv_events is not None and self.cache.events:
            self.kv_events.publish(self.cache.events)
            self.cache.events = []

    def cache_changed(self) -> None:
        """Pages joined or left the prefix cache between steps (a PD hand-off's: the server
        may not step again soon): L3 snapshots the new ones now, and the events go out."""
        if self.l3 is not None:
            self.l3.flush()
        self.publish_kv_events()

    def _rank_max_running(self) -> int:
        """This rank's share of `max_running_requests`: all of it, but under DP attention,
        where each rank schedules its own requests, the ranks split it (the remainder to
        the first) so the cap holds for the whole server, as SGLang divides it by dp_size."""
        cap, pc = self.config.max_running_requests, self.parallel.config
        if not pc.dp_attention:
            return cap
        return cap // pc.world_size + (self.parallel.rank < cap % pc.world_size)

    def _num_pages(self) -> tuple[int, int | None]:
        """The pool's pages (`num_pages`, else as many as `kv_budget_gib` holds), at most
        `max_total_tokens`' whole pages, and, under HiSparse, its device latent pages: then
        the budget (and the cap) buys latent pages, and each backs `host_to_device_ratio`
        logical pages (index-K on the device, every layer's latent on the host)."""
        config = self.config
        budget = self._kv_budget_gib()
        if config.num_pages is not None:
            pages = config.num_pages
        elif self.hisparse is not None:
            tokens = plan_hisparse(self.layout, self.hisparse, kv_budget_gib=budget).device_tokens
            pages = tokens // config.page_size
        else:
            pages = plan_capacity(self.layout, kv_budget_gib=budget).num_pages
        cap = config.max_total_tokens
        if cap is not None:  # (SGLang's: the least of the two, a warning where the cap is more)
            if cap > pages * config.page_size:
                log.warning(
                    "--max-total-tokens %d is more than the %d tokens the KV pool's size "
                    "gives: the pool keeps that size",
                    cap, pages * config.page_size,
                )  # fmt: skip
            pages = min(pages, cap // config.page_size)
        pages = self._least_over_stages(pages)
        check_holds_a_page(pages)
        if self.hisparse is None:
            self._check_host_memory(pages)
            return pages, None
        logical = pages * self.hisparse.host_to_device_ratio
        self._check_host_memory(logical)
        return logical, pages

    def _least_over_stages(self, pages: int) -> int:
        """Under pipeline parallelism the least of every rank's `pages` (each stage's layout
        has its own bytes per page): rank 0's scheduler hands out pages every stage must
        hold. `pages` as it is with one stage."""
        if self.parallel.pp_size == 1:
            return pages
        return min(self.parallel.all_gather_objects(pages))

    def _host_tier_pages(self, pool_pages: int) -> int:
        """The host tier's pages (`host_tier_pages`; 0: none) beside a pool of `pool_pages`:
        under `--host-pool-gib` of the largest page any pipeline stage has (each stage's
        layout has its own bytes per page; rank 0's journal moves pages every stage holds),
        so every rank the same count."""
        size = self.layout.bytes_per_page
        if self.parallel.pp_size > 1:
            size = max(self.parallel.all_gather_objects(size))
        config = self.config
        try:
            return host_tier_pages(config.host_pool_gib, config.host_pool_ratio, size, pool_pages)
        except ValueError as e:  # (its words name the flag)
            raise DsakvError(str(e)) from None

    def _check_host_memory(self, pool_pages: int) -> None:
        """Refuse the host tiers and HiSparse host latents (`pool_pages` logical pages) of a
        node past its memory, all together, as soon as the pool's size is known (before the
        weights load, where it can; each alone is checked again where it is allocated):
        every rank's bytes and its machine's memory gathered (a stage's TP ranks on one
        machine map one host latent), so every rank refuses alike, naming the node."""
        tier_flag, hisparse = self.config.host_tier_flag, self.hisparse is not None
        if tier_flag is None and not hisparse:
            return
        writes = writes_host_latent(self.parallel.config, self.parallel.tp_rank)
        mine = rank_host_bytes(
            self.layout, self._host_tier_pages(pool_pages), pool_pages, hisparse, writes
        )
        cpu = torch.device("cpu")
        gathered = self.parallel.all_gather_objects((mine, host_memory_bytes()))
        pc = self.parallel.config
        what = " and ".join(
            filter(None, [tier_flag and "host KV tier", hisparse and "HiSparse host latent"])
        )
        asks = [
            tier_flag and f"a smaller host tier ({tier_flag})",
            hisparse
            and f"fewer logical tokens (a smaller pool: {POOL_FLAGS}; or a smaller "
            "host_to_device_ratio in --hisparse-config)",
        ]
        sums = node_sums([b for b, _ in gathered], pc.ranks_per_node)
        for node, (need, ranks) in enumerate(sums):  # (each node's own memory)
            where = "a node" if pc.nnodes == 1 else f"node {node}"
            if ranks > 1:
                on_node = f" ({ranks} ranks' on {where})"
            else:
                on_node = f" (on {where})" if pc.nnodes > 1 else ""
            have = gathered[node * pc.ranks_per_node][1]
            try:
                check_fits(need, cpu, what + on_node, have=have)
            except ConfigError as e:
                raise ConfigError(f"{e}: ask for {', or '.join(filter(None, asks))}") from None

    def _kv_budget_gib(self) -> float:
        """`kv_budget_gib` (default 1), or under `mem_fraction_static` what the GPU keeps for
        the pool once the weights are in (`gpu_kv_budget_bytes`: SGLang's), the least any
        rank of this pipeline stage has (`stage_kv_budget_bytes`). Every rank gets every
        rank's numbers first, so a refusal is every rank's."""
        fraction = self.config.mem_fraction_static
        if fraction is None:
            return self.config.kv_budget_gib or 1.0
        before, after = self._free_before_load, self._free_gpu()
        if before is None or after is None:  # (an engine given a CPU device past its config)
            raise DsakvError(
                "--mem-fraction-static sizes the KV pool from GPU memory, and this engine runs "
                "on the CPU, where the pool is host RAM: give --kv-budget-gib"
            )
        per_rank = self.parallel.all_gather_objects((before, after))
        tp, stage = self.parallel.tp_size, self.parallel.stage
        budget = stage_kv_budget_bytes(fraction, per_rank, tp, stage) / GIB
        log.info(
            "KV budget %.2f GiB: --mem-fraction-static %s of the %.2f GiB free before the "
            "load, %.2f GiB of it the weights' (least over %d rank(s)%s)",
            budget, fraction, before / GIB, (before - after) / GIB, tp,
            f" of pipeline stage {stage}" if self.parallel.pp_size > 1 else "",
        )  # fmt: skip
        return budget

    def _free_gpu(self) -> int | None:
        """Free memory on this engine's GPU, its allocator's cache emptied (None: a CPU)."""
        if self.device.type != "cuda":
            return None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # (blocks the load freed count as used otherwise)
        return torch.cuda.mem_get_info(self.device)[0]

    def _max_model_len(self, pool_tokens: int) -> int:
        """The context: `max_model_len` as given, else the model's positions, cut to what the
        pool holds. A given one past either is refused, as vLLM refuses it: past the
        positions the RoPE tables end, past the pool one request could never reach it."""
        positions, asked = self.model_config.max_position_embeddings, self.config.max_model_len
        if asked is None:
            return min(positions, pool_tokens)
        if asked > positions:
            raise DsakvError(
                f"max_model_len {asked} exceeds the model's max_position_embeddings "
                f"{positions} (its config.json)"
            )
        if asked > pool_tokens:
            raise DsakvError(
                f"max_model_len {asked} is more tokens than the KV pool holds ({pool_tokens}): "
                f"give a larger pool ({POOL_FLAGS}) or a smaller max_model_len"
            )
        return asked

    def _tiers(self) -> tuple[HostPool | None, HotBuffers | None]:
        """The optional tiers around the device pool, each None when off: the host pool
        (`host_pool_gib`, or `host_pool_ratio` times this pool's pages) and HiSparse's hot
        buffers."""
        config = self.config
        hot = None
        if self.hisparse is not None:
            hot = HotBuffers(
                self.hisparse, self.pool, self.plan, self.backend, self.device, self.parallel
            )
        host, pages = None, self._host_tier_pages(self.pool.num_pages)
        if pages:  # (a TP rank that maps its stage's host latent keeps index-K only there)
            writes = writes_host_latent(self.parallel.config, self.parallel.tp_rank)
            tier = HostTierPlan.for_rank(self.layout, pages, hot is not None, writes)
            try:
                host = HostPool(self.pool, pages, index_k_only=tier.index_k_only)
            except ConfigError as e:  # (too little memory for it)
                raise ConfigError(
                    f"{e}: ask for a smaller host tier ({config.host_tier_flag})"
                ) from None
        return host, hot

    def _storage_tier(self) -> L3Cache | None:
        """The L3 storage tier (None when off) of each scheduler: rank 0's under TP and
        pipeline stages, whose pages are the whole model's (`ModelRunner.read_pages`, every
        stage's part; those it reads go to every rank), each rank's under DP attention (rank
        0 starts a Mooncake master if asked). Its namespace names how pages were computed
        (`compute`: dtype, backend, deterministic), not only the model and layout: engines
        that compute different bytes do not share stored pages (nor pair as prefill and
        decode servers: `dsakv.disagg.bootstrap.describe`)."""
        storage, rank = self.config.storage, self.parallel.rank
        if storage is None or (rank != 0 and not self.parallel.config.dp_attention):
            return None
        namespace = storage_namespace(self.model_layout, self.model_identity, self.compute)
        if rank != 0:
            storage = replace(storage, start_master=False)
        return L3Cache.create(
            storage, self.runner, self.model_layout, self.pool.num_pages, namespace
        )

    def _log_startup(self) -> None:
        config = self.config
        log.info(
            "engine: %d pages × %d tokens (%.1f MiB%s, %d B/token, %s), plan %s%s",
            self.allocator.num_pages,
            config.page_size,
            self.pool.nbytes / 2**20,
            " on stage 0" if self.parallel.pp_size > 1 else "",
            self.model_layout.bytes_per_token,  # (every stage's: `dsakv plan --pp-size` has each's)
            "elided" if config.elide_index_k else "dense",
            self.plan.pattern,
            ", deterministic" if self.deterministic else "",
        )
        if self.hot is not None:
            log.info(
                "HiSparse: %d device latent slots (%d B/token%s, hot buffers of %d slots: "
                "%d + %d in whole pages), %d logical tokens (%.1f MiB of latent in host memory)",
                self.pool.num_latent_tokens,
                self.layout.latent_bytes_per_token,
                " on stage 0" if self.parallel.pp_size > 1 else "",  # (its layers' latent)
                self.hot.buffer_pages * self.hot.page_size,
                self.hisparse.device_buffer_size,
                self.hisparse.step_tokens,
                self.pool.num_tokens,
                self.hot.host_nbytes / 2**20,
            )

    @functools.cached_property
    def model_identity(self) -> str:
        """The checkpoint's fingerprint (`config.checkpoint.model_identity`, ~4 MB read per shard): for
        L3's namespace and the PD handshake, read once."""
        return model_identity(self.weights_path)

    def _deterministic(self, dtype: torch.dtype) -> bool:
        """Whether every step runs the cpu backend's per-token path: as asked, or by default
        wherever it runs (measured no slower there than the batched path it replaces).
        Under --enable-lora a step with adapter rows runs its layers' blocks eager (not batch
        invariant: asking for it is refused), a step of base rows the per-token path."""
        want = self.config.enable_deterministic_inference
        if want is not None:
            return want  # (True where it cannot run: select_backend says what is missing)
        return (
            self.device.type == "cpu"
            and self.config.attention_backend in ("auto", "cpu")
            and self.parallel.tp_size == 1  # (pipeline stages of one rank each run it too)
            and dtype == torch.float32
            and cpu_native.available()
        )

    def _hisparse_config(self, model_config: ModelConfig) -> HiSparseConfig | None:
        """`--hisparse-config` checked against the model (it needs an indexer, and top_k is
        the indexer's: `HiSparseConfig.parse`, which `dsakv plan` shares)."""
        if not self.config.enable_hisparse:
            return None
        drafts = self.config.max_drafts  # (a hot buffer reserves a slot for each)
        return HiSparseConfig.parse(self.config.hisparse_config, model_config, drafts)

    def _decode_graphs(self) -> DecodeGraphs | None:
        """Padded, graph-capturable decode steps: for the graph-safe backends on one rank
        (captured on CUDA unless `disable_cuda_graph`; eager padded steps elsewhere). Under
        --enable-lora only steps without adapter rows run them (`ModelRunner._forward`)."""
        why = self.backend.graph_blocker(self.model.dtype, self.device, self.model_config.has_moe)
        if why is None and self.parallel.pp_size > 1:
            why = "pipeline stages (--pp-size) run each step eager"
        if why is None and self.parallel.world_size > 1:
            why = "more than one rank"
        if why is None and self.hot is not None:
            why = "HiSparse decode copies host rows (not captured yet)"
        self.decode_graph_blocker = why  # why decode steps are not padded / captured
        if why is not None:
            if self.device.type == "cuda":
                log.info("decode steps run eager: %s", why)
            return None
        graphs = DecodeGraphs(
            self.model,
            self.pool,
            self.device,
            max_batch=min(
                self.config.max_running_requests, self.config.cuda_graph_max_bs or MAX_GRAPH_BATCH
            ),
            max_len=self.max_model_len,
            use_graphs=not self.config.disable_cuda_graph,
        )
        graphs.capture_all()  # at start-up: no capture inside a served (or timed) step
        return graphs

    # --- requests -------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's and its tokenizer's, where the model can sample it (a tokenizer's
        added EOS past the vocabulary failed each `min_tokens` step that banned it)."""
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(t for t in ids if t < self.model_config.vocab_size))

    def encode(self, prompt: str, special: bool = True) -> list[int]:
        """`prompt`'s tokens, with the special tokens its tokenizer adds to a text (a BOS,
        as DeepSeek-V3.2's), as vLLM and SGLang tokenize a completion's prompt; a rendered
        chat template holds its own (`special=False`)."""
        if self.tokenizer is None:
            raise DsakvError("this model has no tokenizer; pass token ids instead of text")
        try:
            return self.tokenizer.encode(prompt, add_special_tokens=special)
        except (TypeError, ValueError) as e:  # a lone surrogate, say
            raise DsakvError(f"the prompt cannot be tokenized: {one_line(e)}") from None

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, rid: int | None = None
    ) -> Request:
        """Queue a prompt, one choice (`add_requests` makes `params.n`); `rid` is given when
        another rank (DP attention) numbered it. It is prefilled here, so under HiSparse its
        latent must fit the device (unlike a PD decode server's prompts, whose latent arrives
        in host memory: `reserve_detached`). A `rid` in use is refused (vLLM's): the second
        request replaced the first in `requests`, and aborting it broke every later step."""
        if rid is not None and rid in self.requests:
            raise DsakvError(f"request id {rid!r} is already in use")
        self.check_awake()
        ids = self.prompt_ids(prompt, params.truncate_prompt_tokens)
        if self.hot is not None and not self.hot.fits(len(ids)):
            held = self.pool.num_latent_tokens
            if params.truncate_prompt_tokens != -1:
                raise PromptTooLong(
                    f"prompt has {len(ids)} tokens; under HiSparse a prompt is prefilled on the "
                    f"device, whose latent pool holds {held} tokens: at most {held - 1} fit (one "
                    "kept for the output)",
                    len(ids),
                    held - 1,
                )
            ids = ids[-(held - 1) :]  # -1, "as many as fit": here, as the device holds
        req = Request(ids, params) if rid is None else Request(ids, params, rid=rid)
        self._init_request(req)
        self.requests[req.rid] = req
        self.stats.prompt_tokens += len(ids)
        self.scheduler.add(req)
        return req

    def add_requests(self, prompt: str | list[int], params: SamplingParams) -> list[Request]:
        """`params.n` completions of one prompt, sharing its KV pages.

        The first request runs the prompt; the other `n - 1` ("forks") are queued only once
        its prefill is done, so they find the prompt's full pages in the prefix cache and
        compute just the last partial page (plus the token they sample from). With a seed,
        choice `i` uses `seed + i`: reproducible, yet not n copies of one sample. Prompt
        logprobs are scored once, by the first request, and copied to the forks.
        """
        n = params.n
        if n > self.max_choices:
            raise DsakvError(f"n must be in 1..{self.max_choices}, got {n!r}")
        first = self.add_request(prompt, params.choice(0))  # each request is one choice
        for i in range(1, n):
            fork = Request(list(first.prompt_ids), params.choice(i))
            self._init_request(fork)
            self.requests[fork.rid] = fork
            self.stats.prompt_tokens += len(fork.prompt_ids)
            first.forks.append(fork)
        return link_choices([first, *first.forks])

    @property
    def max_choices(self) -> int:
        """The largest `n` one request may ask for: all its choices must run at once."""
        return min(16, self.config.max_running_requests)

    @property
    def grammars(self) -> GrammarCache:
        """The xgrammar compiler and compiled-grammar cache, built on first use."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise DsakvError("structured output needs a tokenizer; this model has none")
            self._grammars = GrammarCache(
                self.tokenizer, self.model_config.vocab_size, self.eos_token_ids
            )
        return self._grammars

    @functools.cached_property
    def think_marker_ids(self) -> tuple[list[int], list[int]]:
        """The reasoning block's start and end markers as tokens (one each in GLM-5's and
        DeepSeek-V3.2's vocabularies; several in a byte-level one)."""
        return tuple(self.encode(m, special=False) for m in THINK_MARKERS)

    def _init_request(self, req: Request) -> None:
        """Per-request state its params ask for: a grammar matcher (a bad grammar raises
        `DsakvError` here, before the request is queued) and room for prompt logprobs.
        `max_tokens` is cut to what the context leaves, and None (vLLM's "to the context's
        end") is that: the context ends the request there anyway, and admission reserves
        pages for a share of `max_tokens` (uncut, a client's `max_tokens` of 10**8 made a
        request that could never be admitted)."""
        room = self.max_model_len - len(req.prompt_ids)
        most = req.params.max_tokens
        if most is None or most > room >= 1:
            most = max(room, 1)
            req.params = replace(
                req.params, max_tokens=most, min_tokens=min(req.params.min_tokens, most)
            )
        req.matcher, req.bad_words_ids = self.check_request(req.params)
        p = req.params
        if p.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(req.prompt_ids)
            req.prompt_top_logprobs = [None] * len(req.prompt_ids)
            req.prompt_ranks = [None] * len(req.prompt_ids)
            if p.token_ids_logprob:
                req.prompt_token_ids_logprobs = [None] * len(req.prompt_ids)
            req.score_prompt = p.prompt_logprobs_start < len(req.prompt_ids) - 1
        if p.return_routed_experts or p.return_hidden_states:
            self.check_routed_start(p, len(req.prompt_ids))
            req.capture = Capture(0 if p.return_hidden_states else p.routed_experts_start_len)
        if p.lora_name is not None:  # (last: nothing refuses it after its adapter is held)
            req.lora = self._served_lora(p.lora_name)
            self.lora.hold(req.rid, req.lora)

    def check_routed_start(self, p: SamplingParams, prompt_len: int) -> None:
        """`routed_experts_start_len` within the prompt (SGLang's check; DP attention's rank
        0 runs it for a request another rank serves)."""
        if p.routed_experts_start_len > prompt_len:
            raise DsakvError(
                f"routed_experts_start_len ({p.routed_experts_start_len}) is higher than the "
                f"number of input tokens ({prompt_len})",
                "routed_experts_start_len",
            )

    def check_request(self, p: SamplingParams) -> tuple[Any, list[list[int]]]:
        """Every check that can refuse a request for `p` (a `DsakvError`), and what the
        checks build: its grammar matcher (None without a grammar) and its bad words' token
        ids. Under DP attention rank 0 runs it before sending a request to another rank:
        refused there, the request had no client left to hear it."""
        self.check_params(p)
        matcher = None if p.grammar is None else self.grammars.matcher(p.grammar)
        if p.stop and self.tokenizer is None:  # (matched in the output's text: none here)
            raise DsakvError("stop needs a tokenizer; this model has none", "stop")
        if p.stop and not p.detokenize:
            raise DsakvError(
                "stop strings are matched in the text: not with detokenize=False", "stop"
            )
        if p.thinking_token_budget is not None and self.tokenizer is None:
            raise DsakvError(
                "thinking_token_budget needs a tokenizer (for the reasoning markers); "
                "this model has none",
                "thinking_token_budget",
            )
        if not p.bad_words:
            return matcher, []
        if self.tokenizer is None:
            raise DsakvError("bad_words needs a tokenizer; this model has none", "bad_words")
        try:
            bad = bad_word_ids(self.tokenizer, p.bad_words)
        except (TypeError, ValueError) as e:  # a lone surrogate, say
            raise DsakvError(f"bad_words cannot be tokenized: {one_line(e)}", "bad_words") from None
        vocab = self.model_config.vocab_size
        if any(t >= vocab for ids in bad for t in ids):  # (vLLM's refusal; the ban failed a step)
            raise DsakvError(
                f"bad_words has tokens outside the vocabulary (0..{vocab - 1})", "bad_words"
            )
        if p.allowed_token_ids is not None and set(p.allowed_token_ids) <= {
            ids[0] for ids in bad if len(ids) == 1
        }:
            raise DsakvError("bad_words ban every token allowed_token_ids allows", "bad_words")
        return matcher, bad

    def check_params(self, p: SamplingParams) -> None:
        """What `p` asks of this model that `SamplingParams` cannot check alone: its token
        ids in the vocabulary (an id past it fails the step it is used in); one choice per
        request (`add_requests` makes `n`); a priority only under priority scheduling."""
        if p.n != 1:  # (add_request made one, silently)
            raise DsakvError(f"add_request makes one choice; n={p.n} is add_requests'", "n")
        self.check_priority(p.priority)
        if p.lora_name is not None:
            self._registry().resolve(p.lora_name)
        for name, flag in (
            ("return_routed_experts", "enable_return_routed_experts"),
            ("return_hidden_states", "enable_return_hidden_states"),
        ):
            if getattr(p, name) and not getattr(self.config, flag):  # (SGLang's words)
                what = name.removeprefix("return_").replace("_", " ")
                raise DsakvError(
                    f"The server is not configured to return the {what}. Please set "
                    f"`--{flag.replace('_', '-')}` to enable this feature.",
                    name,
                )
        vocab = self.model_config.vocab_size
        for name, ids in (
            ("logit_bias", [t for t, _ in p.logit_bias]),
            ("stop_token_ids", p.stop_token_ids),
            ("allowed_token_ids", p.allowed_token_ids or ()),
            ("logprob_token_ids", p.logprob_token_ids or ()),  # (vLLM's name for the next)
            ("token_ids_logprob", p.token_ids_logprob or ()),
        ):
            if any(t >= vocab for t in ids):
                raise DsakvError(
                    f"{name} has token ids outside the vocabulary (0..{vocab - 1})", name
                )

    def check_priority(self, priority: int | None) -> None:
        """A `priority` other than 0 runs under priority scheduling only (vLLM's refusal)."""
        if priority and not self.config.priority_sign:
            raise DsakvError(
                f"Got priority {priority} but priority scheduling is not enabled", "priority"
            )

    # --- LoRA adapters (`dsakv.engine.lora`, `dsakv.models.lora`) --------------------------

    def load_lora(self, name: str, path: str) -> None:
        """Read and check the PEFT adapter at `path` and serve it as `name` (on every rank);
        a bad adapter or a name in use is a `DsakvError` naming the problem. Past
        --max-cpu-loras the least recently used adapter no request holds is evicted (read
        again from its path when a request names it)."""
        self._registry().check_new(name)
        self._read_lora(name, path)

    def replace_lora(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name` in place of the one loaded under that name
        (vLLM's load_inplace), in one call: read and checked first, so a bad adapter changes
        nothing. Requests already on the old one finish on its weights (it is dropped with
        the last of them, as an unload's); new ones run the new."""
        self._registry().resolve(name)
        self._read_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name`: requests already on it finish, new ones are
        refused; an unknown name is a `DsakvError`."""
        gone = self._registry().unload(name)
        if gone is not None:
            self._on_every_rank("drop_lora_on_rank", gone.id)

    def loras(self) -> dict[str, str]:
        """The adapters served, name -> path (for /v1/models), evicted ones too (read again
        when a request names one); none without --enable-lora."""
        return {} if self.lora is None else {n: r.path for n, r in self.lora.loaded.items()}

    def _registry(self) -> LoraRegistry:
        if self.lora is None:
            raise DsakvError("LoRA adapters need an engine started with --enable-lora", "lora_name")
        return self.lora

    def _served_lora(self, name: str) -> LoraRef:
        """The adapter a new request on `name` holds: its weights read again from its path
        first if --max-cpu-loras evicted them."""
        registry = self._registry()
        ref = registry.resolve(name)
        if not registry.evicted(ref):
            return ref
        try:
            return self._read_lora(name, ref.path)
        except DsakvError as e:
            raise DsakvError(
                f"LoRA adapter {name!r} left host memory (--max-cpu-loras) and cannot be "
                f"read again: {e}",
                "lora_name",
            ) from None

    def _read_lora(self, name: str, path: str, at_start: bool = False) -> LoraRef:
        """Read the adapter at `path` on every rank and serve it as `name` (in place of the
        one loaded under it, if any), then evict what --max-cpu-loras needs (after: one that
        cannot be read evicts none); `at_start`: every rank runs this itself as it starts
        (`--lora-modules`), none is told to."""
        registry = self._registry()
        if not isinstance(path, (str, Path)) or not str(path):
            raise DsakvError(
                f"a LoRA adapter's path must be a non-empty string, got {path!r}", "lora_path"
            )
        path = str(path)

        def on_every_rank(fn: str, *args: Any) -> Any:
            return getattr(self, fn)(*args) if at_start else self._on_every_rank(fn, *args)

        lora_id = registry.new_id()
        why = on_every_rank("read_lora_on_rank", lora_id, path)
        if why is not None:
            raise DsakvError(why, "lora_path")
        ref = LoraRef(lora_id, name, path, self.model.lora.adapters[lora_id].digest)
        gone = registry.serve(ref)
        for evicted in ([] if gone is None else [gone]) + registry.trim(keep=ref):
            on_every_rank("drop_lora_on_rank", evicted.id)
        return ref

    def read_lora_on_rank(self, lora_id: int, path: str) -> str | None:
        """This rank reads its slices of the adapter at `path` as `lora_id`; every rank then
        hears whether all did (None), or each one's error, and none keeps it."""
        from dsakv.models.lora import read_adapter

        slots, why = self.model.lora, None
        try:
            slots.adapters[lora_id] = read_adapter(path, self.model, self.config.max_lora_rank)
        except Exception as e:  # noqa: BLE001 - every rank hears it
            why = said(e)
        outcome = gather_outcome(self.parallel, None, why)
        if not isinstance(outcome, str):
            return None
        slots.drop(lora_id)
        return outcome

    def drop_lora_on_rank(self, lora_id: int) -> None:
        """This rank forgets adapter `lora_id`'s weights (unloaded, replaced or evicted, and
        no request left on it)."""
        self.model.lora.drop(lora_id)

    def _release_forks(self, req: Request) -> None:
        """Queue `req`'s forks (its prefill is done, or it ended): they inherit its prompt
        logprobs, and score the prompt themselves only if it had not finished. The model
        failed it in its prompt (`model_fault`): they end with its error, their prompt's KV
        and logprobs its own (`_score_prompts` returns them)."""
        for fork in req.forks:
            if fork.finished:
                continue  # aborted while it waited
            if req.model_fault:
                self._fail_alone(fork, req.error, req.metrics.finish_time, True)
                continue
            if req.prompt_logprobs is not None and fork.prompt_logprobs is not None:
                fork.prompt_logprobs = list(req.prompt_logprobs)
                fork.prompt_top_logprobs = list(req.prompt_top_logprobs)
                fork.prompt_ranks = list(req.prompt_ranks)
                if req.prompt_token_ids_logprobs is not None:
                    fork.prompt_token_ids_logprobs = list(req.prompt_token_ids_logprobs)
                fork.score_prompt = req.score_prompt
            if req.capture is not None and fork.capture is not None:
                fork.capture.take(req.capture, len(req.prompt_ids))
            self.scheduler.add(fork)
        req.forks = []

    def prompt_ids(
        self, prompt: str | list[int], keep: int | None = None, special: bool = True
    ) -> list[int]:
        """The prompt's token ids (its last `keep`: `truncate_prompt_tokens`; a text's with
        its tokenizer's special tokens unless `special` is False: `encode`), or a
        `DsakvError` saying why it cannot run. A text too long to fit whatever its tokens
        is refused untokenized (a 30 MB one took 6 GB to tokenize): a token stands for
        at most `chars_per_token` of its characters."""
        limit = self.max_model_len - 1
        m = self.chars_per_token if isinstance(prompt, str) and keep is None else None
        if m is not None and len(prompt) > limit * m:
            least = -(-len(prompt) // m)
            raise PromptTooLong(
                f"prompt has at least {least} tokens ({len(prompt)} characters, "
                f"at most {m} a token); at most {limit} fit (the context is "
                f"{self.max_model_len} tokens, one kept for the output)",
                least,
                limit,
            )
        ids = self.encode(prompt, special) if isinstance(prompt, str) else _token_ids(prompt)
        if not ids:
            raise DsakvError("prompt is empty")
        if keep is not None:
            ids = ids[-(keep if keep > 0 else self.max_model_len - 1) :]
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise DsakvError(f"prompt has token ids outside the vocabulary (0..{vocab - 1})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(
                f"prompt has {len(ids)} tokens; at most {limit} fit (the "
                f"context is {self.max_model_len} tokens, one kept for the output)",
                len(ids),
                limit,
            )
        return ids

    def abort(self, rid: int) -> None:
        """Stop a request now and free everything it holds; unknown ids are ignored."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return
        req.finish_reason = "abort"
        self._end(req)
        self.stats.aborted_requests += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def _busy(self) -> bool:
        """Whether requests keep a weight update or a cache flush off: any request, or
        while `paused` only pages held for a prefill server's hand-off (the paused ones stay
        through it: their KV so far is the old weights', what partial rollouts accept)."""
        return (not self.paused and self.has_unfinished()) or bool(self.scheduler.held)

    def retract_all(self) -> None:
        """SGLang's /pause_generation "retract": every running request gives its pages back
        and waits, to resume from its output so far (its KV recomputed, or reloaded from the
        host tier). Under DP attention each rank retracts the requests it schedules (an
        every-rank call: `DPEngine.retract_all`)."""
        self.scheduler.retract_all()

    def set_paused(self, paused: bool) -> None:
        """`paused`, as DP attention's every-rank call (`DPEngine.paused`): each rank's own
        `_busy` and `flush_cache` read it, as they hold the requests they schedule."""
        self.paused = paused

    def flush_cache(self) -> bool:
        """SGLang's /flush_cache (vLLM's /reset_prefix_cache): drop the prefix cache's device
        and host pages, e.g. between benchmark runs; only with nothing running or waiting
        (False, nothing dropped) and no pages held for a prefill server's hand-off. While
        `paused`, with nothing running (SGLang's: retracted requests compute theirs again)."""
        if not self._flushable():
            return False
        self.cache.reset()
        self.publish_kv_events()
        return True

    def _flushable(self) -> bool:
        return not (self._busy() or (self.paused and self.scheduler.running))

    # --- the ranks: what runs on every rank (the mixins' calls), closing, a dead rank -----

    def _on_every_rank(self, method: str, *args: Any) -> Any:
        """`every_rank_call(method, *args)` on every rank, between steps; rank 0's outcome."""
        if self.parallel.world_size == 1:
            return self.every_rank_call(method, *args)
        if self.parallel.config.dp_attention:
            raise DsakvError(f"under --dp-attention DPEngine runs {method} on every rank")
        with self.rank_failures():
            return self.runner.every_rank(method, *args)

    def every_rank_call(self, method: str, *args: Any) -> Any:
        """This rank's part of a call every rank makes, one of the mixins' (rank 0's runner
        or `DPEngine` sends it: `ModelRunner.serve`, `serve_dp_peer`)."""
        if method not in _EVERY_RANK:
            raise DsakvError(f"{method} is not an every-rank call")
        try:
            return getattr(self, method)(*args)
        finally:
            self.publish_kv_events()  # (a weight update's or a release's clear)

    def close(self) -> None:
        """Release the other ranks (if any) and wait for them to leave; idempotent. Every
        part runs even if one fails (a rank that died broke the group): the process group
        and its one-per-process claim are always released; the first error is raised after."""
        first: Exception | None = None
        parts = [self._drop_profile]
        if self.l3 is not None:  # (before the other ranks go: it reads their stages' pages)
            parts.append(functools.partial(self.l3.close, self.cache))
        parts.append(self.runner.stop)
        if self.kv_events is not None:
            parts += [self.publish_kv_events, self.kv_events.close]
        parts += [functools.partial(weight_sync.leave, g) for _, g in self.weight_groups.values()]
        self.weight_groups.clear()
        while parts or self.on_close:
            part = parts.pop(0) if parts else self.on_close.pop()
            try:
                part()
            except Exception as e:  # noqa: BLE001 - raised once the rest has run
                first = first or e
        if self.parallel.world_size > 1:
            destroy_parallel()
        if first is not None:
            raise first

    @contextlib.contextmanager
    def rank_failures(self) -> Iterator[None]:
        """On rank 0, a collective that fails because another rank died or hung becomes
        `RankDied`, naming the rank when the launcher knows it, not the transport's error
        (gloo's "Connection reset by peer")."""
        try:
            yield
        except Exception as e:
            if self.parallel.world_size == 1 or self.parallel.rank != 0 or not is_dist_error(e):
                raise
            why = self.rank_failure() or f"a collective with another rank failed: {one_line(e)}"
            raise RankDied(f"{why}; this engine cannot run (close it and make a new one)") from e

    # --- prefill/decode disaggregation (`dsakv.engine.disagg`) ----------------------------

    def hold(self, req: Request) -> None:
        """A prefill server's request: its pages outlive its finish (`Scheduler.parked`) until
        `release_held`, once they were shipped."""
        self.scheduler.held.add(req.rid)

    def release_held(self, req: Request) -> None:
        self.scheduler.release_held(req)

    def held_request(self, rid: int) -> Request:
        """A request `hold` kept past its finish (KeyError: none is)."""
        return self.scheduler.parked[rid]

    def unhold(self, rid: int) -> None:
        """`release_held` by number, whether or not the request ran (under DP attention, on
        the rank that holds it)."""
        req = self.scheduler.parked.get(rid)
        if req is None:
            self.scheduler.held.discard(rid)
        else:
            self.release_held(req)

    def reserve_detached(
        self, prompt_ids: list[int], params: SamplingParams, rid: int | None = None
    ) -> Request | None:
        """A decode server's request, with pages for its prompt and first decode token but
        not queued: the prefill server writes the prompt's KV there, then `start_decoding`
        runs it, or `drop_detached` gives it back. None while the pool has no room for it
        (the caller retries). Its LoRA adapter is held from here, as `add_request` holds it
        (an unload meanwhile waits for it); its slot comes when it starts decoding. `rid`:
        rank 0's number for it (under DP attention, for another rank: `DPEngine`)."""
        self.check_awake()
        ids = list(prompt_ids)
        req = Request(ids, params) if rid is None else Request(ids, params, rid=rid)
        self._init_request(req)  # its grammar matcher (the first token comes from prefill)
        if not self.scheduler.reserve_detached(req, len(req.prompt_ids) + 1):
            self._release_lora(req)
            return None
        return req

    def drop_detached(self, req: Request) -> None:
        """Give back a `reserve_detached` request that will not run (its prefill side failed
        or went away): its pages and its adapter."""
        req.finish_reason = "abort"
        self.scheduler.finish(req)
        self._release_lora(req)

    def start_decoding(
        self, req: Request, first_token: int | None, routed: torch.Tensor | None = None
    ) -> None:
        """Decode a `reserve_detached` request whose prompt KV has arrived, from the prefill
        side's first token (it may finish right here: EOS, a stop, max_tokens 1), with the
        prompt's `routed` experts the prefill side sent, if asked for; one whose
        adapter finds no slot waits for one (`Scheduler.adopt`), its pages kept. `first_token`
        None (vLLM's P/D, whose decode side picks it): the last prompt token runs here, its
        KV counted as not yet computed, so the first token follows this request's own
        sampling params (min_tokens, logit_bias, a grammar, a seed...)."""
        n = len(req.prompt_ids)
        try:
            if routed is not None:  # (kept as its own steps keep theirs)
                if req.capture is None:
                    raise DsakvError("routed experts came for a request that asked for none")
                req.capture.write(req.params.routed_experts_start_len, routed, None)
            # (with MTP, the draft layer's KV came too; the last position's is caught up here)
            req.num_computed = n if first_token is not None else n - 1
            latent = None if self.hot is None else self.scheduler.slots(req, n)
            with self.rank_failures():  # (it came to rank 0's pool, and host latent rows)
                self.runner.share_kv(req.pages, latent)
        except BaseException:
            self.drop_detached(req)  # (it ends here: its pages and adapter back)
            raise
        self.requests[req.rid] = req
        self.stats.prompt_tokens += n
        self.scheduler.adopt(req)
        if first_token is not None:
            self._emit(req, first_token, time.perf_counter())

    # --- the step -------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Run one batch; returns the requests that got a token (finished ones included)."""
        with self.rank_failures(), _current_gpu(self.device):
            out = self._step()
            self.publish_kv_events()
            if self.profiler is not None:
                self._profiled_step()
            return out

    def _step(self) -> list[Request]:
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        scheduled = time.perf_counter() if self._timed else start
        failed = self._fail_unschedulable(idle=not batch)
        if not batch and not self.parallel.config.dp_attention:
            return failed  # (under DP attention an idle rank still joins the collectives)
        new_tokens, slots, drafts = [], [], []
        for req, n in batch:
            end = req.num_computed + n
            d = self._drafts(req, n, end)
            new_tokens.append(req.ids(req.num_computed, end) + d)
            slots.append(self.scheduler.slots(req, end + len(d)))
            drafts.append(d)
        ends = [e - 1 for e in accumulate(len(t) for t in new_tokens)]
        sampled = [i for i, (req, n) in enumerate(batch) if req.num_computed + n == req.seq_len]
        # A sampled request's rows: its last token, and each draft after it.
        rows = [r for i in sampled for r in range(ends[i] - len(drafts[i]), ends[i] + 1)]
        hot = None
        if self.hot is not None:
            hot = self.hot.begin_step([(r.rid, r.num_computed, n) for r, n in batch], slots)
        capturing = self._capturing(batch)
        record = any(batch[i][0].params.return_routed_experts for i in capturing)
        keep_hidden = any(batch[i][0].params.return_hidden_states for i in capturing)
        # (None: no expert distribution window is open)
        counting = self.expert_record if self.recording else None
        record = record or counting is not None
        forward = _synced_clock(self.device) if "model" in self._timed else 0.0
        lora = self.lora.step([req.lora for req, _ in batch]) if self.lora is not None else None
        hidden, logits, routed = self.runner.forward(
            new_tokens, slots, hot, rows, record, lora, keep_hidden
        )
        if "model" in self._timed:
            forward = _synced_clock(self.device) - forward
        if counting is not None:
            counted = [(r.num_computed, t) for (r, _), t in zip(batch, new_tokens)]
            counting.add(routed, counted, self.stats.steps)  # (steps: the passes before)
        if hot is not None:
            self.hot.end_step(hot)
        firsts = [e - len(t) + 1 for e, t in zip(ends, new_tokens)]  # (each one's first row)
        if capturing:
            spans = [(batch[i][0], firsts[i], len(new_tokens[i])) for i in capturing]
            self._keep_rows(spans, hidden, routed)
        # (request, first position, first hidden row) of what this step ran, for the drafter
        ran = [(req, req.num_computed, f) for (req, _), f in zip(batch, firsts)]
        self.stats.decode_steps += sum(1 for req, n in batch if n == 1 and not req.in_prefill)
        if self.drafter is not None:
            self.drafter.sampling = frozenset(req.rid for req, _ in batch)
        failed += self._score_prompts(batch, ends)
        for req, n in batch:
            if req.finished:
                continue  # (its prompt's logits were not finite: ended)
            req.num_computed += n
            if n > 1:  # a prefill chunk: its full pages can serve other requests now
                self.scheduler.cache_prefix(req)
            if req.forks and not req.in_prefill:
                self._release_forks(req)
        self.stats.ran(hidden.shape[0])
        out: list[Request] = failed
        if logits is not None:
            reqs = [batch[i][0] for i in sampled]
            out += self._sample(reqs, logits, [drafts[i] for i in sampled])
        if self.drafter is not None:
            self.drafter.step(ran)
        if self.l3 is not None:
            self.l3.flush()  # write-through: this step's new cached pages, draft KV included
        self.stats.steps += 1
        self.stats.step_time_s += time.perf_counter() - start
        if self._timed:
            _time_step(batch, scheduled - start, scheduled, forward)
        now = time.monotonic()
        if now - self._gen_marks[1][0] >= GEN_WINDOW_S:
            self._gen_marks = [self._gen_marks[1], (now, self.stats.output_tokens)]
        return out

    def _capturing(self, batch: list[tuple[Request, int]]) -> list[int]:
        """The requests of `batch` that keep rows of this step (`Request.capture`), by index;
        none, and no work, on an engine that allows no such request."""
        c = self.config
        if not (c.enable_return_routed_experts or c.enable_return_hidden_states):
            return []
        return [i for i, (req, _) in enumerate(batch) if req.capture is not None]

    def _keep_rows(
        self,
        spans: list[tuple[Request, int, int]],
        hidden: torch.Tensor,
        routed: torch.Tensor | None,
    ) -> None:
        """Each (request, its first row, its rows) of the step: the rows it asked for, kept
        by position (`Capture.write`), in one device-to-host copy of each kind."""
        kept: list[dict[str, torch.Tensor]] = [{} for _ in spans]
        for flag, source in (("return_routed_experts", routed), ("return_hidden_states", hidden)):
            asking = [i for i, (req, _, _) in enumerate(spans) if getattr(req.params, flag)]
            if not asking:
                continue
            idx = [r for i in asking for r in range(spans[i][1], spans[i][1] + spans[i][2])]
            rows = source[torch.tensor(idx, device=source.device)].cpu()
            for i, part in zip(asking, rows.split([spans[i][2] for i in asking])):
                kept[i][flag] = part
        for (req, _, _), rows in zip(spans, kept):
            experts = rows.get("return_routed_experts")
            req.capture.write(req.num_computed, experts, rows.get("return_hidden_states"))

    def _drafts(self, req: Request, n: int, end: int) -> list[int]:
        """The drafts `req` verifies this step (decode only), as many as pages allow."""
        if n != 1 or not req.draft_ids or req.in_prefill:
            return []
        d, req.draft_ids = req.draft_ids, []
        if not self.scheduler.reserve(req, end + len(d)):
            d = d[: max(0, len(req.pages) * self.config.page_size - end)]
        return d

    def _sample(
        self, reqs: list[Request], logits: torch.Tensor, drafts: list[list[int]]
    ) -> list[Request]:
        """Record each request's next token(s). `logits` holds one row per request, or
        1 + len(drafts) rows for one verifying drafts. A request whose raw rows are not all
        finite (a NaN or an inf from the model: an adapter's overflow, a kernel's fault)
        ends alone (`_fail_alone`); the check is one reduction, its flags copied with the
        sampler's tokens (a step verifying drafts copies them once more: its verifications
        copy per request anyway). Requests that failed earlier in the step are skipped."""
        now = time.perf_counter()
        first = [0, *accumulate(1 + len(d) for d in drafts)]
        finite = finite_rows(logits)
        plain = [i for i, d in enumerate(drafts) if not d and not reqs[i].finished]
        rows = [first[i] for i in plain]
        out = self._sample_one([reqs[i] for i in plain], logits[rows], now, finite[rows])
        ok = finite.tolist() if any(drafts) else []
        for i, d in enumerate(drafts):
            if d:
                span = slice(first[i], first[i + 1])
                self._accept(reqs[i], logits[span], d, now, ok[span])
                out.append(reqs[i])
        return out

    def _accept(
        self, req: Request, logits: torch.Tensor, drafts: list[int], now: float, ok: list[bool]
    ) -> None:
        """Verify `req`'s drafts and emit what is kept plus one target token; the KV of the
        kept drafts was written by this step's forward. `ok`: which of its raw rows are
        finite; verification stops short of the first that is not (as at a grammar's dead
        end), and a first row that is not ends the request."""
        if not all(ok):
            bad = ok.index(False)
            if bad == 0:
                self._fail_alone(req, _not_finite(len(req.output_ids)), now, True)
                return
            drafts, logits = drafts[: bad - 1], logits[:bad]
        if req.params.penalized or req.params.masked or req.matcher is not None:
            logits = logits.float().clone()
        if req.matcher is not None:  # drafts the grammar refuses are not even checked
            drafts = self.grammars.apply_drafts(logits, req.matcher, drafts)
            logits = logits[: len(drafts) + 1]
            dead = (~torch.isfinite(logits).any(-1)).nonzero().flatten().tolist()
            if dead:  # check only up to the first state the grammar cannot leave
                if dead[0] == 0:
                    self._grammar_dead_end(req, now)
                    return
                drafts, logits = drafts[: dead[0] - 1], logits[: dead[0]]
        k = req.params.logprobs
        processed = req.params.logprobs_mode == "processed"
        logp = None  # (as `_sample_one`'s)
        if k is not None and not processed:
            logp = torch.log_softmax(logits.float(), -1)
        for j in range(len(drafts) + 1):
            if req.params.penalized:
                penalize(
                    logits[j],
                    req.params,
                    self._prompt_mask(req, logits.shape[-1]),
                    req.output_ids + drafts[:j],
                    self._bias(req),
                )
            self._restrict(req, logits[j], req.output_ids + drafts[:j])
        if k is not None and processed:  # each position after its own penalties
            logp = processed_logprobs(logits.float(), [req.params] * logits.shape[0])
        tokens = verify(logits, drafts, req.params, self.sampler.generator, len(req.output_ids))
        accepted = len(tokens) - 1
        req.metrics.draft_tokens += len(drafts)
        req.metrics.accepted_tokens += accepted
        self.stats.draft_tokens += len(drafts)
        self.stats.accepted_tokens += accepted
        self.stats.verify_steps += 1
        top_n = [req.params.num_top_logprobs] * len(tokens)
        logps = None if logp is None else gather_logprobs(logp, tokens, top_n)
        asked = req.params.token_ids_logprob if logp is not None else None
        by_id = gather_ids(logp, [asked] * len(tokens)) if asked else None
        base = req.num_computed  # the last token's KV is counted; the drafts' are not yet
        for j, token in enumerate(tokens):
            req.num_computed = base + j
            self._emit(req, token, now)
            if logps is not None:
                lp, top, rank = logps[j]
                req.logprobs.append(lp)
                req.top_logprobs.append(top)
                req.ranks.append(rank)
            if by_id is not None:
                _record_ids(req, by_id[j])
            if req.finished:
                return

    def _sample_one(
        self, reqs: list[Request], logits: torch.Tensor, now: float, finite: torch.Tensor
    ) -> list[Request]:
        """Pick each request's next token (grammar-masked where constrained) and record it;
        one whose raw row is not all finite (`finite`, `finite_rows`) ends with an error.
        A request with `max_tokens == 0` only wanted its prompt scored: it ends here."""
        done = [r for r in reqs if r.params.max_tokens == 0]
        for req in done:
            self._finish(req, "length", now)
        if done:
            keep = [i for i, r in enumerate(reqs) if r.params.max_tokens > 0]
            reqs, logits, finite = [reqs[i] for i in keep], logits[keep], finite[keep]
        if reqs:
            logits = logits.float()  # (rows of its own: indexed out of the step's logits)
            if any(r.matcher is not None for r in reqs):
                self.grammars.apply(logits, [r.matcher for r in reqs])
                # (a row the model left non-finite is not the grammar's dead end: the
                # sampler's flags end it)
                alive = (torch.isfinite(logits).any(-1) | ~finite).tolist()
                dead = [r for r, ok in zip(reqs, alive) if not ok]
                for req in dead:
                    self._grammar_dead_end(req, now)
                if dead:
                    keep = [i for i, ok in enumerate(alive) if ok]
                    done, reqs = done + dead, [reqs[i] for i in keep]
                    logits, finite = logits[keep], finite[keep]
                    if not reqs:
                        return done
            # vLLM's raw logprobs: of the model's logits as the grammar left them (vLLM masks
            # before its sampler too), not of what penalties, bans and temperature make of
            # them; "processed" ones (SGLang's) of what they make of them
            asked = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
            raw = [i for i in asked if reqs[i].params.logprobs_mode == "raw"]
            processed = [i for i in asked if reqs[i].params.logprobs_mode == "processed"]
            logps = [(raw, torch.log_softmax(logits[raw], -1))] if raw else []
            for i, req in enumerate(reqs):
                if req.params.penalized:
                    penalize(
                        logits[i],
                        req.params,
                        self._prompt_mask(req, logits.shape[-1]),
                        req.output_ids,
                        self._bias(req),
                    )
                self._restrict(req, logits[i], req.output_ids)
            if processed:
                ps = [reqs[i].params for i in processed]
                logps.append((processed, processed_logprobs(logits[processed], ps)))
            tokens = self.sampler.sample(
                logits, [r.params for r in reqs], [len(r.output_ids) for r in reqs], finite
            )
            for req, token in zip(reqs, tokens):
                if token is None:
                    self._fail_alone(req, _not_finite(len(req.output_ids)), now, True)
                else:
                    self._emit(req, token, now)
            for rows, logp in logps:
                ks = [reqs[i].params.num_top_logprobs for i in rows]
                picked = [tokens[i] or 0 for i in rows]  # (a failed row's are not kept)
                for i, (lp, top, rank) in zip(rows, gather_logprobs(logp, picked, ks)):
                    if tokens[i] is not None:
                        reqs[i].logprobs.append(lp)
                        reqs[i].top_logprobs.append(top)
                        reqs[i].ranks.append(rank)
                asked = [reqs[i].params.token_ids_logprob for i in rows]
                for i, by_id in zip(rows, gather_ids(logp, asked)):
                    if by_id is not None and tokens[i] is not None:
                        _record_ids(reqs[i], by_id)
        return done + reqs

    def _score_prompts(self, batch: list[tuple[Request, int]], ends: list[int]) -> list[Request]:
        """Teacher-forced logprobs of prompt tokens, from this step's prefill rows; returns
        the requests it ended, a row of their raw logits not all finite (`_fail_alone`),
        and their forks waiting on them (`_release_forks`).

        Row p of a request predicts token p + 1, so a chunk covering positions
        `start..start+n-1` scores prompt tokens `start+1..start+n` (capped at the prompt's
        end), those past `prompt_logprobs_start` only. While a request is being scored the
        prefix cache serves it at most its positions before `prompt_logprobs_start` (the
        scheduler checks `score_prompt`): cached pages have KV but no logits, and recomputing
        a prefix costs less than special-casing it. Its pages still join the cache for
        others. Scores are stored by position, so a prefill redone after a retraction just
        rewrites them. A non-finite row's logprobs are made all NaN on the device, so the
        copy the scores come in tells it (a finite row's logprob is never NaN).
        """
        rows: list[int] = []
        targets: list[tuple[Request, int]] = []
        for i, (req, n) in enumerate(batch):
            if not req.score_prompt:
                continue
            start, last = req.num_computed, len(req.prompt_ids) - 2  # last position to score
            first_row = int(ends[i]) - n + 1
            for pos in range(
                max(start, req.params.prompt_logprobs_start), min(start + n - 1, last) + 1
            ):
                rows.append(first_row + pos - start)
                targets.append((req, pos + 1))
            if start + n - 1 >= last:
                req.score_prompt = False
        bad: dict[Request, int] = {}  # each failed request's first prompt token so scored
        for lo in range(0, len(rows), _SCORE_ROWS):
            idx = torch.tensor(rows[lo : lo + _SCORE_ROWS], dtype=torch.long)
            raw = self.runner.logits(idx)
            logp = torch.log_softmax(raw, -1).masked_fill(~finite_rows(raw)[:, None], math.nan)
            chunk = targets[lo : lo + _SCORE_ROWS]
            tokens = [req.prompt_ids[pos] for req, pos in chunk]
            ks = [req.params.prompt_logprobs for req, _ in chunk]
            for (req, pos), (lp, top, rank) in zip(chunk, gather_logprobs(logp, tokens, ks)):
                if math.isnan(lp):
                    bad.setdefault(req, pos)
                req.prompt_logprobs[pos], req.prompt_top_logprobs[pos] = lp, top
                req.prompt_ranks[pos] = rank
            asked = [req.params.token_ids_logprob for req, _ in chunk]
            for (req, pos), by_id in zip(chunk, gather_ids(logp, asked)):
                if by_id is not None:
                    req.prompt_token_ids_logprobs[pos] = by_id
        now, ended = time.perf_counter(), []
        for req, pos in bad.items():
            ended += [req, *(f for f in req.forks if not f.finished)]  # (`_release_forks`)
            self._fail_alone(req, _not_finite(pos, "prompt"), now, True)
        return ended

    def _grammar_dead_end(self, req: Request, now: float) -> None:
        """`req`'s grammar allows no next token (nor the end): it cannot be completed, and
        sampling from nothing would fail the whole batch."""
        why = (
            f"the request's grammar allows no token after the {len(req.output_ids)} "
            "generated so far: it cannot be completed"
        )
        self._fail_alone(req, why, now)

    def _fail_alone(self, req: Request, why: str, now: float, model_fault: bool = False) -> None:
        """End `req` alone with finish_reason "error" and `why` (the server's answer for
        it), the other requests of the step going on. `model_fault`: the model's output
        failed it, not its parameters (`Request.model_fault`: its pages join no cache)."""
        req.error, req.model_fault = why, model_fault
        log.warning("request %d: %s", req.rid, why)
        self._finish(req, "error", now)

    def _restrict(self, req: Request, row: torch.Tensor, output: list[int]) -> None:
        """What `req` may not pick after `output`: anything outside `allowed_token_ids`,
        then a stop token under `min_tokens` and the last token of a bad word, each unless
        nothing else is left (applied after those bans, the allowed mask gave way where they
        had banned every allowed id, and the whole vocabulary was open). Before them all, the
        end of a reasoning block past `thinking_token_budget` is forced (vLLM's, whose forced
        token outranks them; a grammar, applied before, outranks it)."""
        p = req.params
        if not p.masked:
            return
        if p.thinking_token_budget is not None:
            if req.thinking is None:
                start, end = self.think_marker_ids
                req.thinking = ThinkingBudget(p.thinking_token_budget, start, end, req.prompt_ids)
            if (token := req.thinking.forced(output, len(req.output_ids))) is not None:
                allow(row, [token])
        if p.allowed_token_ids is not None:
            allow(row, p.allowed_token_ids)
        if len(output) < p.min_tokens:
            ban(row, [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)])
        if req.bad_words_ids:
            ban(row, banned_words_next(req.bad_words_ids, output))

    def _bias(self, req: Request) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`req`'s logit_bias as tensors on the device, made once (a whole vocabulary's, from
        lists each step, cost 50 ms a step)."""
        if req.bias is None and req.params.logit_bias:
            req.bias = bias_tensors(req.params, self.device)
        return req.bias

    def _prompt_mask(self, req: Request, vocab: int) -> torch.Tensor:
        """`req`'s prompt tokens as a mask over the logits (the repetition penalty's), made
        once; none of them where the penalty counts the output's only."""
        if req.prompt_mask is None:
            counted = req.prompt_ids if req.params.repetition_penalty_prompt else []
            req.prompt_mask = token_mask(counted, vocab, self.device)
        return req.prompt_mask

    def _emit(self, req: Request, token: int, now: float) -> None:
        """Record `req`'s next token, wherever it came from (sampled, a kept MTP draft, the
        prefill server's first). Its grammar advances first, on every token, the one that
        ends the request included; a token the grammar refuses is logged and still kept
        (sampling is masked, so only a token from elsewhere can be refused). A grammar
        completed by the token ends the request with "stop", unless it ended already."""
        if req.matcher is not None and not req.matcher.accept_token(token):
            log.warning("request %d: grammar rejected token %d", req.rid, token)
        self._append_token(req, token, now)
        if not req.finished and req.matcher is not None and req.matcher.is_terminated():
            self._finish(req, "stop", now)

    def _append_token(self, req: Request, token: int, now: float) -> None:
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.output_ids.append(token)
        self.stats.output_tokens += 1
        p = req.params
        reason = None
        if not p.ignore_eos and token in self.eos_token_ids:
            reason = "stop"
        elif token in p.stop_token_set:
            reason, req.stop_reason = "stop", token
        by_token = reason is not None
        cut_text = False
        decode = self.tokenizer is not None and p.detokenize
        if decode:
            streamed = len(req.output_text)  # (the text before this token's)
            self._decode_output(req, token)
            if p.stop and reason is None and len(req.output_ids) > p.min_tokens:
                hit = find_stop(req.output_text, p.stops_by_last, req.stop_floor)
                if hit is not None:
                    cut, stop = hit
                    req.output_text = req.output_text[
                        : cut + (len(stop) if p.include_stop_str_in_output else 0)
                    ]
                    reason, cut_text, req.stop_reason = "stop", True, stop
            # The next search starts here: a stop must end past it, so none ending in the
            # first min_tokens tokens' text counts (vLLM's); past them, the text before was
            # searched already (unless a whole decode may change it: its floor stays where
            # min_tokens left it)
            whole = self._decodes_whole and len(req.output_ids) > p.min_tokens
            if p.stop and reason is None and not whole:
                req.stop_floor = len(req.output_text.rstrip("\ufffd"))
        if reason is None and (
            len(req.output_ids) >= p.max_tokens or req.seq_len >= self.max_model_len
        ):
            reason = "length"
        rep = p.repetition_detection  # (vLLM's: not before min_tokens, as a stop token)
        if (
            reason is None
            and rep is not None
            and len(req.output_ids) >= p.min_tokens
            and rep.repeats(req.output_ids)
        ):
            reason, req.stop_reason = "repetition", "repetition_detected"
        if reason is not None:
            if decode and not cut_text:
                # A stop token's own text is not output (vLLM), unless asked for.
                drop = by_token and not p.include_stop_str_in_output
                if self._decodes_whole:  # decoded whole, as it ends
                    ids = req.output_ids[: -1 if drop else None]
                    req.output_text = req.detokenizer.text(ids, end=True)
                elif drop:
                    req.output_text = req.output_text[:streamed]
            self._finish(req, reason, now)

    def _decode_output(self, req: Request, token: int) -> None:
        """Extends `req.output_text` by `token`'s text: decoded incrementally (`TokenTexts`),
        not the whole output again per token (0.2 ms a token at 1,000 tokens, quadratic in
        a request's length), after the prompt's last tokens (`TokenTexts`). A finished
        request's text is what streamed, as vLLM's: decoded whole, a byte-fallback decoder
        reads a run of bytes that is not UTF-8 as U+FFFDs, characters streamed before it
        too. Without a fast tokenizer, every token decodes the whole output.
        A request with logprobs keeps each token's text (`req.detokenizer.texts`, which the
        server reports)."""
        p = req.params
        if req.detokenizer is None:
            keep = p.logprobs is not None
            req.detokenizer = TokenTexts(
                self.tokenizer, p.skip_special_tokens, keep, prompt=req.prompt_ids
            )
        d = req.detokenizer
        if not self._decodes_whole:
            req.output_text += d.step(token)
            return
        if d.texts is not None:
            d.step(token)
        req.output_text = d.text(req.output_ids)

    def _finish(self, req: Request, reason: str, now: float | None = None) -> None:
        req.finish_reason = reason
        req.metrics.finish_time = now or time.perf_counter()
        self._end(req)
        self.stats.finished_requests += 1

    def _end(self, req: Request) -> None:
        """Give back what a request that ended (finished or aborted) holds: its rows, the
        drafter's state for it (the n-gram drafter's copy of its tokens too), its pages."""
        _hand_over_rows(req)
        if self.drafter is not None:
            self.drafter.finish(req)
        self.scheduler.finish(req)
        self._release_forks(req)
        self.requests.pop(req.rid, None)
        self._release_lora(req)

    def _release_lora(self, req: Request) -> None:
        """`req` ended: its adapter's hold goes (an unloaded one is dropped with its last,
        and --max-cpu-loras evicts what requests held past it)."""
        for gone in self.lora.release(req.rid) if self.lora is not None else ():
            self._on_every_rank("drop_lora_on_rank", gone.id)

    def _fail_unschedulable(self, idle: bool) -> list[Request]:
        """Finish the first waiting request if it can never be admitted: cut short ("length",
        its outputs kept) and returned, so whoever waits on it hears. In an idle step with
        nothing running and no pages parked (PD's, which come back without a step), any that
        still cannot be; under HiSparse, at once, a PD decode request retracted with a prompt
        longer than the device latent pool (recomputing would prefill the prompt there), unless
        it went to the host tier."""
        s = self.scheduler
        if not s.waiting:
            return []
        req = s.waiting[0]
        if (
            self.hot is not None
            and req.host_slots is None
            and not self.hot.fits(len(req.prompt_ids))
        ):
            log.warning(
                "request %d was retracted and its %d-token prompt cannot be prefilled again "
                "(HiSparse's device latent pool holds %d tokens); finishing it",
                req.rid,
                len(req.prompt_ids),
                self.pool.num_latent_tokens,
            )
        elif idle and not s.running and not s.parked:
            log.warning("request %d does not fit in the KV pool; finishing it", req.rid)
        else:
            return []
        self._finish(req, "length")
        return [req]

    # --- introspection --------------------------------------------------------------------

    def check_integrity(self) -> None:
        """When idle: every page is free or held by the prefix cache; no request holds any,
        nor a lock on a cached one (which would pin it for good)."""
        self.allocator.check()
        if self.hot is not None:
            self.hot.check(idle=not self.has_unfinished())
            if self.runner.leader is not None:  # (every rank's replica is rank 0's)
                self._check_replicas(self._on_every_rank("hisparse_replicas"))
        if not self.has_unfinished():
            total = self.allocator.num_free_pages + self.cache.num_device_pages
            if len(self.scheduler.req_to_token):
                raise AssertionError("idle engine still maps request slots")
            if self.cache.num_evictable_pages != self.cache.num_device_pages:
                raise AssertionError("idle engine's prefix cache has locked pages")
            if total != self.allocator.num_pages:
                raise AssertionError(
                    f"{self.allocator.num_free_pages} free + {self.cache.num_device_pages} cached "
                    f"!= {self.allocator.num_pages} pages"
                )
            if self.host is not None:
                host_used = self.host.num_pages - self.host.num_free_pages
                if host_used != self.cache.num_host_pages:
                    raise AssertionError(
                        f"{host_used} host pages used, cache holds {self.cache.num_host_pages}"
                    )

    def gathered_integrity(self) -> list[None] | str:
        """This rank's `check_integrity`, every rank's outcome gathered (`gather_outcome`):
        under DP attention each rank checks the requests it schedules (under TP rank 0's
        check asks the others itself)."""
        if not self.parallel.config.dp_attention:
            raise DsakvError("gathered_integrity is DP attention's every-rank check")
        why = None
        try:
            self.check_integrity()
        except AssertionError as e:
            why = str(e)
        return gather_outcome(self.parallel, None, why)

    def gathered_flush(self) -> bool:
        """DP attention's /flush_cache: each rank drops its own prefix cache, once every
        rank can (one rank's refusal drops none: a client that retries finds them all)."""
        return all(self.parallel.all_gather_objects(self._flushable())) and self.flush_cache()

    @staticmethod
    def _check_replicas(states: list[dict[str, object]]) -> None:
        """Every rank's HiSparse state as the first rank's that holds the same part (an
        IndexShare group's: the ranks of the stages that hold a layer of it)."""
        first: dict[str, tuple[int, object]] = {}
        for rank, state in enumerate(states):
            for key, value in state.items():
                holder, want = first.setdefault(key, (rank, value))
                if value != want:
                    raise AssertionError(
                        f"rank {rank}'s HiSparse replica differs from rank {holder}'s: {key}"
                    )

    def hisparse_replicas(self) -> list[dict[str, object]] | None:
        """Every rank's `HotBuffers.replica_state()`, on rank 0 (an every-rank call)."""
        return self.parallel.gather_objects(self.hot.replica_state())

    def _gen_throughput(self) -> float:
        """Output tokens per second since the older of the last two window starts (steps
        move them, every `GEN_WINDOW_S`): the same whoever reads it, and how often."""
        then, before = self._gen_marks[0]
        now = time.monotonic()
        return (self.stats.output_tokens - before) / (now - then) if now > then else 0.0

    def counters(self) -> dict[str, float]:
        """A flat snapshot for /metrics and the benchmark."""
        s, sch = self.stats, self.scheduler.stats
        layered = self._layer_counters()
        if self.parallel.pp_size > 1:  # (each stage's of its own layers)
            stages = self._on_every_rank("stage_layer_counters")
            layered = {key: sum(stage[key] for stage in stages) for key in layered}
        cell = self.model_layout.bytes_per_token  # (every stage's layers: the same at any pp)
        dense = self.model_layout.dense().bytes_per_token
        return {
            "pages_total": self.allocator.num_pages,
            "pages_used": self.allocator.num_used_pages,
            "pages_cached": self.cache.num_device_pages,
            "pages_evictable": self.cache.num_evictable_pages,  # (cached, no request holds)
            "host_pages_total": self.host.num_pages if self.host else 0,
            "host_pages_used": (self.host.num_pages - self.host.num_free_pages) if self.host else 0,
            "running_requests": len(self.scheduler.running),
            # (n's forks wait for their first choice's prefill outside the scheduler)
            "waiting_requests": len(self.scheduler.waiting)
            + sum(not f.finished for r in self.requests.values() for f in r.forks),
            "waiting_tokens": sum(r.seq_len for r in self.scheduler.waiting),
            "peak_running_requests": sch.peak_running,
            "prompt_tokens": s.prompt_tokens,
            "output_tokens": s.output_tokens,
            "gen_throughput": self._gen_throughput(),
            "computed_tokens": s.computed_tokens,
            "prefix_hit_tokens": sch.prefix_hit_tokens,
            "prefix_device_hit_tokens": sch.device_hit_tokens,
            "prefix_external_query_tokens": sch.external_query_tokens,
            "retractions": sch.retractions,
            "retractions_to_host": sch.retractions_to_host,
            "prefix_pages_demoted": self.cache.demoted_pages,
            "prefix_pages_promoted": self.cache.promoted_pages,
            "prefix_pages_evicted": self.cache.evicted_pages,
            "host_bytes_to_host": layered["host_bytes_to_host"],
            "host_bytes_to_device": layered["host_bytes_to_device"],
            "finished_requests": s.finished_requests,
            "steps": s.steps,
            "step_time_s": s.step_time_s,
            "aborted_requests": s.aborted_requests,
            "spec_draft_tokens": s.draft_tokens,
            "spec_accepted_tokens": s.accepted_tokens,
            "spec_verify_steps": s.verify_steps,
            "decode_steps": s.decode_steps,
            **dict(zip(STEP_TOKEN_KEYS, s.step_tokens)),
            "bytes_per_token": cell,
            "index_k_bytes_per_token_saved": dense - cell,
            **(self.l3.counters() if self.l3 is not None else zero_counters()),
            **(
                self.hot.counters(self.allocator.num_used_pages * self.config.page_size, layered)
                if self.hot is not None
                else HotBuffers.zero_counters()
            ),
        }

    def _layer_counters(self) -> dict[str, int]:
        """The counters of what this rank's layers did (its pipeline stage's): the host
        tier's and HiSparse's copies and lookups."""
        host = self.host.bytes_copied if self.host else {"d2h": 0, "h2d": 0}
        hot = self.hot.layer_counters() if self.hot is not None else {}
        return {"host_bytes_to_host": host["d2h"], "host_bytes_to_device": host["h2d"], **hot}

    def stage_layer_counters(self) -> list[dict[str, int]]:
        """Every pipeline stage's `_layer_counters` (its TP rank 0's: a stage's ranks count
        alike), for rank 0's `counters` to sum."""
        mine = self._layer_counters() if self.parallel.tp_rank == 0 else None
        return [c for c in self.parallel.all_gather_objects(mine) if c is not None]

    def lora_requests(self) -> LoraRequests | None:
        """The requests on each LoRA adapter, running and waiting (a decode server's
        adopted ones wait for a slot), for vLLM's lora_requests_info; None without
        --enable-lora."""
        if self.lora is None:
            return None
        s = self.scheduler
        return LoraRequests.of(s.running, [*s.waiting, *s.adopted])


GEN_WINDOW_S = 5.0  # SGLang's last_gen_throughput: output tokens/s over 1-2 such windows
_SCORE_ROWS = 256  # prompt rows per logits call: bounds a [rows, vocab] fp32 temporary


def _token_ids(prompt: object) -> list[int]:
    """`prompt` as a list of ints; `int()` took b"hi" as [104, 105], True as 1, 2.7 as 2."""
    if isinstance(prompt, (bytes, bytearray, dict)) or not isinstance(prompt, Iterable):
        raise DsakvError(f"a prompt is text or a list of token ids, got {reprlib.repr(prompt)}")
    ids = list(prompt)
    bad = [t for t in ids if not is_int(t)]
    if bad:
        raise DsakvError(f"token ids must be ints, got {reprlib.repr(bad[0])}")
    return ids


def find_stop(
    text: str, stops_by_last: dict[str, tuple[str, ...]], floor: int = 0
) -> tuple[int, str] | None:
    """The first stop string in `text` that ends past offset `floor`, and where it starts:
    of the stops (`SamplingParams.stops_by_last`) ending in a character past `floor`."""
    hits = [
        (text.find(s, max(0, floor - len(s) + 1)), s)
        for c in set(text[floor:])
        for s in stops_by_last.get(c, ())
    ]
    hits = [h for h in hits if h[0] >= 0]
    return min(hits) if hits else None


def _not_finite(index: int, of: str = "output") -> str:
    """Why a request whose raw logits held a NaN or an inf ended (`_fail_alone`)."""
    return f"the model's logits for this request are not finite (NaN or inf) at {of} token {index}"


def _record_ids(req: Request, values: list[float]) -> None:
    """`req`'s last token's logprobs of its `token_ids_logprob`; under vLLM's
    `logprob_token_ids` they are its alternatives too, in the place of the top ones (an id
    named twice once, as vLLM's logprobs dict keeps it)."""
    req.token_ids_logprobs.append(values)
    if req.params.logprob_token_ids:
        req.top_logprobs[-1] = list(dict(zip(req.params.logprob_token_ids, values)).items())


def _hand_over_rows(req: Request) -> None:
    """An ended request's kept rows (`Request.capture`) as it reports them: those of every
    position but its last, which no step ran (SGLang's seqlen - 1 rows)."""
    if req.capture is not None:
        end = req.seq_len - 1
        start = req.params.routed_experts_start_len
        req.routed_experts, req.hidden_states = req.capture.rows(end, start)
        req.capture = None


def _load_tokenizer(model: str):
    path = Path(model)
    if not has_tokenizer(path):
        return None
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except StrictDataclassError as e:  # transformers' config class refuses a config.json field
        why = one_line(e.__cause__ or e, named=False)
        raise ConfigError(f"{path / 'config.json'}: {why}") from None
    except Exception as e:  # tokenizers and transformers raise all kinds for a broken file
        raise DsakvError(
            f"cannot load the tokenizer in {path}: {_tokenizer_fault(path, e)}"
        ) from None


def _tokenizer_fault(path: Path, e: Exception) -> str:
    """The tokenizer file that is not valid JSON, if one is; else `e` on one line."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        try:
            if (path / name).is_file():
                load_json((path / name).read_text(), f"{name} is not valid JSON")
        except ValueError as bad:  # (DsakvError, UnicodeDecodeError)
            return str(bad) if isinstance(bad, DsakvError) else f"{name} is not valid JSON: {bad}"
    return one_line(e)
