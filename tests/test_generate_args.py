"""``generate``'s text arguments must be UTF-8 (issue 34, case 11; docs/bad-inputs.md row N7): a
prompt or stop string holding bytes that are not UTF-8 (Python passes them on as lone surrogates)
is ONE line naming the byte, exit 1, before the config or the bundle is read -- it was an
"internal error" from the gdn and mamba2 tokenizers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recurrent_coreai.tools import generate as gen

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args", [["caf\udce9"], ["--stop", "\udcff", "hello"]])
def test_text_that_is_not_utf8_is_one_line(capsys, args):
    rc = gen.main(["--model", "gdn-tiny", "--recipe", "fp32", "--config-file", "nope.yaml", *args])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.splitlines()) == 1, err
    assert "is not valid UTF-8 text (byte 0x" in err and "internal error" not in err, err
    assert "nope.yaml" not in err  # refused while parsing, before the config is read


def test_a_latin1_prompt_from_a_shell_is_one_line(tmp_path):
    """The bytes as a shell passes them: argv is bytes, 0xe9 alone is not UTF-8."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), LC_ALL="C.UTF-8")
    proc = subprocess.run([sys.executable, "-m", "recurrent_coreai", "generate", "--model", "gdn-tiny", "--recipe",
                           "fp32", b"caf\xe9"], cwd=tmp_path, capture_output=True, env=env, timeout=120)
    err = proc.stderr.decode("utf-8", "replace")
    assert proc.returncode == 1 and len(err.splitlines()) == 1, err
    assert ("argument prompt: is not valid UTF-8 text (byte 0xe9 at character 3): pass it as UTF-8 (check the "
            "terminal's or the file's encoding)") in err, err
