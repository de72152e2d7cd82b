"""Wording items of issue 19 (item 9): a persistent HTTP 404 does not say "retry"; a symlink
loop and a broken link are named as such (fsutil.why_missing, for the stages that report a
missing path); a config.json that is a directory and a pickle calling a global were fixed earlier
(tests/test_bad_checkpoints.py) -- checked here again by their first line."""

from __future__ import annotations

import os
import types
from pathlib import Path

import pytest

from recurrent_coreai.hub import download
from recurrent_coreai.util.fsutil import why_missing


class HTTPFailure(Exception):
    def __init__(self, status: int):
        super().__init__(f"{status} Client Error")
        self.response = types.SimpleNamespace(status_code=status)
        self.server_message = "Entry not found"


@pytest.mark.parametrize("status", [404, 410])
def test_a_persistent_http_error_does_not_say_retry(status):
    what, fix = download.describe_download_failure(HTTPFailure(status))
    assert what == f"download failed (HTTP {status}: Entry not found): the Hub has no such file at this revision"
    assert fix.startswith("check source.repo, source.revision and allow_patterns") and not fix.startswith("retry")


def test_a_server_error_still_says_retry():
    what, fix = download.describe_download_failure(HTTPFailure(500))
    assert what == "download failed (HTTP 500: Entry not found)" and fix.startswith("retry:")


def test_why_missing_names_a_loop_a_broken_link_and_a_directory(tmp_path):
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    broken = tmp_path / "broken"
    os.symlink(tmp_path / "nowhere", broken)
    (tmp_path / "config.json").mkdir()
    assert why_missing(loop) == "is a symbolic link loop (it resolves to itself)"
    assert why_missing(broken) == f"is a broken symbolic link (to {tmp_path / 'nowhere'})"
    assert why_missing(tmp_path / "config.json") == "is a directory, not a file"
    assert why_missing(tmp_path / "absent") == "does not exist"


def test_config_json_that_is_a_directory_is_not_called_missing(tmp_path):
    from recurrent_coreai import families
    from recurrent_coreai.checkpoints import reader
    from recurrent_coreai.util.errors import PipelineError

    (tmp_path / "config.json").mkdir()
    with pytest.raises(PipelineError) as err:
        reader.load_geometry(families.get("rwkv7"), tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: is a directory, not a file")
    (tmp_path / "config.json").rmdir()
    os.symlink(tmp_path / "config.json", tmp_path / "config.json")
    with pytest.raises(PipelineError) as err:
        reader.load_geometry(families.get("rwkv7"), tmp_path)
    assert str(err.value).startswith(f"{tmp_path / 'config.json'}: is a symbolic link loop")


def test_a_pickle_calling_a_global_is_refused_in_one_line(tmp_path):
    from recurrent_coreai.checkpoints.reader import load_pickle
    from recurrent_coreai.util.errors import PipelineError

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    import torch

    for legacy in (False, True):  # torch.save's zip format, and the legacy plain pickle
        path = tmp_path / f"model{int(legacy)}.pth"
        torch.save({"w": Evil()}, path, _use_new_zipfile_serialization=not legacy)
        with pytest.raises(PipelineError) as err:
            load_pickle(path)
        text = str(err.value)
        assert "\n" not in text and "refers to posix.system, which weights_only loading refuses" in text, text
    path = tmp_path / "raw.pth"  # not torch.save's at all: the unpickler's own reason, not torch's preamble
    path.write_bytes(__import__("pickle").dumps({"w": 1}, protocol=4) + b"junk")
    try:
        load_pickle(path)
    except PipelineError as exc:
        assert "In PyTorch 2.6" not in str(exc) and "\n" not in str(exc), str(exc)
