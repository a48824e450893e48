"""Speculative decoding: the same greedy workload with and without drafts (MTP's, and
n-gram lookup's beside them), stepped alternately in one process (as the throughput
section does), so noise hits all alike.

Reports the mean acceptance length (tokens emitted per verification), target forward
passes per output token, output tokens/s, and how far the greedy outputs agree. Each
request proposes up to `steps` drafts, fewer while its drafts are being rejected
(`Drafter.adapt`), so the section also reports the drafts checked per verification,
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


def run_speculative_bench(
    model: str,
    work: tp.Workload,
    num_pages: int,
    page_size: int,
    steps: int,
    seed: int = 0,
    device: str = "cpu",
) -> dict[str, Any]:
    """MTP against plain decode; n-gram lookup drafting (`ngram`) beside them on the same
    workload and steps, its own figures under `ngram`."""
    common = dict(model=model, num_pages=num_pages, page_size=page_size, seed=seed, device=device)
    engines = {"base": tp.make_engine(elide=True, **common)}
    for algorithm in ("mtp", "ngram"):
        engines[algorithm] = tp.make_engine(
            elide=True, speculative_algorithm=algorithm, speculative_num_steps=steps, **common
        )
    before = {name: e.counters() for name, e in engines.items()}
    runs = tp.run_interleaved(engines, work, desc="speculative")
    after = {name: e.counters() for name, e in engines.items()}
    alone = _one_at_a_time(engines, work)

    def passes_per_token(name: str) -> float:
        """Target forwards a request takes per token it emits: one for the prompt (which
        gives the first token), then one per decode or verify step."""
        steps = after[name]["decode_steps"] - before[name]["decode_steps"]
        return (work.num_requests + steps) / runs[name]["output_tokens"]

    def drafting(name: str) -> dict[str, Any]:
        """How `name`'s drafts did against plain decode."""
        c = {k: after[name][k] - before[name][k] for k in after[name] if k.startswith("spec_")}
        verified, accepted = c["spec_verify_steps"], c["spec_accepted_tokens"]
        drafted = c["spec_draft_tokens"]
        passes = after[name]["decode_steps"] - before[name]["decode_steps"]
        return {
            "mean_acceptance_length": 1 + accepted / verified if verified else None,
            "draft_acceptance_rate": accepted / drafted if drafted else None,
            "drafts_per_verify": drafted / verified if verified else None,
            "verifying_pass_share": verified / passes if passes else None,
            "drafts_per_output_token": drafted / runs[name]["output_tokens"],
            "output_tokens_per_s_ratio": tp.ratio(
                runs[name]["output_tokens_per_s"], runs["base"]["output_tokens_per_s"]
            ),
            # bf16 weights: the verify extend and a decode step round differently.
            "greedy_token_agreement": tp.token_agreement(
                runs["base"]["_outputs"], runs[name]["_outputs"]
            ),
            "one_at_a_time_ratio": tp.ratio(alone[name], alone["base"]),
        }

    mtp = drafting("mtp")
    return {
        "speculative_num_steps": steps,
        "requests": work.num_requests,
        **{k: v for k, v in mtp.items() if k != "one_at_a_time_ratio"},
        "target_passes_per_output_token": {
            name: passes_per_token(name) for name in ("base", "mtp")
        },
        "output_tokens_per_s": {
            name: runs[name]["output_tokens_per_s"] for name in ("base", "mtp")
        },
        "one_at_a_time": {
            "output_tokens_per_s": {name: alone[name] for name in ("base", "mtp")},
            "output_tokens_per_s_ratio": mtp["one_at_a_time_ratio"],
        },
        "ngram": {
            **drafting("ngram"),
            "output_tokens_per_s": runs["ngram"]["output_tokens_per_s"],
            "one_at_a_time_output_tokens_per_s": alone["ngram"],
            "target_passes_per_output_token": passes_per_token("ngram"),
        },
    }


def _one_at_a_time(engines: dict[str, Any], work: tp.Workload) -> dict[str, float]:
    """Output tokens/s of each engine serving the workload's requests one after another
    (each request's steps alternate between the engines, as in `run_interleaved`)."""
    tokens = dict.fromkeys(engines, 0)
    busy = dict.fromkeys(engines, 0.0)
    for i, prompt in enumerate(work.prompts):
        one = tp.Workload([prompt], [work.max_tokens[i]])
        for name, run in tp.run_interleaved(engines, one, desc="one at a time").items():
            tokens[name] += run["output_tokens"]
            busy[name] += run["busy_s"]
    return {name: tokens[name] / busy[name] for name in engines}
