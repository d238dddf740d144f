"""How long a step's grammar masks take to fill on the host: one matcher after another against
xgrammar's batch fill over threads (`structured.MaskFiller` picks between them), for 1-64 rows.

    python -m bench.mask_fill [--vocab 100000] [--steps 30] [--threads 1,2,4,8] [--out F] [--tiny]

Host only (no GPU): the grammars read a byte-level BPE tokenizer of `--vocab` entries
(bench/engine_build.py, full_vocab_tokenizer); each row's matcher is first advanced by a few tokens
its mask allows. Grammars: a long regex (`[a-z ]{1000}`) and a JSON schema of several typed fields,
inside a string. Prints µs a row per way and writes the rows {grammar, rows, way, us_per_row}.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench.engine_build import full_vocab_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "ok": {"type": "boolean"}}, "required": ["name", "age", "tags", "ok"]}


def advanced_matchers(xgr, compiled, n: int, vocab: int, rng: random.Random, tokens: int):
    matchers = []
    mask = xgr.allocate_token_bitmask(1, vocab)
    for _ in range(n):
        m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        for _ in range(tokens):
            m.fill_next_token_bitmask(mask, 0)
            words = mask[0].tolist()
            allowed = [w * 32 + b for w, word in enumerate(words) if word for b in range(32) if (word >> b) & 1]
            allowed = [t for t in allowed if t > 300] or allowed  # past the bytes: multi-letter tokens
            if not m.accept_token(rng.choice(allowed)) or m.is_terminated():
                break
        matchers.append(m)
    return matchers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", default="1,2,4,8")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tiny", action="store_true", help="a 2,000-token vocabulary, 2 steps: checks the script")
    args = ap.parse_args()
    if args.tiny:
        args.vocab, args.steps = 2_000, 2
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    folder = full_vocab_tokenizer(Path(tempfile.mkdtemp()), args.vocab)
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast.from_pretrained(str(folder)),
                                              vocab_size=args.vocab)
    compiler = xgr.GrammarCompiler(info)
    grammars = {"regex": compiler.compile_regex("[a-z ]{1000}"),
                "json_schema": compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)}
    rng = random.Random(0)
    threads = [int(t) for t in args.threads.split(",")]
    batchers = {t: xgr.BatchGrammarMatcher(t) for t in threads}
    rows_out = []
    print(f"{os.cpu_count()} CPUs, affinity {len(os.sched_getaffinity(0))}; µs a row")
    print(f"{'grammar':12} {'rows':>5} {'one by one':>11} " + " ".join(f"{f'{t} thr':>8}" for t in threads))
    for name, compiled in grammars.items():
        pool = advanced_matchers(xgr, compiled, 64, args.vocab, rng, 6)
        for n in (1, 4, 16, 64):
            matchers, idx = pool[:n], list(range(n))
            mask = xgr.allocate_token_bitmask(n, args.vocab)
            ways = {"one by one": lambda ms=matchers, mk=mask: [m.fill_next_token_bitmask(mk, i) for i, m in enumerate(ms)]}
            for t in threads:
                ways[f"{t} threads"] = lambda b=batchers[t], ms=matchers, mk=mask, ix=idx: b.batch_fill_next_token_bitmask(ms, mk, ix)
            got = {}
            for way, fn in ways.items():
                fn()
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                got[way] = statistics.median(times) / n * 1e6
                rows_out.append({"grammar": name, "rows": n, "way": way, "us_per_row": round(got[way], 2)})
            print(f"{name:12} {n:>5} {got['one by one']:>11.2f} " + " ".join(f"{got[f'{t} threads']:>8.2f}" for t in threads))
    if args.out:
        meta = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "vocab": args.vocab,
                "xgrammar": importlib.metadata.version("xgrammar")}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows_out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
