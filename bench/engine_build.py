"""The engine the benchmarks time, at the seed guide's 7.8B shape, with random weights and adapters.

Random bf16 weights are built directly on the GPU (fp32 on the CPU) and loaded through the engine's
own loading path; nothing is downloaded. Adapters are random bf16 LoRA weights on all 7 projections
(rank 16 in the benchmarks), registered as a0, a1, ... TINY_SHAPE is the shape of --tiny CPU smoke runs.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from bench.engine_workload import adapter_sets, decode_run
from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.lora.adapter import LoraWeights, ModuleWeights
from lorafleet.worker.server.gc_freeze import freeze_startup_objects

SEED_SHAPE = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=100_000, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, torch_dtype="bfloat16",
)
TINY_SHAPE = dict(SEED_SHAPE, vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # --tiny: a CPU smoke run
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_weights(config: ModelConfig, device: str):
    """Hugging Face names -> random bf16 tensors made on the GPU (nothing is downloaded)."""
    g = torch.Generator(device=device).manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32

    def rnd(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=g) * 0.02

    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    yield "model.embed_tokens.weight", rnd(config.vocab_size, h)
    yield "model.norm.weight", torch.ones(h, device=device, dtype=dtype)
    yield "lm_head.weight", rnd(config.vocab_size, h)
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        for name, shape in (("self_attn.q_proj", (q, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, q)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i))):
            yield p + name + ".weight", rnd(*shape)
        yield p + "input_layernorm.weight", torch.ones(h, device=device, dtype=dtype)
        yield p + "post_attention_layernorm.weight", torch.ones(h, device=device, dtype=dtype)


def random_adapter(config: ModelConfig, rank: int, seed: int) -> LoraWeights:
    g = torch.Generator().manual_seed(seed)
    w = LoraWeights(path=f"<random:{seed}>", rank=rank, alpha=2.0 * rank, use_rslora=False, digest=f"sha256:{seed:064x}")
    for layer in range(config.num_layers):
        for t in TARGETS:
            out, in_ = config.linear_shape(t)
            w.modules[(layer, t)] = ModuleWeights(
                a=torch.randn(rank, in_, generator=g, dtype=torch.bfloat16) * 0.01,
                b=torch.randn(out, rank, generator=g, dtype=torch.bfloat16) * 0.01, scaling=2.0)
    return w


def register_random_adapters(engine: LLMEngine, config: ModelConfig, count: int, rank: int) -> list[str]:
    """Register `count` random adapters a0, a1, ... (seeded by their index) -> their names."""
    names = [f"a{k}" for k in range(count)]
    for k, name in enumerate(names):
        engine.registry.register(name, random_adapter(config, rank, seed=k))
    return names


def full_vocab_tokenizer(out: Path, vocab_size: int) -> Path:
    """A byte-level BPE tokenizer of `vocab_size` entries in `out` (the demo's specials and config,
    the 256 bytes, then the lower-case words of 2, 3 and 4 letters in order, each one merge): a real
    model's vocabulary size, where the demo tokenizer has 512. Structured outputs' per-token work
    follows the tokenizer's size: with the demo's 512 entries padded to the seed's 100,000, xgrammar's
    accept_token took 19 µs a token on the development machine, against 1.7 µs with this one."""
    import itertools
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from lorafleet.worker.demo_assets import build_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out)  # tokenizer_config.json: the same specials and chat template
    specials = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    merges = []
    words = (map("".join, itertools.product(string.ascii_lowercase, repeat=n)) for n in (2, 3, 4))
    for word in itertools.islice(itertools.chain.from_iterable(words), max(0, vocab_size - len(vocab))):
        vocab[word] = len(vocab)
        merges.append((word[:-1], word[-1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(out / "tokenizer.json"))
    return out


def build_engine(args, device: str, n_slots: int) -> tuple[LLMEngine, ModelConfig, float]:
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(TINY_SHAPE if args.tiny else SEED_SHAPE))
    from lorafleet.worker.demo_assets import build_tokenizer

    build_tokenizer(folder)  # only to satisfy the folder layout: the benchmark feeds token ids
    model_config = ModelConfig.from_folder(folder)
    config = EngineConfig(max_loras=max(n_slots, 1), max_cpu_loras=n_slots + 8, max_lora_rank=args.rank,
                          max_num_seqs=args.batch, max_num_batched_tokens=8192, device=device, dtype="bfloat16",
                          max_loras_per_request=1, num_kv_blocks=512 if args.tiny else None,
                          cuda_graphs=None if device == "cuda" else "eager" not in args.modes.split(","),
                          quantization=getattr(args, "quantization", None))
    t0 = time.perf_counter()
    engine = LLMEngine(folder, config, weights=random_weights(model_config, device))
    freeze_startup_objects()  # as the worker does once its engine is built (worker/server/gc_freeze.py)
    return engine, model_config, time.perf_counter() - t0


def experiment_engine(batch: int, adapters: int) -> tuple[LLMEngine, list[str]]:
    """The seed-shape async engine the one-engine experiments time variants on (bench/overlap_sweep.py,
    bench/decode_ab.py): `adapters` random rank-16 adapters registered, one warm-up run done."""
    args = argparse.Namespace(tiny=False, rank=16, batch=batch, modes="async")
    engine, model_config, _ = build_engine(args, "cuda", max(adapters, 1))
    names = register_random_adapters(engine, model_config, max(adapters, 1), 16)
    assert engine.runner.graphs is not None and engine.async_steps.enabled
    decode_run(engine, adapter_sets(names, len(names), batch), 16, 4)  # JIT and allocator
    return engine, names
