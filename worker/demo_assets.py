"""`lorafleet demo-assets --out DIR`: a tiny Llama-family model and PEFT adapters for tests and demos.

Everything is made locally with a fixed seed (nothing is downloaded): random weights saved by
transformers, a real byte-level BPE `tokenizer.json` trained with `tokenizers`, and adapters
written by PEFT itself with different ranks, alphas, target modules, rsLoRA and a rank pattern.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

SEED = 1234
MODEL_DIR = "model"
ADAPTERS_DIR = "adapters"

CHAT_TEMPLATE = (  # the template writes the special tokens (bos_token first), as real models' do
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# A small corpus so the BPE merges are real words, not noise.
CORPUS = """
The quick brown fox jumps over the lazy dog. A tenant sends a request naming an adapter.
Every institute uses the same printed textbook, and each keeps its own thin sheet of margin notes.
The router sends each request to a worker replica that already holds that adapter.
Low-rank adaptation freezes the base weights and trains two small matrices per layer.
SELECT name, score FROM students WHERE score > 90 ORDER BY score DESC;
def add(a, b):\n    return a + b\nclass Fleet:\n    pass
Roses are red, violets are blue, the batch is full and the cache is too.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris.
Once upon a time there was a model with many adapters, and every tenant was happy.
""".strip()


@dataclass(frozen=True, slots=True)
class DemoAdapter:
    name: str
    r: int
    alpha: float
    targets: tuple[str, ...]
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

DEMO_ADAPTERS = (
    DemoAdapter("sql", r=8, alpha=16, targets=ATTN),
    DemoAdapter("chat", r=16, alpha=32, targets=ATTN + MLP),
    DemoAdapter("poem", r=4, alpha=8, targets=MLP),
    DemoAdapter("code", r=32, alpha=16, targets=("q_proj", "v_proj", "down_proj"), use_rslora=True),
    DemoAdapter("legal", r=8, alpha=8, targets=("q_proj", "o_proj", "up_proj"), rank_pattern={"up_proj": 2}),
)

DEMO_MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def build_tokenizer(out: Path, vocab_size: int = 512) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": True,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": DEMO_MODEL_CONFIG["max_position_embeddings"],
            },
            indent=2,
        )
    )
    return tok.get_vocab_size()


def _unprintable_token_ids(folder: Path) -> list[int]:
    """Tokens that decode to control characters or partial UTF-8 (raw bytes of the BPE alphabet)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    bad = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i])
        if not text or "\ufffd" in text or not all(c.isprintable() or c in "\n " for c in text):
            bad.append(i)
    return bad


def build_model(out: Path, vocab_size: int, dtype: str = "float32"):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(vocab_size=vocab_size, bos_token_id=0, eos_token_id=1, pad_token_id=2, **DEMO_MODEL_CONFIG)
    model = LlamaForCausalLM(config)
    # Random init is tiny (std 0.02): widen it so greedy outputs vary with the prompt and adapter.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
        # So the demo prints readable text: raw-byte tokens get logits near 0, below the usual winner.
        model.lm_head.weight[_unprintable_token_ids(out)] *= 0.05
    model.to(getattr(torch, dtype)).save_pretrained(str(out), safe_serialization=True)
    return model


def build_adapter(model, spec: DemoAdapter, out: Path, seed: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        rank_pattern=dict(spec.rank_pattern),
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,  # B random too, so the adapter visibly changes the output
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    # Leave the base model untouched for the next adapter.
    peft_model.unload()


@contextlib.contextmanager
def _libraries_quiet() -> Iterator[None]:
    """The first `lorafleet up` prints its own progress: keep transformers' shard bar and the
    FutureWarnings the libraries raise about each other's internals (peft calling transformers) out of it."""
    from transformers.utils import logging as hf_logging

    bar_was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"(transformers|peft)(\.|$)")
            yield
    finally:
        if bar_was_on:
            hf_logging.enable_progress_bar()


def make_demo_assets(out: Path, progress: Callable[[str], None] = lambda _msg: None) -> Path:
    """Write `out/model` and `out/adapters/<name>`; returns `out`. Idempotent: skips if complete."""
    out = Path(out)
    marker = out / ".complete"
    if marker.exists():
        return out
    model_dir = out / MODEL_DIR
    model_dir.mkdir(parents=True, exist_ok=True)
    with _libraries_quiet():
        progress("tokenizer")
        vocab = build_tokenizer(model_dir)
        progress("model")
        model = build_model(model_dir, vocab)
        for i, spec in enumerate(DEMO_ADAPTERS):
            progress(f"adapter {spec.name}")
            build_adapter(model, spec, out / ADAPTERS_DIR / spec.name, seed=SEED + 1 + i)
    marker.write_text("ok\n")
    return out


def build_parser() -> argparse.ArgumentParser:
    from lorafleet.cli_help import finish

    parser = argparse.ArgumentParser(prog="lorafleet demo-assets", description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder to write model/ and adapters/ into")
    return finish(parser, {"Output": ["--out"]})


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ModuleNotFoundError as exc:
        print(f"demo-assets needs {exc.name}: pip install 'lorafleet[demo]'", file=sys.stderr)
        return 2
    steps = 2 + len(DEMO_ADAPTERS)
    done = [0]

    def progress(msg: str) -> None:
        done[0] += 1
        bar = "#" * done[0] + "." * (steps - done[0])
        print(f"\r[{bar}] {msg:<24}", end="", file=sys.stderr, flush=True)

    make_demo_assets(args.out, progress)
    print(file=sys.stderr)
    print(f"demo assets in {args.out}: model/ and adapters/{{{','.join(a.name for a in DEMO_ADAPTERS)}}}")
    return 0
