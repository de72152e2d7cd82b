"""families/rwkv7: see docs/architecture.md."""
