"""Which `adapter_config.json` keys a served adapter may carry: one rule per PEFT `LoraConfig` field.

An adapter is served only if every key of its config is one we implement exactly or one that
cannot change the outputs of inference. Each rule is one of:

- IMPLEMENTED: the loader reads the key and reproduces PEFT's maths for every value it accepts
  (`adapter_config.py` checks the value);
- IRRELEVANT: the key cannot change inference outputs (training-only or bookkeeping), any value
  PEFT itself accepts is served;
- REFUSED: the key changes the maths in a way we do not implement; only the values that mean
  "off" (PEFT's default and its equivalents) are served.

A key that is not a `LoraConfig` field is served only while its value is null or false: a newer
PEFT's variant read as plain LoRA would serve wrong outputs.
Serving a new variant is one changed entry here plus its implementation (DoRA: worker/lora/dora.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lorafleet.worker.lora.errors import AdapterError

IMPLEMENTED, IRRELEVANT, REFUSED = "implemented", "irrelevant", "refused"


def is_off(value: object) -> bool:
    """null or false: a key we do not know is served only with these values. An empty object
    is not "off": PEFT turns KaSA on with `kasa_config: {}` (its defaults)."""
    return value is None or value is False


def _any(value: object) -> bool:
    return True


def _one_of(*allowed: object) -> Callable[[object], bool]:
    def accepts(value: object) -> bool:
        # `True == 1` in Python: compare types too so `"bias": 1` is not read as something else.
        return any(type(value) is type(a) and value == a for a in allowed)
    return accepts


def _is_str_or_null(value: object) -> bool:
    return value is None or isinstance(value, str)


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True, slots=True)
class KeyRule:
    kind: str  # IMPLEMENTED | IRRELEVANT | REFUSED
    accepts: Callable[[object], bool]  # the values served (IMPLEMENTED: checked again by the loader)
    why: str  # what the key does (in the refusal message)


def _implemented(why: str, accepts: Callable[[object], bool] = _any) -> KeyRule:
    return KeyRule(IMPLEMENTED, accepts, why)


def _irrelevant(why: str, accepts: Callable[[object], bool] = _any) -> KeyRule:
    return KeyRule(IRRELEVANT, accepts, why)


def _refused(why: str, *off: object) -> KeyRule:
    """Served only as one of `off` (PEFT's default, and what it treats the same; default null)."""
    return KeyRule(REFUSED, _one_of(*(off or (None,))), why)


# One entry per field of peft.LoraConfig (tests/worker/test_config_rules.py fails when PEFT adds
# one that is not here, and checks each entry against PEFT).
RULES: dict[str, KeyRule] = {
    # What the loader reads.
    "peft_type": _implemented("the adapter type (only LORA is served)"),
    "r": _implemented("the LoRA rank"),
    "lora_alpha": _implemented("the scale numerator (alpha / r)"),
    "target_modules": _implemented("the adapted modules: names (suffix match), a regex (full match) or 'all-linear'"),
    "use_rslora": _implemented("rank-stabilised scaling (alpha / sqrt(r))"),
    "rank_pattern": _implemented("per-module ranks (regex keys)"),
    "alpha_pattern": _implemented("per-module alphas (regex keys)"),
    "use_dora": _implemented("DoRA (weight-decomposed LoRA): a magnitude per output feature of each module", _is_bool),
    # Cannot change what inference computes.
    "task_type": _irrelevant("the task head PEFT wraps the model in (a causal LM's is none)",
                             _one_of(None, "CAUSAL_LM")),
    "auto_mapping": _irrelevant("the class names PEFT records for custom models"),
    "peft_version": _irrelevant("the PEFT version that wrote the file", _is_str_or_null),
    "base_model_name_or_path": _irrelevant("the base model the adapter was trained on", _is_str_or_null),
    "revision": _irrelevant("the base model's revision", _is_str_or_null),
    "inference_mode": _irrelevant("whether PEFT freezes the adapter", _is_bool),
    "lora_dropout": _irrelevant("dropout on the LoRA input during training (off at inference)",
                                lambda v: (_is_int(v) or isinstance(v, float)) and 0 <= v <= 1),
    "megatron_core": _irrelevant("the Megatron module name, used only with megatron_config", _is_str_or_null),
    "qalora_group_size": _irrelevant("the QA-LoRA pooling group, used only with use_qalora", _is_int),
    "ensure_weight_tying": _irrelevant("ties adapters of tied embeddings (embeddings are never targets here)",
                                       _is_bool),
    "loftq_config": _irrelevant("LoftQ's initialisation settings (PEFT drops them unless "
                                "init_lora_weights='loftq', which is refused)", lambda v: isinstance(v, dict)),
    # Runtime placement, never written to a file: PEFT fails on any value read from one.
    "runtime_config": _irrelevant("PEFT's runtime placement options (not a file setting)", lambda v: False),
    # Initialisations other than these rewrite the base weights (PiSSA, OLoRA, LoftQ, EVA, CorDA, ...).
    "init_lora_weights": _refused("an initialisation that rewrites the base weights (PiSSA, OLoRA, LoftQ, "
                                  "EVA, CorDA, LoRA-GA, orthogonal)", True, False, "gaussian"),
    # Change the maths, not implemented.
    "bias": _refused("trained bias terms", "none"),
    "lora_bias": _refused("a bias on lora_B", False),
    "fan_in_fan_out": _refused("transposed (Conv1D-style) weights", False),
    "use_qalora": _refused("QA-LoRA (pooled inputs)", False),
    "layer_replication": _refused("replicated base layers"),
    "target_parameters": _refused("parameter-level LoRA (e.g. MoE experts)"),
    "trainable_token_indices": _refused("trained embedding rows"),
    "modules_to_save": _refused("fully trained extra modules"),
    "exclude_modules": _refused("modules excluded from target_modules"),
    "layers_to_transform": _refused("adapting only some layers"),
    "layers_pattern": _refused("the layer naming used with layers_to_transform"),
    "megatron_config": _refused("Megatron parallel linear layers"),
    "alora_invocation_tokens": _refused("activated LoRA (the adapter switches on after invocation tokens)"),
    "use_bdlora": _refused("block-diagonal LoRA"),
    "arrow_config": _refused("Arrow routing between adapters"),
    "kasa_config": _refused("KaSA (SVD-based knowledge-aware adaptation)"),
    "monteclora_config": _refused("MonteCLoRA (sampled low-rank updates)"),
    "velora_config": _refused("VeLoRA"),
    "eva_config": _refused("EVA initialisation"),
    "corda_config": _refused("CorDA initialisation"),
    "lora_ga_config": _refused("LoRA-GA initialisation"),
    "astra_config": _refused("Astra (PEFT builds its own adapter layers from it)"),
}


def check_config_keys(cfg: dict) -> None:
    """Refuse (AdapterError "unsupported") the first key, in file order, that is neither implemented
    nor irrelevant at its value; the message names the key."""
    for key, value in cfg.items():
        rule = RULES.get(key)
        if rule is None:
            if not is_off(value):
                raise AdapterError("unsupported", f"adapter_config.json key {key!r} (= {_show(value)}) is not a "
                                   "LoRA setting this worker knows; refused rather than served as plain LoRA")
            continue
        if not rule.accepts(value):
            if rule.kind == REFUSED:
                raise AdapterError("unsupported", f"adapter_config.json key {key!r} = {_show(value)} asks for "
                                   f"{rule.why}, which this worker does not implement")
            raise AdapterError("bad_config", f"adapter_config.json key {key!r} = {_show(value)} is not a valid "
                               f"value ({rule.why})")


def _show(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
