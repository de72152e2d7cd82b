"""An ``argparse.ArgumentParser`` whose usage errors are the house's one line
(``error: <prog>: <what> -- fix: see <prog> --help``, exit 1 through ``main_guard``), not argparse's
usage line + message and exit 2."""

from __future__ import annotations

import argparse

from recurrent_coreai.util.errors import PipelineError


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise PipelineError(self.prog, message, f"see {self.prog} --help")


def utf8_text(text: str) -> str:
    """An argparse ``type``: a command-line text that is valid UTF-8. Python hands bytes that are
    not UTF-8 over as lone surrogates (``surrogateescape``); encoding them later failed deep in a
    tokenizer, reported as an internal error. Here it is the parser's one line, naming the byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"code point U+{code:04X}"
        raise argparse.ArgumentTypeError(f"is not valid UTF-8 text ({what} at character {exc.start}): pass it as "
                                         "UTF-8 (check the terminal's or the file's encoding)") from None
    return text
