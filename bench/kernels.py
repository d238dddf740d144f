"""Benchmark the Triton LoRA kernels on a CUDA GPU against the memory floor and torch baselines.

    python bench/kernels.py [--out bench/results/kernels-h200.json] [--quick] [--no-baselines] [--sweep FILE]

The command line over the kernel benchmark's parts: the cases and their inputs
(`bench/kernel_cases.py`), one row per case (`bench/kernel_runner.py`, which says what each column
is), the CUDA-graph timing and the copy bandwidth (`bench/graph_timing.py`), the launch-config sweep
(`bench/kernel_sweep.py`) and the tables (`bench/kernel_report.py`). `--no-baselines` skips the torch
gather/loop and base GEMM timings (they take most of the run time); `--markdown FILE` prints a
results file as a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch
import triton

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.graph_timing import measure_copy_bandwidth
from bench.kernel_cases import main_cases
from bench.kernel_report import markdown_table, print_table
from bench.kernel_runner import run_case
from bench.kernel_sweep import SWEEP_CASES, sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/kernels-h200.json")
    parser.add_argument("--quick", action="store_true", help="a few cases only")
    parser.add_argument(
        "--no-baselines", action="store_true", help="skip the torch gather/loop and base GEMM timings"
    )
    parser.add_argument("--sweep", default=None, help="also time launch configs; write them to this file")
    parser.add_argument("--sweep-cases", default=None, help="TOKENS:ADAPTERS,... for --sweep (default: a few)")
    parser.add_argument("--sweep-only", action="store_true", help="skip the main table")
    parser.add_argument("--markdown", default=None, help="print a results file as a markdown table and exit")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_table(json.loads(Path(args.markdown).read_text())))
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bandwidth = measure_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows = []
    for case in [] if args.sweep_only else main_cases(args.quick):
        rows.append(run_case(case, bandwidth, g, baselines=not args.no_baselines))
        r = rows[-1]
        print(
            f"  {case}: {r['lora_us']} µs floor {r['floor_us']} µs err {r['rel_err']}",
            flush=True,
        )
        torch.cuda.empty_cache()
    print(
        f"machine {torch.cuda.get_device_name()}, date {datetime.date.today().isoformat()}, torch {torch.__version__}, "
        f"triton {triton.__version__}, python {platform.python_version()}, copy bandwidth {bandwidth / 1e12:.3f} TB/s"
    )
    if rows:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))
        print_table(rows)
    if args.sweep:
        cases = [tuple(int(v) for v in c.split(":")) for c in args.sweep_cases.split(",")] if args.sweep_cases else SWEEP_CASES
        Path(args.sweep).write_text(json.dumps(sweep(bandwidth, g, cases), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
