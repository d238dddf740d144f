"""`lorafleet worker` read as vLLM reads the same command line: the pinned table of vLLM 0.32's parses
(tests/worker/vllm_flag_cases.py; tests/vllm/test_flag_parity.py checks it against vLLM itself) and
our parser's settings agree, but for the defaults vllm_flags.DEFAULT_DIFFERENCES lists and says why;
vLLM's flags we do not implement are refused as such, unknown flags as unknown."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from lorafleet.worker import envs
from lorafleet.worker.config import ConfigError
from lorafleet.worker.server.cli import build_parser, main, settings_from_args
from lorafleet.worker.server.vllm_flag_names import VLLM_FLAGS
from lorafleet.worker.server.vllm_flags import DEFAULT_DIFFERENCES, DTYPE_ALIASES, human_readable_int
from tests.worker.vllm_flag_cases import CASES, MODEL, SETTINGS, VLLM_DEFAULTS, Case, vllm_parse

REPO = Path(__file__).resolve().parents[2]
# The parsed defaults that differ (a row with a device differs in what the value means there, not in it).
DIFFERING = {d.flag for d in DEFAULT_DIFFERENCES if d.device is None}
# Left unset by both parsers, resolved per device after parsing: tests/worker/test_device_setup.py
# holds the worker's resolution to vLLM's.
PER_DEVICE = ("max_num_seqs", "max_num_batched_tokens", "block_size")


def flag_of(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def vllm_effective(parsed: dict[str, Any]) -> dict[str, Any]:
    """vLLM's parse with the defaults it resolves after parsing, where they do not depend on the
    device: the CPU cache holds --max-loras adapters, dtype aliases, the host binds every address,
    prefix caching is on for these models."""
    out = dict(parsed)
    if out["max_cpu_loras"] is None:
        out["max_cpu_loras"] = out["max_loras"]
    out["dtype"] = DTYPE_ALIASES.get(out["dtype"], out["dtype"])
    out["host"] = out["host"] or "0.0.0.0"
    if out["enable_prefix_caching"] is None:
        out["enable_prefix_caching"] = True
    return out


def ours(argv: tuple[str, ...]) -> dict[str, Any]:
    args = build_parser().parse_args([*MODEL, *argv])
    s = settings_from_args(args)
    e = s.engine
    return {
        "max_loras": e.max_loras, "max_lora_rank": e.max_lora_rank, "max_cpu_loras": e.max_cpu_loras,
        "max_model_len": e.max_model_len, "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens, "gpu_memory_utilization": e.gpu_memory_utilization,
        "lora_modules": [list(m) for m in s.lora_modules] or None, "enable_lora": args.enable_lora,
        "served_model_name": [s.served_model_name] if s.served_model_name else None, "dtype": e.dtype,
        "seed": e.seed, "block_size": e.block_size, "enable_prefix_caching": e.enable_prefix_caching,
        "host": s.host, "port": s.port, "tensor_parallel_size": args.tensor_parallel_size,
        "api_key": list(s.api_keys) or None, "enforce_eager": e.cuda_graphs is False,
    }


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch):
    monkeypatch.setattr(envs, "VLLM_API_KEY", None)


@pytest.mark.parametrize("case", [c for c in CASES if c.ours == "same"], ids=lambda c: c.id)
def test_a_vllm_command_line_means_the_same(case: Case):
    want = vllm_effective(vllm_parse(case))
    got = ours(case.argv)
    given = {a.partition("=")[0].replace("_", "-") for a in case.argv if a.startswith("--")}
    for key in SETTINGS:
        if got[key] != want[key]:
            # only a default, and only one the table explains
            assert flag_of(key) not in given and flag_of(key) in DIFFERING, (key, got[key], want[key])


@pytest.mark.parametrize("case", [c for c in CASES if c.ours != "same" and not c.ours.startswith("more")],
                         ids=lambda c: c.id)
def test_what_the_worker_does_not_implement_is_refused_by_name(case: Case, capsys):
    flag = case.argv[0].partition("=")[0]
    if case.ours == "vllm-flag":
        assert "error" not in case.vllm  # vLLM takes it
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args([*MODEL, *case.argv])
        assert info.value.code == 2
        base = flag.partition(".")[0].replace("_", "-")
        assert base in VLLM_FLAGS
        assert f"{base} is a vLLM 0.32.0 flag that lorafleet worker does not implement" in capsys.readouterr().err
        return
    if case.ours == "unknown":
        with pytest.raises(SystemExit):
            build_parser().parse_args([*MODEL, *case.argv])
        err = capsys.readouterr().err
        assert f"unknown flag {flag}: neither a lorafleet worker flag nor a vLLM" in err
        return
    with pytest.raises((SystemExit, ConfigError)) as info:
        ours(case.argv)
    message = str(info.value) if isinstance(info.value, ConfigError) else capsys.readouterr().err
    assert {"-tp": "--tensor-parallel-size"}.get(flag, flag) in message, message  # the flag is named


@pytest.mark.parametrize("case", [c for c in CASES if c.ours.startswith("more")], ids=lambda c: c.id)
def test_where_the_worker_takes_more_it_says_why(case: Case):
    got = ours(case.argv)
    assert case.ours.removeprefix("more: ")
    if case.argv[0] == "--max-lora-rank":
        assert "error" in case.vllm and got["max_lora_rank"] == int(case.argv[1])
    else:
        assert got["lora_modules"] == [["a", "/x"], ["b", "/y"]] != case.vllm["lora_modules"]


def test_only_the_products_point_differs_from_vllms_defaults():
    """With no flags, every compared setting is vLLM's parse but the table's rows; those vLLM resolves
    per device are unset on both sides, and vLLM's dtype auto and memory share are ours."""
    want, got = vllm_effective(vllm_parse(Case(()))), ours(())
    differing = {key for key in SETTINGS if got[key] != want[key]}
    assert {flag_of(key) for key in differing} == DIFFERING - {"--model", "--enable-lora"}
    assert all(got[key] is None is want[key] for key in PER_DEVICE)
    assert (got["dtype"], got["gpu_memory_utilization"]) == ("auto", 0.92) == (want["dtype"], want["gpu_memory_utilization"])


def test_the_default_table_quotes_vllms_defaults_and_docs_show_it():
    """Where vLLM's parser gives a default, the table's vLLM column is it; docs/worker.md shows every
    row."""
    docs = (REPO / "docs" / "worker.md").read_text()
    for d in DEFAULT_DIFFERENCES:
        key = d.flag.removeprefix("--").replace("-", "_")
        if VLLM_DEFAULTS.get(key) is not None:
            assert d.vllm.startswith(str(VLLM_DEFAULTS[key])), d
        assert f"| `{d.flag}` | {d.ours} | {d.vllm} |" in docs, d.flag


@pytest.mark.parametrize("text, value", [("2048", 2048), ("1k", 1000), ("1K", 1024), ("25.6k", 25600),
                                         ("2M", 2 << 20), ("3m", 3_000_000), (" 7 ", 7)])
def test_human_readable_ints_are_vllms(text, value):
    assert human_readable_int(text) == value


def test_the_api_key_comes_from_vllms_env_unless_the_flag_gives_one(monkeypatch):
    monkeypatch.setattr(envs, "VLLM_API_KEY", "from-env")
    assert ours(())["api_key"] == ["from-env"]
    assert ours(("--api-key", "flag"))["api_key"] == ["flag"]
    assert "from-env" not in repr(settings_from_args(build_parser().parse_args(list(MODEL))))


def test_start_up_logs_the_defaults_that_differ_from_vllms(demo_model, caplog, monkeypatch):
    from lorafleet.worker.server import cli

    async def serve_nothing(*_args, **_kwargs) -> int:
        return 0

    monkeypatch.setattr(cli, "serve", serve_nothing)  # parse and log, serve nothing
    with caplog.at_level(logging.INFO, logger="lorafleet.worker"):
        assert main(["--model", str(demo_model), "--max-loras", "2"]) == 0
    line = next(r.getMessage() for r in caplog.records if "differ from vLLM" in r.getMessage())
    assert "--max-lora-rank 64 (vLLM: 16)" in line and "--max-loras " not in line  # given: not a default
    assert "--gpu-memory-utilization 0.92; on CPU unused" in line  # --device cpu: the CPU row applies
    assert "--max-num-seqs" not in line and "--dtype" not in line and "--block-size" not in line  # vLLM's now


def test_the_cpu_rows_are_logged_on_cpu_only(caplog):
    from lorafleet.worker.server.vllm_flags import log_default_differences

    log = logging.getLogger("lorafleet.worker")
    with caplog.at_level(logging.INFO, logger="lorafleet.worker"):
        log_default_differences(log, ["--model", "/m"], "cuda:1")
        log_default_differences(log, ["--model", "/m"], "cpu")
    on_cuda, on_cpu = (r.getMessage() for r in caplog.records)
    assert "--gpu-memory-utilization" not in on_cuda and "--gpu-memory-utilization" in on_cpu
    assert "--max-loras 8 (vLLM: 1)" in on_cuda
