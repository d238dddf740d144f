"""A small Llama trained on the CPU on the project's own text: the FP8 quality check's model.

    python -m bench trained_model [--out bench/.cache/trained-llama] [--seconds 900] [--threads 2] [--resume]

No public checkpoint can be downloaded here and the demo model's weights are random, so quantization
error would be measured against noise. This trains a ~0.7M-parameter Llama (3 layers, hidden 128, 4
heads of 32 over 2 KV heads, MLP 384, a 512-entry byte-level BPE trained on the same text) on the repo's
docs and Python sources for a fixed time on the CPU, and saves it as a Hugging Face folder in bf16
(~1 MiB: small enough to carry to a GPU machine), with the demo's tokenizer config and chat template.
Prints the held-out loss against the uniform distribution's (ln vocab): the model's next-token
distributions must be far from uniform for a KL between two engines to mean anything.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = Path(__file__).resolve().parent / ".cache" / "trained-llama"
SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5,
             rope_theta=10000.0, tie_word_embeddings=False)
VOCAB = 512
SPECIALS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def corpus(root: Path = ROOT, max_chars: int = 3_000_000) -> str:
    """The repo's Markdown docs and Python sources, in a fixed order, up to max_chars."""
    files = sorted(root.glob("*.md")) + sorted(root.glob("docs/*.md"))
    for top in ("worker", "kernels", "router", "common", "operator", "bench"):
        files += sorted((root / top).rglob("*.py"))
    parts, total = [], 0
    for f in files:
        text = f.read_text(errors="replace")
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "\n\n".join(parts)


def train_tokenizer(text: str, out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from lorafleet.worker.demo_assets import build_tokenizer

    build_tokenizer(out)  # tokenizer_config.json: the demo's specials and chat template
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 10_000] for i in range(0, len(text), 10_000)], trainer=trainer)
    tok.save(str(out / "tokenizer.json"))


def train(out: Path, seconds: float, threads: int, seq: int = 64, batch: int = 8, seed: int = 0,
          resume: bool = False) -> dict:
    """Train and save the model under `out` -> {steps, train_loss, heldout_loss, uniform_loss}.
    resume: go on training the model saved there (its tokenizer kept)."""
    from tokenizers import Tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    text = corpus()
    resume = resume and (out / "config.json").is_file()
    if not resume:
        train_tokenizer(text, out)
    ids = torch.tensor(Tokenizer.from_file(str(out / "tokenizer.json")).encode(text).ids, dtype=torch.long)
    split = int(len(ids) * 0.95)
    train_ids, held = ids[:split], ids[split:]
    config = LlamaConfig(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2, **SHAPE)
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32) if resume else LlamaForCausalLM(config)
    before = json.loads((out / "training.json").read_text()) if resume and (out / "training.json").is_file() else {}
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed)

    def batch_at(src: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
        return torch.stack([src[s:s + seq] for s in starts.tolist()])

    t0, step, loss = time.perf_counter(), 0, float("nan")
    model.train()
    while time.perf_counter() - t0 < seconds:
        x = batch_at(train_ids, torch.randint(0, len(train_ids) - seq, (batch,), generator=g))
        lr = 3e-3 * min(1.0, (step + 1) / 10)
        for group in opt.param_groups:
            group["lr"] = lr
        loss_t = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss, step = loss_t.item(), step + 1
        if step % 20 == 0:
            print(f"step {step}: loss {loss:.3f} ({time.perf_counter() - t0:.0f}s)", flush=True)
    model.eval()
    with torch.no_grad():
        starts = torch.arange(0, len(held) - seq, max(1, (len(held) - seq) // 16))[:16]
        x = batch_at(held, starts)
        heldout = float(model(input_ids=x, labels=x).loss)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    stats = {"steps": step + before.get("steps", 0), "train_loss": round(loss, 4), "heldout_loss": round(heldout, 4),
             "uniform_loss": round(math.log(VOCAB), 4), "params": sum(p.numel() for p in model.parameters()),
             "seconds": round(time.perf_counter() - t0 + before.get("seconds", 0.0), 1)}
    (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seconds", type=float, default=900.0, help="training time on this CPU")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--resume", action="store_true", help="go on training the model already in --out")
    args = ap.parse_args()
    print(json.dumps(train(args.out, args.seconds, args.threads, resume=args.resume)))


if __name__ == "__main__":
    main()
