"""How a call every rank makes (`Engine.every_rank_call`: sleep mode, weight updates,
profiles, the expert distribution) tells its outcome: each rank's error as one text,
all-gathered (`gather_outcome`), then read as one message on rank 0."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsakv.errors import DsakvError, one_line

if TYPE_CHECKING:
    from dsakv.distributed.parallel import ParallelState


def said(e: BaseException) -> str:
    """What a rank tells the others of its error: ours as is, any other on one line with
    its type."""
    return str(e) if isinstance(e, DsakvError) else one_line(e)


def by_rank(whys: list[str | None]) -> str:
    """Each rank's error, once per text: as is where every rank says the same."""
    ranks: dict[str, list[int]] = {}
    for rank, why in enumerate(whys):
        if why is not None:
            ranks.setdefault(why, []).append(rank)
    if len(ranks) == 1 and len(next(iter(ranks.values()))) == len(whys):
        return next(iter(ranks))
    return "; ".join(
        f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {why}" for why, r in ranks.items()
    )


def gather_outcome(parallel: ParallelState, value: Any, why: str | None) -> list[Any] | str:
    """Every rank's `value` with its `why` (its error, None: none), all-gathered, so that
    every rank decides alike: the values in rank order where no rank failed, else each
    rank's error (`by_rank`)."""
    outcomes = parallel.all_gather_objects((value, why))
    if any(w for _, w in outcomes):
        return by_rank([w for _, w in outcomes])
    return [v for v, _ in outcomes]
