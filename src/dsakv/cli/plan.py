"""`dsakv plan`: the KV capacity plan, dense and elided side by side, without loading a model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsakv.config.layer_plan import plan_overrides
from dsakv.errors import DsakvError

from .args import (
    EP,
    TP,
    add_aliased,
    add_dp_args,
    add_hisparse_args,
    add_host_tier_args,
    add_layout_args,
    add_pp_args,
    check_dp_size,
    draft_layers,
    fold_expert_parallel,
    fold_host_tier,
    fraction,
    nonnegative_float,
    positive_float,
    positive_int,
)

if TYPE_CHECKING:
    from dsakv.config.parallel import ParallelConfig

GIB = 1 << 30  # (memory.capacity's, not imported here: dsakv.memory loads torch)


def _check_checkpoint(model: str, config: Any, plan: Any) -> None:
    """A plan whose full layers a checkpoint has no indexer weights for, or with a draft
    layer where it has no MTP layer, is refused, as the engine refuses it (a config-only
    folder or a preset: nothing to check against)."""
    from dsakv.config.checkpoint import (
        NoCheckpoint,
        checkpoint_files,
        indexer_layers,
        mtp_layer_prefix,
        no_indexer_problem,
    )

    path = Path(model)
    if not path.is_dir():
        return
    try:
        names = checkpoint_files(path)  # (a corrupt or unreadable one: refused, as the engine)
    except NoCheckpoint:
        return
    lacking = set(plan.full_layers) - indexer_layers(names)
    if lacking:
        raise DsakvError(f"{model}: {no_indexer_problem(lacking, plan.pattern)}")
    if plan.num_draft_layers:
        mtp_layer_prefix(path, config, names)


def _check_a_page(pipe: Any, dense: bool) -> None:
    """A budget that holds no page of the layout asked for (under --pp-size, on the stage
    that holds the fewest) is refused, as the engine refuses it; the other layout's column
    may still read 0."""
    from dsakv.memory.capacity import check_holds_a_page
    from dsakv.memory.layout import spans

    s = pipe.limiting
    stage = ""
    if len(pipe.stages) > 1:
        stage = f" on pipeline stage {s.stage} (layers {spans(s.layout.held_layers)})"
    check_holds_a_page(
        s.capacity.num_pages,
        f" of the {'dense' if dense else 'elided'} layout{stage}: "
        f"{s.capacity.kv_budget_bytes:,} B per rank, a page takes {s.layout.bytes_per_page:,} B",
    )


def _cmd_plan(args: argparse.Namespace) -> int:
    from dsakv.config import LayerPlan, ModelConfig
    from dsakv.config.layer_plan import check_one_draft_layer
    from dsakv.config.parallel import ParallelConfig
    from dsakv.memory import CacheLayout, estimate_weight_bytes, plan_pipeline
    from dsakv.memory.capacity import UnpricedWeightsError, gain_pct, host_tier_flag
    from dsakv.memory.layout import DEFAULT_LATENT_DTYPE

    fold_host_tier(args)
    tier_flag = host_tier_flag(args.host_pool_gib or 0.0, args.host_pool_ratio)  # (both: refused)
    config = ModelConfig.resolve(args.model)
    hisparse = _hisparse_config(args, config)
    plan = LayerPlan.from_config(config, draft_layers=args.draft_layers, **plan_overrides(args))
    check_one_draft_layer(plan)
    _check_checkpoint(args.model, config, plan)
    elided = CacheLayout.from_plan(
        config,
        plan,
        args.kv_cache_dtype or DEFAULT_LATENT_DTYPE,
        args.index_k_dtype or "fp8",
        args.page_size or 64,
    )
    dense = elided.dense()
    if args.gpu_memory_gib is None:  # they size a budget from GPU memory, else are dropped
        given = [
            f
            for f in ("weights_gib", "mem_fraction_static", "reserve_gib")
            if getattr(args, f) is not None
        ]
        if given:
            flags = ", ".join("--" + f.replace("_", "-") for f in given)
            raise DsakvError(f"{flags} need{'s' if len(given) == 1 else ''} --gpu-memory-gib")
        if args.kv_budget_gib is None:
            args.kv_budget_gib = 100.0
    check_dp_size(args)
    fold_expert_parallel(args)
    args.ep = args.ep or 1
    parallel = ParallelConfig(
        tp=args.tp,
        ep=args.ep,
        pp=args.pp,
        pp_layer_partition=args.pp_layer_partition,
        dp_attention=args.dp_attention,
        nnodes=args.nnodes,
    )
    parallel.check_model(config)
    stages = parallel.stage_layers(plan.num_layers)  # (refuses a partition that does not fit)
    subtracted = args.gpu_memory_gib is not None and args.weights_gib is None
    try:
        weights = estimate_weight_bytes(
            config, plan, args.tp, ep=args.ep, dp_attention=args.dp_attention
        )
    except UnpricedWeightsError:  # (a malformed config or parallel layout stays an error)
        if subtracted:
            raise
        weights = None  # the budget does not need them: reported as unknown
    # `plan_capacity`'s keywords, each layout's (or stage's) own weights priced from the
    # config (a dense layout's include the indexers shared layers skip); the same budget
    # sizes the HiSparse split.
    budget = dict(
        kv_budget_gib=args.kv_budget_gib,
        gpu_memory_gib=args.gpu_memory_gib,
        mem_fraction_static=0.9 if args.mem_fraction_static is None else args.mem_fraction_static,
        weights_gib=args.weights_gib,
        reserve_gib=args.reserve_gib or 0.0,
        config=None if weights is None else config,
        tp=args.tp,
        ep=args.ep,
        dp_attention=args.dp_attention,
    )
    # Per layout, every stage's plan (`plan_pipeline`; one stage, the whole model, without
    # --pp-size): the least stage's capacity, weights per rank and layout stand here.
    pipe_e, pipe_d = (
        plan_pipeline(layout, stages, index_topk=config.index_topk, **budget)
        for layout in (elided, dense)
    )
    chosen = pipe_d if args.no_elide_index_k else pipe_e
    if hisparse is None:  # (HiSparse's device pool: `check_pool` below)
        _check_a_page(chosen, args.no_elide_index_k)
    chosen_layout = chosen.limiting.layout
    report = {
        "model_type": config.model_type,
        "num_layers": plan.num_layers,
        "num_draft_layers": plan.num_draft_layers,
        "indexer_types": list(plan.indexer_types),
        "layer_pattern": plan.pattern,
        "plan_source": plan.source,
        "num_full_layers": plan.num_full_layers,
        "num_shared_layers": plan.num_shared_layers,
        "elide_index_k": not args.no_elide_index_k,
        "kv_cache_dtype": elided.kv_cache_dtype,
        "index_k_dtype": elided.index_k_dtype,
        "page_size": elided.page_size,
        "latent_bytes_per_token": chosen_layout.latent_bytes_per_token,
        "index_k_bytes_per_token": chosen_layout.index_k_bytes_per_token,
        "bytes_per_token": chosen_layout.bytes_per_token,
        "bytes_per_token_elided": pipe_e.limiting.layout.bytes_per_token,
        "bytes_per_token_dense": pipe_d.limiting.layout.bytes_per_token,
        "kv_budget_bytes": chosen.kv_budget_bytes,
        "max_total_num_tokens": chosen.max_total_num_tokens,
        "max_total_num_tokens_elided": pipe_e.max_total_num_tokens,
        "max_total_num_tokens_dense": pipe_d.max_total_num_tokens,
        "token_gain_pct": gain_pct(pipe_e.max_total_num_tokens, pipe_d.max_total_num_tokens),
        "tp": args.tp,
        "ep": args.ep,
        "dp_attention": args.dp_attention,
        "weight_bytes_per_rank": chosen.limiting.weight_bytes,
        # Every rank holds a pool; plain TP replicates it, DP attention fills each its own.
        "max_total_num_tokens_per_rank": chosen.max_total_num_tokens,
        "max_total_num_tokens_aggregate": chosen.max_total_num_tokens * parallel.dp,
        "indexer_weight_bytes_saved": weights and weights.indexer_bytes_saved,
    }
    if parallel.pp > 1:
        report.update(_model_figures(report, elided, dense, weights))
        if weights is not None:  # (a stage's own, as its weights per rank are)
            report["indexer_weight_bytes_saved"] = estimate_weight_bytes(
                config, plan, args.tp, ep=args.ep, dp_attention=args.dp_attention,
                layers=chosen_layout.layers,
            ).indexer_bytes_saved  # fmt: skip
        report.update(_stages_report(pipe_e, pipe_d, args.no_elide_index_k))
        report["index_topk"] = config.index_topk
    splits = stage_splits = None
    if hisparse is not None:
        from dsakv.memory import plan_hisparse

        # Per rank, as the pool's figures are: each stage's split, all with the least
        # stage's device tokens (one scheduler), and the stage whose budget sets them
        splits, stage_splits = zip(
            *(
                _stage_splits([plan_hisparse(s.layout, hisparse, **budget) for s in pipe.stages])
                for pipe in (pipe_d, pipe_e)
            ),
            strict=True,
        )
        nodes = [_node_host_latents(p, parallel) for p in stage_splits]  # (bytes, latents)
        chosen_split = splits[0] if args.no_elide_index_k else splits[1]
        page = chosen_layout.page_size
        hisparse.check_pool(chosen_split.device_tokens // page, page)  # as the engine refuses
        report["hisparse"] = {
            **hisparse.to_dict(),
            **{
                name: {
                    **split.as_dict(),
                    "host_latents_per_node": latents,
                    "host_bytes_per_node": node,
                    **_stage_hosts(stages),
                }
                for name, split, (node, latents), stages in zip(
                    ("dense", "elided"), splits, nodes, stage_splits, strict=True
                )
            },
            # Budget-independent: the ratio of device bytes per device token.
            "device_tokens_elided_over_dense": round(
                splits[0].device_bytes_per_device_token / splits[1].device_bytes_per_device_token, 3
            ),
        }
    tiers = None
    if tier_flag is not None:
        tiers = tuple(
            _plan_host_tier(args, parallel, pipe, split, asked)
            for pipe, split, asked in zip(
                (pipe_d, pipe_e),
                stage_splits or (None, None),
                (args.no_elide_index_k, not args.no_elide_index_k),
                strict=True,
            )
        )
        report["host_tier"] = {
            "host_pool_gib": args.host_pool_gib or None,
            "host_pool_ratio": args.host_pool_ratio,
            "dense": tiers[0],
            "elided": tiers[1],
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    if parallel.pp > 1:
        print(_stages_table(report, pipe_e, pipe_d))
    else:
        weights_d, weights_e = pipe_d.limiting.weight_bytes, pipe_e.limiting.weight_bytes
        print(_plan_table(report, elided, dense, pipe_e, pipe_d, (weights_d, weights_e)))
    if splits is not None:
        print(_hisparse_table(*splits, parallel, (nodes[0][0], nodes[1][0])))
    if tiers is not None:
        print(_host_tier_table(args, parallel, *tiers))
    return 0


def _stage_splits(plans: list[Any]) -> tuple[Any, list[Any]]:
    """Each pipeline stage's HiSparse split with the least stage's device tokens (one
    scheduler hands out device pages every stage holds: `Engine._least_over_stages`), and
    that stage's."""
    from dataclasses import replace

    limiting = min(plans, key=lambda p: p.device_tokens)
    return limiting, [replace(p, device_tokens=limiting.device_tokens) for p in plans]


def _host_bytes_by_rank(
    parallel: ParallelConfig, layouts: list[Any], tier_pages: int, splits: Any
) -> list[int]:
    """Each rank's host memory as the engine counts it (`rank_host_bytes`): its stage's
    tier of `tier_pages` and, under HiSparse (`splits`, each stage's), the host latent it
    holds and writes (none on the TP ranks that map their stage's TP rank 0's)."""
    from dsakv.config.hisparse import writes_host_latent
    from dsakv.memory.capacity import rank_host_bytes

    tp, page = parallel.tp, layouts[0].page_size
    logical = 0 if splits is None else splits[0].logical_tokens // page
    return [
        rank_host_bytes(
            layouts[r // tp],
            tier_pages,
            logical,
            splits is not None,
            writes_host_latent(parallel, r % tp),
        )
        for r in range(parallel.world_size)
    ]


def _node_host_latents(splits: Any, parallel: ParallelConfig) -> tuple[int, int]:
    """The bytes of the host latents the node that holds the most holds, and how many."""
    from dsakv.memory.capacity import node_sums

    layouts = [p.layout for p in splits]
    return max(
        node_sums(_host_bytes_by_rank(parallel, layouts, 0, splits), parallel.ranks_per_node)
    )


def _stage_hosts(splits: Any) -> dict[str, Any]:
    """`--json`'s per-stage host latent bytes (a rank's) under --pp-size."""
    return {"stages_host_bytes": [p.host_bytes for p in splits]} if len(splits) > 1 else {}


def _plan_host_tier(
    args: argparse.Namespace, parallel: ParallelConfig, pipe: Any, splits: Any, asked: bool
) -> dict[str, Any]:
    """One layout's host tier as the engine sizes it (`Engine._host_tier_pages`): the same
    pages on every rank, of the largest page any stage has, or `--host-pool-ratio` times
    the pool's pages (logical pages under HiSparse: `splits`, each stage's). Each rank's
    tier holds its stage's cells; under HiSparse the ranks that map their stage's TP rank
    0's host latent hold index-K only. The node's host memory is its ranks' tiers and the
    HiSparse host latents it holds. A size that holds no page is refused for the layout
    `asked` for, as the engine refuses it; the other layout's tier is empty."""
    from dsakv.config.hisparse import writes_host_latent
    from dsakv.memory.capacity import HostTierPlan, host_tier_pages, node_sums

    layouts = [s.layout for s in pipe.stages]
    page = layouts[0].page_size
    pool_tokens = pipe.max_total_num_tokens if splits is None else splits[0].logical_tokens
    try:
        pages = host_tier_pages(
            args.host_pool_gib or 0.0,
            args.host_pool_ratio,
            max(lay.bytes_per_page for lay in layouts),
            pool_tokens // page,
        )
    except ValueError as e:  # (its words name the flag)
        if asked:
            raise DsakvError(str(e)) from None
        pages = 0
    tp = parallel.tp
    tiers = [
        HostTierPlan.for_rank(
            layouts[r // tp], pages, splits is not None, writes_host_latent(parallel, r % tp)
        )
        for r in range(parallel.world_size)
    ]
    shared = tp > 1 and tiers[1].index_k_only
    by_rank = _host_bytes_by_rank(parallel, layouts, pages, splits)
    node, _ = max(node_sums(by_rank, parallel.ranks_per_node))
    out = {
        "num_pages": pages,
        "tokens": tiers[0].tokens,
        "bytes_per_token": tiers[0].bytes_per_token,
        "bytes_per_rank": tiers[0].nbytes,
        "index_k_only_bytes_per_rank": tiers[1].nbytes if shared else None,
        "host_memory_bytes_per_node": node,
    }
    if parallel.pp > 1:  # (rank 0's figures above are stage 0's)
        out["stages_bytes_per_rank"] = [t.nbytes for t in tiers[:: parallel.tp]]
    return out


def _host_tier_table(
    args: argparse.Namespace,
    parallel: ParallelConfig,
    dense: dict[str, Any],
    elided: dict[str, Any],
) -> str:
    """The host tier, dense and elided side by side: its cells are the device pool's, so
    a tier of a given size holds as many more tokens as a pool does (`--host-pool-gib`),
    and one sized as a ratio of the pool grows with it (`--host-pool-ratio`)."""
    if args.host_pool_gib:
        size = f"{args.host_pool_gib:,g} GiB per rank (--host-pool-gib)"
    else:
        size = f"{args.host_pool_ratio:g} × the device pool's pages (--host-pool-ratio)"
    ranks, pp, latent = parallel.world_size, parallel.pp > 1, args.enable_hisparse
    lines = [
        "",
        f"host tier: {size}, the device pool's cells (no index-K on shared layers)",
    ]
    if ranks > 1:
        each = (
            ("each stage's TP rank 0's" if pp else "rank 0's")
            + " holds the HiSparse latent the ranks map, the others' index-K only"
            if elided["index_k_only_bytes_per_rank"] is not None
            else "each a tier of its own"
        )
        lines.append(f"per rank ({ranks} ranks, {each}){'; stage 0' if pp else ''}")
    rank = "/rank" if ranks > 1 else ""
    rows = [("tier bytes/token", "bytes_per_token"), (f"tier tokens{rank}", "tokens")]
    if elided["index_k_only_bytes_per_rank"] is None:
        rows.append((f"tier memory{rank} (GiB)", "bytes_per_rank"))
    else:
        rows.append(("tier memory, rank 0 (GiB)", "bytes_per_rank"))
        rows.append(("tier memory, other ranks (GiB)", "index_k_only_bytes_per_rank"))
    if ranks > 1 or latent:  # (the node's tiers, and the host latents it holds)
        what = "tiers" if ranks > 1 else "tier"
        if latent:
            one = elided["index_k_only_bytes_per_rank"] is not None and not pp  # (ranks map it)
            what += " + HiSparse host latent" + ("" if one or ranks == 1 else "s")
        node = "/node" if ranks > 1 else ""
        rows.append((f"host memory{node} (GiB)", "host_memory_bytes_per_node"))
        lines.append(f"host memory{node}: {what}")
    lines += ["", f"{'':32}{'dense':>16}{'elided':>16}{'gain':>10}"]
    for name, key in rows:
        d, e = dense[key], elided[key]
        if "GiB" in name:
            lines.append(f"{name:32}{d / GIB:>16,.3f}{e / GIB:>16,.3f}")
            continue
        gain = _pct(e, d) if key == "tokens" else _pct(d, e)  # (bytes: tokens per byte)
        lines.append(f"{name:32}{d:>16,}{e:>16,}{gain}")
    if pp:
        per_stage = ", ".join(f"{b / GIB:,.2f}" for b in elided["stages_bytes_per_rank"])
        lines.append(f"elided tier memory per rank, by stage (GiB): {per_stage}")
    return "\n".join(lines)


def _model_figures(r: dict[str, Any], elided: Any, dense: Any, weights: Any) -> dict[str, Any]:
    """`--json`'s whole-model figures under --pp-size, under `model_` names: the top-level
    per-token and per-rank keys are the limiting stage's (what the pool's tokens follow)."""
    layout = dense if not r["elide_index_k"] else elided
    return {
        "model_latent_bytes_per_token": layout.latent_bytes_per_token,
        "model_index_k_bytes_per_token": layout.index_k_bytes_per_token,
        "model_bytes_per_token": layout.bytes_per_token,
        "model_bytes_per_token_elided": elided.bytes_per_token,
        "model_bytes_per_token_dense": dense.bytes_per_token,
        "model_indexer_weight_bytes_saved": weights and weights.indexer_bytes_saved,
    }


def _stages_report(elided: Any, dense: Any, no_elide: bool) -> dict[str, Any]:
    """`--json`'s pipeline part: each stage under the chosen layout, with both layouts'
    tokens, and the stage that limits the pool."""
    chosen = dense if no_elide else elided
    return {
        "pp": len(chosen.stages),
        "pp_layer_partition": [len(s.target) for s in chosen.stages],
        "limiting_stage": chosen.limiting.stage,
        "stages": [
            {
                **s.as_dict(),
                "max_total_num_tokens_elided": e.capacity.max_total_num_tokens,
                "max_total_num_tokens_dense": d.capacity.max_total_num_tokens,
            }
            for s, e, d in zip(chosen.stages, elided.stages, dense.stages, strict=True)
        ],
    }


def _stage_layers(stage: Any) -> str:
    """A stage's target layers, and its draft layers apart: "59-77 +78"."""
    from dsakv.memory.layout import spans

    draft = tuple(i for i in stage.layout.held_layers if i >= stage.target.stop)
    return spans(tuple(stage.target)) + (f" +{spans(draft)}" if draft else "")


def _columns(head: list[str], rows: list[list[str]], left: frozenset[int]) -> list[str]:
    """`head` and `rows` as aligned text: each column as wide as its widest cell, two
    spaces apart (columns `left` aligned left, the others right)."""
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return [
        "  ".join(
            c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in [head, *rows]
    ]


def _stages_table(r: dict[str, Any], elided: Any, dense: Any) -> str:
    """The pipeline's plan: each stage's bytes per token and tokens, dense and elided, and
    the stage whose budget limits the pool (one scheduler: the least stage's tokens)."""
    chosen = dense if not r["elide_index_k"] else elided
    head = [
        "stage", "layers", "full/shared", "top-k in", "B/tok dense", "B/tok elided", "gain",
        "weights/rank", "KV GiB", "tokens dense", "tokens elided", "gain",
    ]  # fmt: skip
    rows = []
    for s, e, d in zip(chosen.stages, elided.stages, dense.stages, strict=True):
        bd, be = d.layout.bytes_per_token, e.layout.bytes_per_token
        td, te = d.capacity.max_total_num_tokens, e.capacity.max_total_num_tokens
        w = "n/a" if s.weight_bytes is None else f"{s.weight_bytes / GIB:.2f} GiB"
        rows.append([
            str(s.stage), _stage_layers(s), f"{s.num_full_layers}/{s.num_shared_layers}",
            f"{s.carried_topk_bytes_per_token:,}", f"{bd:,}", f"{be:,}",
            _pct(bd, be).strip(), w, f"{s.capacity.kv_budget_bytes / GIB:,.2f}",
            f"{td:,}", f"{te:,}", _pct(te, td).strip(),
        ])  # fmt: skip
    per_stage = ",".join(map(str, r["pp_layer_partition"]))
    lines = [
        *_header(r, f", PP {r['pp']} (layers per stage {per_stage})"),
        "",
        *_columns(head, rows, left=frozenset({1})),
    ]
    e_lim, d_lim = elided.limiting, dense.limiting
    gain = _pct(elided.max_total_num_tokens, dense.max_total_num_tokens).strip()
    layout = "elided" if r["elide_index_k"] else "dense"
    lines += [
        "",
        f"limiting stage: {e_lim.stage} elided ({e_lim.capacity.max_total_num_tokens:,} tokens), "
        f"{d_lim.stage} dense ({d_lim.capacity.max_total_num_tokens:,} tokens): {gain}",
        f"{layout} layout: KV tokens per rank {chosen.max_total_num_tokens:,} (the least "
        f"stage's: one scheduler addresses every stage's pool)",
        f"top-k in: bytes per token a stage receives with the hidden states ({r['index_topk']:,} "
        "int32 per full layer before it whose top-k its shared layers read)",
    ]
    return "\n".join(lines)


def _hisparse_config(args: argparse.Namespace, config: Any) -> Any:
    """`--enable-hisparse` / `--hisparse-config` as a HiSparseConfig, or None when off. A
    hot buffer reserves a slot for each token of a verify: `--speculative-num-steps`
    drafts, or with `--draft-layers` the engine's default chain."""
    from dsakv.config import HiSparseConfig
    from dsakv.config.layer_plan import DRAFT_STEPS, MAX_DRAFT_STEPS

    drafts = args.speculative_num_steps or (DRAFT_STEPS if args.draft_layers else 0)
    if not args.enable_hisparse:
        if args.hisparse_config is not None:
            raise DsakvError("--hisparse-config needs --enable-hisparse")
        if args.speculative_num_steps is not None:
            raise DsakvError("--speculative-num-steps needs --enable-hisparse")
        return None
    if drafts > MAX_DRAFT_STEPS:  # (as the engine refuses it)
        raise DsakvError(f"--speculative-num-steps must be in 1..{MAX_DRAFT_STEPS}, got {drafts}")
    return HiSparseConfig.parse(args.hisparse_config, config, drafts)


def _hisparse_ranks(parallel: ParallelConfig, shared: bool) -> list[str]:
    """The HiSparse table's line saying its figures are one rank's (none on one rank);
    `shared`: a stage's ranks map one host latent."""
    ranks, nodes = parallel.world_size, parallel.nnodes
    if ranks == 1:
        return []
    on = f"{ranks} ranks" + (f" on {nodes} nodes" if nodes > 1 else "")
    hot = (
        "hot buffers for its own requests"
        if parallel.dp_attention
        else "a replica of the hot buffers"
    )
    ranks_of = "each stage's ranks" if parallel.pp > 1 else "the ranks"
    host = f"{ranks_of} map one host latent" if shared else "a host latent of its own"
    stage = "; the stage whose budget sets the device tokens" if parallel.pp > 1 else ""
    return [f"per rank ({on}, each with {hot}; {host}{stage})"]


def _hisparse_table(
    dense: Any, elided: Any, parallel: ParallelConfig, node_bytes: tuple[int, int]
) -> str:
    """The HiSparse split, dense and elided side by side (DESIGN.md §13): one rank's (of
    the stage whose budget sets the device tokens, under --pp-size), and with more than
    one rank the host memory of a node (`node_bytes`; one rank's too where each rank holds
    a host latent of its own)."""
    from dsakv.config.hisparse import shares_host_latent

    h, ranks, shared = elided.hisparse, parallel.world_size, shares_host_latent(parallel)
    host = "host memory (GiB)" if ranks == 1 else "host memory/node (GiB)"
    rows: list[tuple[str, Any, Any, bool]] = [
        ("device bytes/device token", dense.device_bytes_per_device_token,
         elided.device_bytes_per_device_token, True),
        ("device bytes/logical token", dense.device_bytes_per_logical_token,
         elided.device_bytes_per_logical_token, True),
        ("host bytes/token", dense.host_bytes_per_token, elided.host_bytes_per_token, False),
        ("device tokens", dense.device_tokens, elided.device_tokens, True),
        ("logical tokens", dense.logical_tokens, elided.logical_tokens, True),
        (host, node_bytes[0] / GIB, node_bytes[1] / GIB, False),
        ("concurrent hot buffers", dense.concurrent_hot_buffers,
         elided.concurrent_hot_buffers, True),
    ]  # fmt: skip
    if ranks > 1 and not shared:  # (each rank's own: one rank's, before the node's)
        rank = ("host memory/rank (GiB)", dense.host_bytes / GIB, elided.host_bytes / GIB, False)
        rows.insert([r[0] for r in rows].index(host), rank)
    reserved = f": a verify of {h.step_tokens - 1} drafts" if h.step_tokens > 1 else ""
    lines = [
        "",
        f"HiSparse: top_k {h.top_k:,}, device buffer {h.device_buffer_size:,} "
        f"(+{h.step_tokens} reserved{reserved}, rounded up to whole pages: "
        f"{elided.hot_buffer_slots:,} slots per request), "
        f"host:device ratio {h.host_to_device_ratio}",
        *_hisparse_ranks(parallel, shared),
        "device: latent hot buffers + index-K of every logical token; host: every layer's latent",
        "",
        f"{'':28}{'dense':>16}{'elided':>16}{'gain':>10}",
    ]
    for name, d, e, show_gain in rows:
        fmt = (lambda v: f"{v:>16,.1f}") if isinstance(d, float) else (lambda v: f"{v:>16,}")
        if name.startswith("host memory"):
            fmt = lambda v: f"{v:>16,.3f}"
        gain = ""
        if show_gain:  # bytes: the saving as tokens gained per byte; counts: tokens gained
            gain = _pct(d, e) if name.startswith("device bytes") else _pct(e, d)
        lines.append(f"{name:28}{fmt(d)}{fmt(e)}{gain}")
    share = f"{100 * dense.index_k_share:.1f}%", f"{100 * elided.index_k_share:.1f}%"
    lines.append(f"{'index-K share of device':28}{share[0]:>16}{share[1]:>16}")
    return "\n".join(lines)


def _pct(new: float, old: float) -> str:
    """`gain_pct(new, old)` as a table cell ("n/a" where `old` is 0)."""
    from dsakv.memory.capacity import gain_pct  # (here: dsakv.memory loads torch)

    gain = gain_pct(new, old)
    return f"{'n/a':>10}" if gain is None else f"{gain:>+9.2f}%"


def _header(r: dict[str, Any], ranks: str) -> list[str]:
    """A plan table's first lines: the model, its layers, the cache and its ranks (`ranks`
    follows TP and EP)."""
    return [
        f"dsakv plan: {r['model_type']}, {r['num_layers']} layers"
        f" (+{r['num_draft_layers']} draft), {r['num_full_layers']} full / "
        f"{r['num_shared_layers']} shared ({r['plan_source']})",
        f"layers: {r['layer_pattern']}",
        f"cache: latent {r['kv_cache_dtype']}, index-K {r['index_k_dtype']}, "
        f"page size {r['page_size']}, TP {r['tp']}, EP {r['ep']}{ranks}",
    ]


def _plan_table(
    r: dict[str, Any],
    elided: Any,
    dense: Any,
    cap_e: Any,
    cap_d: Any,
    weights: tuple[int | None, int | None],
) -> str:
    """The plan, dense and elided side by side; with GPU memory, each column's KV budget is
    memory × fraction − its weights − reserve."""
    weights_d, weights_e = (None if w is None else w / GIB for w in weights)
    rows = [
        ("latent bytes/token", dense.latent_bytes_per_token, elided.latent_bytes_per_token),
        ("index-K bytes/token", dense.index_k_bytes_per_token, elided.index_k_bytes_per_token),
        ("cell bytes/token", dense.bytes_per_token, elided.bytes_per_token),
        ("weights/rank (GiB)", weights_d, weights_e),
        ("KV budget (GiB)", cap_d.kv_budget_bytes / GIB, cap_e.kv_budget_bytes / GIB),
        ("max_total_num_tokens", cap_d.max_total_num_tokens, cap_e.max_total_num_tokens),
    ]
    lines = [
        *_header(r, ", DP attention" if r["dp_attention"] else ""),
        "",
        f"{'':24}{'dense':>16}{'elided':>16}{'gain':>10}",
    ]
    for name, d, e in rows:
        cells = "".join(
            f"{'n/a':>16}" if v is None else f"{v:>16,.3f}" if isinstance(v, float) else f"{v:>16,}"
            for v in (d, e)
        )
        gain = ""
        if name.startswith("cell"):
            gain = _pct(d, e)  # the saving, as tokens gained per byte
        elif name.startswith("max"):
            gain = _pct(e, d)
        lines.append(f"{name:24}{cells}{gain}")
    saved = r["indexer_weight_bytes_saved"]
    layout = "elided" if r["elide_index_k"] else "dense"
    lines.append("")
    lines.append(
        f"{layout} layout: KV tokens per rank {r['max_total_num_tokens_per_rank']:,}, "
        f"in aggregate {r['max_total_num_tokens_aggregate']:,}"
    )
    lines.append(
        "indexer weights not built by shared layers: "
        + ("n/a (unknown weights)" if saved is None else f"{saved / GIB:.3f} GiB per rank")
        + f" ({r['num_shared_layers']} layers)"
    )
    return "\n".join(lines)


def add_commands(sub: Any) -> None:
    p = sub.add_parser("plan", help="KV capacity plan: bytes per token and pool tokens")
    p.add_argument("model", help="preset (glm-5, glm-5.2, deepseek-v3.2) or model path")
    add_aliased(p, TP, "tensor-parallel degree", dest="tp", type=positive_int, default=1)
    add_aliased(p, EP, "expert-parallel groups (default 1)", dest="ep", type=positive_int)
    p.add_argument("--enable-expert-parallel", action="store_true", help=argparse.SUPPRESS)
    add_dp_args(p, "one scheduler and pool per rank")
    add_pp_args(p, "pipeline-parallel stages: each plans its own layers' pool", default=1)
    p.add_argument(
        "--nnodes", type=positive_int, default=1, help="machines the ranks span (host memory/node)"
    )
    p.add_argument("--kv-budget-gib", type=positive_float, help="explicit KV budget")
    p.add_argument("--gpu-memory-gib", type=positive_float, help="GPU memory per rank")
    p.add_argument("--mem-fraction-static", type=fraction, help="of --gpu-memory-gib (default 0.9)")
    p.add_argument(
        "--weights-gib", type=nonnegative_float, help="override the estimated weights per rank"
    )
    p.add_argument("--reserve-gib", type=nonnegative_float, help="activations etc. (default 0)")
    p.add_argument("--draft-layers", type=draft_layers, default=0, help="MTP/EAGLE draft layers")
    p.add_argument(
        "--speculative-num-steps",
        type=positive_int,
        help="drafts a step (the engine's flag): HiSparse reserves a slot for each; MTP "
        "(--draft-layers) defaults to 3, n-gram drafts need it",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    add_layout_args(p)
    add_hisparse_args(p, "plan the HiSparse split")
    add_host_tier_args(p.add_argument_group("host KV tier (its tokens and the host memory)"))
    p.set_defaults(func=_cmd_plan, loads_torch=False)
