"""An adapter's weights in the slot pool's layout: pre-scaled, in the slot dtype, in the storage's order.

An adapter is laid out once, as the slots (worker/lora/slots.py) hold it (`pack_weights`;
`AdapterRegistry.read` calls its two halves, `plan_pack` while the file is still being read and
`PackPlan.run` once it is there, off the engine loop). With the file on the
GPU (a registry with CUDA slots) the layout is made there, in one `kernels/lora/scaled_copy.py` launch
per source dtype, and copied back once into the pinned host buffers. Per column, the layers
the adapter targets form runs of consecutive layers at one rank (a uniform adapter: one run of all
L layers; a rank_pattern that changes the rank, or a skipped layer, starts a new run); a run is one
contiguous piece `[n, r, in]` of A rows and one `[n, r, out]` of B's rank-major rows, so nothing
is padded. Pieces sit back to back in a few flat buffers (pinned on CUDA, each at most 16 MiB,
cut at a layer where one is full). A fill is one copy per piece, into the strided 3-D view
`A[l:l+n, slot, :r]` / `B[l:l+n, slot, :r]` (all in one `_foreach_copy_`), plus one copy of the
rank table into the pool's `[layers, slices, S]` table. For a uniform adapter on all 7 targets
that is 14 pieces plus one per buffer cut inside a piece, whatever the number of layers (7.8B seed
shape, rank 16: 18 pieces + 1 = 19 copies, was 2 x 7 x 32 + 1 = 449).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lorafleet.worker.config import FUSED_SLICES
from lorafleet.worker.lora.weights import LoraWeights, ModuleWeights, PackedLora

# Slot order of the slices in a layer: qkv's q, k, v, then o, gate, up, down (FUSED_SLICES order).
SLICE_ORDER: tuple[str, ...] = tuple(t for names in FUSED_SLICES.values() for t in names)
_COLUMN = {t: c for c, t in enumerate(SLICE_ORDER)}
# The caching host allocator rounds each pinned block up to a power of two: a few blocks of at most
# this size keep that rounding small (one 80 MiB buffer would take 128 MiB).
PINNED_CHUNK_BYTES = 16 << 20
# dtypes whose elementwise ops compute in float32 (opmath), so `b * s` in that dtype rounds exactly
# like `(b.float() * s).to(dtype)`.
_FLOAT32_OPMATH = (torch.bfloat16, torch.float16, torch.float32)
_A, _B = 0, 1  # a piece's half


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _raw(t: torch.Tensor):
    """A numpy view of `t`'s elements as same-size integers (bits and strides kept; no copy)."""
    return t.view(_INT_OF_SIZE[t.element_size()]).numpy()


def _same_bits(m: ModuleWeights, dtype: torch.dtype) -> bool:
    """A and B already in `dtype`: copied as bits (on the CPU by numpy: no intra-op thread team, no
    GIL), B scaled afterwards in place, in runs."""
    return dtype in _FLOAT32_OPMATH and all(t.dtype == dtype and not t.requires_grad for t in (m.a, m.b))


def _scaled_b_into(m: ModuleWeights, dst: torch.Tensor) -> None:
    """dst [r, out] = B^T with alpha/r folded in, rounding exactly as the old per-tensor preparation did."""
    b, s = m.b, m.scaling
    if b.dtype == dst.dtype and dst.dtype in _FLOAT32_OPMATH:
        if s == 1.0:
            dst.copy_(b.T)
        else:
            torch.mul(b.T, s, out=dst)
    elif s == 1.0 and m.a.dtype == dst.dtype:
        dst.copy_(b.T)  # converted straight to the slot dtype
    else:
        dst.copy_(b.T.float() * s)  # (b.float() * s).to(dtype)


def _pack_rows(m: ModuleWeights, half: int, rows: torch.Tensor, r: int, dtype: torch.dtype) -> None:
    """One module's A or B into its slot-layout rows on the CPU (B transposed; scaled here unless
    copied as bits, which pack_weights scales afterwards in runs)."""
    if half == _A:
        if _same_bits(m, dtype):
            _raw(rows).reshape(r, -1)[...] = _raw(m.a)
        else:
            rows.view(r, -1).copy_(m.a)
    elif _same_bits(m, dtype):
        _raw(rows).reshape(r, -1)[...] = _raw(m.b).T
    else:
        _scaled_b_into(m, rows.view(r, -1))


def _pack_rows_on_device(copies: list[tuple[torch.Tensor, ModuleWeights, int, torch.Tensor, int]],
                         dtype: torch.dtype) -> None:
    """`_pack_rows` for sources on a GPU: every plain copy (A rows, B^T as bits) in one
    `_foreach_copy_`; only a B that is converted and scaled takes ops of its own."""
    dst, src = [], []
    for _, m, half, rows, r in copies:
        if half == _A or _same_bits(m, dtype):
            dst.append(rows.view(r, -1))
            src.append(m.a if half == _A else m.b.T)
        else:
            _scaled_b_into(m, rows.view(r, -1))
    _copy_all(dst, src)


def _runs(ranks: list[int]) -> list[tuple[int, int, int]]:
    """(first layer, layers, rank) of each run of consecutive layers sharing one non-zero rank."""
    runs: list[tuple[int, int, int]] = []
    for layer, r in enumerate(ranks):
        if r and runs and runs[-1][2] == r and sum(runs[-1][:2]) == layer:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, r)
        elif r:
            runs.append((layer, 1, r))
    return runs


def _place(pieces: list[tuple[int, int, int, int, int, int]], cap: int) -> tuple[list, list[int]]:
    """Cut (column, half, layer, layers, rank, row elements) pieces into buffers of at most `cap`
    elements (0: one buffer), at layer boundaries. Returns ((buffer, offset, *piece) ..., sizes)."""
    placed, sizes = [], [0]
    for col, half, layer, count, r, per in pieces:
        while count:
            take = count if not cap else min(count, (cap - sizes[-1]) // per)
            if take <= 0:
                if sizes[-1]:
                    sizes.append(0)
                    continue
                take = 1  # one layer's rows exceed a buffer: it gets one of its own
            placed.append((len(sizes) - 1, sizes[-1], col, half, layer, take, r, per))
            sizes[-1] += take * per
            layer, count = layer + take, count - take
    return placed, sizes if placed else []


def pack_weights(
    weights: LoraWeights, num_layers: int, dtype: torch.dtype, pin: bool, chunk_bytes: int | None = None
) -> PackedLora:
    """Lay `weights` out as the slot storage holds it, in `dtype`, B transposed to rank-major and pre-scaled.

    Pieces (see the module docstring) go in order: every column's A pieces, then every column's B
    pieces, so B rows with one scaling are mostly one span, scaled by one op. Pinned buffers hold
    at most `chunk_bytes` (default PINNED_CHUNK_BYTES) unless one layer's rows are larger; an
    unpinned layout is one flat buffer. Weights already in `dtype` are copied (B transposed) as
    bits, then B is scaled in place in `dtype`, which rounds exactly as `(b.float() * s).to(dtype)`;
    other weights go through torch. Weights on a GPU are laid out there and copied back
    (`PackPlan.run`, waited for here; the GPU copy is not kept).
    """
    packed, staged = plan_pack(weights, num_layers, dtype, pin, chunk_bytes).run()
    if staged is not None:
        torch.cuda.current_stream(staged.device).synchronize()
        packed.release_gpu()
    return packed


@dataclass(slots=True)
class PackPlan:
    """`pack_weights` up to the first read of the weights: buffers, views and the copies to make.

    A plan can be made while the weights' bytes are still on their way (`load_adapter` on a GPU)."""

    packed: PackedLora  # over the host buffers, not filled yet
    staged: torch.Tensor | None  # for weights on a GPU: the host buffers' contents, back to back, there
    # (source, module, half, rows, r), and [buffer, begin, end, scaling] over B rows to scale in
    # place after the copies; both empty when `launches` make the copies and the scaling
    copies: list[tuple[torch.Tensor, ModuleWeights, int, torch.Tensor, int]]
    scale_runs: list[list]
    # For weights on a GPU that all view one buffer (a file read there): every copy, scaled and
    # cast, in one `scaled_copies` launch per source dtype: (source as a flat tensor, table, scales,
    # largest copy), the tables already on the GPU.
    launches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]] = field(default_factory=list)
    # Weights on a GPU with no room there for `staged`: copied into the host buffers one by one.
    device_sources: torch.device | None = None

    def run(self) -> tuple[PackedLora, torch.Tensor | None]:
        """`lay_out`, then `copy_back`. Returns (packed, staged)."""
        staged = self.lay_out()
        self.copy_back()
        return self.packed, staged

    def lay_out(self) -> torch.Tensor | None:
        """Make the copies. Weights on a GPU are laid out in `staged` there, on the current stream,
        not waited for (`packed.gpu_ready` marks the end; `packed.gpu_sources` are its pieces);
        otherwise into the host buffers. Returns `staged`."""
        dtype, staged = self.packed.dtype, self.staged
        sizes = [c.numel() for c in self.packed.chunks]
        buffers = list(staged.split(sizes)) if staged is not None else self.packed.chunks
        if self.launches:
            from lorafleet.kernels.lora.scaled_copy import scaled_copies

            for src, table, scales, largest in self.launches:
                scaled_copies(src, staged, table, scales, largest)
        else:
            if staged is not None or self.device_sources is not None:
                _pack_rows_on_device(self.copies, dtype)
                if staged is None:  # copies to the host: done before the scaling below touches them
                    torch.cuda.current_stream(self.device_sources).synchronize()
            else:
                # In the sources' memory order: for an adapter read from its file (`load_adapter`)
                # that is the file's order, so the copies walk the bytes read front to back.
                for _, m, half, rows, r in sorted(self.copies, key=lambda c: c[0].data_ptr()):
                    _pack_rows(m, half, rows, r, dtype)
            for ci, begin, end, scaling in self.scale_runs:
                buffers[ci][begin:end].mul_(scaling)
        if staged is not None:
            self.packed.gpu_ready = _recorded(staged.device)
        return staged

    def copy_back(self) -> None:
        """After `lay_out`: a layout on the GPU is copied into the host buffers on the current
        stream, not waited for (`packed.host_ready` marks the end)."""
        staged = self.staged
        if staged is None:
            return
        for host, dev in zip(self.packed.chunks, staged.split([c.numel() for c in self.packed.chunks])):
            host.copy_(dev, non_blocking=True)
        self.packed.host_ready = _recorded(staged.device)


def _recorded(device: torch.device) -> torch.cuda.Event:
    """An event recorded now on `device`'s current stream."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _launches(copies: list, staged: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
    """`PackPlan.launches` for `copies` into `staged`, or [] where one launch cannot make them
    (sources in more than one buffer, or not float16 / bfloat16 / float32)."""
    from lorafleet.kernels.lora.scaled_copy import FLOAT_DTYPES

    if not copies or staged.dtype not in FLOAT_DTYPES:
        return []
    storage = copies[0][0].untyped_storage()
    base, end, out_size = storage.data_ptr(), storage.data_ptr() + storage.nbytes(), staged.element_size()
    groups: dict[torch.dtype, tuple[list, list, list]] = {}
    for source, m, half, rows, r in copies:  # plain arithmetic on pointers: this runs ~900 times a load
        ptr, size = source.data_ptr(), source.element_size()
        if source.dtype not in FLOAT_DTYPES or not base <= ptr < end or (ptr - base) % size:
            return []
        if half == _A:  # A [r, in] as it is
            row_stride, col_stride = source.stride()
            cols, scale = source.shape[1], 1.0
        else:  # B [out, r] read as B^T [r, out]
            col_stride, row_stride = source.stride()
            cols, scale = source.shape[0], m.scaling
        table, scales, largest = groups.setdefault(source.dtype, ([], [], [0]))
        table.append(((ptr - base) // size, (rows.data_ptr() - staged.data_ptr()) // out_size, r, cols,
                      row_stride, col_stride))
        scales.append(scale)
        largest[0] = max(largest[0], r * cols)
    out = []
    for dtype, (table, scales, largest) in groups.items():
        if storage.nbytes() % dtype.itemsize:
            return []
        src = torch.empty(0, dtype=dtype, device=staged.device).set_(storage, 0, (storage.nbytes() // dtype.itemsize,))
        try:
            out.append((src, _to(torch.tensor(table, dtype=torch.int64), staged.device),
                        _to(torch.tensor(scales, dtype=torch.float32), staged.device), largest[0]))
        except torch.cuda.OutOfMemoryError:  # not even room for the tables: copy by copy
            return []
    return out


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: through pinned memory, not waited for, onto a GPU."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def plan_pack(
    weights: LoraWeights, num_layers: int, dtype: torch.dtype, pin: bool, chunk_bytes: int | None = None
) -> PackPlan:
    """Everything `pack_weights` does before it reads the weights (see PackPlan)."""
    if chunk_bytes is None:
        chunk_bytes = PINNED_CHUNK_BYTES if pin else 0
    cap = chunk_bytes // torch.empty((), dtype=dtype).element_size() if chunk_bytes else 0
    n = len(SLICE_ORDER)
    table = [[0] * n for _ in range(num_layers)]
    dims = {}  # column -> (in, out)
    device = torch.device("cpu")
    for (layer, target), m in weights.modules.items():
        table[layer][_COLUMN[target]] = m.a.shape[0]
        dims[_COLUMN[target]] = (m.a.shape[1], m.b.shape[0])
        if m.a.is_cuda:
            device = m.a.device
    ranks = torch.tensor(table, dtype=torch.int32).reshape(num_layers, n)
    if pin:
        ranks = ranks.pin_memory()
    runs = {c: _runs([row[c] for row in table]) for c in sorted(dims)}
    pieces = [(c, half, layer, count, r, r * dims[c][half])
              for half in (_A, _B) for c, col_runs in runs.items() for layer, count, r in col_runs]
    placed, sizes = _place(pieces, cap)
    chunks = [torch.empty(size, dtype=dtype, pin_memory=pin) for size in sizes]
    staged = _device_buffer(sum(sizes), dtype, device) if device.type == "cuda" else None
    targets = list(staged.split(sizes)) if staged is not None else chunks
    halves: dict[int, list] = {}  # k -> [A rows, B rows]
    layout, sources, gpu_sources = [], [], []
    scale_runs: list[list] = []
    copies = []
    for ci, off, col, half, layer, count, r, per in placed:
        chunk = chunks[ci]
        sources.append(chunk[off : off + count * per].view(count, r, per // r))
        if staged is not None:
            gpu_sources.append(targets[ci][off : off + count * per].view(count, r, per // r))
        layout.append((col, half, layer, count, r))
        for i in range(count):
            k, m = (layer + i) * n + col, weights.modules[(layer + i, SLICE_ORDER[col])]
            begin = off + i * per
            halves.setdefault(k, [None, None])[half] = chunk[begin : begin + per]
            rows = targets[ci][begin : begin + per]
            copies.append((m.a if half == _A else m.b, m, half, rows, r))
            if half == _B and _same_bits(m, dtype) and m.scaling != 1.0:
                last = scale_runs[-1] if scale_runs else None
                if last and last[0] == ci and last[2] == begin and last[3] == m.scaling:
                    last[2] = begin + per
                else:
                    scale_runs.append([ci, begin, begin + per, m.scaling])
    blocks = [(k, table[k // n][k % n], a, b) for k, (a, b) in sorted(halves.items())]
    views = {(k // n, SLICE_ORDER[k % n]): ModuleWeights(a=a.view(r, -1), b=b.view(r, -1).T, scaling=1.0)
             for k, r, a, b in blocks}
    packed = PackedLora(dtype=dtype, pinned=pin, chunks=chunks, blocks=blocks, ranks=ranks, views=views,
                        layout=tuple(layout), sources=sources, gpu_sources=gpu_sources if staged is not None else None)
    launches = _launches(copies, staged) if staged is not None else []
    if launches:  # they make every copy and scaling: the ~900 row views go now, not after the load's last byte
        copies, scale_runs = [], []
    return PackPlan(packed=packed, staged=staged, copies=copies, scale_runs=scale_runs, launches=launches,
                    device_sources=device if device.type == "cuda" and staged is None else None)


def _device_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """A flat buffer on the GPU to lay an adapter out in, or None if there is no room for it."""
    try:
        return torch.empty(numel, dtype=dtype, device=device)
    except torch.cuda.OutOfMemoryError:
        return None


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i], non_blocking=True) for all i, looped in C++ where torch has `_foreach_copy_`."""
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        try:
            foreach(dst, src, non_blocking=True)
            return
        except torch.cuda.OutOfMemoryError:
            raise  # no room to stage a strided copy: the caller decides
        except (RuntimeError, TypeError, NotImplementedError):  # an older torch: the plain loop (idempotent)
            pass
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=True)
