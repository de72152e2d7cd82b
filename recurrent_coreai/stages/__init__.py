"""stages: see docs/architecture.md."""
