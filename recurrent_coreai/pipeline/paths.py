"""Where every stage's output lives: the one results layout that the rules (as patterns, with
``{model}``/``{recipe}``/``{target}`` left in), the CLI and the tests share."""

from __future__ import annotations

from pathlib import Path

STATE_DIR = ".snakemake/rwkv7"  # effective configs written by the Snakefile


class Layout:
    def __init__(self, results: str | Path, model: str):
        self.root = Path(results)
        self.base = self.root / model

    source = property(lambda s: s.base / "source")
    vocab = property(lambda s: s.base / "vocab")  # the tokenizer files a device app needs
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

    def gate_shard(self, recipe: str, shard: int | str) -> Path:
        """One gate shard's record (stages/gate_shard.py), gathered into the gate JSON."""
        return self.base / "gate" / recipe / f"shard-{shard}.json"

    def doctor_json(self, recipe: str) -> Path:
        """coreai doctor's reports for a recipe, beside its gate result."""
        return self.base / "gate" / f"{recipe}.doctor.json"

    def log(self, name: str) -> Path:
        """Per-job log: ``results/logs/<model>/<name>.log``."""
        return self.root / "logs" / self.base.name / f"{name}.log"


NAME_MAX = 255  # bytes in one path component (ext4, XFS, APFS, HFS+, NTFS)
# The names made from a bundle name b (bundle_name): b.aimodel (export), b.aimodelx (aot on a linux
# target), b.intoto.json and b.sig (hub/provenance.py, hub/signing.py: the staged bundle's statement
# and signature); a device target adds b.<arch>.aimodelc (device_suffix).
BUNDLE_SUFFIXES = (".aimodel", ".aimodelx", ".intoto.json", ".sig")


def device_suffix(arch: str) -> str:
    """What aot appends to a bundle name for a device architecture: ``.<arch>.aimodelc``."""
    return f".{arch}.aimodelc"


def bundle_name(model: dict, recipe: str) -> str:
    """Name of one recipe's bundle (.aimodel, .aimodelx, .<arch>.aimodelc, and its published
    folders): the model's ``dir`` for its ``shipped`` recipe (the path apps load), else
    ``<dir>-<recipe>``."""
    return model["dir"] if recipe == model.get("shipped") else f"{model['dir']}-{recipe}"


def published_folders(model: dict, targets: list[str]) -> list[str]:
    """The bundle folders publish stages for ``model`` (every recipe, on every target), sorted."""
    names = [bundle_name(model, r) for r in model["recipes"]]
    return sorted([f"aimodel/{n}" for n in names] + [f"{t}/{n}" for t in targets for n in names])


# What the card and publish stages read, by name: the rules declare exactly these as inputs
# (``unpack``) and the CLI takes them as ``--<name> PATH...``; the tests build the same.
def card_inputs(lay: Layout, recipes: list[str], targets: list[str] = ()) -> dict[str, Path | list[Path]]:
    del targets  # the card describes every recipe; the products per target are publish's
    return {"source": lay.source, "vocab": lay.vocab, "toolchain": lay.toolchain,
            "exports": [lay.export(r) for r in recipes], "gates": [lay.gate_json(r) for r in recipes]}


def publish_inputs(lay: Layout, recipes: list[str], targets: list[str]) -> dict[str, Path | list[Path]]:
    return {**card_inputs(lay, recipes, targets), "card": lay.card,
            "aots": [lay.aot(t, r) for t in targets for r in recipes],
            # checked against their stages' records before anything is staged (publish waits for the lint)
            "tsvs": [lay.gate_tsv(r) for r in recipes], "reference": lay.reference,
            "doctors": [lay.doctor_json(r) for r in recipes]}


def as_args(inputs: dict[str, Path | list[Path]]) -> list[str]:
    """``{"exports": [a, b]}`` -> ``["--exports", "a", "b"]`` (the CLI form of a rule's inputs)."""
    out: list[str] = []
    for name, value in inputs.items():
        out += [f"--{name}", *map(str, value if isinstance(value, list) else [value])]
    return out


def stage_args(stage: str, results: str | Path, model: str, recipes: list[str], targets: list[str] = ()) -> list[str]:
    """The input arguments the card or publish rule passes, for a results tree (tests, tools)."""
    inputs_of = {"card": card_inputs, "publish": publish_inputs}[stage]
    return as_args(inputs_of(Layout(results, model), list(recipes), list(targets)))
