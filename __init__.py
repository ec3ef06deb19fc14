"""fp8kv: static FP8 KV-cache scales that serving engines load and use."""

__version__ = "0.1.0"
