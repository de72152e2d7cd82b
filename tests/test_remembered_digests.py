"""fsutil.remembered_digests: inside it a file is hashed once while it is unchanged -- and again
after any write, even one that puts its modification time back (the DVC record's checks must see
a file changed after its stage with its time kept)."""

from __future__ import annotations

import hashlib
import os
import time

from recurrent_coreai.util import fsutil


def _counting(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = fsutil._sha256_file

    def counted(path):
        calls.append(str(path))
        return real(path)

    monkeypatch.setattr(fsutil, "_sha256_file", counted)
    return calls


def test_an_unchanged_file_is_hashed_once_inside_and_every_time_outside(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 1000)
    time.sleep(fsutil.RACY_NS / 1e9 + 0.1)  # older than the racy window: remembered
    want = hashlib.sha256(b"x" * 1000).hexdigest()
    with fsutil.remembered_digests():
        assert [fsutil.sha256_file(f) for _ in range(3)] == [want] * 3
        with fsutil.remembered_digests():  # nested: the same memo
            assert fsutil.sha256_file(f) == want
    assert len(calls) == 1
    assert fsutil.sha256_file(f) == want and len(calls) == 2  # outside: hashed again


def test_a_file_edited_with_its_time_kept_is_hashed_again(tmp_path, monkeypatch):
    calls = _counting(monkeypatch)
    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 1000)
    time.sleep(fsutil.RACY_NS / 1e9 + 0.1)
    with fsutil.remembered_digests():
        before = fsutil.sha256_file(f)
        st = os.stat(f)
        with open(f, "r+b") as fh:  # same size, one byte changed
            fh.seek(10)
            fh.write(b"y")
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # its time kept
        assert os.stat(f).st_mtime_ns == st.st_mtime_ns
        after = fsutil.sha256_file(f)
    assert after != before and after == hashlib.sha256(f.read_bytes()).hexdigest()
    assert len(calls) == 2


def test_a_file_replaced_by_another_is_hashed_again(tmp_path):
    f, g = tmp_path / "a.bin", tmp_path / "b.bin"
    f.write_bytes(b"one")
    g.write_bytes(b"two")
    with fsutil.remembered_digests():
        first = fsutil.sha256_file(f)
        os.replace(g, f)
        assert fsutil.sha256_file(f) != first == hashlib.sha256(b"one").hexdigest()


def test_a_file_changed_within_the_racy_window_is_not_remembered(tmp_path, monkeypatch):
    """On a file system whose clock ticks coarsely a second write in the same tick keeps ctime:
    a file written less than RACY_NS before it is hashed is hashed on every call."""
    calls = _counting(monkeypatch)
    f = tmp_path / "a.bin"
    f.write_bytes(b"fresh")
    with fsutil.remembered_digests():
        fsutil.sha256_file(f)
        fsutil.sha256_file(f)
    assert len(calls) == 2


# --- fsutil.remembered: a check made once while its inputs are unchanged ------------------------
def _inputs(tmp_path):
    d = tmp_path / "tree"
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "t.txt").write_text("table")
    f = tmp_path / "settings.json"
    f.write_text("{}")
    time.sleep(fsutil.RACY_NS / 1e9 + 0.1)  # older than the racy window
    return d, f


def test_a_check_is_made_once_inside_while_its_files_are_unchanged_and_every_time_outside(tmp_path):
    d, f = _inputs(tmp_path)
    made = []

    def make():
        made.append(1)
        return {"files": ["t.txt"]}
    with fsutil.remembered_digests():
        first = fsutil.remembered(("vocab", "world"), [d, f], make)
        first["files"].append("changed by the caller")  # every caller gets its own copy
        assert fsutil.remembered(("vocab", "world"), [d, f], make) == {"files": ["t.txt"]}
        assert len(made) == 1
        fsutil.remembered(("vocab", "other settings"), [d, f], make)  # another key: made again
        assert len(made) == 2
    fsutil.remembered(("vocab", "world"), [d, f], make)
    assert len(made) == 3  # outside the block: every time


def test_a_file_under_a_directory_edited_with_its_time_kept_makes_the_check_again(tmp_path):
    d, f = _inputs(tmp_path)
    made = []
    t = d / "sub" / "t.txt"
    with fsutil.remembered_digests():
        fsutil.remembered(("k",), [d, f], lambda: made.append(1))
        st = t.stat()
        t.write_text("TABLE")
        os.utime(t, ns=(st.st_atime_ns, st.st_mtime_ns))
        fsutil.remembered(("k",), [d, f], lambda: made.append(1))
        (d / "new.txt").write_text("a file added")
        fsutil.remembered(("k",), [d, f], lambda: made.append(1))
    assert len(made) == 3


def test_a_failed_check_and_a_racy_file_are_not_remembered(tmp_path):
    d, f = _inputs(tmp_path)
    calls = []

    def failing():
        calls.append(1)
        raise ValueError("the check failed")
    with fsutil.remembered_digests():
        for _ in range(2):
            try:
                fsutil.remembered(("k",), [d], failing)
            except ValueError:
                pass
        assert len(calls) == 2
        f.write_text("{} ")  # changed just now: within the racy window
        fsutil.remembered(("r",), [f], lambda: calls.append(1))
        fsutil.remembered(("r",), [f], lambda: calls.append(1))
    assert len(calls) == 4
