"""bench/engine.py and bench/prefill.py end to end on CPU (`--tiny`): the scripts run, write their
JSON, and measure what they say they measure (every prompt prefilled from scratch, no part lost to
an error row).

The GPU numbers come from the same script (`bash bench/gpu_engine.sh`), so a broken or misleading
benchmark shows here first: a TTFT that re-sent one prompt once read a prefix-cache hit as a prefill.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(tmp_path: Path, module: str, *args: str) -> dict:
    """`python -m bench.<module> --tiny ... --out F` in a subprocess -> the JSON it wrote."""
    out = tmp_path / f"{module}.json"
    # `bench` importable without the repo root on sys.path (its operator/ would shadow the stdlib's).
    path = tmp_path / "path"
    if not path.exists():
        path.mkdir()
        (path / "bench").symlink_to(ROOT / "bench")
    env = {**os.environ, "PYTHONPATH": str(path), "PYTHONSAFEPATH": "1"}
    cmd = [sys.executable, "-m", f"bench.{module}", "--tiny", *args, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_tiny_engine_benchmark(tmp_path: Path) -> None:
    data = run_bench(tmp_path, "engine", "--adapters", "1,2", "--prompt-lens", "16", "--new-tokens", "4",
                     "--breakdown", "2")
    rows = data["rows"]
    assert {(r["mode"], r["adapters"]) for r in rows} == {(m, d) for m in ("graphs", "async") for d in (0, 1, 2)}
    assert all(r["tokens_per_s"] > 0 and r["prefix_hit_tokens"] == 0 for r in rows)
    assert all(r["vs_base"] == 1.0 for r in rows if r["adapters"] == 0)
    assert len(data["ttft_ms_512_runs"]) == 5 and data["ttft_ms_512"] in data["ttft_ms_512_runs"]
    assert data["ttft_host"] and data["breakdown"] and "error" not in data["breakdown"][0]
    assert data["async_scheduling"]["overlapped"] > 0  # the async mode really pipelined steps



@pytest.mark.slow
def test_tiny_prefill_benchmark(tmp_path: Path) -> None:
    """bench/prefill.py: a burst of fresh prompts and one prompt joining running decodes, per length
    (it raises if any prompt hit the prefix cache)."""
    data = run_bench(tmp_path, "prefill", "--batch", "8", "--prompt-lens", "16,150", "--repeats", "1")
    assert [r["prompt_len"] for r in data["rows"]] == [16, 150]
    assert all(r["burst_ms"] > 0 and r["join_ms"] > 0 for r in data["rows"])
    assert data["ttft_512_first_ms"] > 0 and data["ttft_512_then_ms"] > 0


def test_disk_read_benchmark(tmp_path: Path) -> None:
    """bench/disk_read.py on a small file: every strategy timed, each trial from a dropped cache."""
    out = tmp_path / "disk.json"
    path = tmp_path / "path"
    path.mkdir()
    (path / "bench").symlink_to(ROOT / "bench")
    env = {**os.environ, "PYTHONPATH": str(path), "PYTHONSAFEPATH": "1"}
    cmd = [sys.executable, "-m", "bench.disk_read", "--mib", "4", "--repeats", "1", "--dir", str(tmp_path),
           "--out", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    try:  # O_DIRECT rows where this file system takes it (tmpfs refuses it)
        os.close(os.open(out, os.O_RDONLY | os.O_DIRECT))
        direct = {"threads O_DIRECT"}
    except (AttributeError, OSError):
        direct = set()
    assert {r["strategy"] for r in rows} == {"read()", "mmap, touched", "fadvise, then mmap", "threads pread",
                                            "threads + mmap", *direct}
    assert all(r["ms_median"] > 0 and len(r["ms_all"]) == 1 and 0 <= r["cached_max"] <= 1 for r in rows)
    assert not list(tmp_path.glob("disk-read-*"))  # its file and folder are removed


def test_tiny_sampling_decode_benchmark(tmp_path: Path) -> None:
    """bench/sampling_decode.py: every case each repeat, a positive rate; the host-token cases ran as
    they say: deferred sampling on the async path, or synchronous steps."""
    data = run_bench(tmp_path, "sampling_decode", "--batch", "4", "--prompt-len", "8", "--new-tokens", "6")
    rows = data["rows"]
    assert len(rows) == 2 * len({(r["group"], r["mode"], r["variant"], r["draw"]) for r in rows})
    assert all(r["tokens_per_s"] > 0 for r in rows)
    cases = {(r["group"], r["mode"], r["variant"]) for r in rows}
    # a process a draw (LORAFLEET_SAMPLER), each with its greedy baseline
    assert {r["draw"] for r in rows if r["mode"] == "greedy"} == {"torch", "triton"}
    assert all(r["variant"] == r["draw"] for r in rows if r["group"] == "sampling" and r["mode"] != "greedy")
    assert {("sampling", "greedy", "-"), ("sampling", "top_p_0.9", "triton"), ("sampling", "top_p_0.9", "torch"),
            ("edits", "logit_bias", "-"), ("edits", "penalties", "-")} <= cases
    hosts = [r for r in rows if r["group"] == "host_tokens"]
    assert {r["mode"] for r in hosts} == {"regex 1/4"} and len(hosts) == 4  # 8 and 64 exceed the batch
    assert all(r["deferred_steps"] > 0 for r in hosts if r["variant"] == "deferred")
    assert all(r["overlapped_steps"] == 0 for r in hosts if r["variant"] == "synchronous")
    assert all(r["overlapped_steps"] > 0 and r["deferred_steps"] == 0 for r in rows if r["group"] != "host_tokens")


def test_tiny_mask_fill_benchmark(tmp_path: Path) -> None:
    """bench/mask_fill.py: every grammar, row count and way, a positive time."""
    pytest.importorskip("xgrammar")
    data = run_bench(tmp_path, "mask_fill", "--threads", "1,2")
    ways = {(r["grammar"], r["rows"], r["way"]) for r in data["rows"]}
    assert len(ways) == len(data["rows"]) == 2 * 4 * 3 and all(r["us_per_row"] > 0 for r in data["rows"])
