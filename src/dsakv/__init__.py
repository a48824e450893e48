"""dsakv: DeepSeek Sparse Attention inference with layer-aware index-K elision."""
