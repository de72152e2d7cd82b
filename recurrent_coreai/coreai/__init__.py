"""coreai: see docs/architecture.md."""
