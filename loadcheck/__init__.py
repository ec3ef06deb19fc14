"""`fp8kv load-check`: what a serving engine's own loader holds for each layer's K/V scales, against the file."""
