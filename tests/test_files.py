"""The digest cache (engine/files.cached_sha256): a nightly run does not re-read an unchanged checkpoint, a
changed file is read again, and `verify` always reads."""
import hashlib
import os
import shutil

import pytest
from conftest import SAMPLE

from policyscan.engine import files
from policyscan.engine.model.checkpoint import Checkpoint


@pytest.fixture
def reads(monkeypatch, tmp_path):
    """The names of the files hashed by reading them; each call of `forget` is a new process (the disk alone
    remembers)."""
    monkeypatch.setenv("POLICYSCAN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(files, "_SHA_CACHE", {})
    monkeypatch.setattr(files, "SETTLED_NS", -1)  # files written by the test count as settled
    seen: list[str] = []
    real = files.file_sha256
    monkeypatch.setattr(files, "file_sha256", lambda p, *a: seen.append(p.name) or real(p, *a))
    return seen


def forget(monkeypatch) -> None:
    monkeypatch.setattr(files, "_SHA_CACHE", {})


def test_unchanged_file_is_read_once_across_runs(reads, monkeypatch, tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 16))
    want = hashlib.sha256(f.read_bytes()).hexdigest()
    assert files.cached_sha256(f) == want
    forget(monkeypatch)
    assert files.cached_sha256(f) == want
    assert reads == ["w.bin"]


def test_a_file_written_just_now_is_not_remembered(reads, monkeypatch, tmp_path):
    """Within the settling time a rewrite could keep the identity it was hashed under (a coarse clock)."""
    monkeypatch.setattr(files, "SETTLED_NS", 60_000_000_000)
    f = tmp_path / "w.bin"
    f.write_bytes(b"new" * 100)
    files.cached_sha256(f)
    forget(monkeypatch)
    files.cached_sha256(f)
    assert reads == ["w.bin", "w.bin"] and not (tmp_path / "cache" / "sha256").exists()


def test_changed_file_is_read_again(reads, monkeypatch, tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 4096)
    st = f.stat()
    files.cached_sha256(f)
    f.write_bytes(b"b" * 4096)  # same size; mtime put back: the ctime still moves
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    forget(monkeypatch)
    assert files.cached_sha256(f) == hashlib.sha256(b"b" * 4096).hexdigest()
    assert reads == ["w.bin", "w.bin"]


def test_corrupt_or_unwritable_cache_falls_back_to_reading(reads, monkeypatch, tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(b"x" * 100)
    files.cached_sha256(f)
    for entry in (tmp_path / "cache" / "sha256").iterdir():
        entry.write_text("not a digest")
    forget(monkeypatch)
    assert files.cached_sha256(f) == hashlib.sha256(b"x" * 100).hexdigest()
    (tmp_path / "blocker").write_text("a file where the cache folder would be")  # and no .tmp left behind
    monkeypatch.setenv("POLICYSCAN_CACHE_DIR", str(tmp_path / "blocker"))
    forget(monkeypatch)
    assert files.cached_sha256(f) == hashlib.sha256(b"x" * 100).hexdigest()
    assert reads == ["w.bin"] * 3
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_verify_reads_every_file(reads, monkeypatch, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(SAMPLE / "model", model)
    ckpt = Checkpoint.open(model)
    first = ckpt.fingerprint()
    n = len(reads)
    forget(monkeypatch)
    assert ckpt.fingerprint() == first and len(reads) == n  # the nightly run: from the cache
    forget(monkeypatch)
    assert ckpt.fingerprint(fresh=True) == first and len(reads) == 2 * n  # verify: every file read


def test_an_output_not_there_yet_is_no_protected_file_that_is_not_there_either(tmp_path):
    from policyscan.cli.common import refuse_overwrites

    refuse_overwrites([(tmp_path / "new.html", "report")], {tmp_path / "gone.parquet": "an input"})
    (tmp_path / "in.parquet").write_text("x")
    with pytest.raises(Exception, match="writing it would destroy it"):
        refuse_overwrites([(tmp_path / "in.parquet", "report")], {tmp_path / "in.parquet": "an input"})
