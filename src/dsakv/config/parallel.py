"""How the model is split across ranks (`ParallelConfig`): the flags, checked; the groups
and collectives that carry it out are `dsakv.distributed`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsakv.errors import DsakvError, is_int
from dsakv.procs import split_address

from .layer_plan import parse_layer_partition

DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """`--tp`, `--pp-size`, `--ep`, `--dp-attention` and the multi-node launch flags
    (SGLang's names).

    Ranks are numbered stage-major: rank r is tensor-parallel rank `r % tp` of pipeline
    stage `r // tp`; stage s runs the target layers `stage_layers(N)[s]`. Keywords only.
    """

    tp: int = 1
    ep: int = 1
    pp: int = 1
    # Target layers per stage (SGLang's SGLANG_PP_LAYER_PARTITION; "3,5" taken, as
    # `parse_layer_partition` takes it); None: `even_split`
    pp_layer_partition: tuple[int, ...] | None = None
    dp_attention: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of rank 0's rendezvous
    timeout_s: float = DEFAULT_TIMEOUT_S  # a collective that waits longer fails

    def __post_init__(self) -> None:
        for name, flag in (
            ("tp", "--tp"),
            ("ep", "--ep"),
            ("pp", "--pp-size"),
            ("nnodes", "--nnodes"),
        ):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise DsakvError(f"{flag} must be an integer >= 1, got {v!r}")
        if self.pp_layer_partition is not None:
            self._check_partition(parse_layer_partition(self.pp_layer_partition))
        if self.ep > self.tp:
            raise DsakvError(f"--ep {self.ep} is larger than --tp {self.tp}")
        if self.tp % self.ep:
            raise DsakvError(f"--tp {self.tp} is not a multiple of --ep {self.ep}")
        if self.dp_attention and self.pp > 1:
            raise DsakvError("--dp-attention with --pp-size > 1 is not supported: give one")
        if self.dp_attention and self.tp < 2:
            raise DsakvError("--dp-attention needs --tp N with N >= 2")
        if self.world_size % self.nnodes:
            raise DsakvError(
                f"{self.world_size} ranks ({self.ranks_flags}) are not divisible by "
                f"--nnodes {self.nnodes}"
            )
        if not 0 <= self.node_rank < self.nnodes:
            raise DsakvError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.dist_init_addr is not None:
            split_address(self.dist_init_addr, "--dist-init-addr", " (port 1..65535)")
        if not self.timeout_s > 0:
            raise DsakvError(f"timeout must be > 0 seconds, got {self.timeout_s}")

    def _check_partition(self, parts: tuple[int, ...]) -> None:
        """One number per stage (each a count of layers: `parse_layer_partition` checked);
        kept as the parsed tuple."""
        given, n = ",".join(map(str, parts)), len(parts)
        if self.pp == 1 and n > 1:  # (--pp-size left at 1: say which it needs)
            raise DsakvError(
                f"--pp-layer-partition {given} gives {n} stages: give --pp-size {n} too"
            )
        if n != self.pp:
            raise DsakvError(
                f"--pp-layer-partition must be {self.pp} numbers (one per stage of --pp-size "
                f"{self.pp}), got {given}"
            )
        object.__setattr__(self, "pp_layer_partition", parts)

    @property
    def world_size(self) -> int:
        """Every rank: `tp` per pipeline stage."""
        return self.tp * self.pp

    @property
    def ranks_flags(self) -> str:
        """The flags that set the ranks, for errors (`--pp-size` only when given)."""
        return f"--tp {self.tp}" if self.pp == 1 else f"--tp {self.tp} x --pp-size {self.pp}"

    def rank_name(self, rank: int) -> str:
        """Rank `rank` as errors name it: with its pipeline stage under `--pp-size` (a
        stage holds its own layers, so which one failed says what to look at)."""
        return f"rank {rank}" + (f" (stage {rank // self.tp})" if self.pp > 1 else "")

    @property
    def attn_tp(self) -> int:
        """Ranks one attention computation is split over (1 under DP attention)."""
        return 1 if self.dp_attention else self.tp

    @property
    def dp(self) -> int:
        """Independent schedulers (one per rank under DP attention)."""
        return self.tp if self.dp_attention else 1

    @property
    def moe_tp(self) -> int:
        """Ranks one expert's intermediate size is split over."""
        return self.tp // self.ep

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes

    def stage_layers(self, num_layers: int) -> tuple[range, ...]:
        """Each pipeline stage's target layers, in order (`--pp-layer-partition`, else
        `even_split`). The MTP draft layer, when built, sits on the last stage."""
        sizes = self.pp_layer_partition or even_split(num_layers, self.pp)
        if sum(sizes) != num_layers:
            raise DsakvError(
                f"--pp-layer-partition {','.join(map(str, sizes))} covers {sum(sizes)} layers; "
                f"the model has {num_layers}"
            )
        if self.pp > num_layers:
            raise DsakvError(f"--pp-size {self.pp} is more than the model's {num_layers} layers")
        starts = [sum(sizes[:s]) for s in range(self.pp)]
        return tuple(range(a, a + n) for a, n in zip(starts, sizes))

    def check_model(self, config: Any) -> None:
        """Refuse a split the model's shapes do not allow (one `error:` line)."""
        checks = [
            ("num_attention_heads", config.num_attention_heads, self.attn_tp, "--tp"),
            ("n_routed_experts", config.n_routed_experts, self.ep, "--ep"),
            ("moe_intermediate_size", config.moe_intermediate_size, self.moe_tp, "--tp/--ep"),
            ("intermediate_size", config.intermediate_size, self.tp, "--tp"),
            (
                "shared experts' intermediate size",
                config.moe_intermediate_size * config.n_shared_experts,
                self.tp,
                "--tp",
            ),
        ]
        for name, value, parts, flag in checks:
            if value % parts:
                raise DsakvError(f"{name} ({value}) is not divisible by {flag} ({parts})")
        self.stage_layers(config.num_hidden_layers)  # (a partition that does not fit it)


def even_split(num_layers: int, stages: int) -> tuple[int, ...]:
    """vLLM's and SGLang's default split (`get_pp_indices`): `num_layers // stages` each,
    the remainder one more each on the stages before the last (it also holds the head)."""
    sizes = [num_layers // stages] * stages
    for s in range(num_layers % stages):
        sizes[-2 - s] += 1
    return tuple(sizes)
