"""The adapter fuzz campaign's fast subset: the fixed corpus and seeded mutations, each judged by
safetensors + PEFT + the config table (`bench/adapter_fuzz_judge.py`) and read by the registry's
reader, which must agree: valid → read, invalid → AdapterError with a reason (never another
exception, never the catch-all "malformed"). The full campaign against a real worker is
`python bench/adapter_fuzz.py --cases 2000` (docs/benchmarks.md, "Adapter fuzz campaign")."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from lorafleet.worker.config import EngineConfig, ModelConfig
from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.reader import AdapterReader

pytest.importorskip("peft")

MUTATED = 48  # seeded mutations on top of the corpus
SEED = 49


@pytest.fixture(scope="module")
def fuzz(tmp_path_factory, demo_model, demo_adapters):
    link_dir = tmp_path_factory.mktemp("benchlink")  # `bench` alone on sys.path (the root would shadow `kernels`)
    (link_dir / "bench").symlink_to(Path(__file__).resolve().parents[2] / "bench")
    sys.path.insert(0, str(link_dir))
    try:
        from bench.adapter_fuzz_cases import base_cases, corpus, mutate
        from bench.adapter_fuzz_judge import Caps, Judge, peft_key
    finally:
        sys.path.remove(str(link_dir))
    bases = base_cases(next(iter(demo_adapters.values())).parent)
    rng = random.Random(SEED)
    cases = corpus(bases) + [mutate(bases, rng) for _ in range(MUTATED)]
    judge = Judge(demo_model, Caps())
    layers = judge.base.model.layers

    def base_weight(layer: int, target: str) -> torch.Tensor:  # DoRA's norms: transformers' weights
        block = layers[layer].self_attn if hasattr(layers[layer].self_attn, target) else layers[layer].mlp
        return getattr(block, target).weight.detach()

    reader = AdapterReader(ModelConfig.from_folder(demo_model), EngineConfig(max_lora_rank=64), torch.float32, None,
                           base_weight)
    return {"cases": cases, "judge": judge, "reader": reader, "peft_key": peft_key}


def test_corpus_names_the_issues_variants(fuzz):
    names = {c.name for c in fuzz["cases"]}
    for variant in ("alora", "bdlora", "arrow", "kasa", "monteclora", "dora_magnitudes", "weights_link_out", "regex_catastrophic",
                    "config_1gib_sparse"):
        assert variant in names


def test_every_case_gets_the_judges_verdict(fuzz, tmp_path):
    disagreements, catch_all = [], []
    valid = 0
    for i, case in enumerate(fuzz["cases"]):
        folder = tmp_path / f"c{i}"
        case.write(folder)
        verdict = fuzz["judge"](folder)
        valid += verdict.valid
        try:
            fuzz["reader"].read(str(folder))
            loaded, reason = True, None
        except AdapterError as exc:
            loaded, reason = False, exc.reason
            assert str(exc), case.name
            assert str(tmp_path) not in str(exc), f"{case.name}: a server path in {exc}"
        if reason == "malformed":
            catch_all.append(case.name)
        if loaded != verdict.valid:
            disagreements.append(f"{case.name}: judge {verdict.why!r}, reader {'loaded' if loaded else reason}")
    assert not disagreements, "\n".join(disagreements)
    assert not catch_all, f"refused only by the reader's catch-all: {catch_all}"
    assert 10 <= valid < len(fuzz["cases"]) - 10  # both verdicts exercised


def test_valid_cases_decode_as_peft_does(fuzz, tmp_path, demo_model):
    """Each valid case served by the engine decodes greedily as PEFT does with the same config and
    tensors (tensor names put in PEFT's saved form, as the judge reads them)."""
    import copy
    import json
    import warnings

    import peft
    from safetensors.torch import load_file

    from lorafleet.worker.engine.engine import LLMEngine
    from lorafleet.worker.engine.sequence import SamplingParams

    judge = fuzz["judge"]
    engine = LLMEngine(demo_model, EngineConfig(max_loras=2, max_cpu_loras=2, max_lora_rank=64, dtype="float32"))
    prompt = [3, 17, 40, 99, 5, 250, 7]
    compared = 0
    for i, case in enumerate(fuzz["cases"]):
        folder = tmp_path / f"v{i}"
        case.write(folder)
        if not judge(folder).valid:
            continue
        cfg = json.loads((folder / "adapter_config.json").read_text())
        fields = set(peft.LoraConfig.__dataclass_fields__)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = peft.get_peft_model(copy.deepcopy(judge.base),
                                        peft.LoraConfig(**{k: v for k, v in cfg.items() if k in fields and k != "peft_type"}))
            tensors = {fuzz["peft_key"](k): v.float() for k, v in load_file(str(folder / "adapter_model.safetensors")).items()}
            peft.set_peft_model_state_dict(model, tensors)
        model.eval()
        ids = list(prompt)
        with torch.no_grad():
            for _ in range(4):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        engine.load_adapter(f"v{i}", str(folder))
        got = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
                              [((f"v{i}", 1.0),)])[0].token_ids
        engine.unload_adapter(f"v{i}")
        assert list(got) == ids[len(prompt):], case.name
        compared += 1
    assert compared >= 10

