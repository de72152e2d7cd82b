"""recurrent-coreai: turn no-KV-cache recurrent language models (RWKV-7, RWKV-6, Mamba-2) into
verified Core AI bundles.

The package holds the pipeline's logic; ``scripts/`` are thin entry points that
Snakemake (``rules/*.smk``) and DVC (``dvc.yaml``) call.
"""

import os as _os

__version__ = "0.1.0"
DISTRIBUTION = "recurrent-coreai"  # the package's distribution name (pyproject.toml)

# Before anything loads coreai's Swift runtime: its dictionaries (metadata.json key order) hash
# with a per-process seed otherwise. coreai/reproducible/swift.py checks the loaded runtime took it.
_os.environ.setdefault("SWIFT_DETERMINISTIC_HASHING", "1")

# Before anything loads numpy: its exp/log kernels (the gate's softmax and KL) differ in their last
# bits between AVX2 and AVX-512 hosts. util/numpy_simd.py caps them at the recorded X86_V3.
from recurrent_coreai.util import numpy_simd as _numpy_simd  # noqa: E402,F401  (sets the environment)
