"""`file_bytes.read_file`: a file read by several threads into chunks, handed over in file order."""

from __future__ import annotations

import os

import pytest
import torch

from lorafleet.worker.lora import file_bytes
from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.file_bytes import FileBytes, read_file


@pytest.fixture
def data(tmp_path):
    blob = os.urandom(5 * 1024 + 123)
    path = tmp_path / "blob"
    path.write_bytes(blob)
    return path, blob


@pytest.mark.parametrize("chunk_bytes, piece_bytes", [(0, 1 << 20), (1024, 100), (4096, 4096), (7000, 333)])
def test_chunks_hold_the_file_and_arrive_in_order(data, chunk_bytes, piece_bytes, monkeypatch):
    path, blob = data
    monkeypatch.setattr(file_bytes, "PIECE_BYTES", piece_bytes)  # many requests a chunk, some cut inside one
    seen = []
    got = read_file(path, max_bytes=1 << 20, chunk_bytes=chunk_bytes,
                    on_chunk=lambda off, size, chunk: seen.append((off, size, chunk.numpy().tobytes())))
    assert b"".join(c.numpy().tobytes() for c in got.chunks) == blob and len(got) == len(blob)
    assert [off for off, _, _ in seen] == sorted(off for off, _, _ in seen)
    assert all(size == len(blob) and blob[off : off + len(b)] == b for off, size, b in seen)
    assert b"".join(b for _, _, b in seen) == blob
    step = chunk_bytes or len(blob)
    assert [c.numel() for c in got.chunks[:-1]] == [step] * (len(got.chunks) - 1)
    assert b"".join(bytes(buf) for buf in got.buffers()) == blob  # what the digest hashes


def test_slices_read_across_chunks(data):
    path, blob = data
    got = read_file(path, max_bytes=1 << 20, chunk_bytes=1000)
    for lo, hi in [(0, 8), (995, 1010), (10, 4000), (5000, 99999), (3000, 3000), (-9, None)]:
        assert got[lo:hi] == blob[lo:hi], (lo, hi)
    with pytest.raises(ValueError):
        got[0:10:2]


def test_empty_file_and_the_size_cap(tmp_path, data):
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    got = read_file(empty, max_bytes=10)
    assert got.chunks == [] and len(got) == 0 and got[:8] == b""
    path, blob = data
    with pytest.raises(AdapterError) as info:
        read_file(path, max_bytes=len(blob) - 1)
    assert info.value.reason == "too_large" and str(len(blob)) in str(info.value)


def test_a_file_that_shrinks_under_the_read_is_refused(data, monkeypatch):
    """A request that hits the end early means the file got shorter: refused, not half-read."""
    path, blob = data
    real = os.preadv
    monkeypatch.setattr(file_bytes, "PIECE_BYTES", 512)
    monkeypatch.setattr(file_bytes.os, "preadv", lambda fd, bufs, off: 0 if off >= 4096 else real(fd, bufs, off))
    with pytest.raises(AdapterError, match="got shorter") as info:
        read_file(path, max_bytes=1 << 20, chunk_bytes=1024)
    assert info.value.reason == "bad_weights"


def test_short_reads_are_resumed(data, monkeypatch):
    """preadv may return fewer bytes than asked: the rest is asked for again."""
    path, blob = data
    real = os.preadv
    monkeypatch.setattr(file_bytes.os, "preadv", lambda fd, bufs, off: real(fd, [bufs[0][:7]], off))
    got = read_file(path, max_bytes=1 << 20, chunk_bytes=2048)
    assert b"".join(c.numpy().tobytes() for c in got.chunks) == blob


def test_a_failed_read_stops_and_leaves_no_request_running(data, monkeypatch):
    """On an error the requests not started are dropped, and those under way finish before the
    call returns: none writes into a buffer, or reads the file, afterwards."""
    import time

    path, _ = data
    done, real = [], os.preadv

    def slow(fd, bufs, off):
        if off == 0:
            raise OSError(5, "Input/output error")
        time.sleep(0.01)
        n = real(fd, bufs, off)
        done.append(off)
        return n

    monkeypatch.setattr(file_bytes, "PIECE_BYTES", 64)
    monkeypatch.setattr(file_bytes.os, "preadv", slow)
    with pytest.raises(AdapterError, match="Input/output error") as info:
        read_file(path, max_bytes=1 << 20, chunk_bytes=1024)
    assert info.value.reason == "unreadable"
    after = len(done)
    time.sleep(0.1)
    assert len(done) == after  # nothing ran on after the call
    assert after < len(range(64, 5 * 1024 + 123, 64)) // 2  # most of the file was never asked for


def test_a_file_that_grows_under_the_read_is_refused(data, monkeypatch):
    path, _ = data
    real, grown = file_bytes._read_piece, []

    def piece(fd, view, offset, p):
        if not grown:
            grown.append(True)
            with open(path, "ab") as f:
                f.write(b"more")
        real(fd, view, offset, p)

    monkeypatch.setattr(file_bytes, "_read_piece", piece)
    with pytest.raises(AdapterError, match="changed size") as info:
        read_file(path, max_bytes=1 << 20, chunk_bytes=1024)
    assert info.value.reason == "bad_weights"


def test_reads_do_not_queue_behind_each_other(tmp_path, monkeypatch):
    """Each read has its own requests in flight: a small read started while a slow big one is
    under way finishes long before it."""
    import threading
    import time

    big, small = tmp_path / "big", tmp_path / "small"
    big.write_bytes(os.urandom(64 * 4096))
    small.write_bytes(os.urandom(100))
    real = os.preadv

    def slow(fd, bufs, off):
        if os.fstat(fd).st_size > 1000:
            time.sleep(0.02)
        return real(fd, bufs, off)

    monkeypatch.setattr(file_bytes, "PIECE_BYTES", 4096)
    monkeypatch.setattr(file_bytes.os, "preadv", slow)
    t = threading.Thread(target=read_file, args=(big,), kwargs={"max_bytes": 1 << 20})
    t.start()
    time.sleep(0.01)
    t0 = time.perf_counter()
    assert read_file(small, max_bytes=1 << 20)[:] == small.read_bytes()
    took = time.perf_counter() - t0
    t.join()
    assert took < 0.1  # the big read's 64 pieces at 20 ms over 8 threads take ~160 ms


def test_file_bytes_of_tensors():
    fb = FileBytes([torch.arange(3, dtype=torch.uint8), torch.arange(3, 5, dtype=torch.uint8)])
    assert len(fb) == 5 and fb[1:4] == bytes([1, 2, 3])
