"""DSA model execution over the paged KV pool."""

from .forward_batch import ForwardBatch

__all__ = ["ForwardBatch"]
