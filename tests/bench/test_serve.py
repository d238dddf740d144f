"""bench/serve.py's weights kinds: the FP8 worker's command line, rows and engine figures kept apart by
`weights` through --merge, the GPU pieces' commands, and a CPU run of the FP8 piece's logic (the tiny
model, the torch reference FP8 path) added to a JSON written before FP8 rows existed."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest


def parse(*argv: str):
    from bench.serve import parse as serve_parse

    return serve_parse(list(argv))


def test_explicit_loads_beside_quick_are_kept(bench_importable) -> None:
    args = parse("--quick", "--adapters", "0,8", "--weights", "fp8", "--seconds", "5")
    assert (args.concurrency, args.adapters, args.prompts, args.poisson) == ([64], [0, 8], [128], [0.7])
    assert (args.weights, args.seconds, args.warmup) == (["fp8"], 5.0, 2.5)
    full = parse()
    assert (full.adapters, full.concurrency, full.weights, full.seconds) == ([0, 8, 64], [1, 16, 64, 256], ["bf16"], 20.0)


@pytest.mark.parametrize("weights", ["int4", "bf16,fp4", ","])
def test_unknown_weights_are_refused(bench_importable, weights: str, capsys) -> None:
    with pytest.raises(SystemExit):
        parse("--weights", weights)
    assert "bf16 and/or fp8" in capsys.readouterr().err


@pytest.mark.parametrize("weights, quantization", [("bf16", None), ("fp8", "fp8")])
def test_the_workers_command_line_as_the_worker_reads_it(bench_importable, tmp_path: Path, weights: str,
                                                          quantization: str | None) -> None:
    from bench.serve import worker_cmd
    from lorafleet.worker.server.cli import build_parser, settings_from_args

    args = parse("--workdir", str(tmp_path), "--adapters", "0,8", "--concurrency", "64")
    cmd = worker_cmd(args, tmp_path / "model", {"a0": tmp_path / "a0"}, 9000, weights)
    engine = settings_from_args(build_parser().parse_args(cmd[4:])).engine
    assert (engine.quantization, engine.dtype, engine.max_loras, engine.max_num_seqs) == (quantization, "float32", 8, 64)
    args = parse("--workdir", str(tmp_path), "--adapters", "0,8", "--max-loras", "64")
    engine = settings_from_args(build_parser().parse_args(worker_cmd(args, tmp_path, {}, 9000, weights)[4:])).engine
    assert (engine.max_loras, engine.max_cpu_loras) == (64, 72)


def old_json(path: Path) -> dict:
    """A serve JSON as bf16-only runs wrote it: rows and engine figures without `weights`."""
    row = {"path": "direct", "adapters": 0, "prompt": 16, "new_tokens": 16, "concurrency": 4, "tokens_per_s": 500.0,
           "mean_new_tokens": 16.0}
    data = {"engine": [{"batch": 4, "prompt": 16, "adapters": 0, "tokens_per_s": 900.0}], "rows": [row],
            "worker_commands": {"bf16": "lorafleet worker --model m"}}
    path.write_text(json.dumps(data))
    return data


def test_merge_keeps_each_weights_kind_apart(bench_importable, tmp_path: Path) -> None:
    from bench.serve_pieces import merged, row_key

    out = tmp_path / "serve-cpu.json"
    data = old_json(out)
    fp8 = dict(data["rows"][0], weights="fp8", tokens_per_s=700.0)
    data["rows"].append(fp8)
    data["engine"].append({"weights": "fp8", "batch": 4, "prompt": 16, "adapters": 0, "tokens_per_s": 1300.0})
    out.write_text(json.dumps(data))
    engine, rows, peaks, _ = merged(out, parse("--merge"))
    assert engine == {("bf16", 4, 16, 0): 900.0, ("fp8", 4, 16, 0): 1300.0}
    assert peaks[("bf16", 16, 0)]["tokens_per_s"] == 500.0 and peaks[("fp8", 16, 0)]["tokens_per_s"] == 700.0
    assert len({row_key(r) for r in rows}) == 2  # the same load, two kinds: neither replaces the other
    assert merged(out, parse()) == ({}, [], {}, {})  # without --merge nothing is kept


def test_the_gpu_pieces_parse_and_the_fp8_one_fits_a_device_call(bench_importable) -> None:
    from bench.serve_pieces import GPU_PIECES, gpu_commands

    text = gpu_commands()
    commands = [line for line in text.splitlines() if not line.startswith("#")]
    assert len(commands) == len(GPU_PIECES) == 4
    for line, (_, extra, minutes, seeded) in zip(commands, GPU_PIECES):
        assert minutes <= 9 and f"--merge {extra};" in line
        argv = shlex.split(line.split("python3 -m bench.serve ", 1)[1].split(";", 1)[0])
        parse(*argv)
        assert ("cp -n bench/results/serve-*.json" in line) == seeded
    fp8 = parse(*shlex.split(GPU_PIECES[-1][1]))
    assert (fp8.weights, fp8.adapters, fp8.concurrency, fp8.poisson, fp8.paths, fp8.no_engine) == \
        (["fp8"], [0, 8], [64], [0.7], "direct", False)
    # Its worker as the bf16 direct piece's (64 adapters: 64 slots), so the rows differ by the weights alone.
    bf16 = parse(*shlex.split(GPU_PIECES[1][1]))
    assert fp8.max_loras == max(bf16.adapters) and bf16.max_loras is None
    assert GPU_PIECES[-1][2] + 1 <= 9  # within 9 minutes even where the adapters must be written first


def test_the_served_workers_dummy_weights_are_the_engine_figures_weights(bench_importable, tmp_path: Path) -> None:
    """The served worker makes its weights (--load-format dummy) as bench/engine_build.py's engine
    gets them (`random_weights`): the served / engine ratio compares one model."""
    import torch

    from bench.engine_build import TINY_SHAPE, random_weights
    from bench.serve_assets import write_model
    from lorafleet.worker.config import ModelConfig
    from lorafleet.worker.models.dummy import dummy_checkpoint
    from lorafleet.worker.models.registry import model_class

    folder = write_model(tmp_path / "model", "cpu", weights=False)
    assert not list(folder.glob("*.safetensors")) and (folder / "config.json").exists()
    config = ModelConfig.from_folder(folder)
    assert config == ModelConfig.from_dict(dict(TINY_SHAPE, torch_dtype="float32"))
    model = model_class(config)(config, torch.device("cpu"), torch.float32, 64)
    made = dict(dummy_checkpoint(model, config, torch.device("cpu"), torch.float32))
    bench = dict(random_weights(config, "cpu"))
    assert made.keys() == bench.keys()
    for name, t in bench.items():
        assert torch.equal(made[name], t), name


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_fp8_piece_on_a_cpu_adds_its_rows_beside_the_old_ones(bench_importable, tmp_path: Path) -> None:
    """The FP8 piece's arguments at CPU scale, merged into a bf16-only JSON: the old row and engine
    figure kept as bf16, FP8 engine figures and rows (closed loop, then Poisson at 70% of the FP8
    closed loop's peak) for each adapter count, measured from a worker started with --quantization fp8."""
    from bench.serve import main

    out = tmp_path / "serve-cpu.json"
    old = old_json(out)
    status = main(["--device", "cpu", "--weights", "fp8", "--merge", "--adapters", "0,2", "--concurrency", "4",
                   "--prompts", "16", "--new-tokens", "16", "--poisson", "0.7", "--seconds", "3", "--warmup", "1",
                   "--paths", "direct", "--selfcheck-rate", "2000", "--ignore-selfcheck",
                   "--workdir", str(tmp_path / "work"), "--out", str(out)])
    assert status == 0
    got = json.loads(out.read_text())
    assert got["rows"][0] == old["rows"][0]
    assert {(e.get("weights", "bf16"), e["adapters"]) for e in got["engine"]} == {("bf16", 0), ("fp8", 0), ("fp8", 2)}
    assert "--quantization fp8" in got["worker_commands"]["fp8"] and "--quantization" not in got["worker_commands"]["bf16"]
    fp8 = [r for r in got["rows"] if r.get("weights") == "fp8"]
    assert [(r["adapters"], "concurrency" in r) for r in fp8] == [(0, True), (0, False), (2, True), (2, False)]
    engine = {e["adapters"]: e["tokens_per_s"] for e in got["engine"] if e.get("weights") == "fp8"}
    for closed, poisson in (fp8[0:2], fp8[2:4]):
        assert closed["errors"] == poisson["errors"] == 0 and closed["tokens_per_s"] > 0
        assert closed["engine_tokens_per_s"] == engine[closed["adapters"]]
        assert poisson["rate"] == round(0.7 * closed["tokens_per_s"] / closed["mean_new_tokens"], 2)
