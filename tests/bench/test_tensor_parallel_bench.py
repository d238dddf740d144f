"""bench/tensor_parallel.py --one-gpu-shard (one rank's shard alone on one device, its collectives
replaced by local copies): the mode the GPU run uses, as a CPU smoke run on the tiny shape."""

from __future__ import annotations

import json


def test_one_gpu_shard_runs_on_cpu(bench_importable, tmp_path):
    from bench.tensor_parallel import main

    out = tmp_path / "shard.json"
    main(["--one-gpu-shard", "--tp", "4", "--tiny", "--device", "cpu", "--steps", "1", "--adapters", "0,8",
          "--hbm-gbps", "100", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["one_gpu_shard"] and "not NCCL" in report["collectives"]
    assert [r["adapters"] for r in report["rows"]] == [0, 8]
    assert all(r["tp"] == 4 and r["tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0 for r in report["rows"])
