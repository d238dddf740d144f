"""Decode throughput of each model family at an ~8B shape of its own, through the engine (issue 50).

    python -m bench.engine_models [--archs llama,qwen3,gemma2] [--adapters 0,64] [--dora-archs llama]
                                  [--batch 64] [--rank 16] [--prompt-len 128] [--new-tokens 64] [--out-dir D]

Each family's engine is built in turn with random bf16 weights under its own checkpoint names
(made on the GPU, loaded through the engine's loading path; nothing is downloaded), with the
engine's defaults on CUDA (Triton LoRA and attention, CUDA graphs, warm-up), then freed. Rows:
{arch, adapter_kind, adapters, batch, rank, tokens_per_s, weight_bytes, bytes_rate, vs_llama,
kv_bytes, step_bytes, vs_llama_step_bytes}, where bytes_rate = tokens_per_s × weight_bytes (the
same fraction of the memory bound reads as the same rate whatever the shape; issue 50's metric) and
vs_llama is that over Llama's at the seed shape with the same adapters. The step columns count what
a decode step reads besides the weights: kv_bytes is the K and V of the batch at the decode phase's
mean context, prompt + new_tokens / 2 (bench/engine_fp8.py's `kv_bytes`; Gemma 2's heads of 256
make it twice Llama's), step_bytes = the weights a step reads (all but the embedding table, of which
it reads B rows, unless the table is the tied lm_head) + kv_bytes, and vs_llama_step_bytes is
tokens_per_s × step_bytes over Llama's. adapter_kind is "base" (no adapters), "lora", or "dora"
(for the families of --dora-archs: the same batch with as many DoRA adapters, random magnitudes,
whose g = m / ||W + s·BA|| the registry computes at registration; the LoRA side path plus DoRA's
per-token epilogue).
Writes bench/results/engine-models-<gpu>.json.

Shapes: Llama is the seed guide's 7.8B; Qwen3 is Qwen3-8B's (hidden 4096, 32 heads over 8 KV heads
of 128, MLP 12288, vocab 151936, q/k norms, untied) at 32 layers; Gemma 2 is Gemma 2 9B's head
and MLP (16 heads over 8 KV heads of 256, MLP 14336, vocab 256000 tied, soft-capping, a
4096-token window on alternate layers) at hidden 4096 and 32 layers.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_build import SEED_SHAPE, random_adapter, register_random_adapters
from bench.engine_fp8 import kv_bytes
from bench.engine_workload import adapter_sets, decode_run
from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.lora.weights import LoraWeights

SHAPES: dict[str, dict] = {
    "llama": SEED_SHAPE,
    "qwen3": dict(SEED_SHAPE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151_936,
                  intermediate_size=12_288, rope_theta=1_000_000.0, rms_norm_eps=1e-6),
    "gemma2": dict(SEED_SHAPE, model_type="gemma2", architectures=["Gemma2ForCausalLM"], vocab_size=256_000,
                   num_attention_heads=16, num_key_value_heads=8, head_dim=256, intermediate_size=14_336,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, sliding_window=4096, tie_word_embeddings=True,
                   rope_theta=10_000.0, rms_norm_eps=1e-6),
}


def tiny(shape: dict) -> dict:
    """--tiny: the family's shape cut down for a CPU smoke run (checks the script, measures nothing)."""
    heads = 4
    kv = 2
    return dict(shape, vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=heads, num_key_value_heads=kv, head_dim=16,
                **({"query_pre_attn_scalar": 16, "sliding_window": 8} if shape["model_type"] == "gemma2" else {}))


def random_weights(config: ModelConfig, device: str):
    """The family's Hugging Face names -> random tensors made on the device."""
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g) * 0.02

    def norm(n: int) -> torch.Tensor:  # Gemma's weights are offsets from 1
        return torch.full((n,), 0.0 if config.model_type.startswith("gemma") else 1.0, device=device, dtype=dtype)

    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    yield "model.embed_tokens.weight", rnd(config.vocab_size, h)
    yield "model.norm.weight", norm(h)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", rnd(config.vocab_size, h)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i))):
            yield p + name + ".weight", rnd(*shape)
        norms = ["input_layernorm", "post_attention_layernorm"]
        if config.model_type == "gemma2":
            norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
        for name in norms:
            yield p + name + ".weight", norm(h)
        if config.qk_norm:
            yield p + "self_attn.q_norm.weight", norm(config.head_dim)
            yield p + "self_attn.k_norm.weight", norm(config.head_dim)


def random_dora_adapter(config: ModelConfig, rank: int, seed: int) -> LoraWeights:
    """`random_adapter` with a DoRA magnitude per output row, near the rows' norms of
    `random_weights` (0.02 · sqrt(in)), so g stays near 1."""
    w = random_adapter(config, rank, seed)
    w.dora, w.path = True, f"<random-dora:{seed}>"
    g = torch.Generator().manual_seed(10_000 + seed)
    for m in w.modules.values():
        out, in_ = m.b.shape[0], m.a.shape[1]
        m.magnitude = 0.02 * in_ ** 0.5 * (1 + 0.05 * torch.randn(out, generator=g))
    return w


def weights_read(model) -> int:
    """The weight bytes a decode step reads: all but the embedding table (B rows of it are read),
    unless the table is also the lm_head (tied embeddings: read whole by the logits)."""
    w = model.weights
    tied = w["lm_head"].data_ptr() == w["embed"].data_ptr()
    return model.weight_bytes() - (0 if tied else w["embed"].numel() * w["embed"].element_size())


def build(shape: dict, device: str, batch: int, rank: int, n_slots: int, n_registered: int) -> LLMEngine:
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(shape))
    from lorafleet.worker.demo_assets import build_tokenizer

    build_tokenizer(folder)  # the folder layout only: the benchmark feeds token ids
    model_config = ModelConfig.from_folder(folder)
    config = EngineConfig(max_loras=max(n_slots, 1), max_cpu_loras=n_registered + 8, max_lora_rank=rank,
                          max_num_seqs=batch, max_num_batched_tokens=8192, device=device, dtype="bfloat16",
                          max_loras_per_request=1, num_kv_blocks=512 if device == "cpu" else None)
    return LLMEngine(folder, config, weights=random_weights(model_config, device))


def family_rows(arch: str, shape: dict, device: str, args) -> list[dict]:
    counts = [int(x) for x in args.adapters.split(",") if x]
    t0 = time.perf_counter()
    n = max(counts + [1])
    # Every registered adapter stays in the CPU tier: the random ones have no folder to be read again from.
    engine = build(shape, device, args.batch, args.rank, n, 2 * n if arch in args.dora_archs.split(",") else n)
    names = register_random_adapters(engine, engine.model_config, n, args.rank)
    kinds = [("lora", names)]
    if arch in args.dora_archs.split(","):
        t1 = time.perf_counter()
        dora = [f"d{k}" for k in range(n)]
        for k, name in enumerate(dora):
            engine.registry.register(name, random_dora_adapter(engine.model_config, args.rank, seed=k))
        kinds.append(("dora", dora))
        print(f"{arch}: {len(dora)} DoRA adapters' norms in {time.perf_counter() - t1:.1f}s", flush=True)
    weight_bytes = engine.model.weight_bytes()
    kv = kv_bytes(engine.model_config, args.batch, args.prompt_len + args.new_tokens / 2)
    step_bytes = weights_read(engine.model) + kv
    print(f"{arch}: built in {time.perf_counter() - t0:.1f}s, weights {weight_bytes / 2**30:.2f} GiB", flush=True)
    rows = []
    for d in counts:
        for kind, kind_names in kinds if d else [("base", names)]:
            sets = adapter_sets(kind_names, d, args.batch)
            decode_run(engine, sets, args.prompt_len, min(args.new_tokens, 8))  # JIT, allocator, graph capture
            res = decode_run(engine, sets, args.prompt_len, args.new_tokens)
            rows.append({"arch": arch, "adapter_kind": kind, "adapters": d, "batch": args.batch,
                         "rank": args.rank, "tokens_per_s": res["tokens_per_s"], "weight_bytes": weight_bytes,
                         "decode_step_ms": res["decode_step_ms"], "prompt_len": args.prompt_len,
                         "bytes_rate": res["tokens_per_s"] * weight_bytes, "kv_bytes": kv,
                         "step_bytes": step_bytes, "step_bytes_rate": res["tokens_per_s"] * step_bytes})
            print(f"{arch:<8} {kind:<4} adapters {d:>3}: {res['tokens_per_s']:>9,.0f} tok/s, "
                  f"step {res['decode_step_ms']} ms", flush=True)
    del engine
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--archs", default="llama,qwen3,gemma2")
    ap.add_argument("--adapters", default="0,64", help="distinct adapters in the batch (0: base only)")
    ap.add_argument("--dora-archs", default="llama", help="families also run with DoRA adapters ('' for none)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU: checks the script, measures nothing")
    ap.add_argument("--out", type=Path, default=None, help="default: <--out-dir>/engine-models-<gpu>.json")
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    gpu = "cpu" if args.tiny else torch.cuda.get_device_name().split()[1].lower()  # "NVIDIA H100 ..." -> h100
    out = args.out or args.out_dir / f"engine-models-{gpu}.json"
    rows: list[dict] = []
    for arch in [a for a in args.archs.split(",") if a]:
        shape = tiny(SHAPES[arch]) if args.tiny else SHAPES[arch]
        rows += family_rows(arch, shape, device, args)
        write(out, device, rows)  # after each family: a run cut short keeps the families it finished
    print(f"\n{'arch':<8} {'kind':<5} {'adapters':>8} {'tok/s':>10} {'weights GiB':>12} {'KV GiB':>7} {'step GiB':>9}"
          f" {'tok/s x weights vs llama':>25} {'tok/s x step vs llama':>22} {'vs lora':>8}")
    for r in rows:
        print(f"{r['arch']:<8} {r['adapter_kind']:<5} {r['adapters']:>8} {r['tokens_per_s']:>10,.0f} "
              f"{r['weight_bytes'] / 2**30:>12.2f} {r['kv_bytes'] / 2**30:>7.2f} {r['step_bytes'] / 2**30:>9.2f} "
              f"{_or_dash(r['vs_llama']):>25} {_or_dash(r['vs_llama_step_bytes']):>22} {r.get('vs_lora', '-'):>8}")
    print(f"wrote {out}")


def _or_dash(value) -> str:
    return "-" if value is None else str(value)


def write(out: Path, device: str, rows: list[dict]) -> None:
    """The JSON of the rows so far, each with its ratios to Llama's (and DoRA's to LoRA's) where measured."""
    llama = {(r["adapter_kind"], r["adapters"]): r for r in rows if r["arch"] == "llama"}
    lora = {(r["arch"], r["adapters"]): r["tokens_per_s"] for r in rows if r["adapter_kind"] == "lora"}
    for r in rows:
        ref = llama.get((r["adapter_kind"], r["adapters"]))
        r["vs_llama"] = round(r["bytes_rate"] / ref["bytes_rate"], 3) if ref else None
        r["vs_llama_step_bytes"] = round(r["step_bytes_rate"] / ref["step_bytes_rate"], 3) if ref else None
        if r["adapter_kind"] == "dora" and (r["arch"], r["adapters"]) in lora:
            r["vs_lora"] = round(r["tokens_per_s"] / lora[(r["arch"], r["adapters"])], 3)
    result = {"machine": torch.cuda.get_device_name() if device == "cuda" else "cpu (--tiny smoke run)",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
