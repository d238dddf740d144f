"""`lorafleet up`'s options are checked before anything starts and reach every worker's command line
as the worker reads them; a worker's start-up failure is reported with its own log lines, not an
earlier run's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lorafleet.local import process_group
from lorafleet.local.options import build_parser, options_from_args
from lorafleet.local.preflight import FleetError
from lorafleet.local.run_dir import RunDir
from lorafleet.local.workers import worker_argv


def options(*argv: str):
    return options_from_args(build_parser().parse_args(list(argv)))


def test_defaults_pass() -> None:
    opts = options()
    assert (opts.port, opts.workers, opts.max_loras, opts.max_lora_rank) == (8000, 2, 8, 64)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--port", "99999"], "--port 99999: a port is 1..65535"),
    (["--port", "0"], "--port 0: a port is 1..65535"),
    (["--worker-port", "70000"], "--worker-port 70000: a port is 1..65535"),
    (["--worker-port", "65535", "--workers", "3"], "3 workers need ports up to 65537, past 65535"),
    (["--ready-timeout", "0"], "--ready-timeout 0: must be more than 0 seconds"),
    (["--max-loras", "0"], "max-loras must be >= 1 (--max-loras 0,"),
    (["--max-lora-rank", "1024"], "max-lora-rank must be in 1..512 (--max-loras 8, --max-cpu-loras 32, --max-lora-rank 1024)"),
    # The default --max-cpu-loras (32) is named with its value, not blamed as if given.
    (["--max-loras", "100"], "max-cpu-loras must be >= max-loras (--max-loras 100, --max-cpu-loras 32,"),
    (["--tensor-parallel-size", "0"], "tensor-parallel-size must be >= 1 (--tensor-parallel-size 0)"),
    # What the engine refuses at start-up, said before any worker starts.
    (["-q", "fp8", "-tp", "2"], "--quantization fp8 with --tensor-parallel-size 2: FP8 weights are served on one"),
    (["--device", "cuda", "--tensor-parallel-size", "2"],
     "--tensor-parallel-size 2 on CUDA: each worker's ranks take cuda:0..1, so --workers 1 (got 2)"),
])
def test_bad_options_are_refused_before_starting(argv: list[str], message: str) -> None:
    with pytest.raises(FleetError) as info:
        options(*argv)
    assert message in str(info.value)


def test_a_childs_log_tail_is_its_own(tmp_path: Path) -> None:
    log = tmp_path / "worker-0.log"
    for line in ("first run: max_loras must be >= 1", "second run: max_lora_rank must be in 1..512"):
        child = process_group.spawn("w", [sys.executable, "-c", f"print({line!r})"], log)
        assert child.process.wait(timeout=60) == 0
    assert child.log_tail() == "second run: max_lora_rank must be in 1..512"
    assert "first run" in log.read_text()  # the log itself keeps every run


def worker_settings(opts, tmp_path: Path):
    """The worker's own parse of the command line `lorafleet up` spawns it with."""
    from lorafleet.worker.server.cli import build_parser as worker_parser
    from lorafleet.worker.server.cli import settings_from_args

    argv = worker_argv(opts, RunDir(tmp_path), tmp_path / "model", 9001, "cpu")
    assert argv[1:4] == ["-m", "lorafleet", "worker"]
    return argv, settings_from_args(worker_parser().parse_args(argv[4:]))


def test_the_workers_model_and_adapter_flags_reach_their_command_line(tmp_path: Path) -> None:
    opts = options("--quantization", "fp8", "--dtype", "half", "--max-loras", "4", "--max-cpu-loras", "6",
                   "--max-lora-rank", "32")
    argv, settings = worker_settings(opts, tmp_path)
    assert argv[argv.index("--quantization") + 1] == "fp8"
    e = settings.engine
    assert (e.quantization, e.dtype, e.max_loras, e.max_cpu_loras, e.max_lora_rank, e.tensor_parallel_size) == \
        ("fp8", "float16", 4, 6, 32, 1)


def test_tensor_parallel_size_reaches_every_worker_on_cpu(tmp_path: Path) -> None:
    opts = options("-tp", "2", "--workers", "2")
    argv, settings = worker_settings(opts, tmp_path)
    assert settings.engine.tensor_parallel_size == 2 and argv[argv.index("--tensor-parallel-size") + 1] == "2"


def test_model_flags_left_out_are_the_workers_defaults(tmp_path: Path) -> None:
    argv, settings = worker_settings(options(), tmp_path)
    assert not {"--quantization", "--tensor-parallel-size"} & set(argv)
    assert (settings.engine.quantization, settings.engine.tensor_parallel_size) == (None, 1)
    assert settings.engine.dtype == "float32"  # on CPU: exact, not the worker's auto (vLLM's, bfloat16)


def test_workers_sharing_a_gpu_split_vllms_memory_share(tmp_path: Path) -> None:
    from lorafleet.worker.server.cli import build_parser as worker_parser
    from lorafleet.worker.server.cli import settings_from_args

    def share(device: str, sharers: int) -> float | None:
        argv = worker_argv(options("--device", "cuda"), RunDir(tmp_path), tmp_path / "model", 9001, device, sharers)
        return settings_from_args(worker_parser().parse_args(argv[4:])).engine.gpu_memory_utilization

    assert share("cuda:0", 2) == 0.46 and share("cuda:1", 3) == 0.3067
    default = settings_from_args(worker_parser().parse_args(["--model", "m"])).engine.gpu_memory_utilization
    assert share("cuda:0", 1) == default  # alone on its GPU: the worker's own default (vLLM's)
    assert "--gpu-memory-utilization" not in worker_argv(options(), RunDir(tmp_path), tmp_path / "model", 9001, "cpu", 2)
