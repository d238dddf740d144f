"""What a step's sampling costs with per-request logit edits (penalties, logit_bias, min_tokens),
against the same step without them: `ModelRunner`'s path, `LogitsProcessors.prepare`, then
`sample_on_device` (edits applied, tokens drawn, sampled tokens counted), then the host read.

Each case runs `--steps` consecutive steps on the same requests (their outputs grow, as in decode)
and reports the median wall time a step, host work included (the engine waits for it too), with
the edits made by each backend of `kernels/logit_edits` (the Triton kernels, the torch reference).

Usage (GPU): python -m bench.logit_edits [--vocab 100000] [--batch 64] [--out bench/results/logit-edits-h200.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from lorafleet.worker.engine.sequence import SamplingParams, Sequence
from lorafleet.worker.sampling.logits_processors import LogitsProcessors
from lorafleet.worker.sampling.sampler import sample_on_device

EDITS = {
    "none": {},
    "penalties": dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1),
    "bias": dict(logit_bias=tuple((t, 1.0) for t in range(0, 3000, 10))),
    "all": dict(frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1, min_tokens=64,
                logit_bias=tuple((t, 1.0) for t in range(0, 3000, 10))),
}
SAMPLING = {"greedy": dict(temperature=0.0), "top_p": dict(temperature=0.8, top_p=0.9)}


def run_case(vocab: int, batch: int, edited: int, edit: dict, knobs: dict, steps: int, device: torch.device,
             backend: str, prompt_len: int = 128) -> float:
    """Median seconds a step for `batch` rows, `edited` of them with `edit`."""
    procs = LogitsProcessors(vocab, device, backend)
    if "logit_bias" in edit:  # the ids a small vocabulary has
        edit = {**edit, "logit_bias": tuple(p for p in edit["logit_bias"] if p[0] < vocab)}
    g = torch.Generator(device=device).manual_seed(0)
    seqs = []
    for i in range(batch):
        sp = SamplingParams(max_tokens=4096, **knobs, **(edit if i < edited else {}))
        prompt = [(7919 * i + 13 * j) % vocab for j in range(prompt_len)]
        seqs.append(Sequence(seq_id=i, prompt_ids=prompt, sampling=sp, stop_ids=frozenset({1})))
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, vocab, device=device, generator=g)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = sample_on_device(logits, [s.sampling for s in seqs], [None] * batch, None, procs.prepare(seqs))
        tokens, _ = out.read()
        times.append(time.perf_counter() - t0)
        for s, t in zip(seqs, tokens):
            s.output_ids.append(t)
    return statistics.median(times[steps // 4:])  # the first steps fill the rows


def sampling_step_args(doc: str) -> argparse.ArgumentParser:
    """The options of the sampling benches: a step of --batch requests at a --vocab vocabulary, on
    --device, the results written to --out."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=100_000)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path)
    return ap


def main() -> None:
    ap = sampling_step_args(__doc__)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--backends", default="triton,torch", help="kernels/logit_edits backends, comma-separated")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    print(f"{'backend':8} {'sampling':8} {'edits':10} {'rows edited':>11} {'step µs':>9} {'vs none':>8}")
    for backend in args.backends.split(","):
        for sname, knobs in SAMPLING.items():
            plain = None
            for ename, edit in EDITS.items():
                for edited in ([0] if ename == "none" else [args.batch // 8, args.batch]):
                    s = run_case(args.vocab, args.batch, edited, edit, knobs, args.steps, device, backend)
                    plain = s if ename == "none" else plain
                    rows.append({"backend": backend, "sampling": sname, "edits": ename, "edited_rows": edited,
                                 "batch": args.batch, "vocab": args.vocab, "step_us": round(s * 1e6, 1),
                                 "vs_none": round(s / plain, 3)})
                    r = rows[-1]
                    print(f"{backend:8} {sname:8} {ename:10} {edited:>11} {r['step_us']:>9.1f} {r['vs_none']:>8.3f}")
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                "torch": torch.__version__, "steps": args.steps}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
