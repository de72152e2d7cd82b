"""The exact pins of the watched packages in requirements.txt, and moving them -- in
requirements.txt and every envs/*.yaml together."""

from __future__ import annotations

import re
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from recurrent_coreai.util.errors import PipelineError

REQUIREMENTS = "requirements.txt"
ENVS_GLOB = "envs/*.yaml"

Updates = dict[str, tuple[Version, Version]]  # {package: (pinned, new)}


def _lines(requirements: Path) -> list[str]:
    try:
        return requirements.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise PipelineError(requirements, "not found", "run beta-watch in the repository whose requirements.txt "
                            "pins the watched packages") from None
    except UnicodeDecodeError:
        raise PipelineError(requirements, "is not UTF-8 text", "restore requirements.txt (git checkout -- "
                            "requirements.txt)") from None


def read_pins(requirements: Path, packages: list[str]) -> dict[str, Version]:
    """``name==version`` pins of ``packages`` in a requirements file, keyed by the name as the file
    writes it (bump_pins rewrites those lines)."""
    pins: dict[str, tuple[Version, int, str]] = {}  # canonical name: (version, line, name as written)
    for n, line in enumerate(_lines(requirements), 1):
        text = line.split("#", 1)[0].strip()
        if not text or text.startswith("-"):
            continue
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            why = str(exc).splitlines()[0]
            raise PipelineError(f"{requirements}:{n}", f"cannot parse {text!r} ({why})", "fix the line") from None
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==":
            continue
        try:
            version = Version(spec[0].version)
        except InvalidVersion:
            raise PipelineError(f"{requirements}:{n}", f"{text!r} is not an exact pin (a wildcard)",
                                f"pin one version: {req.name}==X.Y.Z") from None
        name = canonicalize_name(req.name)
        if name in pins and pins[name][0] != version:
            raise PipelineError(f"{requirements}:{n}", f"{req.name} is pinned twice ({pins[name][0]} on line "
                                f"{pins[name][1]}, {version} here)", "keep one pin per package")
        pins[name] = (version, n, req.name)
    missing = [p for p in packages if canonicalize_name(p) not in pins]
    if missing:
        raise PipelineError(requirements, f"no exact pin (name==version) for {', '.join(missing)}",
                            "pin every watched package exactly (beta_watch.packages in config.yaml); beta-watch "
                            "compares against the pins")
    return {pins[canonicalize_name(p)][2]: pins[canonicalize_name(p)][0] for p in packages}


def bump_pins(tree: Path, updates: Updates) -> list[Path]:
    """Rewrite ``name==old`` to ``name==new`` in requirements.txt and every envs/*.yaml, line by
    line (comments and layout kept). Every file must hold every pin: they move together."""
    files = [tree / REQUIREMENTS, *sorted(tree.glob(ENVS_GLOB))]
    for path in files:
        lines = path.read_text().splitlines(keepends=True)
        for package, (old, new) in updates.items():
            pat = re.compile(rf"^(\s*(?:-\s+)?){re.escape(package)}=={re.escape(str(old))}(?=\s|$|#)", re.I)
            hits = [i for i, line in enumerate(lines) if pat.match(line)]
            if len(hits) != 1:
                raise PipelineError(path, f"{'no' if not hits else len(hits)} line(s) pin {package}=={old}",
                                    f"pin {package}=={old} once in requirements.txt and every envs/*.yaml "
                                    "(tests/test_envs.py keeps them equal)")
            lines[hits[0]] = pat.sub(lambda m: f"{m.group(1)}{package}=={new}", lines[hits[0]])
        path.write_text("".join(lines))
    return files
