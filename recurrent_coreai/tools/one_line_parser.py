"""An ``argparse.ArgumentParser`` whose usage errors are the house's one line
(``error: <prog>: <what> -- fix: see <prog> --help``, exit 1 through ``main_guard``), not argparse's
usage line + message and exit 2."""

from __future__ import annotations

import argparse

from recurrent_coreai.util.errors import PipelineError


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise PipelineError(self.prog, message, f"see {self.prog} --help")
