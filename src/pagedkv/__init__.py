"""pagedkv: paged KV-cache management for LLM serving."""
__version__ = "0.1.0"
