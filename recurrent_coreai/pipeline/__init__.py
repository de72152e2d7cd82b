"""pipeline: see docs/architecture.md."""
