"""DoRA adapters (PEFT `use_dora: true`) for the tiny family checkpoints of family_checkpoints.py,
and the engine against transformers + PEFT with DoRA, plain-LoRA and base requests in one batch."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from .family_checkpoints import FAMILIES, oracle_logprobs

TOLERANCE = 2e-3  # |engine - oracle| logprob
STEPS = 16


def build_dora(kind: str, folder: Path, seed: int = 11, targets: tuple[str, ...] | None = None):
    """A DoRA adapter for the checkpoint in `folder` (saved to folder/dora) -> its PEFT model (eval).

    A and B are drawn at the base weights' scale, the magnitudes at ±30% of PEFT's initial ones
    (the norms of W + s·B·A): DoRA's scale then moves every adapted row, and some rows a lot."""
    import peft
    import transformers

    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                             attn_implementation="eager")
    config = peft.LoraConfig(r=4, lora_alpha=8, use_dora=True, init_lora_weights=False,
                             target_modules=list(targets or FAMILIES[kind].targets))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.normal_(0.0, 0.1)
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.0 + 0.3 * torch.randn_like(p))
    model.save_pretrained(str(folder / "dora"))
    return model.eval()


def check_mixed_batch(engine, oracles: dict[str, object | None], prompt: list[int]) -> dict[str, float]:
    """Serve one request per name of `oracles` ("" = the base model) in one batch -> each one's max
    |Δ logprob| over every step. First-step top-5 tokens and logprobs equal the oracle's to
    TOLERANCE, greedy continuations are its argmax for STEPS tokens."""
    from lorafleet.worker.engine.sequence import SamplingParams

    rows: dict[int, list[torch.Tensor]] = {}
    engine.logits_hook = lambda seqs, logits: [rows.setdefault(s.seq_id, []).append(r.clone()) for s, r in
                                               zip(seqs, logits)]
    names = list(oracles)
    sp = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=5)
    outs = engine.generate([prompt] * len(names), sp, [((n, 1.0),) if n else () for n in names])
    worst: dict[str, float] = {}
    for rid, out, name in zip(sorted(rows), outs, names):
        model = oracles[name]
        want = oracle_logprobs(model, prompt + out.token_ids[:-1], bool(name))[len(prompt) - 1 :]
        got = torch.log_softmax(torch.stack(rows[rid]).double().cpu(), dim=-1)
        assert got.shape == want.shape == (STEPS, want.shape[1])
        top = out.logprobs[0].top
        want_top = want[0].topk(5)
        assert [t for t, _ in top] == want_top.indices.tolist(), f"{name or 'base'}: top-5 tokens differ"
        assert max(abs(v - w) for (_, v), w in zip(top, want_top.values.tolist())) <= TOLERANCE
        assert out.token_ids == want.argmax(-1).tolist(), f"{name or 'base'}: greedy continuation differs"
        worst[name or "base"] = float((got - want).abs().max())
        assert worst[name or "base"] <= TOLERANCE, f"{name or 'base'}: max |Δ logprob| {worst[name or 'base']:.2e}"
    engine.logits_hook = None
    return worst
