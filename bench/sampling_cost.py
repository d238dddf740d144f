"""Where a decode step's sampling time goes, by sampling mode and by piece: what a faster top-p would
have to beat (bench/logit_edits.py measured top-p at 1.16 ms a step against 0.13 ms greedy for 64
requests at a 100k vocabulary on the H200).

Modes: `sample_on_device(...).read()` for greedy, temperature only, top-k 50, top-p 0.9, top-k 50 with
top-p 0.9, and min-p 0.05, every row of the batch alike, with each draw (`--draws`: the torch draw,
which sorts every row for top-p, and kernels/sampling/draw_triton.py, which does not). Pieces (the torch ops `worker/sampling/sampler.py`
runs for top-p): the full sort of each row, a top-k of 50, the running-mass count
(`_count_cumsum_below`), the softmax over the sorted rows, the exponential noise. Median wall time
over `--repeats` (device synchronised), host work included.

`--sweep`: the Triton draw alone (its kernel, noise and top-k floor given) under each launch
setting (BLOCK, NUM_WARPS) for each sampled mode but temperature, to pick the defaults.

Usage (GPU): python -m bench.sampling_cost [--batch 64] [--vocab 100000] [--draws torch,triton] [--sweep]
             [--out bench/results/sampling-cost-h200.json]
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable

import torch

from bench.logit_edits import sampling_step_args
from lorafleet.worker.engine.sequence import SamplingParams
from lorafleet.worker.sampling import sampler as sampling

MODES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k_50": dict(temperature=0.8, top_k=50),
    "top_p_0.9": dict(temperature=0.8, top_p=0.9),
    "top_k_50+top_p_0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "min_p_0.05": dict(temperature=0.8, min_p=0.05),
}


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls (after one warm-up), the device synchronised."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pieces(logits: torch.Tensor) -> dict[str, Callable[[], object]]:
    scaled = logits / 0.8
    desc = scaled.sort(dim=-1, descending=True).values
    probs = torch.softmax(desc, dim=-1)
    bound = torch.full((logits.shape[0], 1), 0.9, device=logits.device)
    noise = torch.empty_like(scaled)
    return {
        "sort (descending, every row)": lambda: scaled.sort(dim=-1, descending=True),
        "topk 50": lambda: scaled.topk(50, dim=-1),
        "softmax of the sorted rows": lambda: torch.softmax(desc, dim=-1),
        "running-mass count": lambda: sampling._count_cumsum_below(probs, bound),
        "exponential noise": lambda: noise.exponential_(),
    }


SWEEP = [dict(BLOCK=b, NUM_WARPS=w) for b in (2048, 4096, 8192) for w in (16, 32)]


def sweep(logits: torch.Tensor, device: torch.device, repeats: int) -> list[dict]:
    """kernels/sampling/draw_triton.py's kernel alone (noise and top-k floor given) under launch settings
    (its block and num_warps arguments)."""
    from lorafleet.kernels.sampling import draw_triton as dt

    n, vocab = logits.shape
    log_noise = torch.empty_like(logits).exponential_().log_()
    rows = []
    for mode in ("top_p_0.9", "min_p_0.05", "top_k_50", "top_k_50+top_p_0.9"):
        params = [SamplingParams(max_tokens=16, **MODES[mode])] * n
        knobs = sampling._Knobs(params, vocab)
        knobs_t = torch.tensor(knobs.values, dtype=torch.float32, device=device).view(sampling._Knobs.ROWS, n)
        floor = sampling.top_k_floor(logits, knobs_t, knobs.k_max)
        want = None
        for setting in SWEEP:
            def run(knobs_t=knobs_t, floor=floor, setting=setting):
                return dt.draw_triton(logits, knobs_t, log_noise, floor, block=setting["BLOCK"],
                                      num_warps=setting["NUM_WARPS"])
            got = run()
            want = got if want is None else want
            s = timed(run, device, repeats)
            same = bool(torch.equal(got, want))
            rows.append({"kind": "sweep", "name": mode, **setting, "us": round(s * 1e6, 1), "same_tokens": same})
            print(f"{mode:20} {setting} {s * 1e6:>10.1f} us{'' if same else '  tokens differ'}")
    return rows


def main() -> None:
    ap = sampling_step_args(__doc__)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--draws", default="torch,triton", help="sample_on_device's draw settings to time (LORAFLEET_SAMPLER's values)")
    ap.add_argument("--sweep", action="store_true", help="also time the Triton draw under launch settings")
    args = ap.parse_args()
    device = torch.device(args.device)
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(args.batch, args.vocab, device=device, generator=g) * 3
    rows = []
    print(f"{'what':32} {'µs':>10}")
    for name, knobs in MODES.items():
        params = [SamplingParams(max_tokens=16, **knobs)] * args.batch
        for draw in args.draws.split(","):
            s = timed(lambda params=params, draw=draw: sampling.sample_on_device(
                logits, params, [None] * args.batch, draw=draw).read(), device, args.repeats)
            rows.append({"kind": "mode", "name": name, "draw": draw, "us": round(s * 1e6, 1)})
            print(f"{name + ' (' + draw + ')':32} {s * 1e6:>10.1f}")
    if args.sweep:
        rows += sweep(logits, device, args.repeats)
    for name, fn in pieces(logits).items():
        s = timed(fn, device, args.repeats)
        rows.append({"kind": "piece", "name": name, "us": round(s * 1e6, 1)})
        print(f"{name:32} {s * 1e6:>10.1f}")
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
                "batch": args.batch, "vocab": args.vocab, "repeats": args.repeats}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
