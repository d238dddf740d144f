"""transformers + PEFT as the oracle for the engine's logits (fp32, one request at a time)."""

from __future__ import annotations

import copy

import torch


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|: the error relative to the logits' scale."""
    return float((a.float().cpu() - b.float().cpu()).abs().max() / b.float().abs().max())


def rel_norm_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||: the error over the whole vocabulary, robust to one unlucky logit."""
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm())


def load_hf_base(model_dir) -> torch.nn.Module:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), torch_dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def oracle_logits(base, adapter_dirs: dict, adapters, ids: list[int]) -> torch.Tensor:
    """Logits at every position of `ids` from transformers (+ PEFT) for one request alone.

    Several adapters (or a scale other than 1) are merged with PEFT's
    `add_weighted_adapter(..., combination_type="cat")`, the RFC's oracle.
    """
    import peft

    model = copy.deepcopy(base)
    if adapters:
        names = [n for n, _ in adapters]
        model = peft.PeftModel.from_pretrained(model, str(adapter_dirs[names[0]]), adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(str(adapter_dirs[name]), adapter_name=name)
        if len(adapters) > 1 or adapters[0][1] != 1.0:
            model.add_weighted_adapter(names, [s for _, s in adapters], adapter_name="combo", combination_type="cat")
            model.set_adapter("combo")
        else:
            model.set_adapter(names[0])
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def run_engine_with_logits(engine, requests, sampling) -> dict:
    """Run (prompt, adapters) requests in shared batches; returns {request_id: (seq, [step logits])}."""
    steps: dict[int, list[torch.Tensor]] = {}

    def hook(seqs, logits):
        for seq, row in zip(seqs, logits):
            steps.setdefault(seq.seq_id, []).append(row.float().cpu().clone())

    engine.logits_hook = hook
    ids = [engine.add_request(prompt, sampling, adapters) for prompt, adapters in requests]
    seqs = {rid: engine._tracked[rid].seq for rid in ids}
    max_running = 0
    while engine.has_unfinished():
        engine.step()
        max_running = max(max_running, len(engine.scheduler.running))
    engine.logits_hook = None
    return {"ids": ids, "seqs": seqs, "steps": steps, "max_running": max_running}


