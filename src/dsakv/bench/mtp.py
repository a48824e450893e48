"""MTP speculative decoding: the same greedy workload with and without drafts, stepped
alternately in one process (as the throughput section does), so noise hits both alike.

Reports the mean acceptance length (tokens emitted per verification), target forward
passes per output token, output tokens/s, and how far the greedy outputs agree. Each
request proposes up to `steps` drafts, fewer while its drafts are being rejected
(`MTPDrafter.adapt`), so the section also reports the drafts checked per verification,
the share of a request's decode passes that verified drafts, and the drafts checked per
output token (each one a verify row of the target's).
On a CPU the verify forward's extra rows cost nearly their full compute (a GPU hides
them in a memory-bound decode step), so fewer target passes buys less speed here: a step's
fixed part (its weights' bytes, the per-layer overheads) is what verifying drafts shares,
and it dominates a lone request's step. So the section also runs each request alone,
both engines in turn, as latency-bound serving sees it (`one_at_a_time`).
"""

from __future__ import annotations

import random
from typing import Any

from . import throughput as tp


def fitted_workload(
    n: int, prompt_lens: tuple[int, int], output_lens: tuple[int, int], seed: int, bos: int
) -> tp.Workload:
    """Prompts shaped like the ones the tiny presets' MTP layers were fitted on (BOS, then
    printable ASCII): random bytes are out of distribution for any draft layer."""
    rng = random.Random(seed)
    prompts = [
        [bos] + [rng.randrange(32, 127) for _ in range(rng.randint(*prompt_lens) - 1)]
        for _ in range(n)
    ]
    return tp.Workload(prompts, [rng.randint(*output_lens) for _ in range(n)])


def run_mtp_bench(
    model: str,
    work: tp.Workload,
    num_pages: int,
    page_size: int,
    steps: int,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    common = dict(model=model, num_pages=num_pages, page_size=page_size, seed=seed, device=device)
    engines = {
        "base": tp.make_engine(elide=True, **common),
        "mtp": tp.make_engine(
            elide=True, speculative_algorithm="mtp", speculative_num_steps=steps, **common
        ),
    }
    before = engines["mtp"].counters()
    warm = {name: e.counters()["decode_steps"] for name, e in engines.items()}
    runs = tp.run_interleaved(engines, work, desc="mtp")
    c = engines["mtp"].counters()
    verified = c["spec_verify_steps"] - before["spec_verify_steps"]
    accepted = c["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    drafted = c["spec_draft_tokens"] - before["spec_draft_tokens"]
    base, mtp = runs["base"], runs["mtp"]
    decode = {name: e.counters()["decode_steps"] for name, e in engines.items()}

    def passes_per_token(name: str, run: dict[str, Any]) -> float:
        """Target forwards a request takes per token it emits: one for the prompt (which
        gives the first token), then one per decode or verify step."""
        return (work.num_requests + decode[name] - warm[name]) / run["output_tokens"]

    passes = decode["mtp"] - warm["mtp"]  # a request's decode passes, verifying or not
    alone = _one_at_a_time(engines, work)
    return {
        "speculative_num_steps": steps,
        "requests": work.num_requests,
        "mean_acceptance_length": 1 + accepted / verified if verified else None,
        "draft_acceptance_rate": accepted / drafted if drafted else None,
        "drafts_per_verify": drafted / verified if verified else None,
        "verifying_pass_share": verified / passes if passes else None,
        "drafts_per_output_token": drafted / mtp["output_tokens"],
        "target_passes_per_output_token": {
            "base": passes_per_token("base", base),
            "mtp": passes_per_token("mtp", mtp),
        },
        "output_tokens_per_s": {
            "base": base["output_tokens_per_s"],
            "mtp": mtp["output_tokens_per_s"],
        },
        "output_tokens_per_s_ratio": tp.ratio(
            mtp["output_tokens_per_s"], base["output_tokens_per_s"]
        ),
        # bf16 weights: the verify extend and a decode step round differently.
        "greedy_token_agreement": tp.token_agreement(base["_outputs"], mtp["_outputs"]),
        "one_at_a_time": {
            "output_tokens_per_s": alone,
            "output_tokens_per_s_ratio": tp.ratio(alone["mtp"], alone["base"]),
        },
    }


def _one_at_a_time(engines: dict[str, Any], work: tp.Workload) -> dict[str, float]:
    """Output tokens/s of each engine serving the workload's requests one after another
    (each request's steps alternate between the engines, as in `run_interleaved`)."""
    tokens = dict.fromkeys(engines, 0)
    busy = dict.fromkeys(engines, 0.0)
    for i, prompt in enumerate(work.prompts):
        one = tp.Workload([prompt], [work.max_tokens[i]])
        for name, run in tp.run_interleaved(engines, one, desc="mtp, one at a time").items():
            tokens[name] += run["output_tokens"]
            busy[name] += run["busy_s"]
    return {name: tokens[name] / busy[name] for name in engines}
