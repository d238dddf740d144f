"""Engine decode throughput on a GPU at the seed guide's 7.8B shape (issue 9's benchmark).

    python -m bench.engine [--adapters 1,8,32,64] [--prompt-lens 128,512] [--new-tokens 128]
                           [--modes graphs,async,eager] [--peers] [--adapter-load 10] [--breakdown 8,64]

Random bf16 weights are built directly on the GPU and loaded through the engine's own loading
path; adapters are random rank-16 on all 7 projections. Prints a table and writes
bench/results/engine-h200.json: {machine, copy bandwidth, ceiling, ttft, rows, breakdown,
peers, adapter_load}. Rows are {workload, mode, adapters, prompt_len, tokens_per_s,
decode_step_ms, batch_ttft_ms_median / _max (all requests submitted at once), ceiling_tokens_per_s, of_ceiling,
of_ceiling_all_weights, vs_base}; the ceiling is the weight bytes a decode step reads (all but the
embedding table, of which it reads B rows) over the copy bandwidth measured in the same run; issue 9
defines its ceiling with every weight byte (the embedding table too: a lower ceiling), reported
beside it. `mode` is graphs (the engine's default on CUDA: synchronous steps from
CUDA graphs), async (the same with async scheduling, `worker/async_step.py`: the next step is
launched before this one's tokens are read) or eager (graphs off); each listed mode is timed on
the same engine (--modes, default graphs,async).

--breakdown: for each listed adapter count, where a decode step's time goes: the GPU kernels of a
few eager steps under torch.profiler, summed per class (base matmuls, LoRA, attention, other)
by kernel name; the graph replay alone (CUDA events); and the whole step (host included).
--peers: transformers `generate` and PEFT's mixed-adapter batch on the same shape and batch
(bench/engine_peers.py), run first, before the engine takes the GPU's memory.
--adapter-load N: cold adapter loads (bench/adapter_load.py) on this engine, N repeats.
A step holds at most `--batch` distinct adapters, so counts above the batch are not run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
import time
from pathlib import Path

import torch

from lorafleet.kernels import lora_linear
from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.engine import LLMEngine
from lorafleet.worker.gc_freeze import freeze_startup_objects
from lorafleet.worker.lora.adapter import LoraWeights, ModuleWeights
from lorafleet.worker.sequence import SamplingParams

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


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted), median of repeats."""
    n = 1 << 30 if device == "cuda" else 1 << 24
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(10):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n / times[len(times) // 2]


_PROMPTS = itertools.count()  # every prompt of a run differs from all others: no prefix-cache hits


def fresh_prompt(engine: LLMEngine, prompt_len: int) -> list[int]:
    """A prompt no earlier one of this process shares a block with: its first three tokens spell a
    running count in base `vocab`."""
    vocab = engine.model_config.vocab_size - 10
    n = next(_PROMPTS)
    digits = [(n // vocab**i) % vocab for i in range(3)]  # n in base `vocab`: unique below vocab**3
    return [10 + (digits[j] if j < 3 else n * 7919 + j * 31) % vocab for j in range(prompt_len)]


def decode_run(engine: LLMEngine, adapter_sets, prompt_len: int, new_tokens: int) -> dict:
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    hits0 = engine.blocks.prefix_hits
    sync()
    submitted = time.perf_counter()
    for adapters in adapter_sets:
        engine.add_request(fresh_prompt(engine, prompt_len), sp, adapters)
    first: dict[int, float] = {}  # request -> seconds from submission to its first token on the host
    # Timed as one phase, from the first all-decode step to idle, without a sync per step: with
    # async scheduling a step's outputs come from the step launched before it, and a sync after
    # each step() would stall the pipeline. (num_uncomputed is 0 for a token still in flight.)
    decode_tokens, t0 = 0, None
    while engine.has_unfinished():
        if t0 is None and engine.scheduler.running and not engine.scheduler.waiting and all(
                s.num_uncomputed <= 1 for s in engine.scheduler.running):
            sync()
            t0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            first.setdefault(out.request_id, now - submitted)
        if t0 is not None:
            decode_tokens += len(outs)
    sync()
    decode_time = time.perf_counter() - t0
    firsts = sorted(first.values())
    return {"tokens_per_s": round(decode_tokens / decode_time, 1),
            "decode_step_ms": round(1e3 * decode_time / max(1, decode_tokens / len(adapter_sets)), 2),
            # the whole batch submitted at once: its prefill steps, then the first sampled tokens
            "batch_ttft_ms_median": round(1e3 * firsts[len(firsts) // 2], 2), "batch_ttft_ms_max": round(1e3 * firsts[-1], 2),
            "prefix_hit_tokens": engine.blocks.prefix_hits - hits0}


def ttft(engine: LLMEngine, prompt_len: int, count: int = 1) -> float:
    """ms from submitting `count` new prompts at once (nothing of them cached) to the last one's
    first token on the host."""
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    hits0 = engine.blocks.prefix_hits
    for _ in range(count):
        engine.add_request(fresh_prompt(engine, prompt_len), sp)
    sync()
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    sync()
    elapsed = (time.perf_counter() - t0) * 1e3
    if engine.blocks.prefix_hits != hits0:  # (the earlier benchmark re-sent one prompt: a cached prefill)
        raise RuntimeError("a TTFT prompt hit the prefix cache")
    return elapsed


KERNEL_CLASSES = (  # (class, substrings of CUDA kernel names), first match wins
    ("lora", ("_lora_shrink", "_lora_expand")),
    ("attention", ("paged", "attention", "attn", "flash", "fmha", "sdpa")),
    ("base matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "matmul")),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def start_decode(engine: LLMEngine, adapter_sets, prompt_len: int, new_tokens: int) -> None:
    """Queue the batch and run its prefill steps, so every later step is an all-decode step."""
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for adapters in adapter_sets:
        engine.add_request(fresh_prompt(engine, prompt_len), sp, adapters)
    while engine.scheduler.waiting or any(s.num_uncomputed > 1 for s in engine.scheduler.running):
        engine.step()


def profiled(engine: LLMEngine, run, steps: int) -> dict:
    """Kernel time per step by class while `run()` does `steps` steps (CPU op time on CPU: smoke)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if engine.device.type == "cuda" else ProfilerActivity.CPU
    sync()
    t0 = time.perf_counter()
    with profile(activities=[activity]) as prof:
        run()
        sync()
    wall = time.perf_counter() - t0
    per_class = {cls: 0.0 for cls, _ in KERNEL_CLASSES} | {"other": 0.0}
    launches = 0
    for avg in prof.key_averages():
        us = avg.self_device_time_total if activity == ProfilerActivity.CUDA else avg.self_cpu_time_total
        if us > 0:
            per_class[kernel_class(avg.key)] += us
            launches += avg.count
    result = {f"{cls}_ms": round(us / 1e3 / steps, 3) for cls, us in per_class.items()}
    result["kernels_ms"] = round(sum(per_class.values()) / 1e3 / steps, 3)
    result["launches_per_step"] = round(launches / steps)
    result["profiled_wall_ms"] = round(wall * 1e3 / steps, 3)
    return result


def host_profile(run, top: int = 14) -> list[str]:
    """cProfile of `run()`: the `top` functions by cumulative time, as 'ms  calls  function' lines."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    sync()
    prof.enable()
    run()
    sync()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][3], reverse=True)[:top]  # (cc, nc, tt, ct, callers)
    return [f"{ct * 1e3:8.2f} ms {nc:6d}  {Path(f).name}:{line}({fn})" for (f, line, fn), (_cc, nc, _tt, ct, _c) in rows]


def step_breakdown(engine: LLMEngine, adapter_sets, prompt_len: int, steps: int = 6) -> dict:
    """Per decode step: GPU kernel time by class (eager, profiled), graph replay alone, whole step."""
    graphs = engine.runner.graphs
    start_decode(engine, adapter_sets, prompt_len, 5 * steps + 8)
    if graphs is not None:
        graphs.enabled = False
    engine.step()
    sync()
    result = profiled(engine, lambda: [engine.step() for _ in range(steps)], steps)
    if graphs is not None and graphs.capture:
        graphs.enabled = True
        for _ in range(2):
            engine.step()  # capture, then a plain replay
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        result["graph_step_ms"] = round((time.perf_counter() - t0) * 1e3 / steps, 3)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):  # same inputs again: rewrites the same K/V, so harmless
            graphs.last.graph.replay()
        end.record()
        sync()
        result["graph_replay_ms"] = round(start.elapsed_time(end) / steps, 3)
        result["host_ms"] = round(result["graph_step_ms"] - result["graph_replay_ms"], 3)
        engine.async_steps.enabled = True  # the same steps pipelined: host work behind the GPU's
        engine.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        sync()
        engine.async_steps.enabled = False
        result["async_step_ms"] = round((time.perf_counter() - t0) * 1e3 / steps, 3)
    while engine.has_unfinished():
        engine.step()
    return result


def build_engine(args, device: str, n_slots: int) -> tuple[LLMEngine, ModelConfig, float]:
    folder = Path(tempfile.mkdtemp())
    (folder / "config.json").write_text(json.dumps(TINY_SHAPE if args.tiny else SEED_SHAPE))
    from lorafleet.worker.demo_assets import build_tokenizer

    build_tokenizer(folder)  # only to satisfy the folder layout: the benchmark feeds token ids
    model_config = ModelConfig.from_folder(folder)
    config = EngineConfig(max_loras=max(n_slots, 1), max_cpu_loras=n_slots + 8, max_lora_rank=args.rank,
                          max_num_seqs=args.batch, max_num_batched_tokens=8192, device=device, dtype="bfloat16",
                          max_loras_per_request=1, num_kv_blocks=512 if args.tiny else None,
                          cuda_graphs=None if device == "cuda" else "eager" not in args.modes.split(","))
    t0 = time.perf_counter()
    engine = LLMEngine(folder, config, weights=random_weights(model_config, device))
    freeze_startup_objects()  # as the worker does once its engine is built (worker/gc_freeze.py)
    return engine, model_config, time.perf_counter() - t0


def guarded(label: str, run) -> list[dict]:
    """run() -> rows; a failure becomes one error row, so one broken part does not lose the run."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - recorded in the results and printed
        import traceback

        traceback.print_exc()
        print(f"{label} failed: {exc!r}", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [{"error": f"{label}: {exc!r}"}]


def adapter_sets(names: list[str], d: int, batch: int):
    return [()] * batch if d == 0 else [((names[r % d], 1.0),) for r in range(batch)]


def experiment_engine(batch: int, adapters: int) -> tuple[LLMEngine, list[str]]:
    """The seed-shape async engine the one-engine experiments time variants on (bench/overlap_sweep.py,
    bench/decode_ab.py): `adapters` random rank-16 adapters registered, one warm-up run done."""
    args = argparse.Namespace(tiny=False, rank=16, batch=batch, modes="async")
    engine, model_config, _ = build_engine(args, "cuda", max(adapters, 1))
    names = register_random_adapters(engine, model_config, max(adapters, 1), 16)
    assert engine.runner.graphs is not None and engine.async_steps.enabled
    decode_run(engine, adapter_sets(names, len(names), batch), 16, 4)  # JIT and allocator
    return engine, names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--adapters", default="1,8,32,64")
    ap.add_argument("--prompt-lens", default="128,512")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--modes", default="graphs,async",
                    help="comma-separated, each timed on the same engine: graphs (synchronous steps), async "
                         "(graphs + async scheduling), eager")
    ap.add_argument("--breakdown", default="0,8,64", help="adapter counts to break a decode step down for ('' = none)")
    ap.add_argument("--peers", action="store_true", help="also run transformers generate and PEFT's mixed batch")
    ap.add_argument("--peft-adapters", default="1,8")
    ap.add_argument("--adapter-load", type=int, default=0, metavar="N", help="cold adapter load timings, N repeats")
    ap.add_argument("--tiny", action="store_true", help="tiny shape on CPU: checks the script, measures nothing")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "engine-h200.json")
    args = ap.parse_args()
    device = "cpu" if args.tiny else "cuda"
    modes = [m for m in args.modes.split(",") if m]
    adapter_counts = [d for d in (int(x) for x in args.adapters.split(",") if x) if d <= args.batch]
    prompt_lens = [int(x) for x in args.prompt_lens.split(",") if x]
    breakdown_counts = [int(x) for x in args.breakdown.split(",") if x]

    peers = []
    if args.peers:
        from bench.engine_peers import peer_rows

        peers = guarded("peers", lambda: peer_rows(
            TINY_SHAPE if args.tiny else SEED_SHAPE, device, args.batch, prompt_lens[0], args.new_tokens,
            [int(x) for x in args.peft_adapters.split(",") if x], 32))
    n_slots = max(adapter_counts + breakdown_counts + [1])
    engine, model_config, load_s = build_engine(args, device, n_slots)
    weight_bytes = engine.model.weight_bytes()
    names = register_random_adapters(engine, model_config, n_slots, args.rank)
    bw = copy_bandwidth(device)
    # Bytes a decode step must read: every weight except the embedding table (only B rows are read).
    step_bytes = weight_bytes - model_config.vocab_size * model_config.hidden_size * 2
    ceiling = args.batch * bw / step_bytes
    # Issue 9 defines its ceiling with every weight byte (14.53 GiB at the seed shape), the
    # embedding table too: a lower ceiling than the bytes a step reads. Both are reported.
    ceiling_all = args.batch * bw / weight_bytes
    print(f"weights {weight_bytes / 2**30:.2f} GiB (step reads {step_bytes / 2**30:.2f} GiB), load {load_s:.1f}s, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s, ceiling {ceiling:,.0f} tok/s at batch {args.batch} "
          f"({ceiling_all:,.0f} with every weight byte, as issue 9 defines it)")
    print(f"memory plan: {engine.memory_plan}")

    # Warm-up at the measured shapes: the first pass over each context length pays for the
    # allocator and kernel selection (seen: a cold first workload ran 2.4x slower), and Triton JITs.
    for plen in prompt_lens:
        decode_run(engine, [()] * args.batch, plen, args.new_tokens)
    decode_run(engine, adapter_sets(names, len(names), args.batch), 16, 4)
    rows = []
    graphs = engine.runner.graphs
    for mode in modes:
        if graphs is not None:
            graphs.enabled = mode in ("graphs", "async")
        engine.async_steps.enabled = mode == "async"
        for plen in prompt_lens:
            for d in [0] + adapter_counts:
                label = "base-only" if d == 0 else f"{d} adapters"
                sets = adapter_sets(names, d, args.batch)
                decode_run(engine, sets, plen, min(args.new_tokens, 16))  # JIT, allocator and graph capture
                res = decode_run(engine, sets, plen, args.new_tokens)
                row = {"workload": label, "mode": mode, "adapters": d, "prompt_len": plen, "batch": args.batch,
                       "new_tokens": args.new_tokens, **res, "ceiling_tokens_per_s": round(ceiling, 1),
                       "of_ceiling": round(res["tokens_per_s"] / ceiling, 4),
                       "of_ceiling_all_weights": round(res["tokens_per_s"] / ceiling_all, 4)}
                rows.append(row)
                print(f"{label:<14} {mode:<6} prompt {plen:>4}: {res['tokens_per_s']:>9,.0f} tok/s  "
                      f"step {res['decode_step_ms']:>7} ms", flush=True)
    if graphs is not None:
        graphs.enabled = modes != ["eager"]
    engine.async_steps.enabled = False  # TTFT and the breakdown time synchronous steps (and async_step_ms)
    ttft_ms = [ttft(engine, 512) for _ in range(5)]
    print(f"time to first token, 512 tokens, 5 runs: {[round(t, 2) for t in ttft_ms]} ms", flush=True)
    ttft_breakdown = profiled(engine, lambda: ttft(engine, 512), 1)
    print(f"time to first token, 512 tokens, by kernel class: {ttft_breakdown}", flush=True)
    ttft_host = host_profile(lambda: ttft(engine, 512))
    print("time to first token, 512 tokens, host functions by cumulative time:\n  " + "\n  ".join(ttft_host), flush=True)
    breakdown = []
    for d in breakdown_counts:
        sets = adapter_sets(names, d, args.batch)
        parts = guarded(f"breakdown {d}", lambda sets=sets: [step_breakdown(engine, sets, prompt_lens[0])])
        breakdown.append({"adapters": d, "prompt_len": prompt_lens[0], **parts[0]})
        print(f"breakdown {d} adapters: {breakdown[-1]}", flush=True)
    load = []
    if args.adapter_load:
        from bench.adapter_load import load_rows

        # The profiles above left objects behind that a serving worker never holds: out of the
        # cycle collector with the rest, so its full collections cost what a worker's do.
        freeze_startup_objects()
        load = guarded("adapter load", lambda: load_rows(engine, model_config, device, args.adapter_load))
    base = {(r["mode"], r["prompt_len"]): r["tokens_per_s"] for r in rows if r["adapters"] == 0}
    for r in rows:
        r["vs_base"] = round(r["tokens_per_s"] / base[(r["mode"], r["prompt_len"])], 3)
    result = {
        "machine": torch.cuda.get_device_name() if device == "cuda" else "cpu (--tiny smoke run)", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
        "copy_bandwidth_tb_s": round(bw / 1e12, 3), "weight_gib": round(weight_bytes / 2**30, 3),
        "ceiling_tokens_per_s": round(ceiling, 1), "step_read_gib": round(step_bytes / 2**30, 3),
        "ceiling_all_weights_tokens_per_s": round(ceiling_all, 1), "ttft_ms_512": round(sorted(ttft_ms)[len(ttft_ms) // 2], 2),
        "ttft_ms_512_runs": [round(t, 2) for t in ttft_ms], "ttft_breakdown": ttft_breakdown, "ttft_host": ttft_host,
        "lora_backend": engine.model.lora_backend, "attention_backend": engine.model.attention_backend,
        "blas": torch.backends.cuda.preferred_blas_library().name.lower() if device == "cuda" else None,
        "lora_overlap_max_chunks": lora_linear.OVERLAP_MAX_CHUNKS, "gemm_sm_carveout": lora_linear.GEMM_SM_CARVEOUT,
        "warmup_s": None if engine.warmup_s is None else round(engine.warmup_s, 2),
        "cuda_graphs": None if graphs is None else {
            "buckets": graphs.buckets, "captures": graphs.stats.captures, "replays": graphs.stats.replays,
            "capture_s": round(graphs.stats.capture_s, 2)},
        "memory_plan": engine.memory_plan,
        "async_scheduling": {
            "launched": engine.async_steps.stats.launched, "overlapped": engine.async_steps.stats.overlapped,
            "fallbacks": dict(engine.async_steps.stats.fallbacks)},
        "rows": rows, "breakdown": breakdown, "peers": peers, "adapter_load": load,
    }
    print(f"\n{'workload':<14} {'mode':<6} {'prompt':>6} {'tok/s':>10} {'vs base':>8} {'ceiling':>10} {'of it':>6} "
          f"{'of all-weights ceiling':>22}")
    for r in rows:
        print(f"{r['workload']:<14} {r['mode']:<6} {r['prompt_len']:>6} {r['tokens_per_s']:>10,.0f} {r['vs_base']:>8} "
              f"{r['ceiling_tokens_per_s']:>10,.0f} {r['of_ceiling']:>6.1%} {r['of_ceiling_all_weights']:>22.1%}")
    for p in peers:
        print(f"{p.get('workload', 'peer')}: {p}")
    for r in load:
        print(f"adapter load {r.get('case', '?'):<40} {r.get('ms_median')} ms (p90 {r.get('ms_p90')})")
    if graphs is not None:
        print(f"CUDA graphs: {result['cuda_graphs']}")
    print(f"time to first token, one 512-token prompt: {result['ttft_ms_512']} ms")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
