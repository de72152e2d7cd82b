"""Where every stage's output lives (used by the rules, the CLI and the tests alike)."""

from __future__ import annotations

from pathlib import Path


class Layout:
    def __init__(self, results: str | Path, model: str):
        self.root = Path(results)
        self.model = model
        self.base = self.root / model

    source = property(lambda s: s.base / "source")
    vocab = property(lambda s: s.base / "vocab" / "rwkv_vocab.tsv")
    reference = property(lambda s: s.base / "reference" / "stream.npz")
    card = property(lambda s: s.base / "card" / "README.md")
    publish = property(lambda s: s.base / "publish")
    toolchain = property(lambda s: s.root / "toolchain.json")

    def export(self, recipe: str) -> Path:
        return self.base / "export" / recipe

    def aot(self, target: str, recipe: str) -> Path:
        return self.base / "aot" / target / recipe

    def gate_json(self, recipe: str) -> Path:
        return self.base / "gate" / f"{recipe}.json"

    def gate_tsv(self, recipe: str) -> Path:
        return self.base / "gate" / f"{recipe}.tsv"


def bundle_name(model_dir: str, recipe: str) -> str:
    """Name of one recipe's bundle: ``<dir>-<recipe>`` (.aimodel, .aimodelx, .<arch>.aimodelc)."""
    return f"{model_dir}-{recipe}"
