"""Store plain latent rows (bf16 / fp32, `[slots, kv_lora + rope]`) at token slots.

The Triton backend's store for the unquantised latents: bits copied as they are, and a
slot < 0 (a padding row of a CUDA-graph decode batch) writes nothing — which an
`index_copy_` cannot express without a host sync or a scratch row.
"""

from __future__ import annotations

import torch

from ._triton import cdiv, require_triton, tl, triton

BLOCK = 256
_BITS = {2: torch.int16, 4: torch.int32}


@triton.jit
def _copy_rows_kernel(src, dst, slots, width, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    slot = tl.load(slots + r).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (cols < width) & ((cols * 0 + slot) >= 0)
    v = tl.load(src + r.to(tl.int64) * width + cols, mask=ok)
    tl.store(dst + slot * width + cols, v, mask=ok)


def store_rows(rows: torch.Tensor, data: torch.Tensor, slots: torch.Tensor) -> None:
    """`data[slots[i]] = rows[i]` (cast to `data`'s dtype) for every slot ≥ 0."""
    require_triton()
    n, width = rows.shape
    if data.dim() != 2 or data.shape[1] != width or slots.shape != (n,):
        raise ValueError(
            f"rows {tuple(rows.shape)}, data {tuple(data.shape)}, slots {tuple(slots.shape)}"
        )
    bits = _BITS[data.element_size()]
    src = rows.to(data.dtype).contiguous().view(bits)
    if n:
        _copy_rows_kernel[(n, cdiv(width, BLOCK))](
            src, data.view(bits), slots.contiguous(), width, BLOCK=BLOCK
        )
