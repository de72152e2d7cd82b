"""util: see docs/architecture.md."""
