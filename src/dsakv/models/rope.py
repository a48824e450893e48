"""Rotary position embedding as DSA models define it (default or DeepSeek YaRN).

MLA's rope part is always interleaved (pairs `(x0, x1), (x2, x3), …`); the indexer's is
interleaved on GLM and half-split on DeepSeek-V3.2 (`ModelConfig.indexer_rope_interleave`).
The interleaved form writes its output de-interleaved (evens then odds), exactly like the
reference; q and k get the same permutation, so every q·k is unchanged.
"""

from __future__ import annotations

import math

import torch

from dsakv.config import ModelConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """`(inv_freq[rope_dim/2], attention_factor)`; the factor scales cos and sin."""
    p = config.rope_parameters
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    if p.get("rope_type", "default") == "default":
        return 1.0 / pos_freqs, 1.0
    factor = p.get("factor")
    orig = p.get("original_max_position_embeddings") or config.max_position_embeddings
    if factor is None:
        factor = config.max_position_embeddings / orig
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention_factor = (
            _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
            if m and m_all
            else _yarn_mscale(factor)
        )
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(config: ModelConfig) -> float:
    """MLA softmax scale: 1/√qk_head_dim, times mscale² under YaRN with `mscale_all_dim`."""
    scale = config.qk_head_dim**-0.5
    p = config.rope_parameters
    if p.get("rope_type", "default") != "default" and p.get("mscale_all_dim"):
        m = _yarn_mscale(p["factor"], p["mscale_all_dim"])
        scale *= m * m
    return scale


class Rotary:
    """Per-token cos/sin (`[T, rope_dim/2]`) from absolute positions: rows of tables over
    every position (`max_position_embeddings`), made once per device, as vLLM's cos/sin
    cache (each value is what computing it for its position alone gives)."""

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq, self.attention_factor = rope_inv_freq(config)
        self.positions = config.max_position_embeddings
        self._on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos and sin `[max_position_embeddings, rope_dim/2]` on `device`."""
        made = self._on.get(device)
        if made is None:  # (on first use, before any CUDA graph captures the lookups)
            positions = torch.arange(self.positions, device=device)
            freqs = positions[:, None].float() * self.inv_freq.to(device)
            factor = self.attention_factor
            made = self._on[device] = (freqs.cos() * factor, freqs.sin() * factor)
        return made

    def __call__(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(positions.device)
        return cos[positions].to(dtype), sin[positions].to(dtype)


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs; output laid out as (rotated evens ‖ rotated odds)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (first half, second half) pairs — the non-interleaved form."""
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
