"""Host memory HiSparse's host latent takes on one machine under `--tp N`, as the kernel
counts it: the ranks' proportional set size (Pss, shared pages split between the processes
that map them) summed, after a workload that writes host rows.

    .venv/bin/python scripts/hisparse_host_memory.py MODEL [--tp 2] [--ratio 64] [--prompts 40]

`MODEL`: e.g. `dsakv init-tiny --preset glm-tiny DIR`. The ranks map one host latent
(`memfd:dsakv-hisparse-host-latent`), so the sum counts it once; where each rank held its own
(before, or under `--dp-attention`), once per rank.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
from pathlib import Path

SHARED = "memfd:dsakv-hisparse-host-latent"


def pss_kib(pid: int, only: str | None = None) -> int:
    """`pid`'s Pss in KiB, over the mappings whose line names `only` (None: all)."""
    total, take = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if not head[0].endswith(":"):  # a mapping's first line: address range, perms, ...
            take = only is None or only in line
        elif take and head[0] == "Pss:":
            total += int(head[1])
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--ratio", type=int, default=64, help="host_to_device_ratio")
    ap.add_argument("--prompts", type=int, default=40)
    args = ap.parse_args()

    from dsakv import LLM, SamplingParams

    cfg = {"host_to_device_ratio": args.ratio}
    flags = dict(kv_cache_dtype="fp32", index_k_dtype="fp32", page_size=8, num_pages=512)
    with LLM(args.model, tp=args.tp, device="cpu", enable_hisparse=True, hisparse_config=cfg,
             **flags) as llm:  # fmt: skip
        prompts = [[(i * 7 + j) % 200 + 1 for j in range(300)] for i in range(args.prompts)]
        llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        pids = [os.getpid()] + [p.pid for p in multiprocessing.active_children()]
        host = llm.engine.hot.host_nbytes / 2**20
        shared = [pss_kib(p, SHARED) for p in pids]
        whole = [pss_kib(p) for p in pids]
    print(
        f"host latent: {host:,.1f} MiB per rank (allocated; pages are backed as rows are written)"
    )
    print(f"shared host latent Pss per rank (KiB): {shared}, summed {sum(shared):,}")
    print(f"process Pss per rank (KiB): {whole}, summed {sum(whole):,}")


if __name__ == "__main__":
    main()
