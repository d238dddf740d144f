"""bench/adapter_load.py on the tiny CPU shape: every case runs through the registry's own methods,
reports what its docstring says, and leaves the engine as it found it.

The issue-9 figures (disk -> GPU, CPU -> GPU) come from this module on the H200 (`--adapter-load` in
bench/engine.py runs the same load_rows()), so a case that silently stopped measuring shows here.
"""

from __future__ import annotations

import pytest


def drops_page_cache(where) -> bool:
    """Whether this file system lets posix_fadvise DONTNEED drop a file's pages (tmpfs does not)."""
    from bench.adapter_folder import cached_fraction, write_folder
    from lorafleet.worker.lora.adapter import WEIGHTS_FILE

    probe = where / "probe"
    write_folder(probe, {}, rank=1, drop_cache=True)
    return cached_fraction(probe / WEIGHTS_FILE) == 0.0


@pytest.fixture
def tiny_engine(bench_importable):
    from bench.adapter_load import build_engine

    return build_engine(tiny=True, max_lora_rank=16)


def test_every_case_is_measured_and_the_engine_is_left_as_found(tiny_engine, tmp_path) -> None:
    from bench.adapter_load import load_rows

    engine, model_config, device = tiny_engine
    names, resident = engine.registry.names(), engine.registry.gpu_resident()
    rows = load_rows(engine, model_config, device, repeats=2, workdir=tmp_path)

    by_case = {r["case"]: r for r in rows}
    assert len(by_case) == len(rows) == 13
    assert by_case["disk->gpu"]["target_ms"] == 50.0 and by_case["cpu->gpu"]["target_ms"] == 5.0
    measured = [r for r in rows if r["repeats"]]
    # CPU has no side stream, so only the prefetch copy's own row stays unmeasured
    assert [r["case"] for r in rows if not r["repeats"]] == ["prefetch copy (side stream, overlapping the step)"]
    for r in measured:
        assert len(r["ms_all"]) == r["repeats"] >= 2, r["case"]
        lo, hi = min(r["ms_all"]) - 0.01, max(r["ms_all"]) + 0.01  # (ms_all is rounded to 0.01 ms)
        assert 0 < lo <= r["ms_median"] <= r["ms_p90"] <= hi, r["case"]
    # the adapter is the tiny shape's rank-16 adapter on all 7 projections, the same in every case
    assert len({r["adapter_mib"] for r in rows if r["case"] != "disk read alone (read_file, page cache dropped)"}) == 1
    # a load's parts add up to no more than the whole
    cold = by_case["disk->gpu"]
    assert cold["read_ms_median"] + cold["register_ms_median"] <= cold["ms_median"]
    assert 0 < cold["disk_ms_median"] <= cold["read_ms_median"] and 0 < cold["after_disk_ms_median"] < cold["ms_median"]
    assert by_case["disk->gpu, page cache warm"]["cached_fraction_median"] == 1.0
    assert cold["cached_fraction_median"] == (0.0 if drops_page_cache(tmp_path) else 1.0)
    assert cold["gpu_evictions"] == 0 and by_case["decode step, prefetch each step"]["prefetched"] == 2
    # every adapter it loaded was unloaded again, and its folders removed
    assert engine.registry.names() == names and engine.registry.gpu_resident() == resident
    assert not engine.has_unfinished() and not list(tmp_path.glob("adapter-load-*"))


def test_a_busy_engine_is_refused(tiny_engine, tmp_path) -> None:
    from bench.adapter_load import load_rows
    from bench.engine_workload import fresh_prompt
    from lorafleet.worker.engine.sequence import SamplingParams

    engine, model_config, device = tiny_engine
    engine.add_request(fresh_prompt(engine, 8), SamplingParams(max_tokens=2), ())
    with pytest.raises(RuntimeError, match="idle engine"):
        load_rows(engine, model_config, device, repeats=1, workdir=tmp_path)


def test_piece_clock_notes_every_piece_of_a_read_without_patching(bench_importable, tmp_path) -> None:
    """PieceClock sees each read request's end (a profile hook on the read's threads) and leaves
    `file_bytes` as it was; after it, reads are no longer noted."""
    import time

    from bench.adapter_load_cases import PieceClock
    from lorafleet.worker.lora import file_bytes

    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * (3 * file_bytes.PIECE_BYTES // 256 + 7))
    before = file_bytes._read_piece
    t0 = time.perf_counter()
    with PieceClock() as clock:
        got = file_bytes.read_file(path, max_bytes=1 << 30)
    assert file_bytes._read_piece is before
    assert len(clock.ends) == 4 and t0 < clock.last <= time.perf_counter()
    assert got[0:len(got)] == path.read_bytes()
    file_bytes.read_file(path, max_bytes=1 << 30)
    assert len(clock.ends) == 4
