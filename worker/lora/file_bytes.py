"""A file read into buffers of our own by a few threads at once, handed over chunk by chunk.

An adapter's weights file is read once, here: the parser, the digest and the packing all use these
bytes. A few `preadv` requests in flight read a cold file faster than one `read()` or a mapping
touched in order, and a chunk can go on to the GPU while the next ones are still on the disk
(`on_chunk`). On the H200 machine (bench/disk_read.py, 80 MiB with the page cache dropped): one
`read()` 97-112 ms, the file mapped and touched in order 45-53 ms, 4-8 threads of 1 MiB `preadv`
39-50 ms (O_DIRECT no faster).
The buffers are ours, not the page cache's: nothing can change or truncate them under a reader.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from lorafleet.worker.lora.adapter_files import open_checked
from lorafleet.worker.lora.errors import AdapterError

PIECE_BYTES = 1 << 20  # one request
READ_THREADS = 8  # requests in flight a read (each read has its own: one read never queues behind another)


class FileBytes:
    """A file's bytes in `chunks` (uint8 tensors, back to back); sliced like `bytes` for the parser."""

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        self.chunks = chunks
        self.size = sum(c.numel() for c in chunks)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> bytes:
        begin, end, step = key.indices(self.size)
        if step != 1:
            raise ValueError("FileBytes slices take no step")
        out, offset = [], 0
        for chunk in self.chunks:
            n = chunk.numel()
            lo, hi = max(begin - offset, 0), min(end - offset, n)
            if lo < hi:
                out.append(chunk[lo:hi].numpy().tobytes())
            offset += n
            if offset >= end:
                break
        return b"".join(out)

    def buffers(self) -> list:
        """The chunks as buffers (what hashlib takes), in order."""
        return [c.numpy() for c in self.chunks]


def _read_piece(fd: int, view: memoryview, offset: int, path: Path) -> None:
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise AdapterError("bad_weights", f"{path.name} got shorter while it was being read")
        view, offset = view[n:], offset + n


class FileRead:
    """A read under way: every piece requested at once, the bytes handed over as they land.

    Slicing (`read[a:b]`, what `parse_safetensors` does) waits only for the pieces that hold those
    bytes, so a header can be parsed, and work planned, while the rest is still on the disk;
    `chunks` yields each chunk once all of it is read, in file order; `finish` waits for the end.
    Use it as a context manager: leaving waits for the requests under way, drops the others, and
    closes the file (an I/O error is AdapterError "unreadable")."""

    def __init__(self, path: Path, *, max_bytes: int, pin: bool = False, chunk_bytes: int = 0,
                 bound: Path | None = None) -> None:
        """`bound`: the real path `path` must resolve inside (`adapter_files.open_checked`: a regular
        file, never opened blocking); None: opened as it is."""
        self.path = path
        if bound is not None:
            self._fd = open_checked(path, bound, path.name)
        else:
            self._fd = _unreadable(path, lambda: os.open(path, os.O_RDONLY))
        self._pieces: list[tuple[int, int, Future]] = []  # (begin, end, request), in file order
        self._pool: ThreadPoolExecutor | None = None
        try:
            self.size = _unreadable(path, lambda: os.fstat(self._fd).st_size)
            if self.size > max_bytes:
                raise AdapterError("too_large", f"adapter weights are {self.size} bytes, over the {max_bytes}-byte cap")
            step = chunk_bytes or self.size
            self._bounds = [(b, min(b + step, self.size)) for b in range(0, self.size, step)] if self.size else []
            pieces = sum(-(-(e - b) // PIECE_BYTES) for b, e in self._bounds)
            self._pool = pool = ThreadPoolExecutor(max_workers=max(1, min(READ_THREADS, pieces)),
                                                   thread_name_prefix="adapter-read")
            # Each chunk's requests go out as soon as its buffer exists: the disk starts on the
            # first while the others are allocated (a pinned one the caching allocator has no
            # free block for costs a cudaHostAlloc).
            self.chunks_read: list[torch.Tensor] = []
            for begin, end in self._bounds:
                chunk = torch.empty(end - begin, dtype=torch.uint8, pin_memory=pin)
                self.chunks_read.append(chunk)
                view = memoryview(chunk.numpy()).cast("B")
                for lo in range(begin, end, PIECE_BYTES):
                    hi = min(lo + PIECE_BYTES, end)
                    self._pieces.append((lo, hi, pool.submit(_read_piece, self._fd, view[lo - begin : hi - begin],
                                                             lo, path)))
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> FileRead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the requests under way (none may write into a buffer, or read a closed file,
        afterwards) and drop the ones not started: a read that failed reads no further."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _wait(self, begin: int, end: int) -> None:
        for lo, hi, request in self._pieces:
            if lo < end and hi > begin:
                _unreadable(self.path, request.result)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> bytes:
        begin, end, _ = key.indices(self.size)
        self._wait(begin, end)
        return FileBytes(self.chunks_read)[key]

    def chunks(self):
        """(offset, chunk) for each chunk, in file order, as soon as all of it is read."""
        for (begin, end), chunk in zip(self._bounds, self.chunks_read):
            self._wait(begin, end)
            yield begin, chunk

    def finish(self, on_chunk: Callable[[int, int, torch.Tensor], None] | None = None) -> FileBytes:
        """Wait for the whole file (calling `on_chunk(offset, size, chunk)` for each chunk as it
        lands), check that its size did not change, and close it."""
        for begin, chunk in self.chunks():
            if on_chunk is not None:
                on_chunk(begin, self.size, chunk)
        if _unreadable(self.path, lambda: os.fstat(self._fd).st_size) != self.size:
            raise AdapterError("bad_weights", f"{self.path.name} changed size while it was being read")
        self.close()
        return FileBytes(self.chunks_read)


def _unreadable(path: Path, call: Callable):
    try:
        return call()
    except OSError as exc:
        raise AdapterError("unreadable", f"cannot read {path.name}: {exc.strerror or exc}") from None


def read_file(
    path: Path,
    *,
    max_bytes: int,
    pin: bool = False,
    chunk_bytes: int = 0,
    on_chunk: Callable[[int, int, torch.Tensor], None] | None = None,
) -> FileBytes:
    """Read `path` (at most `max_bytes`, else AdapterError "too_large") into chunks of `chunk_bytes`
    (0: one chunk), pinned if `pin`. `on_chunk(offset, size, chunk)` runs on the calling thread for
    each chunk, in file order, as soon as its bytes are all read (`size` is the file's). An I/O
    error is AdapterError "unreadable"."""
    with FileRead(path, max_bytes=max_bytes, pin=pin, chunk_bytes=chunk_bytes) as reading:
        return reading.finish(on_chunk)
