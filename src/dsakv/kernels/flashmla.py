"""FlashMLA sparse decode and DeepGEMM paged indexer logits, when the libraries import.

Optional (`pip install dsakv[gpu]`): sgl-kernel's `flash_mla` and `deep_gemm` are built
against one torch each, so they are probed, never required. dsakv's pool layouts are
theirs byte for byte at page size 64 (DESIGN.md §12): the fp8_ds_mla latent is viewed as
`[P, 64, 1, 656]`, the fp8 index-K as `[P, 64, 1, 132]`; nothing is copied.
"""

from __future__ import annotations

import torch

from . import torch_ops
from .backend import TritonBackend

FLASHMLA_HEADS = (64, 128)  # the sparse fp8 decode kernel's head counts (pad up)
DEEPGEMM_INDEX_HEADS = (32, 64)
TOPK = 2048  # what the library kernels are built for
PAGE = 64


def probe() -> tuple[bool, str]:
    """(available, why) for the library path on this machine."""
    try:
        from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata  # noqa: F401
    except Exception as e:  # ImportError or an undefined symbol from another torch
        return False, f"sgl_kernel.flash_mla unavailable ({type(e).__name__}: {e})"
    try:
        import deep_gemm  # noqa: F401
    except Exception as e:
        return False, f"deep_gemm unavailable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False, "needs an sm90 or newer GPU"
    return True, "sgl_kernel.flash_mla and deep_gemm import"


def fits(layout, n_heads: int, index_heads: int, index_topk: int) -> tuple[bool, str]:
    """Whether this model and cache layout are shapes the library kernels take."""
    if layout.page_size != PAGE:
        return False, f"page size {layout.page_size} (needs {PAGE})"
    if layout.kv_cache_dtype not in ("fp8_ds_mla", "bf16"):
        return False, f"kv_cache_dtype {layout.kv_cache_dtype} (needs fp8_ds_mla or bf16)"
    if layout.index_k_dtype != "fp8":
        return False, f"index_k_dtype {layout.index_k_dtype} (needs fp8)"
    if index_topk != TOPK:
        return False, f"index_topk {index_topk} (needs {TOPK})"
    if n_heads > max(FLASHMLA_HEADS):
        return False, f"{n_heads} q-heads per rank (at most {max(FLASHMLA_HEADS)})"
    if index_heads not in DEEPGEMM_INDEX_HEADS:
        return False, f"{index_heads} index heads (needs 32 or 64)"
    return True, "shapes fit"


class FlashMLABackend(TritonBackend):
    """FlashMLA for fp8_ds_mla decode, DeepGEMM for paged decode logits; Triton for the rest."""

    name = "flashmla"

    def __init__(self, layout) -> None:
        super().__init__(layout)
        import deep_gemm
        from sgl_kernel import flash_mla

        self._flash_mla, self._deep_gemm = flash_mla, deep_gemm

    def describe(self) -> dict[str, str]:
        d = super().describe()
        if self.kind == "fp8_ds_mla":
            d["mla_decode"] = "flashmla flash_mla_with_kvcache (fp8_ds_mla, sparse indices)"
        d["index_logits"] = "deep_gemm fp8_paged_mqa_logits (decode), triton (extend)"
        return d

    def mla_decode(self, math, pool, layer, q_nope, q_rope, slots, valid, w_uk, w_uv):
        if self.kind != "fp8_ds_mla":
            return super().mla_decode(math, pool, layer, q_nope, q_rope, slots, valid, w_uk, w_uv)
        b, h = q_nope.shape[:2]
        q = torch.cat([q_nope, q_rope], dim=-1).to(torch.bfloat16)
        hp = next(n for n in FLASHMLA_HEADS if n >= h)
        if hp != h:  # the kernel takes 64 or 128 heads: pad with zeros, drop after
            q = torch.nn.functional.pad(q, (0, 0, 0, hp - h))
        idx = slots.masked_fill(~valid, -1).to(torch.int32)
        width = -(-idx.shape[1] // 64) * 64
        if width != idx.shape[1]:
            idx = torch.nn.functional.pad(idx, (0, width - idx.shape[1]), value=-1)
        cache = pool.latent_data(layer).view(-1, PAGE, 1, pool.latent_data(layer).shape[-1])
        seqlens = valid.sum(-1, dtype=torch.int32)
        meta, splits = self._flash_mla.get_mla_metadata(
            seqlens, hp, 1, num_heads_q=hp, is_fp8_kvcache=True, topk=width
        )
        out, _ = self._flash_mla.flash_mla_with_kvcache(
            q[:, None],
            cache,
            torch.empty(b, 0, dtype=torch.int32, device=q.device),
            seqlens,
            math.kv_lora,
            meta,
            splits,
            softmax_scale=math.scale,
            is_fp8_kvcache=True,
            indices=idx[:, None],
        )
        o_lat = out[:, 0, :h].float()
        return torch.einsum("bhc,hvc->bhv", o_lat.to(w_uv.dtype), w_uv)

    def index_topk_decode(self, pool, layer, q, w, table, lens, scale, topk):
        ps = pool.page_size
        b, width = table.shape
        block_table = self._indexer.block_table_from_slots(table, ps)
        lens32 = lens.to(torch.int32)
        kv = pool.index_k_data(layer).view(-1, ps, 1, pool.index_k_data(layer).shape[-1] // ps)
        # e4m3 queries with a power-of-two scale per (token, head), folded into the weights
        amax = q.float().abs().amax(-1).clamp_min(1e-4)
        q_scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)))  # [B, H]
        q8 = (q.float() / q_scale[..., None]).to(torch.float8_e4m3fn)[:, None]  # [B, 1, H, D]
        w = w * q_scale
        sched = self._deep_gemm.get_paged_mqa_logits_metadata(
            lens32, ps, self._deep_gemm.get_num_sms()
        )
        logits = self._deep_gemm.fp8_paged_mqa_logits(
            q8, kv, (w * scale).float(), lens32, block_table, sched, width, False
        )
        kpos = torch.arange(width, device=logits.device)
        logits = logits[:, :width].masked_fill(kpos[None, :] >= lens[:, None], float("-inf"))
        return torch_ops.topk_by_position(logits, topk)
