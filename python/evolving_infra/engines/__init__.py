"""Engines: the simulated engine, the SGLang launcher and sidecar, and the shared L2 KV pool."""
