"""Snakemake jobs: running Snakemake in a tree, reading the jobs its log announced and finished,
and a short per-model description of a job list."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, order=True)
class Job:
    """One Snakemake job: its rule and wildcards (in Snakemake's order)."""

    rule: str
    wildcards: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict:
        return {"rule": self.rule, "wildcards": dict(self.wildcards)}

    @classmethod
    def from_json(cls, data: dict) -> Job:
        return cls(data["rule"], tuple(data["wildcards"].items()))

    def get(self, key: str) -> str | None:
        return dict(self.wildcards).get(key)

    def __str__(self) -> str:
        return self.rule + (f"[{', '.join(f'{k}={v}' for k, v in self.wildcards)}]" if self.wildcards else "")


def parse_jobs(text: str) -> tuple[dict[int, Job], set[int]]:
    """Snakemake's log -> ({jobid: job} of every job it announced, {jobids it finished})."""
    announced, head, fields = {}, None, {}

    def close():
        if head is not None and "jobid" in fields:
            wc = tuple(tuple(kv.split("=", 1)) for kv in fields.get("wildcards", "").split(", ") if "=" in kv)
            announced[int(fields["jobid"])] = Job(head, wc)

    for line in text.splitlines():
        m = re.match(r"^(?:local)?rule (\S+):$", line)
        if m or not line.startswith(" "):
            close()
            head, fields = (m.group(1) if m else None), {}
        elif head is not None and ":" in line:
            key, _, value = line.strip().partition(":")
            fields[key] = value.strip()
    close()
    finished = {int(n) for n in re.findall(r"^Finished jobid: (\d+)", text, re.M)}
    return announced, finished


def snakemake(tree: Path, args: list[str], env: dict, python: str = sys.executable,
              log: Path | None = None) -> tuple[int, str]:
    """Run Snakemake in ``tree``: (exit status, its output). With ``log`` the output streams there."""
    cmd = [python, "-m", "snakemake", "--cores", "1", *args]
    if log is None:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
        return proc.returncode, proc.stdout + proc.stderr
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as fh:
        fh.write(f"$ cd {tree} && {' '.join(cmd[1:])}\n")
        fh.flush()
        rc = subprocess.run(cmd, cwd=tree, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    return rc, log.read_text(errors="replace")


def describe(jobs: list[Job]) -> list[str]:
    """Jobs grouped per model, in the order Snakemake listed them (a DAG order): ``toolchain``,
    ``rwkv7-tiny: export fp16, fp32; aot universal/fp16; card``, ``publish``."""
    groups: dict[str, dict[str, list[str]]] = {}
    for job in jobs:
        model = job.get("model")
        rest = "/".join(v for k, v in job.wildcards if k != "model")
        groups.setdefault(model or job.rule, {}).setdefault(job.rule, []).append(rest)
    return [key if key in rules and len(rules) == 1 and rules[key] == [""] else
            f"{key}: " + "; ".join(f"{r} {', '.join(sorted(v))}".strip() for r, v in rules.items())
            for key, rules in groups.items()]
