"""coreai: see docs/architecture.md."""

# the modules of this layer that every family's export modules run while traced: coreai doctor
# lints them with each family's own ``export_sources`` (families.base.Family.doctor_sources)
TRACED_SOURCES = ("recurrent_coreai/coreai/layers.py", "recurrent_coreai/coreai/stateful.py")
