"""`adapter_config.json` read as PEFT reads it: which modules get LoRA, with which rank and alpha.

The bytes are capped before they are read (`adapter_files.MAX_CONFIG_BYTES`) and every key is
checked against the rule table (`config_rules`). Targets follow PEFT's `check_target_module_exists`
over the base model's module names (`module_names`): a list entry matches a module whose name is
the entry or ends with "." + entry; a string is a regex that must match a whole name (or
'all-linear'). Every module matched must be one of the linear layers this worker adapts.
`rank_pattern`/`alpha_pattern` keys pick a module's rank and alpha as PEFT's `get_pattern_key`
does (the first key, in file order, that matches the end of its name). All regexes run in the
`RegexSandbox` (time and memory budget, off the serving threads).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from lorafleet.worker.config import ModelConfig
from lorafleet.worker.lora.config_rules import check_config_keys
from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.regex_sandbox import FULL, SUFFIX, RegexSandbox

CONFIG_FILE = "adapter_config.json"
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output layer
DEFAULT_R, DEFAULT_ALPHA = 8, 8  # peft.LoraConfig's defaults
# The attention block's adapter targets (a fused family's qkv_proj among them); the rest are the MLP's.
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    r: int
    alpha: float
    use_rslora: bool
    modules: dict[tuple[int, str], tuple[int, float]]  # (layer, target) -> (rank, alpha), the adapted ones
    use_dora: bool = False  # DoRA: each module also has a magnitude vector (worker/lora/dora.py)

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def module_path(layer: int, target: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if target in ATTENTION_TARGETS else 'mlp'}.{target}"


def module_names(model: ModelConfig) -> list[str]:
    """The base model's `named_modules()` names as transformers builds its CausalLM (the family's own
    adapter targets: Phi-3's fused qkv_proj and gate_up_proj), but the root's "" (PEFT never adapts
    the model itself)."""
    targets = list(model.adapter_targets)
    attention = [t for t in targets if t in ATTENTION_TARGETS]
    mlp = [t for t in targets if t not in ATTENTION_TARGETS]
    names = ["model", "model.embed_tokens", "model.layers"]
    for layer in range(model.num_layers):
        p = f"model.layers.{layer}"
        names += [p, f"{p}.self_attn", *(f"{p}.self_attn.{t}" for t in attention), f"{p}.mlp",
                  *(f"{p}.mlp.{t}" for t in mlp), f"{p}.mlp.act_fn",
                  f"{p}.input_layernorm", f"{p}.post_attention_layernorm"]
    return names + ["model.norm", "model.rotary_emb", "lm_head"]


def decode_config(raw: bytes) -> dict:
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, int digit limits
        raise AdapterError("bad_config", f"{CONFIG_FILE} is not valid JSON: {_short(exc)}") from None
    if not isinstance(cfg, dict):
        raise AdapterError("bad_config", f"{CONFIG_FILE} must be a JSON object")
    return cfg


def parse_adapter_config(raw: bytes, model: ModelConfig, max_lora_rank: int,
                         regex: RegexSandbox | None = None) -> AdapterConfig:
    """Validate adapter_config.json's bytes (those the digest covers) against `model`.
    `regex`: the sandbox to match regexes in (None: a temporary one, started only if needed)."""
    cfg = decode_config(raw)
    if cfg.get("peft_type") != "LORA":
        raise AdapterError("not_lora", f"peft_type is {_short(cfg.get('peft_type'))}; only LORA adapters are served")
    check_config_keys(cfg)
    r = cfg.get("r", DEFAULT_R)
    if not _positive_int(r):
        raise AdapterError("bad_rank", f"r must be a positive integer, got {_short(r)}")
    alpha = cfg.get("lora_alpha", DEFAULT_ALPHA)
    if not _finite_number(alpha):
        raise AdapterError("bad_alpha", f"lora_alpha must be a finite number, got {_short(alpha)}")
    rslora = cfg.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise AdapterError("bad_config", f"use_rslora must be true or false, got {_short(rslora)}")
    dora = cfg.get("use_dora", False)
    if not isinstance(dora, bool):
        raise AdapterError("bad_config", f"use_dora must be true or false, got {_short(dora)}")
    rank_pattern = _pattern_dict(cfg, "rank_pattern", _positive_int, "bad_rank", "positive integers")
    alpha_pattern = _pattern_dict(cfg, "alpha_pattern", _finite_number, "bad_alpha", "finite numbers")

    own = regex is None and (isinstance(cfg.get("target_modules"), str) or rank_pattern or alpha_pattern)
    sandbox = RegexSandbox() if own else regex
    try:
        targeted = _targets(cfg.get("target_modules"), model, sandbox)
        paths = [module_path(*m) for m in targeted]
        ranks = _pattern_values(rank_pattern, paths, r, "rank_pattern", sandbox)
        alphas = _pattern_values(alpha_pattern, paths, alpha, "alpha_pattern", sandbox)
    finally:
        if own:
            sandbox.close()
    modules = {m: (rank, float(a)) for m, rank, a in zip(targeted, ranks, alphas)}
    top = max(rank for rank, _ in modules.values())
    if top > max_lora_rank:
        raise AdapterError("rank_too_high", f"adapter rank {top} exceeds max_lora_rank {max_lora_rank}")
    return AdapterConfig(r=r, alpha=float(alpha), use_rslora=rslora, modules=modules, use_dora=dora)


def _positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _finite_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _pattern_dict(cfg: dict, key: str, ok, reason: str, kind: str) -> dict:
    if key not in cfg:
        return {}
    value = cfg[key]
    if not isinstance(value, dict):  # null too: PEFT fails on it
        raise AdapterError("bad_config", f"{key} must be an object mapping module patterns to values")
    for k, v in value.items():
        if not ok(v):
            raise AdapterError(reason, f"{key} values must be {kind}, got {_short(k)}: {_short(v)}")
    return value


def _targets(targets: object, model: ModelConfig, sandbox: RegexSandbox | None) -> list[tuple[int, str]]:
    """The (layer, target) pairs PEFT would adapt, in model order; AdapterError if any matched
    module is not a linear layer we adapt, or none is matched."""
    names = module_names(model)
    linear = {module_path(layer, t): (layer, t) for layer in range(model.num_layers) for t in model.adapter_targets}
    if isinstance(targets, str):
        if not targets:
            raise AdapterError("bad_targets", "target_modules is an empty string")
        if targets == ALL_LINEAR:
            matched = [n for n in names if n in linear]
        else:
            (result,) = sandbox.match(names, [(FULL, targets)], "target_modules")
            if result.hits is None:
                raise AdapterError("bad_targets", f"target_modules is not a valid regex: {result.error}")
            matched = [names[i] for i in result.hits]
    elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
        wanted = set(targets)
        matched = [n for n in names if n in wanted or any(n.endswith("." + t) for t in wanted)]
    else:
        raise AdapterError("bad_targets", "target_modules must be a non-empty list of module names or a regex string")
    if not matched:
        raise AdapterError("bad_targets", f"target_modules {_short(targets)} matches no module of this model "
                           f"(supported: {', '.join(model.adapter_targets)})")
    others = [n for n in matched if n not in linear]
    if others:
        raise AdapterError("bad_targets", f"target_modules matches {_short(others[0])}, which is not a layer this "
                           f"worker adapts (supported: {', '.join(model.adapter_targets)})")
    return [linear[n] for n in matched]


def _pattern_values(patterns: dict, paths: list[str], default, key: str, sandbox: RegexSandbox | None) -> list:
    """Each module's value: that of the first pattern key (in file order) matching its name's end."""
    if not patterns:
        return [default] * len(paths)
    keys = list(patterns)
    results = sandbox.match(paths, [(SUFFIX, k) for k in keys], key)
    bad = next((res for res in results if res.hits is None), None)
    if bad is not None:
        raise AdapterError("bad_config", f"{key} key {_short(bad.pattern)} is not a valid regex: {bad.error}")
    out = [default] * len(paths)
    done = [False] * len(paths)
    for k, res in zip(keys, results):
        for i in res.hits:
            if not done[i]:
                out[i], done[i] = patterns[k], True
    return out


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
