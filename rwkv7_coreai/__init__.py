"""rwkv7-coreai: turn RWKV-7 checkpoints into verified Core AI bundles.

The package holds the pipeline's logic; ``scripts/`` are thin entry points that
Snakemake (``rules/*.smk``) and DVC (``dvc.yaml``) call.
"""

__version__ = "0.1.0"

from . import reproducible  # noqa: E402,F401 - sets SWIFT_DETERMINISTIC_HASHING before anything loads coreai
