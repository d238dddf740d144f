"""`scaled_copies` (kernels/lora/scaled_copy.py) against its torch reference, bit for bit.

Without CUDA the kernel runs in the Triton interpreter (conftest.py). Cases: A-like row copies and
B-like transposed ones, scales of 1 and not, every pair of bf16 / fp16 / fp32 source and
destination, copies longer than a program's block and shorter, several copies into one buffer in
any order, and bad arguments refused. `@pytest.mark.gpu`: the seed shape's 448 copies of a rank-16
adapter, compiled.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lorafleet.kernels.lora.scaled_copy import BLOCK, scaled_copies, scaled_copies_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def layout(shapes, gen) -> tuple[list[list[int]], int, int, int]:
    """A table over `shapes` [(rows, cols, transposed)], sources back to back, destinations shuffled."""
    table, src_off, dst_offs = [], 0, []
    sizes = [r * c for r, c, _ in shapes]
    order = torch.randperm(len(shapes), generator=gen).tolist()
    at = 0
    for k in order:
        dst_offs.append((k, at))
        at += sizes[k]
    dst_of = dict(dst_offs)
    for k, (rows, cols, transposed) in enumerate(shapes):
        # the source as stored: [rows, cols], or [cols, rows] read transposed
        strides = (1, rows) if transposed else (cols, 1)
        table.append([src_off, dst_of[k], rows, cols, *strides])
        src_off += rows * cols + 3  # gaps between sources
    return table, src_off, at, max(sizes)


@pytest.mark.parametrize("src_dtype, dst_dtype", list(itertools.product(DTYPES, DTYPES)))
def test_kernel_equals_the_reference(src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(0)
    shapes = [(3, 5, False), (7, 5, True), (1, BLOCK + 9, False), (4, BLOCK // 2 + 1, True), (16, 33, True),
              (2, 1, False)]
    table, src_n, dst_n, biggest = layout(shapes, gen)
    src = (torch.randn(src_n, generator=gen) * 3).to(src_dtype).to(DEVICE)
    scales = torch.tensor([1.0, 0.37, 1.0, 2.5, 1 / 3, -1.0], dtype=torch.float32)
    table_t = torch.tensor(table, dtype=torch.int64)
    want = torch.full((dst_n,), float("nan"), dtype=dst_dtype)
    scaled_copies_reference(src.cpu(), want, table_t, scales)
    got = torch.full((dst_n,), float("nan"), dtype=dst_dtype, device=DEVICE)
    scaled_copies(src, got, table_t.to(DEVICE), scales.to(DEVICE), biggest)
    assert torch.equal(got.cpu().view(torch.uint8), want.view(torch.uint8))
    assert not want.isnan().any()  # every destination element was written (the layout has no holes)


@pytest.mark.parametrize("max_blocks", [1, 2])
def test_programs_stride_over_copies_longer_than_the_grid(max_blocks, monkeypatch):
    """Past MAX_BLOCKS programs a copy, each program walks several blocks of it."""
    from lorafleet.kernels.lora import scaled_copy

    monkeypatch.setattr(scaled_copy, "MAX_BLOCKS", max_blocks)
    gen = torch.Generator().manual_seed(2)
    shapes = [(3, 2 * BLOCK + 5, False), (5, BLOCK + 1, True), (2, 3, False)]
    table, src_n, dst_n, biggest = layout(shapes, gen)
    src = torch.randn(src_n, generator=gen).to(DEVICE)
    table_t, scales = torch.tensor(table, dtype=torch.int64), torch.tensor([1.0, 0.5, 3.0])
    want = torch.full((dst_n,), float("nan"))
    scaled_copies_reference(src.cpu(), want, table_t, scales)
    got = torch.full((dst_n,), float("nan"), device=DEVICE)
    scaled_copies(src, got, table_t.to(DEVICE), scales.to(DEVICE), biggest)
    assert torch.equal(got.cpu(), want)


def test_bf16_rounding_of_special_values_is_torchs():
    """Ties to even, overflow to Inf, Inf, NaN, subnormals, -0: the kernel's bf16 rounding is torch's."""
    values = [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38, -3.39e38, float("inf"), float("-inf"), 1e-40, -1e-39,
              -0.0, 0.0, 65504.0, 2**-126, float("nan")]
    src = torch.tensor(values, dtype=torch.float32)
    table = torch.tensor([[0, 0, 1, len(values), len(values), 1]], dtype=torch.int64)
    got = torch.empty(len(values), dtype=torch.bfloat16, device=DEVICE)
    scaled_copies(src.to(DEVICE), got, table.to(DEVICE), torch.ones(1, device=DEVICE), len(values))
    want = src.to(torch.bfloat16)
    got = got.cpu()
    assert torch.equal(got[:-1].view(torch.int16), want[:-1].view(torch.int16))
    assert got[-1].isnan()


def test_reference_is_torchs_rounding():
    """What the adapter packing did with torch ops: A copied (cast), B^T times s, one rounding."""
    a = torch.randn(4, 6, dtype=torch.float32)
    b = torch.randn(6, 4, dtype=torch.bfloat16)
    src = torch.cat([a.reshape(-1).to(torch.float32), b.reshape(-1).float()])  # one source dtype: fp32
    dst = torch.empty(48, dtype=torch.bfloat16)
    table = torch.tensor([[0, 0, 4, 6, 6, 1], [24, 24, 4, 6, 1, 4]], dtype=torch.int64)
    scaled_copies_reference(src, dst, table, torch.tensor([1.0, 0.75]))
    assert torch.equal(dst[:24].view(4, 6), a.to(torch.bfloat16))
    assert torch.equal(dst[24:].view(4, 6), (b.T.float() * 0.75).to(torch.bfloat16))
    assert torch.equal(dst[24:].view(4, 6), torch.mul(b.T, 0.75))  # bf16 mul rounds the same


def test_empty_table_is_a_no_op():
    dst = torch.zeros(4, device=DEVICE)
    scaled_copies(torch.ones(4, device=DEVICE), dst, torch.empty(0, 6, dtype=torch.int64, device=DEVICE),
                  torch.empty(0, device=DEVICE), 0)
    assert not dst.any()


@pytest.mark.parametrize("bad", ["int_src", "2d", "table_dtype", "table_cols", "scales_len", "scales_dtype"])
def test_bad_arguments_are_refused(bad):
    src, dst = torch.ones(8), torch.zeros(8)
    table, scales = torch.tensor([[0, 0, 2, 2, 2, 1]]), torch.ones(1)
    if bad == "int_src":
        src = src.int()
    elif bad == "2d":
        dst = dst.view(2, 4)
    elif bad == "table_dtype":
        table = table.int()
    elif bad == "table_cols":
        table = table[:, :5]
    elif bad == "scales_len":
        scales = torch.ones(2)
    elif bad == "scales_dtype":
        scales = scales.double()
    with pytest.raises(ValueError):
        scaled_copies(src, dst, table, scales, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_seed_shape_adapter_in_one_launch():
    """32 layers x 7 targets of rank 16 (A [16, in], B [out, 16] read transposed), bf16 -> bf16."""
    gen = torch.Generator().manual_seed(1)
    dims = [(4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)]
    shapes = [s for _ in range(32) for i, o in dims for s in ((16, i, False), (16, o, True))]
    table, src_n, dst_n, biggest = layout(shapes, gen)
    src = torch.randn(src_n, generator=gen).to(torch.bfloat16).cuda()
    scales = torch.rand(len(shapes), generator=gen) + 0.5
    table_t = torch.tensor(table, dtype=torch.int64)
    want = torch.empty(dst_n, dtype=torch.bfloat16)
    scaled_copies_reference(src.cpu(), want, table_t, scales)
    got = torch.empty(dst_n, dtype=torch.bfloat16, device="cuda")
    scaled_copies(src, got, table_t.cuda(), scales.cuda(), biggest)
    assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_adapter_packing_table(dtype, demo_adapters, demo_model, tmp_path):
    """`slots._launches`, the table the adapter packing launches this kernel with, lays out a real
    PEFT file (read as load_adapter reads it: views of one buffer) exactly as the host packing does:
    A as it is, B transposed and scaled, cast to the slot dtype (a fp32 file and a bf16 one)."""
    from safetensors.torch import load_file, save_file

    from lorafleet.worker.config import ModelConfig
    from lorafleet.worker.lora import packing
    from lorafleet.worker.lora.adapter import load_adapter

    model = ModelConfig.from_folder(demo_model)
    bf16 = tmp_path / "bf16"
    bf16.mkdir()
    src = demo_adapters["code"]  # rsLoRA: scalings are not 1
    (bf16 / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(src / "adapter_model.safetensors")).items()},
              str(bf16 / "adapter_model.safetensors"))
    for folder in (src, bf16):
        want = packing.pack_weights(load_adapter(folder, model, 64, 1 << 30), model.num_layers, dtype, pin=False)
        # On a GPU the file is read there (one raw copy), as the registry reads it; here on the host.
        weights = load_adapter(folder, model, 64, 1 << 30, prepare=lambda w: (lambda: None),
                               device=torch.device(DEVICE))
        plan = packing.plan_pack(weights, model.num_layers, dtype, pin=False)
        flat = plan.staged if plan.staged is not None else plan.packed.chunks[0]  # the one flat buffer
        launches = plan.launches or packing._launches(plan.copies, flat)  # (a plan with launches keeps no copies)
        assert len(launches) == 1 and flat.device.type == DEVICE
        flat.fill_(float("nan"))
        for source, table, scales, largest in launches:
            scaled_copies(source, flat, table, scales, largest)
        assert torch.equal(flat.cpu().view(torch.uint8), want.chunks[0].view(torch.uint8)), folder.name
