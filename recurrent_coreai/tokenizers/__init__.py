"""tokenizers: see docs/architecture.md."""
