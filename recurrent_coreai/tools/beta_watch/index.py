"""Which versions of a package the index lists, asked through pip's own finder
(``pip index versions --pre -vv``: the same index settings, proxies and certificates as the
installs), and which of them are newer than the pins.

The pinned version must be listed: an index that does not list it -- HTTP 404, an empty project
page, a missing file:// directory, a plain-http host pip ignores -- is the wrong index, and
"nothing newer" from it would be reported forever. Each is an error naming the index and the pin.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass, field

from packaging.version import InvalidVersion, Version

from recurrent_coreai.tools.beta_watch.pins import REQUIREMENTS, Updates
from recurrent_coreai.util.errors import PipelineError

TIMEOUT_S = 300


def where(index_url: str | None) -> str:
    return f"index {index_url}" if index_url else "pip's configured index (PyPI unless pip.conf or PIP_INDEX_URL says otherwise)"


def pip_index_args(index_url: str | None) -> list[str]:
    """An explicit index is the ONLY source (``--isolated`` drops pip's env/user extra indexes)."""
    return ["--isolated", "--index-url", index_url] if index_url else []


@dataclass
class Listing:
    """What pip found for one project: the versions, and why pages gave nothing."""
    versions: list[Version]
    problems: list[str] = field(default_factory=list)


def _reason(text: str) -> str:
    """The useful part of pip's "Could not fetch URL" reason (urllib3 nests it in reprs)."""
    errno = re.search(r"\[Errno -?\d+\] [^'\")]+", text)
    return errno.group(0) if errno else re.sub(r" for url: \S+", "", text)[:200]


def listing(package: str, index_url: str | None) -> Listing:
    """Every version of ``package`` the index lists (pre-releases included) that pip could install
    here. An index that cannot be reached is an error, not an empty listing."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", package, "--pre", "-vv",
           "--disable-pip-version-check", "--retries", "1", "--timeout", "30", *pip_index_args(index_url)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise PipelineError(where(index_url), f"pip index versions {package} got no answer within {TIMEOUT_S} s",
                            "check the index URL and the network, then run again") from None
    out = proc.stdout + proc.stderr
    problems = []
    for line in out.splitlines():
        fetch = re.match(r"Could not fetch URL (\S+?): (.*?)(?: - skipping)?$", line)
        if fetch and re.search(r"connection error|SSLError|ProxyError|timed out|confirming the ssl", fetch.group(2)):
            raise PipelineError(where(index_url), f"the index could not be reached at {fetch.group(1)} "
                                f"({_reason(fetch.group(2))})",
                                "check --index-url / beta_watch.index_url and the network, then run again")
        if fetch:
            problems.append(f"{fetch.group(1)} answers {_reason(fetch.group(2))}")
        ignored = re.match(r"WARNING: Location '(.+)' is ignored: (.*?)\.?$", line)
        if ignored:
            problems.append(f"pip ignores {ignored.group(1)}: {ignored.group(2)}")
        insecure = re.match(r"WARNING: The repository located at (\S+) is not a trusted or secure host", line)
        if insecure:
            raise PipelineError(where(index_url), f"pip ignores it: {insecure.group(1)} is not a trusted or secure "
                                "host (plain http)", "use the index's https:// URL (plain http is trusted on "
                                "localhost only)")
    listed = re.search(r"^Available versions: (.*)$", out, re.M)
    if proc.returncode == 0 and listed:
        try:
            return Listing(sorted(Version(v.strip()) for v in listed.group(1).split(",")), problems)
        except InvalidVersion as exc:
            raise PipelineError(where(index_url), f"unexpected version list for {package}: {exc}",
                                "run the same pip command by hand to see why") from None
    if "No matching distribution found" in out:
        return Listing([], problems)
    last = (out.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    raise PipelineError(where(index_url), f"pip index versions {package} failed: {last[:200]}",
                        "run the same pip command by hand to see why")


def index_versions(package: str, index_url: str | None) -> list[Version]:
    return listing(package, index_url).versions


def _few(versions: list[Version]) -> str:
    if len(versions) <= 6:
        return ", ".join(map(str, versions))
    return f"{len(versions)} versions, the newest {', '.join(map(str, versions[-5:]))}"


def find_updates(pins: dict[str, Version], index_url: str | None, origin: str = REQUIREMENTS) -> Updates:
    """{package: (pinned, newest newer version)} for the packages the index has something newer of.
    Every pinned version must be listed there (else: the wrong index, an error)."""
    updates = {}
    for package, pinned in pins.items():
        found = listing(package, index_url)
        if pinned not in found.versions:
            why = (f"its project page lists {_few(found.versions)}" if found.versions
                   else "; ".join(found.problems) or "its project page lists no versions")
            raise PipelineError(where(index_url), f"{package}=={pinned} (pinned in {origin}) is not listed there "
                                f"({why})", "point --index-url (or beta_watch.index_url in config.yaml) at the PEP "
                                f"503 simple index that serves {package} {pinned}, e.g. https://pypi.org/simple (pip "
                                "lists only files it could install here: not yanked, for this platform and Python)")
        newer = [v for v in found.versions if v > pinned]
        if newer:
            updates[package] = (pinned, max(newer))
    return updates
