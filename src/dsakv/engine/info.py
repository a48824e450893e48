"""SGLang's server info (its `Engine.get_server_info`, its /server_info): an engine's
settings under SGLang's names, which `LLM.get_server_info` returns and the server's
/server_info extends with what only a server has (its PD role)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsakv import __version__


def engine_info(
    engine: Any, counters: Mapping[str, float] | None, served_model_name: str
) -> dict[str, Any]:
    """`engine`'s (an `Engine` or `DPEngine`) settings, and from its `counters` (None: not
    read yet) the pool's size and SGLang's `internal_states`. sglang-router loads the
    tokenizer at `model_path` and registers a worker under `served_model_name`."""
    c = engine.config
    pages = counters["pages_total"] if counters else None
    return {
        "model_path": c.model,
        "tokenizer_path": None if engine.tokenizer is None else c.tokenizer or c.model,
        "served_model_name": served_model_name,
        "version": __version__,
        "context_length": engine.max_model_len,
        "page_size": c.page_size,
        "max_total_num_tokens": None if pages is None else int(pages) * c.page_size,
        "max_running_requests": c.max_running_requests,
        "chunked_prefill_size": c.chunked_prefill_size,
        "kv_cache_dtype": c.kv_cache_dtype,
        # (SGLang's server args: a prompt must fit the device latent slots, not the context)
        "enable_hisparse": c.enable_hisparse,
        "hisparse_config": None if engine.hisparse is None else engine.hisparse.to_dict(),
        "tp_size": c.tp,
        "ep_size": c.parallel.ep,
        "pp_size": c.parallel.pp,
        # each stage's target layers (`--pp-layer-partition`, else the even split)
        "pp_layer_partition": [len(r) for r in c.parallel.stage_layers(engine.plan.num_layers)],
        # SGLang's data-parallel size: under DP attention each rank schedules its own
        # requests (still behind this one entry point), as sglang-router's dp-aware mode
        # reads it
        "dp_size": c.parallel.dp,
        "enable_dp_attention": c.dp_attention,
        "internal_states": [_internal_state(counters)] if counters else [],
    }


def _internal_state(counters: Mapping[str, float]) -> dict[str, float]:
    """SGLang's `internal_states` entry: output tokens per second over the engine's
    recent window (`last_gen_throughput`, `Engine.counters`' gen_throughput, whoever
    reads it how often) and, with MTP, `avg_spec_accept_length` (accepted drafts + 1
    per verification, which sglang.bench_serving reports)."""
    state = {"last_gen_throughput": float(counters.get("gen_throughput", 0.0))}
    if steps := counters.get("spec_verify_steps", 0):
        state["avg_spec_accept_length"] = 1 + counters["spec_accepted_tokens"] / steps
    return state
