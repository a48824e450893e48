"""Prefill/decode disaggregation: a prefill server runs prompts and writes their KV pages
into a decode server's pool over the Mooncake Transfer Engine; `dsakv router` sends each
request to one of each. Only the buffers the layout has move (index-K elided on shared
layers). Mooncake, FastAPI and httpx are imported by the submodules that need them.
"""

from .config import DisaggConfig

__all__ = ["DisaggConfig"]
