"""``python -m recurrent_coreai beta-watch``: rebuild on a new Core AI beta and compare.

1. Ask the package index (pip's own client: ``pip index versions --pre``) for versions of the
   watched packages (coreai-core, coreai-torch, coreai-opt) newer than their pins in
   requirements.txt, pre-releases included, and list what would rebuild: the toolchain stage and
   every job after it, as ``snakemake -n --forcerun toolchain publish`` plans it (pipeline/dag.py). An index that
   does not list a pinned version (HTTP 404, an empty project page, a missing file:// directory,
   a host pip ignores) is the wrong index: an error, never "nothing newer".
2. ``--apply``: in a throwaway ``git worktree`` of HEAD, bump the pins in requirements.txt and
   envs/*.yaml together, prepare a venv that holds ONLY the new wheels (installed ``--no-deps``)
   and sees everything else -- torch included -- through a ``.pth`` into the current venv, copy
   the current results in, run ``snakemake --cores 1 --keep-going publish`` there, check that
   exactly the planned jobs ran, and write ``reports/beta-<versions>.md`` + ``.json``: per model
   and recipe the gate numbers old vs new, bundle size, export time and peak RSS, bundle digest.
   A regression beyond ``beta_watch.limits`` (any gate failure, an agreement drop, max|dlogits|
   growing by more than a factor) is one error line and exit 1. Nothing is ever published from
   the worktree: the run gets no Hub token.

One module per concern:

* ``settings``  -- config.yaml ``beta_watch:`` over the defaults, ``--limits`` and ``--index-url`` checked;
* ``pins``      -- the exact pins in requirements.txt; moving them in requirements.txt and envs/*.yaml;
* ``index``     -- which versions the index lists (pip index versions), newer than the pins;
* ``jobs``      -- Snakemake jobs: running Snakemake, reading which jobs it announced and finished;
* ``plan``      -- the jobs a tree would run: pipeline.dag's one job listing, run in that tree by its venv;
* ``worktree``  -- git: a clean HEAD, the throwaway worktree, seeding it with the baseline results;
* ``venv``      -- the beta venv: only the new wheels, the rest through a .pth, verified;
* ``rebuild``   -- seed, bump, prepare, run Snakemake in the worktree, check the jobs it ran;
* ``assess``    -- old vs new gate numbers per recipe, the regressions beyond the limits;
* ``report``    -- reports/beta-<versions>.md and .json;
* ``cli``       -- the command: arguments, the dry listing, ``--apply``.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The command (``cli.main``), for ``python -m recurrent_coreai beta-watch``."""
    from recurrent_coreai.tools.beta_watch.cli import main as cli_main

    return cli_main(argv)
