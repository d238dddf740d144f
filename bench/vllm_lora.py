"""Our LoRA kernels against vLLM's Triton LoRA kernels, on the inputs of bench/kernels.py.

    python -m bench.vllm_lora --fetch                 # once, where PyPI answers: unpack vLLM's kernels
    python -m bench.vllm_lora [--quick] [--out bench/results/vllm-lora-h200.json]

vLLM's kernels are not vendored: `--fetch` downloads the pinned vLLM wheel (`pip download --no-deps
vllm==VLLM_VERSION`) and unpacks only its LoRA Triton ops (`vllm/lora/ops/triton_ops/`: the shrink,
the expand, their helpers and the step metadata) into `bench/.vllm/` (git-ignored; the device tool
carries it with `carry=["bench/.vllm"]`, as the GPU image has no vLLM and no network). They import a
few things from the rest of vLLM (its env flags, platform probe, logger, custom-op registration);
`_install_shim` writes small stand-ins for those into a temporary package, so the kernels and their
launch code run unmodified, with vLLM's default configs (no tuned-config folder).

Per case (bench/kernels.py's main table, one adapter per token: vLLM has no several-adapters-per-
token op): both sides add Σ scale·B(A x) into the same y, timed the same way (bench/graph_timing.py's
`time_graph`: a CUDA graph over enough weight copies that L2 does not hold them). Scales are per
adapter, which vLLM bakes into B (as its punica wrapper does at load time); ours reads them per
token. vLLM computes at the pool rank (its `max_lora_rank` padding, the zeros past each adapter's
rank included); ours at the true rank. Rows:

- vllm_us: `lora_shrink` (into a zeroed fp32 buffer, which it zeroes itself) then `lora_expand`
  with `add_inputs=True`, as vLLM's punica wrapper calls them, the step metadata from
  `LoRAKernelMeta.prepare_tensors` with the grid over active adapters (`specialize_active_lora`);
  vllm_pdl_us: the same with `VLLM_LORA_ENABLE_DUAL_STREAM=1` (programmatic dependent launch, which
  vLLM uses only then).
- lora_us: ours (`add_lora_triton`, the default config and PDL), in the same process.
- speedup = min(vllm_us, vllm_pdl_us) / lora_us; the issue asks for >= 1.5.
- vllm_err, lora_err: ‖Δ − Δref‖ / ‖Δref‖ against the torch reference (`add_lora_reference`) on the
  first weight copy. A row whose error passes 2e-2 is reported and not timed.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict
from pathlib import Path
from unittest import mock

import torch

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import graph_timing
from bench import kernel_cases as kb
from lorafleet.kernels.lora.launch import add_lora_triton
from lorafleet.kernels.lora.ops import add_lora_reference

VLLM_VERSION = "0.33.0"
SRC = Path(__file__).resolve().parent / ".vllm"
OPS = "vllm/lora/ops/triton_ops"
OP_FILES = ("kernel_utils.py", "lora_shrink_op.py", "lora_expand_op.py", "lora_kernel_metadata.py", "utils.py")
MAX_ERR = 2e-2

# Stand-ins for the parts of vLLM its LoRA ops import (module name -> source). Only what those five
# files use: env flags at vLLM's defaults (read from the environment as vLLM does), a CUDA
# capability probe, a logger with `*_once`, and no custom-op registration (the ops then bind the
# plain functions, their own fallback).
_SHIM = {
    "vllm/__init__.py": "",
    "vllm/envs.py": """
import os
VLLM_BATCH_INVARIANT = bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0")))
VLLM_TUNED_CONFIG_FOLDER = os.getenv("VLLM_TUNED_CONFIG_FOLDER")
VLLM_LORA_DISABLE_PDL = bool(int(os.getenv("VLLM_LORA_DISABLE_PDL", "0")))


def __getattr__(name):
    if name == "VLLM_LORA_ENABLE_DUAL_STREAM":  # read per call, so one process can time both
        return bool(int(os.getenv(name, "0")))
    raise AttributeError(name)
""",
    "vllm/logger.py": """
import logging


class _Once(logging.LoggerAdapter):
    seen = set()

    def process(self, msg, kwargs):
        return msg, kwargs

    def info_once(self, msg, *a):
        if msg not in self.seen:
            self.seen.add(msg)
            self.info(msg, *a)

    def warning_once(self, msg, *a):
        if msg not in self.seen:
            self.seen.add(msg)
            self.warning(msg, *a)


def init_logger(name):
    return _Once(logging.getLogger(name), {})
""",
    "vllm/platforms/__init__.py": """
import torch


class _Platform:
    def is_cuda(self):
        return torch.cuda.is_available() and torch.version.cuda is not None

    def _cap(self):
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor

    def has_device_capability(self, cap):
        return self.is_cuda() and self._cap() >= cap

    def is_device_capability(self, cap):
        return self.is_cuda() and self._cap() == cap


current_platform = _Platform()
""",
    "vllm/triton_utils/__init__.py": "import triton\nimport triton.language as tl\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/math_utils.py": "import triton\n\n\ndef next_power_of_2(n):\n    return triton.next_power_of_2(n)\n",
    "vllm/utils/torch_utils.py": """
import torch


def async_tensor_h2d(data, dtype, device):
    return torch.tensor(data, dtype=dtype, pin_memory=torch.cuda.is_available()).to(device, non_blocking=True)


def direct_register_custom_op(**_):
    raise AttributeError("not registered: the ops bind their plain functions")
""",
    "vllm/lora/__init__.py": "",
    "vllm/lora/ops/__init__.py": "",
    f"{OPS}/__init__.py": "",  # vLLM's own imports the MoE and fp8 ops too
}


def fetch(dest: Path = SRC) -> None:
    """Download vLLM's wheel (no dependencies) and unpack its LoRA Triton ops into `dest`."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"vllm=={VLLM_VERSION}",
                        "-d", tmp], check=True)
        wheel = next(Path(tmp).glob("vllm-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            for name in OP_FILES:
                target = dest / OPS / name
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(z.read(f"{OPS}/{name}"))
    (dest / "VERSION").write_text(VLLM_VERSION + "\n")
    print(f"vLLM {VLLM_VERSION}'s LoRA Triton ops in {dest / OPS}")


def _install_shim(src: Path) -> Path:
    """A temporary `vllm` package of the shim plus `src`'s op files; put first on sys.path."""
    missing = [n for n in OP_FILES if not (src / OPS / n).is_file()]
    if missing:
        raise SystemExit(f"vLLM's LoRA ops are not in {src} ({', '.join(missing)} missing): "
                         "run `python -m bench.vllm_lora --fetch` where PyPI answers")
    root = Path(tempfile.mkdtemp(prefix="vllm-shim-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for rel, text in _SHIM.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text.lstrip())
    for name in OP_FILES:
        (root / OPS / name).write_bytes((src / OPS / name).read_bytes())
    sys.path.insert(0, str(root))
    return root


class VllmOps:
    """vLLM's `lora_shrink`, `lora_expand` and `LoRAKernelMeta`, loaded through the shim."""

    def __init__(self, src: Path = SRC):
        if "vllm" not in sys.modules:
            _install_shim(src)
        self.shrink = importlib.import_module(f"{OPS.replace('/', '.')}.lora_shrink_op").lora_shrink
        self.expand = importlib.import_module(f"{OPS.replace('/', '.')}.lora_expand_op").lora_expand
        self.meta_cls = importlib.import_module(f"{OPS.replace('/', '.')}.lora_kernel_metadata").LoRAKernelMeta
        self.utils = importlib.import_module(f"{OPS.replace('/', '.')}.utils")

    def forget_weights(self) -> None:
        """Drop vLLM's pointer-table caches. They are keyed by the weights' data pointers (vLLM
        allocates its slot weights once), so a later case whose tensors reuse freed memory would get
        an earlier case's strides and sizes."""
        self.utils._LORA_A_PTR_DICT.clear()
        self.utils._LORA_B_PTR_DICT.clear()

    def make_meta(self, token_slots: torch.Tensor, max_loras: int, device: str):
        meta = self.meta_cls.make(max_loras, token_slots.shape[0], device)
        meta.prepare_tensors(token_slots.to(device))
        return meta.meta_args(token_slots.shape[0], specialize_active_lora=True)

    def add_lora(self, y, x, lora_a, lora_b, buffer, meta_args) -> None:
        """What vLLM's punica wrapper does for one linear: shrink into buffer, expand-add into y."""
        self.shrink(x, lora_a, buffer, *meta_args, 1.0)
        self.expand(buffer, lora_b, y, *meta_args, offset_start=0, add_inputs=True)


def vllm_weights(inp: kb.Inputs, rank: int, adapter_scale: torch.Tensor) -> tuple[list, list]:
    """vLLM's layout of the same adapters: A `[S, pool_rank, in]` and B `[S, out, pool_rank]`
    contiguous, zero past each adapter's rank (its padding), the adapter's scale folded into B."""
    a_v = [a.clone() for a in inp.lora_a]
    b_v = [(b * adapter_scale.to(b.device, b.dtype)[:, None, None]).contiguous() for b in inp.lora_b]
    for a, b in zip(a_v, b_v, strict=True):
        a[:, rank:] = 0
        b[:, :, rank:] = 0
    return a_v, b_v


def rel_err(y: torch.Tensor, y0: torch.Tensor, ref: torch.Tensor) -> float:
    d, d_ref = y.double() - y0.double(), ref.double() - y0.double()
    return float((d - d_ref).norm() / d_ref.norm().clamp_min(1e-30))


def cases(quick: bool) -> list[kb.Case]:
    return [c for c in kb.main_cases(quick) if c.k == 1 and c.b_layout == "rank_major"]


def run_case(ops: VllmOps, case: kb.Case, g: torch.Generator, device: str = "cuda", timed: bool = True) -> dict:
    """One row (see the module docstring); `timed=False` only checks both against the reference."""
    d_in, outs = kb.MODULES[case.module]
    ops.forget_weights()
    sets, token_slots, _, ranks = kb.make_case_inputs(case, g)
    adapter_scale = torch.rand(case.adapters, generator=g) + 0.5
    token_scales = adapter_scale[token_slots.long()]  # one scale per adapter, which vLLM can fold into B
    meta = kb.case_meta(case, token_slots, token_scales)
    ranks_dev = torch.tensor(ranks, dtype=torch.int32, device=device)
    vw = [vllm_weights(s, case.rank, adapter_scale) for s in sets]
    v_meta = ops.make_meta(token_slots[:, 0], case.adapters, device)
    buffers = [torch.empty(len(outs), case.tokens, case.pool_rank, dtype=torch.float32, device=device) for _ in sets]

    def ours(i: int) -> None:
        s = sets[i]
        add_lora_triton(s.y, s.x, s.lora_a, s.lora_b, ranks_dev, meta)

    def theirs(i: int) -> None:
        s = sets[i]
        ops.add_lora(s.y, s.x, *vw[i], buffers[i], v_meta)

    saved = [s.y.clone() for s in sets]
    ref = sets[0].y.clone()
    add_lora_reference(ref, sets[0].x, sets[0].lora_a, sets[0].lora_b, ranks, meta)
    row = {**asdict(case), "n_sets": len(sets)}
    for name, fn in (("lora", ours), ("vllm", theirs)):
        for i in range(len(sets)):  # every copy once outside the graph: vLLM caches pointer tables
            fn(i)
        row[f"{name}_err"] = float(f"{rel_err(sets[0].y, saved[0], ref):.2e}")
        for s, y in zip(sets, saved, strict=True):
            s.y.copy_(y)
    if not timed or max(row["lora_err"], row["vllm_err"]) > MAX_ERR:
        return row
    row["lora_us"] = round(graph_timing.time_graph([lambda i=i: ours(i) for i in range(len(sets))]), 2)
    row["vllm_us"] = round(graph_timing.time_graph([lambda i=i: theirs(i) for i in range(len(sets))]), 2)
    with mock.patch.dict(os.environ, {"VLLM_LORA_ENABLE_DUAL_STREAM": "1"}):
        row["vllm_pdl_us"] = round(graph_timing.time_graph([lambda i=i: theirs(i) for i in range(len(sets))]), 2)
    row["speedup"] = round(min(row["vllm_us"], row["vllm_pdl_us"]) / row["lora_us"], 2)
    for s, y in zip(sets, saved, strict=True):
        s.y.copy_(y)
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'module':8s} {'T':>4s} {'A':>4s} {'rank':>4s} {'pool':>4s} {'ours µs':>8s} {'vLLM µs':>8s} "
          f"{'vLLM PDL':>8s} {'speedup':>7s}")
    for r in rows:
        if "lora_us" not in r:
            print(f"{r['module']:8s} {r['tokens']:4d} {r['adapters']:4d} {r['rank']:4d} {r['pool_rank']:4d}  "
                  f"not timed: error ours {r['lora_err']}, vLLM {r['vllm_err']}")
            continue
        print(f"{r['module']:8s} {r['tokens']:4d} {r['adapters']:4d} {r['rank']:4d} {r['pool_rank']:4d} "
              f"{r['lora_us']:8.2f} {r['vllm_us']:8.2f} {r['vllm_pdl_us']:8.2f} {r['speedup']:6.2f}×")


def _geomean(values: list[float]) -> float | None:
    return round(math.exp(sum(map(math.log, values)) / len(values)), 3) if values else None


def summary(rows: list[dict]) -> dict:
    """Over the timed rows with >= 16 tokens; the geometric mean also over those at the pool's rank
    alone (rank 8 in a rank-64 pool is where vLLM does 8x the rank work by design)."""
    timed = [r for r in rows if "speedup" in r and r["tokens"] >= 16]
    return {"rows_tokens_ge_16": len(timed), "geomean_speedup": _geomean([r["speedup"] for r in timed]),
            "geomean_speedup_rank_eq_pool": _geomean([r["speedup"] for r in timed if r["rank"] == r["pool_rank"]]),
            "min_speedup": min((r["speedup"] for r in timed), default=None),
            "rows_ge_1_5": sum(r["speedup"] >= 1.5 for r in timed)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fetch", action="store_true", help="download vLLM's wheel and unpack its LoRA ops, then exit")
    ap.add_argument("--src", type=Path, default=SRC, help="where --fetch put vLLM's ops")
    ap.add_argument("--quick", action="store_true", help="bench/kernels.py's quick cases")
    ap.add_argument("--cases", default=None, help="MODULE:TOKENS:ADAPTERS,... (rank 16) instead of the table's")
    ap.add_argument("--out", type=Path, default=Path("bench/results/vllm-lora-h200.json"))
    args = ap.parse_args(argv)
    if args.fetch:
        fetch(args.src)
        return 0
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    ops = VllmOps(args.src)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    bandwidth = graph_timing.measure_copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}, copy bandwidth {bandwidth / 1e12:.2f} TB/s, vLLM "
          f"{(args.src / 'VERSION').read_text().strip() if (args.src / 'VERSION').exists() else '?'}", flush=True)
    rows = []
    for case in kb.parse_cases(args.cases) if args.cases else cases(args.quick):
        rows.append(run_case(ops, case, g))
        print(" ", {k: v for k, v in rows[-1].items() if k not in ("k", "b_layout")}, flush=True)
        torch.cuda.empty_cache()
    print_table(rows)
    result = {"device": torch.cuda.get_device_name(), "vllm": VLLM_VERSION, "torch": torch.__version__,
              "bandwidth_tb_s": round(bandwidth / 1e12, 3), "summary": summary(rows), "rows": rows}
    print(json.dumps(result["summary"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
