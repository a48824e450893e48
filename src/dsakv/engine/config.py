"""`EngineConfig`: the engine's arguments (`LLM(...)` keywords, `dsakv` CLI flags), each
checked as it is given, and the device they name (`resolve_device`). The model's own config
and its layer plan are `dsakv.config`'s."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from dsakv.config import plan_overrides
from dsakv.config.kv_events import KVEventsConfig
from dsakv.config.layer_plan import DRAFT_STEPS, MAX_DRAFT_STEPS, parse_layer_partition
from dsakv.config.parallel import ParallelConfig
from dsakv.errors import DsakvError, is_int, is_number
from dsakv.kernels import BACKENDS
from dsakv.memory.capacity import host_tier_flag
from dsakv.memory.layout import DEFAULT_LATENT_DTYPE
from dsakv.memory.storage import StorageConfig
from dsakv.models.lora import check_fully_sharded, target_suffixes

MAX_GRAPH_BATCH = 128  # larger decode batches run eagerly (as SGLang's cuda_graph_max_bs)


# vLLM's `LLM(...)` keywords for fields named after SGLang's flags here
VLLM_KWARGS = {"tensor_parallel_size": "tp", "pipeline_parallel_size": "pp"}


def vllm_names_as_ours(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with vLLM's names (`VLLM_KWARGS`) as the fields they set; both names of
    one field given is refused. Renamed rather than added as fields: one field per
    setting, so every check and every reader of `EngineConfig` sees one name (a second
    field would have to be kept in step with the first)."""
    out = dict(kwargs)
    for theirs, ours in VLLM_KWARGS.items():
        if theirs in out:
            if ours in out:
                raise DsakvError(f"{ours} and {theirs} are one setting: give one")
            out[ours] = out.pop(theirs)
    return out


@dataclass(frozen=True)
class EngineConfig:
    """Engine arguments; the same names as `LLM(...)` keywords and `dsakv` CLI flags."""

    model: str
    # The tokenizer's folder where it is not the model's (vLLM's --tokenizer): its chat
    # template and special tokens come with it.
    tokenizer: str | None = None
    kv_cache_dtype: str = DEFAULT_LATENT_DTYPE
    index_k_dtype: str = "fp8"
    elide_index_k: bool = True
    kv_budget_gib: float | None = None
    num_pages: int | None = None
    # SGLang's cap on the device pool, in tokens: the pool is the least of what its size
    # gives and this, in whole pages (`Engine._num_pages`)
    max_total_tokens: int | None = None
    # The pool from what the GPU has free after the load (SGLang's flag; CUDA only), and
    # vLLM's, refused: see `_check_pool_size`.
    mem_fraction_static: float | None = None
    gpu_memory_utilization: float | None = None
    host_pool_gib: float = 0.0
    # The host tier as this many times the device pool's pages, sized once the pool is
    # (SGLang's --hicache-ratio under --enable-hierarchical-cache); not with host_pool_gib.
    host_pool_ratio: float | None = None
    page_size: int = 64
    chunked_prefill_size: int = 512
    max_running_requests: int = 256
    # Which waiting request runs first (`priority_sign`): vLLM's "fcfs", or "priority", by
    # the requests' `priority`, lower values first; or SGLang's switch, higher values first
    # unless `schedule_low_priority_values_first`; or SGLang's "lpm", the longest cached
    # prefix first (`SchedulerConfig.longest_prefix_first`)
    scheduling_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    # SGLang's: a waiting request retracts running ones whose priority is worse by more than
    # this (`SchedulerConfig.preemption_threshold`); None: its default, 10
    priority_scheduling_preemption_threshold: int | None = None
    max_model_len: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    enable_prefix_cache: bool = True
    # Which code runs the hot ops (`dsakv.kernels`), and CUDA-graph decode on CUDA.
    attention_backend: str = "auto"
    disable_cuda_graph: bool = False
    # Larger decode batches run eagerly (SGLang's --cuda-graph-max-bs; None: MAX_GRAPH_BATCH)
    cuda_graph_max_bs: int | None = None
    # The cpu backend runs decode steps of up to 4 requests through torch.compile
    # (inductor's C++): off by default, for its warm-up of 10-45 s per process (cpu_ops).
    enable_torch_compile: bool = False
    # One per-token reduction order for every step (SGLang's flag): a request's tokens and
    # logprobs do not depend on its batch, chunking, cache path or thread count. None: on
    # wherever that path runs (the cpu backend, fp32 compute) with one rank a stage (under
    # --tp it prefills long prompts slower than the batched path); True: required;
    # False: the batched path of before (`--disable-deterministic-inference`).
    enable_deterministic_inference: bool | None = None
    index_topk_pattern: str | None = None
    index_topk_freq: int | None = None
    index_skip_topk_offset: int | None = None
    no_index_share: bool = False
    seed: int = 0
    # What requests leave out (vLLM's flag): "auto", generation_config.json's sampling
    # fields and max_new_tokens; "vllm", SamplingParams' own
    generation_config: str = "auto"
    # vLLM's --override-generation-config (JSON or a dict): sampling defaults over those
    # (`served_sampling_defaults`), under either source
    override_generation_config: str | dict | None = None
    # Speculative decoding (SGLang's names): "mtp" (the checkpoint's draft layer), "ngram"
    # (prompt lookup) or None, and drafts per step.
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None  # (None: DRAFT_STEPS)
    # n-gram lookup: the shortest and longest suffix matched (None: SGLang's 1 and 12)
    speculative_ngram_min_match_window_size: int | None = None
    speculative_ngram_max_match_window_size: int | None = None
    # Parallelism (SGLang's flag names): see `dsakv.config.parallel.ParallelConfig`.
    tp: int = 1
    ep: int = 1
    dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Pipeline stages (SGLang's --pp-size, vLLM's --pipeline-parallel-size), each of `tp`
    # ranks, and the target layers of each (None: `ParallelConfig`'s `even_split`)
    pp: int = 1
    pp_layer_partition: tuple[int, ...] | None = None
    # L3 storage tier for prefix KV (SGLang's HiCache names): see `StorageConfig`.
    hicache_storage_backend: str | None = None  # "file" | "mooncake"
    hicache_storage_dir: str | None = None
    hicache_storage_max_gib: float | None = None
    hicache_mooncake_master: str | None = None  # HOST:PORT of mooncake_master
    hicache_mooncake_start_master: bool = False
    hicache_write_policy: str | None = None  # (None: StorageConfig's defaults)
    hicache_storage_prefetch_timeout: float | None = None
    # HiSparse (SGLang's names): latent on the host, per-request hot buffers on the device.
    enable_hisparse: bool = False
    hisparse_config: str | dict | None = None  # JSON object: see `HiSparseConfig`
    # SGLang's: requests may ask for the experts each of their tokens was routed to
    # (`SamplingParams.return_routed_experts`: an MoE model only) and for their last
    # hidden states (`return_hidden_states`); a request asking without them is refused
    enable_return_routed_experts: bool = False
    enable_return_hidden_states: bool = False
    # SGLang's expert distribution recorder (`ExpertDistributionMixin`): "stat" (each
    # layer's count of tokens per expert, EPLB's input) or "per_token"; None: off. A "stat"
    # dump keeps the last `buffer_size` steps' counts (< 0: every step's)
    expert_distribution_recorder_mode: str | None = None
    expert_distribution_recorder_buffer_size: int = 1000
    # SGLang's --watchdog-timeout (a server's: `server.watchdog`): a step running longer
    # than this many seconds ends the process, a stuck engine being worse than none; None: off
    watchdog_timeout: float | None = 300.0
    # SGLang's and vLLM's --stream-interval (a server's: `AsyncEngine`): a running request's
    # tokens reach its stream N at a time (its first and last at once): fewer, larger
    # chunks for fewer handler wake-ups a token
    stream_interval: int = 1
    # vLLM's --collect-detailed-traces (a server's, with its --otlp-traces-endpoint): "model",
    # "worker", "all", or several, comma-separated. Each request's steps are timed for its
    # span (`dsakv.server.tracing`): the scheduler's (whichever is named), the step's run
    # ("worker"), the model's forward pass, the device synced around it ("model"); None:
    # none are
    collect_detailed_traces: str | None = None
    # vLLM's and SGLang's --kv-events-config (JSON, a dict or a `KVEventsConfig`): the
    # prefix cache's pages stored and removed, published over ZMQ for KV-aware routers
    # (`dsakv.engine.kv_events`); None or not enabled: none
    kv_events_config: str | dict | KVEventsConfig | None = None
    # LoRA adapters (vLLM's names; `dsakv.models.lora`): served per request
    # (`SamplingParams.lora_name`); steps with adapter rows run the torch path. `max_loras`
    # adapters are resident at once, each up to rank `max_lora_rank`; `max_cpu_loras` caps
    # those held in host memory (None: no cap; past it the least recently used no request
    # holds is evicted, read again when named: `dsakv.engine.lora`); `lora_modules`: (name, path)
    # pairs loaded at start; `lora_target_modules` (SGLang's): the modules that hold slots
    # (`dsakv.models.lora.TARGET_MODULES`, `all`), an adapter adapting another refused;
    # `fully_sharded_loras` (vLLM's, off as there): under --tp the slots' other half split
    # too (A of column-parallel layers by rank, B of row-parallel ones by rows: `RankSplit`)
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[tuple[str, str], ...] = ()
    lora_target_modules: tuple[str, ...] = ("all",)
    fully_sharded_loras: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):  # every bool field, by its annotation (a string here)
            v = getattr(self, f.name)
            if f.type == "bool" and not isinstance(v, bool):
                raise DsakvError(f"{f.name} must be True or False, got {v!r}")
            if f.type == "bool | None" and not (v is None or isinstance(v, bool)):
                raise DsakvError(f"{f.name} must be True, False or None, got {v!r}")
        if not isinstance(self.device, (str, torch.device)):
            raise DsakvError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        ints = ("page_size", "chunked_prefill_size", "max_running_requests")
        for name in ints:
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise DsakvError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("num_pages", "max_total_tokens", "max_model_len", "cuda_graph_max_bs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise DsakvError(f"{name} must be an integer >= 1 or None, got {v!r}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise DsakvError(
                f"--max-total-tokens {self.max_total_tokens} holds no {self.page_size}-token "
                "page (--page-size)"
            )
        budget, host = self.kv_budget_gib, self.host_pool_gib
        if budget is not None and not (is_number(budget) and 0 < budget < math.inf):
            raise DsakvError(f"kv_budget_gib must be a finite number > 0, got {budget!r}")
        if not (is_number(host) and 0 <= host < math.inf):
            raise DsakvError(f"host_pool_gib must be a finite number >= 0, got {host!r}")
        ratio = self.host_pool_ratio
        if ratio is not None and not (is_number(ratio) and 0 < ratio < math.inf):
            raise DsakvError(f"host_pool_ratio must be a finite number > 0, got {ratio!r}")
        host_tier_flag(host, ratio)  # (both sizes: one error)
        if not is_int(self.seed):
            raise DsakvError(f"seed must be an integer, got {self.seed!r}")
        if self.expert_distribution_recorder_mode not in (None, "stat", "per_token"):
            raise DsakvError(
                "expert_distribution_recorder_mode must be stat or per_token, got "
                f"{self.expert_distribution_recorder_mode!r}"
            )
        size = self.expert_distribution_recorder_buffer_size
        if not is_int(size) or size == 0:
            raise DsakvError(
                f"expert_distribution_recorder_buffer_size must be a nonzero integer, got {size!r}"
            )
        timeout = self.watchdog_timeout
        if timeout is not None and not (is_number(timeout) and timeout > 0):
            raise DsakvError(f"watchdog_timeout must be a positive number, got {timeout!r}")
        if not is_int(self.stream_interval) or self.stream_interval < 1:
            raise DsakvError(
                f"stream_interval must be a positive integer, got {self.stream_interval!r}"
            )
        detailed_trace_modules(self.collect_detailed_traces)
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise DsakvError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.scheduling_policy not in ("fcfs", "priority", "lpm"):
            raise DsakvError(
                "scheduling_policy must be fcfs or priority (vLLM's), or lpm (SGLang's), "
                f"got {self.scheduling_policy!r}"
            )
        if self.enable_priority_scheduling and self.scheduling_policy == "lpm":
            raise DsakvError(
                "--schedule-policy lpm orders the waiting requests by cached prefix, "
                "--enable-priority-scheduling by priority: give one"
            )
        if self.schedule_low_priority_values_first and not self.enable_priority_scheduling:
            raise DsakvError(
                "--schedule-low-priority-values-first needs --enable-priority-scheduling"
            )
        if self.enable_priority_scheduling and self.scheduling_policy == "priority":
            raise DsakvError(
                "--scheduling-policy priority (vLLM's: lower values first) and "
                "--enable-priority-scheduling (SGLang's: higher values first unless "
                "--schedule-low-priority-values-first) both ask for priority scheduling: give one"
            )
        threshold = self.priority_scheduling_preemption_threshold
        if threshold is not None:
            if not self.enable_priority_scheduling:
                raise DsakvError(
                    "--priority-scheduling-preemption-threshold needs --enable-priority-scheduling"
                )
            if not is_int(threshold) or threshold < 0:  # (below 0 equals preempt each other)
                raise DsakvError(
                    "priority_scheduling_preemption_threshold must be an integer >= 0, got "
                    f"{threshold!r}"
                )
        if self.tokenizer is not None:
            check_tokenizer_dir(self.tokenizer)
        if self.generation_config not in ("auto", "vllm"):
            raise DsakvError(
                f"generation_config must be auto or vllm, got {self.generation_config!r}"
            )
        check_generation_overrides(self.override_generation_config)
        if self.attention_backend not in BACKENDS:
            raise DsakvError(
                f"attention_backend must be one of {', '.join(BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.speculative_algorithm not in (None, "mtp", "ngram"):
            raise DsakvError(
                "speculative_algorithm must be 'mtp', 'ngram' or None, "
                f"got {self.speculative_algorithm!r}"
            )
        window = (
            self.speculative_ngram_min_match_window_size,
            self.speculative_ngram_max_match_window_size,
        )
        if window != (None, None) and self.speculative_algorithm != "ngram":
            raise DsakvError(
                "--speculative-ngram-min/max-match-window-size need --speculative-algorithm ngram"
            )
        lo, hi = self.ngram_window
        if not (is_int(lo) and is_int(hi) and 1 <= lo <= hi <= 1024):
            raise DsakvError(
                "the n-gram match window (--speculative-ngram-min/max-match-window-size) must "
                f"be 1 <= min <= max <= 1024, got {lo!r} and {hi!r}"
            )
        n = self.speculative_num_steps
        if n is not None and not (is_int(n) and 1 <= n <= MAX_DRAFT_STEPS):
            raise DsakvError(f"speculative_num_steps must be in 1..{MAX_DRAFT_STEPS}, got {n!r}")
        # Settings that act only beside another are refused alone, not silently ignored.
        if n is not None and self.speculative_algorithm is None:
            raise DsakvError("--speculative-num-steps needs --speculative-algorithm")
        self._check_pool_size()
        if self.pp_layer_partition is not None:  # (an LLM(...) keyword's "3,5" or list)
            parts = parse_layer_partition(self.pp_layer_partition)
            object.__setattr__(self, "pp_layer_partition", parts)
        pc = self.parallel  # (validates the parallel flags)
        if self.enable_torch_compile and pc.world_size > 1:  # (else eager, unsaid)
            raise DsakvError(
                "--enable-torch-compile runs on one rank (its compiled blocks hold no "
                f"collectives), not {pc.world_size} (--tp {self.tp}, --pp-size {self.pp})"
            )
        if pc.dp_attention and self.max_running_requests < pc.world_size:
            raise DsakvError(
                f"--max-running-requests {self.max_running_requests} is less than one request "
                f"per rank: under --dp-attention the {pc.world_size} ranks share it"
            )
        self._check_hisparse()
        self._check_lora()
        if self.enable_deterministic_inference and self.dtype not in ("auto", "float32"):
            raise DsakvError(
                f"--enable-deterministic-inference does not run with --dtype {self.dtype} "
                "(fp32 only) yet"
            )
        if (events := self.kv_events) is not None:
            if not self.enable_prefix_cache:
                raise DsakvError(
                    "--kv-events-config publishes the prefix cache's pages: it needs the "
                    "prefix cache (drop --no-prefix-cache)"
                )
            try:
                events.check_ranks(pc.dp)
            except DsakvError as e:
                raise DsakvError(f"kv_events_config: {e}") from None
        if self.storage is not None:
            if not self.enable_prefix_cache:
                raise DsakvError(
                    "--hicache-storage-backend needs the prefix cache (drop --no-prefix-cache)"
                )
            if pc.pp > 1 and self.enable_hisparse and pc.tp > 1 and pc.nnodes > 1:
                raise DsakvError(
                    "--hicache-storage-backend with --enable-hisparse under --pp-size and "
                    "--tp runs on one machine yet (--nnodes 1): each rank's own host latent "
                    "rows would need a page read back"
                )

    def _check_pool_size(self) -> None:
        """One way to size the pool; a fraction of the GPU on a GPU, with SGLang's meaning."""
        given = [
            flag
            for flag, v in (
                ("--kv-budget-gib", self.kv_budget_gib),
                ("--num-pages", self.num_pages),
                ("--mem-fraction-static", self.mem_fraction_static),
                ("--gpu-memory-utilization", self.gpu_memory_utilization),
            )
            if v is not None
        ]
        if len(given) > 1:
            both = "both" if len(given) == 2 else "all"
            raise DsakvError(f"{' and '.join(given)} {both} size the KV pool: give one")
        for name in ("mem_fraction_static", "gpu_memory_utilization"):
            v = getattr(self, name)
            if v is not None and not (is_number(v) and 0 < v <= 1):
                raise DsakvError(f"{name} must be a number in (0, 1], got {v!r}")
        if self.mem_fraction_static is None and self.gpu_memory_utilization is None:
            return
        flag = given[0]
        device = str(self.device)
        if device.startswith("cpu") or device == "auto" and not torch.cuda.is_available():
            raise DsakvError(
                f"{flag} sizes the KV pool from GPU memory, and this engine runs on the CPU, "
                "where the pool is host RAM: give --kv-budget-gib"
            )
        if self.gpu_memory_utilization is not None:
            raise DsakvError(
                "--gpu-memory-utilization (vLLM's: the share of the GPU the whole instance may "
                "use, activations and CUDA graphs included, which vLLM measures with a "
                "profiling run dsakv does not make) cannot be honoured: give "
                "--mem-fraction-static F (SGLang's: F of the GPU for weights and KV, the rest "
                "for activations) or --kv-budget-gib"
            )

    def _check_lora(self) -> None:
        """The LoRA settings, each refused without --enable-lora."""
        modules = self.lora_modules
        if isinstance(modules, list):  # (LLM(...) keywords may give lists)
            modules = tuple(tuple(m) if isinstance(m, list) else m for m in modules)
            object.__setattr__(self, "lora_modules", modules)
        targets = self.lora_target_modules
        if isinstance(targets, (str, list)):  # (a name alone, or LLM(...)'s list)
            targets = (targets,) if isinstance(targets, str) else tuple(targets)
            object.__setattr__(self, "lora_target_modules", targets)
        if not self.enable_lora:
            for flag, given in (
                ("--max-loras", self.max_loras != 1),
                ("--max-lora-rank", self.max_lora_rank != 16),
                ("--max-cpu-loras", self.max_cpu_loras is not None),
                ("--lora-modules", bool(modules)),
                ("--lora-target-modules", targets != ("all",)),
                ("--fully-sharded-loras", self.fully_sharded_loras),
            ):
                if given:
                    raise DsakvError(f"{flag} needs --enable-lora")
        if not isinstance(targets, tuple) or not all(isinstance(m, str) for m in targets):
            raise DsakvError(f"lora_target_modules must be module names, got {targets!r}")
        target_suffixes(targets)
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise DsakvError(f"{name} must be an integer >= 1, got {v!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not is_int(cpu) or cpu < 1):
            raise DsakvError(f"max_cpu_loras must be an integer >= 1 or None, got {cpu!r}")
        if cpu is not None and cpu < self.max_loras:  # (vLLM's refusal)
            raise DsakvError(
                f"--max-cpu-loras {cpu} is less than --max-loras {self.max_loras}: the "
                "adapters in a batch are held in host memory too"
            )
        ok = isinstance(modules, tuple) and all(
            isinstance(m, tuple) and len(m) == 2 and all(isinstance(x, str) and x for x in m)
            for m in modules
        )
        if not ok:
            raise DsakvError(
                f"lora_modules must be (name, path) pairs of non-empty strings, got {modules!r}"
            )
        names = [name for name, _ in modules]
        if len(set(names)) < len(names):
            raise DsakvError(f"--lora-modules names an adapter twice: {names}")
        if not self.enable_lora:
            return
        # Steps with adapter rows run the torch path, eager (each token's adapter slot is per
        # step): not batch invariant; the others run as without --enable-lora
        refused = (
            (self.dp_attention, "--dp-attention"),
            (self.enable_torch_compile, "--enable-torch-compile"),
            (self.enable_deterministic_inference, "--enable-deterministic-inference"),
        )
        for bad, flag in refused:
            if bad:
                raise DsakvError(f"--enable-lora does not run with {flag} yet")
        if self.fully_sharded_loras:
            check_fully_sharded(self.max_lora_rank, self.tp)

    def _check_hisparse(self) -> None:
        """What HiSparse runs with; the model-dependent checks come with the model."""
        if not self.enable_hisparse:
            if self.hisparse_config is not None:
                raise DsakvError("--hisparse-config needs --enable-hisparse")
            return
        if self.chunked_prefill_size < 2:  # (under HiSparse a one-token step decodes)
            raise DsakvError(
                "--enable-hisparse does not run with --chunked-prefill-size 1 (a 1-token step "
                "decodes) yet"
            )

    @property
    def max_drafts(self) -> int:
        """The most drafts a request verifies in one step (0 without speculative decoding)."""
        if self.speculative_algorithm is None:
            return 0
        return self.speculative_num_steps or DRAFT_STEPS

    @property
    def host_tier_flag(self) -> str | None:
        """The flag that sized the host tier, with the spellings that set it (for errors:
        SGLang's fold into these), or None when there is no host tier."""
        return host_tier_flag(self.host_pool_gib, self.host_pool_ratio)

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """The KV cache events publisher's settings, or None when events are off."""
        if self.kv_events_config is None:
            return None
        try:
            events = KVEventsConfig.parse(self.kv_events_config)
        except DsakvError as e:
            raise DsakvError(f"kv_events_config: {e}") from None
        return events if events.enabled else None

    @property
    def detailed_traces(self) -> frozenset[str]:
        """What `collect_detailed_traces` times: "model", "worker", both or neither."""
        return detailed_trace_modules(self.collect_detailed_traces)

    @property
    def storage(self) -> StorageConfig | None:
        """The L3 storage tier's settings, or None when it is off."""
        if self.hicache_storage_backend is None:
            for flag, value in (
                ("storage-dir", self.hicache_storage_dir),
                ("storage-max-gib", self.hicache_storage_max_gib),
                ("mooncake-master", self.hicache_mooncake_master),
                ("mooncake-start-master", self.hicache_mooncake_start_master),
                ("write-policy", self.hicache_write_policy),
                ("storage-prefetch-timeout", self.hicache_storage_prefetch_timeout),
            ):
                if value is not None and value is not False:
                    raise DsakvError(f"--hicache-{flag} needs --hicache-storage-backend")
            return None
        given = {
            "write_policy": self.hicache_write_policy,
            "prefetch_timeout_s": self.hicache_storage_prefetch_timeout,
        }
        return StorageConfig(
            self.hicache_storage_backend,
            self.hicache_storage_dir,
            self.hicache_storage_max_gib,
            self.hicache_mooncake_master,
            self.hicache_mooncake_start_master,
            **{k: v for k, v in given.items() if v is not None},
        )

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineConfig:
        kwargs = vllm_names_as_ours(kwargs)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise DsakvError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=str(model), **kwargs)

    @property
    def plan_overrides(self) -> dict[str, Any]:
        return plan_overrides(self)

    @property
    def ngram_window(self) -> tuple[int, int]:
        """The n-gram drafter's shortest and longest suffix matched (SGLang's defaults: 1
        and 12, the longest raised to a shortest given past it)."""
        lo = self.speculative_ngram_min_match_window_size
        hi = self.speculative_ngram_max_match_window_size
        if lo is None:
            lo = 1
        if hi is None:
            hi = max(12, lo) if is_int(lo) else 12
        return lo, hi

    @property
    def priority_sign(self) -> int:
        """The scheduler's order (`SchedulerConfig.priority_sign`): 0 first come first
        served, 1 lower `priority` values first, -1 higher ones first."""
        if self.scheduling_policy == "priority" or self.schedule_low_priority_values_first:
            return 1
        return -1 if self.enable_priority_scheduling else 0

    @property
    def preemption_threshold(self) -> int | None:
        """`SchedulerConfig.preemption_threshold`: SGLang's (10 unless given) under its
        priority scheduling, else None."""
        if not self.enable_priority_scheduling:
            return None
        threshold = self.priority_scheduling_preemption_threshold
        return 10 if threshold is None else threshold

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(
            tp=self.tp,
            ep=self.ep,
            pp=self.pp,
            pp_layer_partition=self.pp_layer_partition,
            dp_attention=self.dp_attention,
            nnodes=self.nnodes,
            node_rank=self.node_rank,
            dist_init_addr=self.dist_init_addr,
        )


def detailed_trace_modules(value: str | None) -> frozenset[str]:
    """vLLM's --collect-detailed-traces value as the modules it names ("all": both)."""
    if value is None:
        return frozenset()
    names = set(value.split(",")) if isinstance(value, str) else {None}
    if not names <= {"model", "worker", "all"}:
        raise DsakvError(
            "collect_detailed_traces must be model, worker or all, or several of them "
            f"comma-separated, got {value!r}"
        )
    return frozenset({"model", "worker"} if "all" in names else names)


def resolve_device(name: str) -> torch.device:
    """The device `name` picks, a GPU always with its index: tensors report `cuda:0`, so an
    index-less key (`cuda`) missed every table kept per device and built it twice."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise DsakvError(f"unknown device {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise DsakvError(f"device {name!r}: dsakv runs on cpu or cuda")
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        raise DsakvError("device cuda requested but CUDA is not available")
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise DsakvError(f"device {name!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return torch.device("cuda", index)


def has_tokenizer(path: Path) -> bool:
    """Whether the folder `path` holds a tokenizer (its files; no Hub names here)."""
    return (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()


def check_tokenizer_dir(where: str) -> None:
    """A `tokenizer` folder holds one: vLLM would take a Hub name here and download it."""
    if not isinstance(where, (str, os.PathLike)) or not str(where):  # ("" is the cwd)
        raise DsakvError(f"--tokenizer must be a directory path, got {where!r}")
    path = Path(where)
    if not path.is_dir():
        raise DsakvError(
            f"--tokenizer {where} is not a directory (dsakv loads local tokenizers only, "
            "no Hub names: download it and give its folder)"
        )
    if not has_tokenizer(path):
        raise DsakvError(
            f"--tokenizer {where} holds no tokenizer (tokenizer.json or tokenizer_config.json)"
        )


def check_generation_overrides(value: str | dict | None) -> None:
    """`override_generation_config` as sampling params could take it (a request leaving
    them out gets them: a bad one would fail each), in one error naming the field."""
    from dsakv.config.model import served_sampling_defaults

    from .sampling import SamplingParams

    try:
        SamplingParams(**served_sampling_defaults({}, "vllm", value))
    except (DsakvError, TypeError) as e:
        raise DsakvError(f"override_generation_config: {e}") from None
