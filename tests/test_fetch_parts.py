"""The named parts of fetch._download, each on its own: where a partial file resumes, receiving the rest of a
file, and backing off after a transient failure (a scripted remote, no network)."""

from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import pytest

from warmfleet import fetch as f

DATA = b"0123456789" * 10
FILE = f.RemoteFile(name="w.bin", size=len(DATA), digest="sha256:" + hashlib.sha256(DATA).hexdigest(), locator="x")


class Scripted:
    """Serves DATA from the start asked for (or from 0: a server that ignores Range), cut short after `cut` bytes."""

    src = None

    def __init__(self, honour_range: bool = True, cut: int | None = None, trust: bool = True) -> None:
        self.honour_range, self.cut, self.trust, self.starts = honour_range, cut, trust, []

    @contextlib.contextmanager
    def open(self, rf: f.RemoteFile, start: int):
        self.starts.append(start)
        begin = start if self.honour_range else 0
        body = DATA[begin:] if self.cut is None else DATA[begin:begin + self.cut]
        yield f.Body(chunks=iter([body[:7], body[7:]]), start=begin, trust_digest=self.trust)


def test_resume_point_hashes_what_the_partial_file_holds_and_restarts_one_too_long(tmp_path: Path):
    part = tmp_path / "w.part"
    assert f._resume_point(part, FILE)[0] == 0 and part.read_bytes() == b""  # created empty
    part.write_bytes(DATA[:40])
    have, h = f._resume_point(part, FILE)
    assert have == 40 and h.hexdigest() == hashlib.sha256(DATA[:40]).hexdigest()
    part.write_bytes(DATA + b"extra")
    assert f._resume_point(part, FILE)[0] == 0 and part.read_bytes() == b""


def test_receive_appends_from_the_offset_and_feeds_the_hasher(tmp_path: Path):
    part = tmp_path / "w.part"
    part.write_bytes(DATA[:40])
    have, h = f._resume_point(part, FILE)
    progress = f.Progress(files=1, total_bytes=len(DATA), done_bytes=40)
    remote = Scripted()
    trust, h = f._receive(remote, FILE, part, have, h, progress)
    assert remote.starts == [40] and part.read_bytes() == DATA and trust and f._matches(h, FILE.digest)
    assert progress.transferred_bytes == 60 and progress.done_bytes == 100


def test_receive_starts_over_when_the_server_ignores_the_range(tmp_path: Path):
    part = tmp_path / "w.part"
    part.write_bytes(DATA[:40])
    have, h = f._resume_point(part, FILE)
    progress = f.Progress(files=1, total_bytes=len(DATA), done_bytes=40)
    trust, h = f._receive(Scripted(honour_range=False, trust=False), FILE, part, have, h, progress)
    assert part.read_bytes() == DATA and f._matches(h, FILE.digest) and not trust
    assert progress.done_bytes == 100  # the 40 resumed bytes were taken back before the whole file came


def test_receive_of_a_short_body_is_transient(tmp_path: Path):
    part = tmp_path / "w.part"
    have, h = f._resume_point(part, FILE)
    with pytest.raises(f._Transient, match="got 30 of 100 bytes"):
        f._receive(Scripted(cut=30), FILE, part, have, h, f.Progress(files=1, total_bytes=100))
    assert part.read_bytes() == DATA[:30]  # kept: the next attempt resumes it


def test_back_off_doubles_the_delay_up_to_30_s_and_gives_up_after_the_retries(tmp_path: Path, monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(f.time, "sleep", slept.append)
    part = tmp_path / "w.part"
    part.write_bytes(DATA[:30])
    progress = f.Progress(files=1, total_bytes=100, done_bytes=30)
    f._back_off(Scripted(), FILE, part, progress, f._Transient("cut"), 0, 9, 1.0)
    assert progress.done_bytes == 0 and part.exists()  # the partial bytes are counted again when it resumes
    for attempt in range(1, 7):
        f._back_off(Scripted(), FILE, part, progress, f._Transient("cut"), attempt, 9, 1.0)
    assert slept == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    with pytest.raises(f.FetchError, match=r"gave up after 10 attempts"):
        f._back_off(Scripted(), FILE, part, progress, f._Transient("cut"), 9, 9, 1.0)
    f._back_off(Scripted(), FILE, part, progress, f._Transient("bad range", restart=True), 0, 9, 1.0)
    assert not part.exists()  # a restart drops the partial file
