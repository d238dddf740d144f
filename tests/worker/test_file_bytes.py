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


def test_a_failed_read_leaves_no_request_running(data, monkeypatch):
    """On an error every other request has finished before the descriptor closes."""
    path, _ = data
    done, real = [], os.preadv

    def slow(fd, bufs, off):
        if off == 0:
            raise OSError(5, "Input/output error")
        n = real(fd, bufs, off)
        done.append(off)
        return n

    monkeypatch.setattr(file_bytes, "PIECE_BYTES", 256)
    monkeypatch.setattr(file_bytes.os, "preadv", slow)
    with pytest.raises(AdapterError, match="Input/output error") as info:
        read_file(path, max_bytes=1 << 20, chunk_bytes=1024)
    assert info.value.reason == "unreadable"
    assert len(done) == len(range(256, 5 * 1024 + 123, 256))


def test_file_bytes_of_tensors():
    fb = FileBytes([torch.arange(3, dtype=torch.uint8), torch.arange(3, 5, dtype=torch.uint8)])
    assert len(fb) == 5 and fb[1:4] == bytes([1, 2, 3])
