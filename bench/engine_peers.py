"""The engine's peers at bench/engine.py's shape and batch: transformers `generate` and PEFT mixed batches.

    python -m bench.engine_peers [--tiny] [--batch 64] [--prompt-len 128] [--new-tokens 128]
                                 [--peft-adapters 1,8] [--peft-new-tokens 32] [--out FILE]

A `LlamaForCausalLM` with random bf16 weights is built directly on the GPU from SEED_SHAPE (fp32 on
the CPU from TINY_SHAPE with --tiny; nothing is downloaded). The batch is B distinct prompts of P
token ids, decoded greedily with min_new_tokens = max_new_tokens = N so that EOS never ends a row.
The decode rate leaves prefill out: tokens_per_s = B * (N - 1) / (t(generate N) - t(generate 1)),
each t the faster of two runs (the first generate of N is the warm-up). Rows:

- "transformers generate base-only": plain `generate` as shipped (dynamic KV cache, the model's
  default attention, named in attn_implementation, no compile); ttft_ms_512 is one 512-token prompt
  generating 1 token, median of 3.
- "peft mixed batch": the same base wrapped by PEFT with D random adapters (rank 16, alpha 32, all 7
  projections, B nonzero, kept in the base dtype as the engine keeps them); row r uses adapter r % D
  through `generate(adapter_names=...)`, PEFT's mixed-batch inference. N is --peft-new-tokens (PEFT
  is slow); adapter_setup_s is the time to create the adapters, not part of the rate.

Prints a table and writes bench/results/engine-peers-h200.json ({machine, torch, ..., rows}).
bench/engine.py imports peer_rows() to measure the peers in its own run before building the engine:
peer_rows() frees the GPU memory it took before it returns.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from contextlib import contextmanager
from pathlib import Path

import peft
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from bench.engine_build import SEED_SHAPE, TARGETS, TINY_SHAPE
from bench.engine_workload import sync

PAD_TOKEN_ID = 2
TTFT_PROMPT_LEN = 512
PEFT_RANK = 16


@contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_base(shape: dict, device: str) -> LlamaForCausalLM:
    """Random weights made on `device` itself: bf16 on CUDA, fp32 on the CPU."""
    fields = {k: v for k, v in shape.items() if k not in ("model_type", "torch_dtype")}
    config = LlamaConfig(**fields, pad_token_id=PAD_TOKEN_ID)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):
        return LlamaForCausalLM(config).eval()


def batch_prompts(batch: int, prompt_len: int, vocab: int, device: str) -> torch.Tensor:
    """The token ids bench/engine.py feeds its engine: row r is distinct from every other row."""
    r = torch.arange(batch, device=device)[:, None]
    j = torch.arange(prompt_len, device=device)[None, :]
    return (r * 7919 + j * 31) % (vocab - 10) + 10


def timed_generate(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> float:
    """Seconds for a greedy generate of exactly `new_tokens` tokens per row."""
    sync()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=PAD_TOKEN_ID,
                         **kwargs)
    sync()
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - t0


def decode_rate(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> dict:
    """Decode tokens/s with prefill left out: generate N minus generate 1, each the faster of two runs.

    The first generate of N is the warm-up; taking the faster run keeps a cold one out.
    """
    total_s = min(timed_generate(model, ids, new_tokens, **kwargs) for _ in range(2))
    prefill_s = min(timed_generate(model, ids, 1, **kwargs) for _ in range(2))
    decode_s = total_s - prefill_s
    steps = new_tokens - 1
    return {"tokens_per_s": round(ids.shape[0] * steps / decode_s, 1),
            "decode_step_ms": round(1e3 * decode_s / steps, 2)}


def ttft_ms(model, vocab: int, device: str) -> float:
    """Median ms for one 512-token prompt to give its first token (a warm-up call first)."""
    ids = ((torch.arange(TTFT_PROMPT_LEN, device=device) * 13) % (vocab - 10) + 10)[None, :]
    times = [timed_generate(model, ids, 1) for _ in range(4)][1:]
    return round(1e3 * sorted(times)[1], 2)


def add_peft_adapters(base: LlamaForCausalLM, count: int, device: str):
    """Wraps `base` with `count` random LoRA adapters made on `device`: (peft model, names, seconds)."""
    config = peft.LoraConfig(r=PEFT_RANK, lora_alpha=2 * PEFT_RANK, target_modules=list(TARGETS),
                             lora_dropout=0.0, bias="none", init_lora_weights=False, task_type="CAUSAL_LM")
    names = [f"a{k}" for k in range(count)]
    sync()
    t0 = time.perf_counter()
    with torch.device(device), default_dtype(base.dtype):
        model = peft.get_peft_model(base, config, adapter_name=names[0], autocast_adapter_dtype=False)
        for name in names[1:]:
            model.add_adapter(name, config, autocast_adapter_dtype=False)
    sync()
    return model.eval(), names, time.perf_counter() - t0


def peft_rate(base: LlamaForCausalLM, ids: torch.Tensor, adapters: int, new_tokens: int, device: str) -> dict:
    """PEFT's mixed-batch decode rate with row r on adapter r % `adapters`; `base` is left as it was."""
    model, names, setup_s = add_peft_adapters(base, adapters, device)
    per_row = [names[r % adapters] for r in range(ids.shape[0])]
    rate = decode_rate(model, ids, new_tokens, adapter_names=per_row)
    model.unload()
    return {**rate, "adapter_setup_s": round(setup_s, 2)}


def free_device_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
        print(f"peers done: {torch.cuda.memory_allocated() / 2**30:.2f} GiB still allocated on the GPU")


def peer_rows(shape: dict, device: str, batch: int, prompt_len: int, new_tokens: int,
              peft_adapters: list[int], peft_new_tokens: int) -> list[dict]:
    """transformers generate (base only) and PEFT mixed batches, one row each; frees the GPU after."""
    base = build_base(shape, device)
    vocab = shape["vocab_size"]
    ids = batch_prompts(batch, prompt_len, vocab, device)
    common = {"prompt_len": prompt_len, "batch": batch}
    versions = {"transformers": transformers.__version__, "peft": peft.__version__}
    rows = [{"workload": "transformers generate base-only", "peer": "transformers", "adapters": 0, **common,
             "new_tokens": new_tokens, **decode_rate(base, ids, new_tokens),
             "ttft_ms_512": ttft_ms(base, vocab, device),
             "attn_implementation": base.config._attn_implementation, **versions}]
    rows += [{"workload": "peft mixed batch", "peer": "peft", "adapters": d, **common,
              "new_tokens": peft_new_tokens, **peft_rate(base, ids, d, peft_new_tokens, device), **versions}
             for d in peft_adapters]
    del base, ids
    free_device_memory(device)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'workload':<32} {'adapters':>8} {'prompt':>6} {'batch':>5} {'new':>4} {'tok/s':>10} "
          f"{'step ms':>9}")
    for r in rows:
        print(f"{r['workload']:<32} {r['adapters']:>8} {r['prompt_len']:>6} {r['batch']:>5} "
              f"{r['new_tokens']:>4} {r['tokens_per_s']:>10,.0f} {r['decode_step_ms']:>9}")
    for r in rows:
        if "ttft_ms_512" in r:
            print(f"transformers time to first token, one 512-token prompt: {r['ttft_ms_512']} ms")
        if "adapter_setup_s" in r:
            print(f"peft: creating {r['adapters']} adapters took {r['adapter_setup_s']} s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--peft-adapters", default="1,8", help="adapter counts for the PEFT mixed batch")
    ap.add_argument("--peft-new-tokens", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU: checks the script only")
    ap.add_argument("--out", type=Path, default=None, help="default bench/results/engine-peers-h200.json, "
                    "or /tmp/engine-peers-tiny.json with --tiny")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    out = args.out or (Path("/tmp/engine-peers-tiny.json") if args.tiny
                       else Path(__file__).parent / "results" / "engine-peers-h200.json")
    t0 = time.perf_counter()
    peft_adapters = [int(x) for x in args.peft_adapters.split(",") if x]
    rows = peer_rows(TINY_SHAPE if args.tiny else SEED_SHAPE, device, args.batch, args.prompt_len,
                     args.new_tokens, peft_adapters, args.peft_new_tokens)
    print_table(rows)
    print(f"all peers took {time.perf_counter() - t0:.1f} s")
    result = {"machine": torch.cuda.get_device_name() if device == "cuda" else "cpu (--tiny smoke run)",
              "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
              "date": time.strftime("%Y-%m-%d"), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
