"""FP8 weights' quality against the bf16 engine on the same weights: per-token KL and greedy agreement.

    python -m bench fp8_quality [--model bench/.cache/trained-llama] [--device cuda] [--prompts 16]
                                [--new-tokens 32] [--layers seed|tiny] [--out F]

Two engines load the same checkpoint, one in bf16, one with `--quantization fp8`, and generate
greedily from the same prompts (slices of the repo's docs, tokenized by the model's tokenizer) while
a logits hook records every next-token distribution. Positions whose context is still identical in
both engines (every earlier token agreed) are compared: KL(bf16 || fp8) of the two next-token
distributions (`mean_kl`, `max_kl`), and whether their argmax agrees (`greedy_agree`). Step 0 of
each prompt comes from prefill (on CUDA: the prefill path), the later steps from decode steps (the
W8A16 kernel), reported apart too. `entropy` is the bf16 model's mean next-token entropy beside the
uniform distribution's (ln vocab): a model far from uniform makes the KL meaningful (train one with
`python -m bench trained_model`). `layers`: each projection's relative output error
||fp8(x) - bf16(x)|| / ||bf16(x)|| at the seed shape's GEMMs (random N(0, 0.02) weights, 64 rows).
Targets (issue 53): mean KL <= 0.01.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.engine.engine import LLMEngine
from lorafleet.worker.engine.sequence import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = Path(__file__).resolve().parent / ".cache" / "trained-llama"
SEED_GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TINY_GEMMS = {"qkv": (128, 64), "o": (64, 64), "gate_up": (256, 64), "down": (64, 128)}


def doc_prompts(engine: LLMEngine, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens: evenly spaced slices of the repo's docs."""
    text = "\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    step = max(1, (len(ids) - length) // count)
    return [ids[i * step:i * step + length] for i in range(count)]


def record(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy outputs and every step's next-token log-probabilities (fp32, on the CPU), per prompt."""
    steps: dict[int, list[torch.Tensor]] = {}

    def hook(seqs, logits: torch.Tensor) -> None:
        lp = torch.log_softmax(logits.float(), dim=-1).cpu()
        for i, s in enumerate(seqs):
            steps.setdefault(s.seq_id, []).append(lp[i])

    engine.logits_hook = hook
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, sp) for p in prompts]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    engine.logits_hook = None
    return [out[i] for i in ids], [steps[i] for i in ids]


def compare(ref: tuple[list[list[int]], list[list[torch.Tensor]]],
            test: tuple[list[list[int]], list[list[torch.Tensor]]]) -> dict:
    """KL(ref || test) and argmax agreement at every position whose context both share."""
    kls: list[float] = []
    prefill: list[float] = []
    decode: list[float] = []
    agree = compared = 0
    entropy: list[float] = []
    for toks_r, lps_r, toks_t, lps_t in zip(*ref, *test):
        for t, (a, b) in enumerate(zip(lps_r, lps_t)):
            if toks_r[:t] != toks_t[:t]:
                break
            kl = float((a.exp() * (a - b)).sum())
            kls.append(kl)
            (prefill if t == 0 else decode).append(kl)
            agree += int(a.argmax() == b.argmax())
            compared += 1
            entropy.append(float(-(a.exp() * a).sum()))
    decode = decode or [0.0]
    vocab = ref[1][0][0].numel()
    return {"mean_kl": sum(kls) / len(kls), "max_kl": max(kls), "greedy_agree": agree / compared,
            "positions": compared, "prefill_mean_kl": sum(prefill) / len(prefill),
            "decode_mean_kl": sum(decode) / len(decode), "entropy": sum(entropy) / len(entropy),
            "uniform_entropy": float(torch.log(torch.tensor(float(vocab)))),
            "same_greedy_text": sum(a == b for a, b in zip(ref[0], test[0])) / len(ref[0])}


def engine_quality(model: Path, device: str, prompts: int, prompt_len: int, new_tokens: int,
                   dtype: str = "bfloat16") -> dict:
    """bf16 vs FP8 engines on `model`: `compare`'s figures, rounded."""
    runs = []
    prompt_ids: list[list[int]] = []
    for quant in (None, "fp8"):
        config = EngineConfig(device=device, dtype=dtype, quantization=quant, max_num_seqs=max(prompts, 1),
                              max_num_batched_tokens=max(2048, prompts * prompt_len), max_loras=1,
                              num_kv_blocks=None if device == "cuda" else 256)
        engine = LLMEngine(model, config)
        prompt_ids = prompt_ids or doc_prompts(engine, prompts, prompt_len)
        runs.append(record(engine, prompt_ids, new_tokens))
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return {k: round(v, 6) for k, v in compare(runs[0], runs[1]).items()}


def layer_errors(device: str, gemms: dict[str, tuple[int, int]] = SEED_GEMMS, rows: int = 64) -> dict[str, float]:
    """Each projection's relative output error, FP8 (per-channel) vs bf16, random weights."""
    from lorafleet.kernels.quant.fp8_linear import fp8_linear, quantize_rows

    g = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, (n, k) in gemms.items():
        w = (torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16)
        x = torch.randn(rows, k, generator=g, device=device).to(torch.bfloat16)
        ref = (x.float() @ w.float().t())
        q, s = quantize_rows(w)
        y = fp8_linear(x, q, s).float()
        out[name] = round(float((y - ref).norm() / ref.norm()), 6)
        del w, q, s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--layers", choices=["seed", "tiny"], default="seed")
    ap.add_argument("--out", type=Path, default=None, help="write the result JSON here (default: print only)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    result = engine_quality(args.model, args.device, args.prompts, args.prompt_len, args.new_tokens)
    result["layers"] = layer_errors(args.device, SEED_GEMMS if args.layers == "seed" else TINY_GEMMS)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
