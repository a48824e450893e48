"""`DSAKVPool`: the physical KV buffers, one latent buffer per layer and index-K only where
the layout gives a layer index-K (DESIGN.md §2, §3). A pipeline stage's pool holds its own
layers only (`CacheLayout.layers`), each addressed by its layer index in the whole model.

Every buffer is stored as one real tensor (`data`, what transfer descriptors point at) and
seen through per-token `parts`: views shaped `[num_pages, page_size, width]`, so token
slot `s` lives at `part[s // page_size, s % page_size]`. Moving, exporting and host copies
work on parts, one token at a time (§7.4), whatever the page-internal arrangement.
"""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from dsakv.errors import ConfigError, is_int

from .fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_e4m3_blockwise,
    e4m3_to_float,
    hadamard_rotate,
    quantize_e4m3_blockwise,
    scale_blocks,
)
from .layout import CacheLayout, latent_bytes

LATENT, INDEX_K = "latent", "index_k"


class SharedLayerIndexKError(RuntimeError):
    """Index-K access on a layer whose index-K is elided by the layer plan (§7.2)."""


@dataclass(frozen=True)
class TransferDescriptor:
    """One contiguous buffer a KV transfer engine can register: where, how big, page stride."""

    layer: int
    component: str  # "latent" | "index_k"
    data_ptr: int
    nbytes: int
    bytes_per_page: int
    # (byte offset in a page, bytes per token) of each per-token region of a page: its first
    # n tokens are bytes [offset, offset + n * width) of every region (fp8 index-K has two:
    # keys, then scales), so a partial page moves as whole rows, never padding.
    token_rows: tuple[tuple[int, int], ...] = ()


# --- buffers ---------------------------------------------------------------------------------


class _Buffer:
    """One layer's storage for one component; subclasses define encode/decode."""

    def __init__(self, data: torch.Tensor, parts: tuple[torch.Tensor, ...]) -> None:
        self.data = data
        self.parts = parts

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError


class _NoMemory(Exception):
    """A pool buffer could not be allocated (`DSAKVPool` says how much the pool needed)."""


def allocation_failed(e: BaseException) -> bool:
    """Whether `e` is an allocation that failed (torch's out-of-memory on a device, Python's
    MemoryError, the CPU and pinned allocators' RuntimeErrors), not another error."""
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and (
        "can't allocate memory" in text or "out of memory" in text
    )


def memory_bytes(device: torch.device) -> int | None:
    """All the memory `device` has (the host's RAM for the CPU; None: unknown): a pool past
    it can never be allocated, and one past 2^63 bytes overflows torch's size arithmetic."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    if device.type == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def host_memory_bytes() -> int | None:
    """All the host RAM this machine has (`memory_bytes` of the CPU)."""
    return memory_bytes(torch.device("cpu"))


def check_fits(need: int, device: torch.device, what: str, have: int | None = None) -> str:
    """Refuse `need` bytes of `what` past all the memory `device` has (`memory_bytes`, or
    `have`: another machine's), one ConfigError before torch is asked (past int64 too:
    torch would overflow). Returns how an allocation that fails anyway begins its error
    ("cannot allocate ...")."""
    where = "host" if device.type == "cpu" else str(device)
    cannot = f"cannot allocate {need / 2**30:.2f} GiB of {what} on the {where}"
    have = memory_bytes(device) if have is None else have
    if have is not None and need > have:
        raise ConfigError(f"{cannot}, which has {have / 2**30:.2f} GiB in all")
    return cannot


_OS_PAGE = mmap.PAGESIZE
_HUGE_PAGE = 2 << 20  # (x86-64's and most arm64 kernels' transparent huge page)
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # (Linux's)


def huge_page_empty_like(nbytes: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`torch.empty_like` on the CPU for many tensors of `nbytes` in all (a model's weights,
    as `Module.to_empty` makes them), each carved from one block that Linux is asked to back
    with transparent huge pages before anything is written (THP "madvise" or "always";
    elsewhere plain pages). A CPU decode step streams every weight byte: with 4 KiB pages
    each is a TLB miss and the hardware prefetcher stops at its edge (a glm-bench decode
    step at one request: about 10% longer). Each weight alone is far smaller than a huge
    page, and the allocator writes the pages around it: hence the block. Past `nbytes`,
    plain `empty_like`."""
    block = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    at = advise_huge_pages(block.data_ptr(), block.numel())  # (from a huge page's start)

    def empty_like(t: torch.Tensor) -> torch.Tensor:
        nonlocal at
        n = t.numel() * t.element_size()
        if at + n > block.numel():
            return torch.empty_like(t, device="cpu")
        view = block[at : at + n].view(t.dtype).view(t.shape)
        at += -(-n // 64) * 64  # (64-byte aligned, as the allocator's)
        return view

    return empty_like


def advise_huge_pages(ptr: int, nbytes: int) -> int:
    """Ask Linux to back the whole huge pages in `nbytes` of memory from `ptr` with
    transparent huge pages (before anything is written there); how far from `ptr` the first
    one starts."""
    at = -ptr % _HUGE_PAGE
    whole = max(nbytes - at, 0) // _HUGE_PAGE * _HUGE_PAGE
    if _MADV_HUGEPAGE is not None and whole:  # (its answer unread: without THP, EINVAL)
        _libc().madvise(ctypes.c_void_p(ptr + at), ctypes.c_size_t(whole), _MADV_HUGEPAGE)
    return at


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None)


_CUDA_OUT_OF_MEMORY = 2  # cudaErrorMemoryAllocation


def page_aligned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """An uninitialised host tensor that starts on an OS page, and the length of the whole
    pages it covers, all inside its own allocation (never a page it shares with another)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + 2 * _OS_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _OS_PAGE
    length = -(-nbytes // _OS_PAGE) * _OS_PAGE
    return raw[start : start + nbytes].view(dtype).view(shape), length


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised host memory page-locked at its own size, for a host tier.

    torch's pinned allocator rounds every block up to a power of two: a host tier held as
    per-layer blocks locked up to 1.6× what it was given (a 100 GiB GLM-5.2 tier: 161 GiB),
    HiSparse's host latent 1.5×. Pageable memory registered with CUDA is locked as is (as
    SGLang's host pools do), and unregistered when the tensor goes."""
    t, length = page_aligned_empty(shape, dtype)
    return page_lock(t, length)


def page_lock(t: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Register the OS pages of `nbytes` of host memory from `t`'s start (an OS page) with
    CUDA, until `t` goes: copies to and from the device then run at full speed,
    asynchronously. Every page is touched (backed) here."""
    length = -(-nbytes // _OS_PAGE) * _OS_PAGE
    if length:
        cudart = torch.cuda.cudart()
        err = int(cudart.cudaHostRegister(t.data_ptr(), length, 0))
        if err == _CUDA_OUT_OF_MEMORY:
            raise RuntimeError(f"out of memory: cannot page-lock {length} bytes")
        if err:
            raise RuntimeError(f"cannot page-lock {length} bytes: cudaError {err}")
        # (not at exit: an engine thread still stepping may read it)
        weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr()).atexit = False
    return t


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, pin: bool):
    try:
        if pin:
            return pinned_empty(shape, dtype).zero_()
        return torch.zeros(shape, dtype=dtype, device=device)
    except (RuntimeError, MemoryError) as e:  # (torch.OutOfMemoryError is a RuntimeError)
        if not allocation_failed(e):
            raise
        raise _NoMemory(str(e).splitlines()[0]) from None


class _TokenMajor(_Buffer):
    """`[num_pages * page_size, dim]` in fp32 / bf16 (as is) or e4m3 (plain cast, saturating)."""

    def __init__(self, pages: int, ps: int, dim: int, dtype: torch.dtype, device, pin) -> None:
        data = _empty((pages * ps, dim), dtype, device, pin)
        view = data.view(torch.uint8) if dtype == FP8_DTYPE else data  # index on bytes
        super().__init__(data, (view.view(pages, ps, view.shape[-1]),))  # (0 pages too)
        self.dtype = dtype

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.dtype == FP8_DTYPE:
            return [x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)]
        return [x.to(self.dtype)]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        (p,) = parts
        return (e4m3_to_float(p) if self.dtype == FP8_DTYPE else p).to(dtype)


class _DsMlaLatent(_Buffer):
    """`fp8_ds_mla` rows: kv_lora e4m3 bytes ‖ fp32 scale per 128 ‖ bf16 rope (656 B on GLM)."""

    def __init__(self, pages: int, ps: int, lora: int, rope: int, device, pin) -> None:
        self.lora, self.rope = lora, rope
        self.width = latent_bytes("fp8_ds_mla", lora, rope)
        data = _empty((pages * ps, self.width), torch.uint8, device, pin)
        super().__init__(data, (data.view(pages, ps, self.width),))

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        q, s = quantize_e4m3_blockwise(x[:, : self.lora])
        rope = x[:, self.lora :].to(torch.bfloat16).contiguous().view(torch.uint8)
        return [torch.cat([q, s.view(torch.uint8), rope], dim=1)]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        (row,) = parts
        lo, hi = self.lora, self.width - 2 * self.rope
        nope = dequantize_e4m3_blockwise(
            row[:, :lo], row[:, lo:hi].contiguous().view(torch.float32)
        )
        rope = row[:, hi:].contiguous().view(torch.bfloat16).float()
        return torch.cat([nope, rope], dim=1).to(dtype)


class _PageMajorFp8(_Buffer):
    """FP8 index-K, one uint8 row per page: all `page_size × D` key bytes, then all scales."""

    def __init__(self, pages: int, ps: int, dim: int, device, pin) -> None:
        self.dim = dim
        sbytes = 4 * scale_blocks(dim)
        data = _empty((pages, ps * (dim + sbytes)), torch.uint8, device, pin)
        keys = data[:, : ps * dim].view(pages, ps, dim)
        scales = data[:, ps * dim :].view(pages, ps, sbytes)
        super().__init__(data, (keys, scales))

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        q, s = quantize_e4m3_blockwise(hadamard_rotate(x.float()))
        return [q, s.view(torch.uint8)]

    def decode(self, parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        q, s = parts
        return dequantize_e4m3_blockwise(q, s.contiguous().view(torch.float32), dtype)


_PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8_e4m3": FP8_DTYPE}


def _latent_buffer(layout: CacheLayout, pages: int, device, pin) -> _Buffer:
    ps = layout.page_size
    if layout.kv_cache_dtype == "fp8_ds_mla":
        return _DsMlaLatent(pages, ps, layout.kv_lora_rank, layout.qk_rope_head_dim, device, pin)
    return _TokenMajor(pages, ps, layout.latent_dim, _PLAIN[layout.kv_cache_dtype], device, pin)


def _index_k_buffer(layout: CacheLayout, pages: int, device, pin) -> _Buffer:
    ps, d = layout.page_size, layout.index_head_dim
    if layout.index_k_dtype == "fp8":
        return _PageMajorFp8(pages, ps, d, device, pin)
    return _TokenMajor(pages, ps, d, _PLAIN[layout.index_k_dtype], device, pin)


# --- the pool --------------------------------------------------------------------------------


class DSAKVPool:
    """Paged KV storage for every layer of one `CacheLayout` on one device (a pipeline
    stage's: its held layers, by their global index; another stage's layer is refused).

    Latent and index-K share one slot space, except under HiSparse (`latent_pages`): there
    the latent buffers hold only the device latent slots (hot buffers, prompts being
    prefilled), addressed on their own, while index-K holds every logical token.
    """

    def __init__(
        self,
        layout: CacheLayout,
        num_pages: int,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
        latent_pages: int | None = None,
    ) -> None:
        if not isinstance(layout, CacheLayout):
            raise TypeError(f"layout must be a CacheLayout, got {type(layout).__name__}")
        for name, n in (("num_pages", num_pages), ("latent_pages", latent_pages)):
            if n is not None and not is_int(n):
                raise TypeError(f"{name} must be an int, got {n!r}")
        if num_pages < 1:
            raise ValueError(f"a KV pool needs at least one page, got {num_pages}")
        if latent_pages is not None and not 0 <= latent_pages <= num_pages:
            raise ValueError(
                f"latent_pages must be in 0..num_pages ({num_pages}): the latent slots are "
                f"a subset of the logical ones, got {latent_pages}"
            )
        self.layout = layout
        self.num_pages = num_pages
        self.latent_pages = num_pages if latent_pages is None else latent_pages
        self.page_size = layout.page_size
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        lat = (layout, self.latent_pages, self.device, pin_memory)
        idx = (layout, num_pages, self.device, pin_memory)
        ps = self.page_size
        need = self.latent_pages * ps * layout.latent_bytes_per_token
        need += num_pages * ps * layout.index_k_bytes_per_token
        cannot = check_fits(need, self.device, "KV cache")
        try:
            self._latent = {layer: _latent_buffer(*lat) for layer in layout.held_layers}
            # The layout (hence the LayerPlan) alone decides which layers get index-K.
            self._index_k = {layer: _index_k_buffer(*idx) for layer in layout.index_k_layers}
        except _NoMemory as e:
            raise ConfigError(f"{cannot} ({e})") from None
        # HiSparse: the logical tokens' latent rows in host memory (`attach_host_latent`)
        self._host_latent: dict[int, torch.Tensor] = {}
        self._writes_host_latent = True

    # --- sizes -------------------------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def num_latent_tokens(self) -> int:
        return self.latent_pages * self.page_size

    @property
    def moves_latent(self) -> bool:
        """Whether token and page moves carry latent; else index-K only: a pool of no latent
        slots (a TP rank's host tier under HiSparse, whose latent rank 0's holds), or host
        rows another rank writes (`attach_host_latent`)."""
        return self.latent_pages > 0 and self._writes_host_latent

    @property
    def split_latent(self) -> bool:
        """Whether latent slots are their own address space (HiSparse)."""
        return self.latent_pages != self.num_pages

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for _, _, b in self._buffers())

    def has_index_k(self, layer: int) -> bool:
        return self.layout.check_held(layer) in self._index_k

    # --- latent ------------------------------------------------------------------------------

    def write_latent(self, layer: int, slots: torch.Tensor, latent: torch.Tensor) -> None:
        buf, dim = self._latent[self.layout.check_held(layer)], self.layout.latent_dim
        self._write(buf, slots, latent, dim, "latent", self.num_latent_tokens)

    def gather_latent(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        buf = self._latent[self.layout.check_held(layer)]
        return self._gather(buf, slots, dtype, self.num_latent_tokens)

    def latent_data(self, layer: int) -> torch.Tensor:
        """The layer's latent buffer as stored (`[slots, row]`), for kernels that read or
        write the bytes in place: uint8 656-byte rows (fp8_ds_mla), e4m3 / bf16 / fp32 rows."""
        return self._latent[self.layout.check_held(layer)].data

    # --- index-K -----------------------------------------------------------------------------

    def index_k_data(self, layer: int) -> torch.Tensor:
        """The layer's index-K buffer as stored: fp8 is uint8 `[pages, page_size * 132]`
        (all keys, then all scales, per page; DeepGEMM's paged layout at page size 64)."""
        return self._index_k_of(layer).data

    def write_index_k(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Store keys (post-RoPE, unrotated); fp8 mode rotates and quantises here."""
        buf = self._index_k_of(layer)
        self._write(buf, slots, keys, self.layout.index_head_dim, "index-K")

    def gather_index_k(
        self, layer: int, slots: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Dequantised keys; in fp8 mode these are rotated, so pair them with `prepare_index_q`."""
        return self._gather(self._index_k_of(layer), slots, dtype)

    @property
    def rotates_index_q(self) -> bool:
        """Whether indexer queries are rotated to match the stored keys: iff index-K is fp8
        (§7.7)."""
        return self.layout.index_k_dtype == "fp8"

    def prepare_index_q(self, q: torch.Tensor) -> torch.Tensor:
        """Indexer queries as the stored keys expect them (`rotates_index_q`)."""
        return hadamard_rotate(q) if self.rotates_index_q else q

    # --- moving tokens -----------------------------------------------------------------------

    def attach_host_latent(self, rows: Mapping[int, torch.Tensor], writes: bool = True) -> None:
        """HiSparse: a logical token's latent is its row in `rows` (host memory; one
        `[num_tokens, row bytes]` uint8 tensor per held layer, by layer index: the stored
        bytes of `latent_data`'s rows), its index-K is here. Token and page moves (`copy_tokens`,
        `read_tokens`, `read_pages`, `write_pages`) and transfer descriptors then address
        the latent there, so the host tier, L3 and KV transfer see whole logical tokens.
        `writes` False: another rank writes these rows (TP ranks on one machine map rank
        0's), so this rank's moves carry index-K only."""
        want = (
            self.num_tokens,
            self.latent_data(self.layout.held_layers[0]).view(torch.uint8).shape[1],
        )
        if set(rows) != set(self.layout.held_layers):
            raise ValueError(
                f"host latent rows for layers {sorted(rows)}; this pool holds "
                f"{list(self.layout.held_layers)}"
            )
        held = dict(rows)
        for layer, t in held.items():
            if t.dtype != torch.uint8 or tuple(t.shape) != want:
                raise ValueError(
                    f"layer {layer}'s host latent must be uint8 {list(want)}, got "
                    f"{t.dtype} {list(t.shape)}"
                )
        self._host_latent, self._writes_host_latent = held, writes

    def move(self, dst_slots: torch.Tensor, src_slots: torch.Tensor) -> None:
        """Copy every buffer's bytes from `src_slots` to `dst_slots`, token by token."""
        copy_tokens(self, dst_slots, self, src_slots)

    def transfer_descriptors(self) -> list[TransferDescriptor]:
        """One per real buffer (latent per layer, index-K per owning layer); none for elided.
        Under HiSparse the latent's are the host rows (`attach_host_latent`), so a prefill
        server writes a decode server's latent straight into its host memory."""
        out = []
        for layer, comp, b in self._buffers():
            if comp == LATENT:
                t = self._latent_rows(layer)  # (uint8: its bytes are its elements)
                out.append(
                    TransferDescriptor(
                        layer,
                        comp,
                        t.data_ptr(),
                        t.numel(),
                        t.numel() // self.num_pages,
                        ((0, t.shape[1]),),
                    )
                )
                continue
            out.append(
                TransferDescriptor(
                    layer,
                    comp,
                    b.data.data_ptr(),
                    b.nbytes,
                    b.nbytes // self.num_pages,
                    tuple(_token_rows(b)),
                )
            )
        return out

    def read_tokens(self, slots: torch.Tensor) -> dict[str, list[torch.Tensor]]:
        """Raw stored bytes of the tokens at `slots` on the CPU, per buffer (`"latent.3"`,
        `"index_k.0"`; a latent as its rows' bytes): what a copy between pools or tiers must
        carry exactly."""
        page, off = self._locate(slots)
        return {
            f"{comp}.{layer}": [_at(p, page, off).cpu() for p in parts]
            for layer, comp, parts in self._token_views()
        }

    # --- whole pages as raw bytes (the L3 storage tier, a PD request's KV to every TP rank) ----

    def read_pages(
        self, pages: Sequence[int], on_device: bool = False, index_k_only: bool = False
    ) -> torch.Tensor:
        """Raw stored bytes of whole pages, `[len(pages), page_bytes()]` uint8 on the CPU
        (`on_device`: the pool's device): every real buffer's page in `_buffers` order
        (latent per layer, index-K only where the layout has it), so a row is exactly the
        layout's bytes for that page. `index_k_only`: the index-K buffers' (a HiSparse pool's
        latent rows are on the host: `ModelRunner.share_kv` sends them on their own)."""
        idx = self._check_pages(pages)
        to = self.device if on_device else torch.device("cpu")
        got = [v.index_select(0, idx.to(v.device)) for v in self._page_views(index_k_only)]
        away = [i for i, g in enumerate(got) if g.device != to]
        if away:  # (one copy across, not one a buffer: L3 snapshots pages every step)
            moved = torch.cat([got[i] for i in away], dim=1).to(to)
            for i, m in zip(away, moved.split([got[i].shape[1] for i in away], dim=1)):
                got[i] = m
        return torch.cat(got, dim=1)

    def write_pages(
        self, pages: Sequence[int], data: torch.Tensor, index_k_only: bool = False
    ) -> None:
        """Inverse of `read_pages`: bit-exact, same layout only (the row width checks it)."""
        want = (len(pages), self.page_bytes(index_k_only))
        if data.dtype != torch.uint8 or tuple(data.shape) != want:
            raise ValueError(
                f"page bytes must be uint8 [{want[0]}, {want[1]}], "
                f"got {data.dtype} {tuple(data.shape)}"
            )
        idx, col = self._check_pages(pages), 0
        on = {data.device: data}  # (one copy to each device, not one a buffer)
        for v in self._page_views(index_k_only):
            if v.device not in on:
                on[v.device] = data.to(v.device)
            v[idx.to(v.device)] = on[v.device][:, col : col + v.shape[1]]
            col += v.shape[1]

    def page_bytes(self, index_k_only: bool = False) -> int:
        """A `read_pages` row's bytes: the layout's per page, or its index-K's."""
        return sum(v.shape[1] for v in self._page_views(index_k_only))

    def _page_views(self, index_k_only: bool = False) -> list[torch.Tensor]:
        """Each real buffer (`index_k_only`: each index-K buffer) as `[num_pages, its bytes
        per page]` uint8 (a view, not a copy; a HiSparse latent's: its host rows')."""
        return [
            parts[0].view(self.num_pages, -1)
            if comp == LATENT
            else self._index_k[layer].data.view(torch.uint8).view(self.num_pages, -1)
            for layer, comp, parts in self._token_views(index_k_only)
        ]

    # --- internals ---------------------------------------------------------------------------

    def buffers(self) -> list[torch.Tensor]:
        """Every real buffer (latent per layer, index-K only where the layout has it), as
        stored: what sleep mode frees (`Engine.release_memory_occupation`)."""
        return [b.data for _, _, b in self._buffers()]

    def _buffers(self):
        """(layer, component, buffer) for every real buffer, in a fixed order (by layer)."""
        for layer, buf in self._latent.items():
            yield layer, LATENT, buf
            if layer in self._index_k:
                yield layer, INDEX_K, self._index_k[layer]

    def _token_views(
        self, index_k_only: bool = False
    ) -> Iterator[tuple[int, str, tuple[torch.Tensor, ...]]]:
        """(layer, component, parts) of every buffer a logical token has (`index_k_only`: of
        each index-K buffer), in `_buffers` order: parts index as `part[page, offset]`; a
        latent's is one uint8 part of its rows' bytes, under HiSparse its host rows
        (`attach_host_latent`)."""
        for layer, comp, b in self._buffers():
            if comp == INDEX_K:
                yield layer, comp, b.parts
                continue
            if index_k_only:
                continue
            if not self.moves_latent:
                raise ValueError(
                    "this pool moves index-K only (it holds no latent, or another rank writes "
                    "its host latent)"
                )
            rows = self._latent_rows(layer)
            yield layer, comp, (rows.view(self.num_pages, self.page_size, -1),)

    def _latent_rows(self, layer: int) -> torch.Tensor:
        """A logical token's latent bytes, one `[num_tokens, row bytes]` uint8 row a slot:
        under HiSparse its host rows (`attach_host_latent`), else the latent buffer's."""
        if layer in self._host_latent:
            return self._host_latent[layer]
        if self.latent_pages == 0:
            raise ValueError("this pool holds index-K only (no latent slots)")
        if self.split_latent:
            raise ValueError(
                "this pool keeps latent in its own (HiSparse) slot space and no host latent "
                "is attached: tokens cannot be moved, exported or transferred as whole rows "
                "of every buffer"
            )
        return self._latent[self.layout.check_held(layer)].data.view(torch.uint8)

    def _index_k_of(self, layer: int) -> _Buffer:
        layer = self.layout.check_held(layer)
        buf = self._index_k.get(layer)
        if buf is None:
            src = self.layout.plan.topk_source(layer)
            raise SharedLayerIndexKError(
                f"layer {layer} has no index-K cache: it is a shared layer (reuses layer "
                f"{src}'s top-k) and its index-K is elided by the layer plan"
            )
        return buf

    def _check_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """Page numbers as a long tensor on the pool's device; raises on any out of range."""
        return self._check_slots(
            torch.as_tensor(list(pages), dtype=torch.long), self.num_pages, "page"
        )

    def _check_slots(self, slots, limit: int | None = None, what: str = "slot") -> torch.Tensor:
        """Slots as a long tensor on the pool's device; raises on any out-of-range slot (a
        negative one would silently wrap around in a write)."""
        limit = self.num_tokens if limit is None else limit
        s = torch.as_tensor(slots)
        if s.dtype not in (torch.int64, torch.int32) or s.dim() != 1:
            raise TypeError(f"{what}s must be a 1-D integer tensor, got {s.dtype} {tuple(s.shape)}")
        s = s.to(device=self.device, dtype=torch.long)
        if s.numel():
            lo, hi = torch.aminmax(s)  # one op, one sync: this runs per layer per step
            if lo < 0 or hi >= limit:
                bad = s[(s < 0) | (s >= limit)][0].item()
                raise IndexError(f"{what} {bad} out of range 0..{limit - 1}")
        return s

    def _locate(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) index tensors on the pool's device; raises on any out-of-range slot."""
        s = self._check_slots(slots)
        return s // self.page_size, s % self.page_size

    def _write(
        self, buf: _Buffer, slots, x: torch.Tensor, dim: int, what: str, limit: int | None = None
    ) -> None:
        s = self._check_slots(slots, limit)
        if x.dim() != 2 or x.shape != (s.numel(), dim):
            raise ValueError(
                f"{what} must be [{s.numel()}, {dim}] for {s.numel()} slots, got {tuple(x.shape)}"
            )
        for p, v in zip(buf.parts, buf.encode(x.to(self.device)), strict=True):
            if p.is_contiguous():  # token-major: slot s is row s
                p.view(-1, p.shape[-1]).index_copy_(0, s, v)
            else:
                p[s // self.page_size, s % self.page_size] = v

    def _gather(self, buf: _Buffer, slots, dtype: torch.dtype, limit: int | None = None):
        s = self._check_slots(slots, limit)
        return buf.decode([_rows(p, s, self.page_size) for p in buf.parts], dtype)


def _token_rows(buf: _Buffer):
    """(offset in page 0, row bytes) of each part: rows are contiguous within a page."""
    base = buf.data.data_ptr()
    for p in buf.parts:
        width = p.shape[-1] * p.element_size()
        assert p.stride(-1) == 1 and p.stride(1) * p.element_size() == width, "strided rows"
        yield p.data_ptr() - base, width


def _rows(part: torch.Tensor, slots: torch.Tensor, ps: int) -> torch.Tensor:
    """`part[slot // ps, slot % ps]`; token-major parts take the faster flat `index_select`
    (the hot path: every layer, every step)."""
    if part.is_contiguous():
        return part.view(-1, part.shape[-1]).index_select(0, slots)
    return part[slots // ps, slots % ps]


def copy_tokens(
    dst: DSAKVPool, dst_slots: torch.Tensor, src: DSAKVPool, src_slots: torch.Tensor
) -> int:
    """Copy stored bytes token by token between two pools of one layout; returns bytes copied.
    A HiSparse pool's latent is its host rows (`attach_host_latent`); where either pool moves
    index-K only (`moves_latent`), only index-K is copied."""
    if not isinstance(dst, DSAKVPool) or not isinstance(src, DSAKVPool):
        raise TypeError(
            f"copy_tokens copies between DSAKVPools, got {type(dst).__name__} <- "
            f"{type(src).__name__}"
        )
    if dst.layout.fingerprint() != src.layout.fingerprint():
        raise ValueError("cannot copy KV between pools of different layouts")
    dp, do = dst._locate(dst_slots)
    sp, so = src._locate(src_slots)
    if dp.numel() != sp.numel():
        raise ValueError(f"{dp.numel()} destination slots for {sp.numel()} source slots")
    index_k_only = not (dst.moves_latent and src.moves_latent)
    views = zip(dst._token_views(index_k_only), src._token_views(index_k_only), strict=True)
    on_device: dict[torch.device, list[torch.Tensor]] = {}  # the slot indices, once a device

    def on(device: torch.device) -> list[torch.Tensor]:
        if device not in on_device:
            on_device[device] = [t.to(device) for t in (dp, do, sp, so)]
        return on_device[device]

    nbytes = 0
    for (_, _, dparts), (_, _, sparts) in views:
        for d, s in zip(dparts, sparts, strict=True):
            (dpage, doff, _, _), (_, _, spage, soff) = on(d.device), on(s.device)
            d[dpage, doff] = s[spage, soff].to(d.device)  # gather first: overlaps stay right
            nbytes += dp.numel() * d.shape[-1] * d.element_size()
    return nbytes


def _at(part: torch.Tensor, page: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
    """`part[page, off]`, the indices moved to the part's device (a HiSparse pool's latent
    is in host memory, its index-K on the pool's device)."""
    return part[page.to(part.device), off.to(part.device)]
