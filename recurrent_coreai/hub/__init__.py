"""hub: see docs/architecture.md."""
