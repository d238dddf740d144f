"""Malformed (and sound) adapter folders for the fuzz campaign: a fixed corpus and a seeded mutator.

Every case starts from one of the demo adapters (their config and tensors, as PEFT wrote them)
and changes it: config keys, values and types (PEFT variants, unknown keys, regexes, patterns),
the raw config bytes, tensor names, dtypes, shapes and values, the safetensors header and file
bytes, and the files themselves (links out of the folder, FIFOs, folders, missing files, sparse
files over the caps). A case is only a recipe: `Case.write(folder)` makes the folder, and the
verdict comes from the judge (`adapter_fuzz_judge`), never from the case.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# Backtracks exponentially on the module names (minutes in-process; see tests/worker/test_regex_sandbox.py).
CATASTROPHIC = r"([a-z_.0-9]+)+[A-Z]"
SOUND_REGEXES = [r".*\.(q|v)_proj", "all-linear", r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj", r".*proj",
                 r"model\.layers\.1\.mlp\..*", r"(?i).*Q_PROJ"]
BAD_REGEXES = [".*", "(q_proj", "lm_head", r".*\.self_attn", "nothing", "", r".*embed_tokens", CATASTROPHIC,
               r"(.+)+Q", r"((\w|\.)+)+Z"]
TARGET_ENTRIES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "self_attn.q_proj",
                  "mlp.up_proj", "layers.0.self_attn.v_proj", "lm_head", "embed_tokens", "self_attn", "mlp", "",
                  "model.norm", "nonexistent", "Q_PROJ"]
ODD_VALUES = [None, True, False, 0, 1, -1, 2.5, float("nan"), float("inf"), "x", "", [], {}, [1, 2], {"a": 1},
              10**30, "CAUSAL_LM"]


@dataclass
class Case:
    """A recipe for one adapter folder."""

    labels: list[str]
    config: dict | None  # None: no config file
    tensors: dict[str, torch.Tensor] | None  # None: no weights file
    config_raw: bytes | None = None  # replaces the config's JSON
    weights_raw: bytes | None = None  # replaces the serialized tensors
    post: list[Callable[[Path], None]] = field(default_factory=list)  # file-level changes after writing

    @property
    def name(self) -> str:
        return "+".join(self.labels) or "unchanged"

    def write(self, folder: Path) -> None:
        folder.mkdir(parents=True)
        if self.config_raw is not None:
            (folder / CONFIG).write_bytes(self.config_raw)
        elif self.config is not None:
            (folder / CONFIG).write_text(json.dumps(self.config))
        if self.weights_raw is not None:
            (folder / WEIGHTS).write_bytes(self.weights_raw)
        elif self.tensors is not None:
            (folder / WEIGHTS).write_bytes(save(self.tensors, metadata={"format": "pt"}))
        for change in self.post:
            change(folder)


def base_cases(demo_adapters: Path) -> dict[str, Case]:
    """The demo adapters as PEFT wrote them (sound)."""
    out = {}
    for folder in sorted(p for p in demo_adapters.iterdir() if p.is_dir()):
        out[folder.name] = Case([], json.loads((folder / CONFIG).read_text()), load_file(str(folder / WEIGHTS)))
    return out


def _copy(case: Case) -> Case:
    return Case(list(case.labels), None if case.config is None else json.loads(json.dumps(case.config)),
                None if case.tensors is None else dict(case.tensors), case.config_raw, case.weights_raw,
                list(case.post))


# -- file-level changes ---------------------------------------------------------------------------
def link_out(name: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        if not (folder / name).exists():
            return
        outside = folder.parent / f"{folder.name}.outside.{name}"
        (folder / name).rename(outside)
        (folder / name).symlink_to(outside)
    return change


def link_inside(name: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        if (folder / name).exists():
            (folder / name).rename(folder / f"real.{name}")
            (folder / name).symlink_to(f"real.{name}")
    return change


def link_abs(name: str, target: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(target)
    return change


def fifo(name: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        (folder / name).unlink(missing_ok=True)
        os.mkfifo(folder / name)
    return change


def as_dir(name: str) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        (folder / name).unlink(missing_ok=True)
        (folder / name).mkdir()
    return change


def sparse(name: str, size: int) -> Callable[[Path], None]:
    def change(folder: Path) -> None:
        with open(folder / name, "r+b" if (folder / name).exists() else "wb") as f:
            f.truncate(size)
    return change


def pickle_only(folder: Path) -> None:
    torch.save(load_file(str(folder / WEIGHTS)), folder / "adapter_model.bin")
    (folder / WEIGHTS).unlink()


# -- the fixed corpus ---------------------------------------------------------------------------
def corpus(bases: dict[str, Case]) -> list[Case]:
    sql, chat = bases["sql"], bases["chat"]

    def cfg(base: Case, label: str, **changes) -> Case:
        c = _copy(base)
        c.labels.append(label)
        c.config.update(changes)
        return c

    def post(base: Case, label: str, *changes) -> Case:
        c = _copy(base)
        c.labels.append(label)
        c.post.extend(changes)
        return c

    def raw(base: Case, label: str, config_raw: bytes | None = None, weights_raw: bytes | None = None) -> Case:
        c = _copy(base)
        c.labels.append(label)
        c.config_raw, c.weights_raw = config_raw, weights_raw
        return c

    cases = [_copy(b) for b in bases.values()]
    cases += [
        cfg(sql, "alora", alora_invocation_tokens=[5, 6, 7]), cfg(sql, "bdlora", use_bdlora={"nblocks": 2}),
        cfg(sql, "arrow", arrow_config={"top_k": 2}), cfg(sql, "kasa", kasa_config={}),
        cfg(sql, "monteclora", monteclora_config={}), cfg(sql, "dora", use_dora=True),
        cfg(sql, "lora_bias", lora_bias=True), cfg(sql, "pissa", init_lora_weights="pissa"),
        cfg(sql, "olora", init_lora_weights="olora"), cfg(sql, "gaussian_init", init_lora_weights="gaussian"),
        cfg(sql, "layers_to_transform", layers_to_transform=[0]), cfg(sql, "exclude", exclude_modules=["k_proj"]),
        cfg(sql, "modules_to_save", modules_to_save=["lm_head"]), cfg(sql, "future_flag", use_future_lora=True),
        cfg(sql, "future_null", use_future_lora=None), cfg(sql, "seq_cls", task_type="SEQ_CLS"),
        cfg(sql, "dropout", lora_dropout=0.25), cfg(sql, "qalora", use_qalora=True),
        cfg(sql, "regex_catastrophic", target_modules=CATASTROPHIC),
        cfg(sql, "pattern_catastrophic", rank_pattern={CATASTROPHIC: 4}),
        cfg(chat, "regex_sound", target_modules=r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"),
        cfg(chat, "all_linear", target_modules="all-linear"),
        cfg(sql, "suffix_targets", target_modules=["self_attn.q_proj", "self_attn.k_proj", "v_proj", "o_proj"]),
        cfg(sql, "no_r", r=None), cfg(sql, "bool_r", r=True), cfg(sql, "nan_alpha", lora_alpha=float("nan")),
        post(sql, "weights_link_out", link_out(WEIGHTS)), post(sql, "config_link_out", link_out(CONFIG)),
        post(sql, "weights_link_inside", link_inside(WEIGHTS)), post(sql, "weights_to_dev_zero",
                                                                      link_abs(WEIGHTS, "/dev/zero")),
        post(sql, "config_to_etc_passwd", link_abs(CONFIG, "/etc/passwd")),
        post(sql, "weights_fifo", fifo(WEIGHTS)), post(sql, "config_fifo", fifo(CONFIG)),
        post(sql, "weights_dir", as_dir(WEIGHTS)), post(sql, "pickle_only", pickle_only),
        post(sql, "config_1gib_sparse", sparse(CONFIG, 1 << 30)),
        post(sql, "weights_3gib_sparse", sparse(WEIGHTS, 3 << 30)),
        raw(sql, "config_deep", config_raw=b"[" * 200_000 + b"]" * 200_000),
        raw(sql, "config_huge_int", config_raw=b'{"peft_type": "LORA", "r": ' + b"9" * 6000 + b"}"),
        raw(sql, "config_not_utf8", config_raw=b'{"peft_type": "LORA\xff"}'),
        raw(sql, "config_array", config_raw=b"[]"), raw(sql, "config_empty", config_raw=b""),
        raw(sql, "weights_empty", weights_raw=b""), raw(sql, "weights_7_bytes", weights_raw=b"\x01" * 7),
        raw(sql, "header_len_huge", weights_raw=(1 << 62).to_bytes(8, "little") + b"{}"),
        raw(sql, "header_deep", weights_raw=_with_header(b"[" * 50_000 + b"]" * 50_000)),
        raw(sql, "header_over_cap", weights_raw=_with_header(b"{" + b" " * (2 << 20) + b"}")),
    ]
    cases += [with_magnitudes(cfg(sql, "dora_magnitudes", use_dora=True)),
              with_magnitudes(cfg(sql, "magnitudes_without_dora"))]
    missing_config = _copy(sql)
    missing_config.labels.append("no_config")
    missing_config.config = None
    missing_weights = _copy(sql)
    missing_weights.labels.append("no_weights")
    missing_weights.tensors = None
    return cases + [missing_config, missing_weights]


def with_magnitudes(case: Case) -> Case:
    """`case` with a DoRA magnitude vector beside each module's lora_B (PEFT's saved name), drawn
    in [1, 2)."""
    gen = torch.Generator().manual_seed(len(case.labels))
    case.tensors = dict(case.tensors)
    for k, v in list(case.tensors.items()):
        if ".lora_B." in k:
            case.tensors[k.split(".lora_B.")[0] + ".lora_magnitude_vector"] = (1 + torch.rand(v.shape[0], generator=gen)).to(v.dtype)
    return case


def _with_header(header: bytes, data: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + data


# -- the mutator ---------------------------------------------------------------------------------
def mutate(bases: dict[str, Case], rng: random.Random, max_mutations: int = 3) -> Case:
    """A base adapter with 1..max_mutations random changes (some of them leave it sound)."""
    case = _copy(bases[rng.choice(sorted(bases))])
    for _ in range(rng.randint(1, max_mutations)):
        rng.choice(MUTATIONS)(case, rng)
    return case


def _config_key(case: Case, rng: random.Random) -> None:
    from lorafleet.worker.lora.config_rules import RULES

    if case.config is None:
        return
    key = rng.choice(sorted(RULES))
    value = rng.choice(ODD_VALUES + [case.config.get(key)] * 4)  # often a value PEFT itself wrote
    case.config[key] = value
    case.labels.append(f"cfg:{key}={_short(value)}")


def _config_drop(case: Case, rng: random.Random) -> None:
    if case.config:
        key = rng.choice(["r", "lora_alpha", "target_modules", "peft_type", rng.choice(sorted(case.config))])
        case.config.pop(key, None)
        case.labels.append(f"drop:{key}")


def _unknown_key(case: Case, rng: random.Random) -> None:
    if case.config is not None:
        value = rng.choice(ODD_VALUES)
        case.config[rng.choice(["use_xlora", "future_config", "lora_variant", "foo"])] = value
        case.labels.append(f"unknown={_short(value)}")


def _targets(case: Case, rng: random.Random) -> None:
    if case.config is None:
        return
    kind = rng.random()
    if kind < 0.4:
        value = rng.choice(SOUND_REGEXES)
    elif kind < 0.55:
        value = rng.choice(BAD_REGEXES)
    else:
        value = rng.sample(TARGET_ENTRIES, rng.randint(1, 4))
        own = case.config.get("target_modules")
        if rng.random() < 0.5 and isinstance(own, list):  # keep the adapter's own targets too
            value = sorted(set(value) | {t for t in own if isinstance(t, str)})
    case.config["target_modules"] = value
    case.labels.append(f"targets={_short(value)}")


def _patterns(case: Case, rng: random.Random) -> None:
    if case.config is None:
        return
    key = rng.choice(["rank_pattern", "alpha_pattern"])
    pattern = rng.choice(["q_proj", r"layers\.0\.self_attn\.v_proj", "up_proj", "(q", CATASTROPHIC, "mlp.down_proj",
                          r"\d\.self_attn\.o_proj", "nomatch"])
    value = rng.choice([1, 2, 4, 8, 0, -3, 2.5, "4", None, 10**6, 16.0])
    case.config[key] = {pattern: value} if rng.random() < 0.9 else rng.choice([[pattern], pattern, None])
    case.labels.append(f"{key}={_short(case.config[key])}")


def _rank(case: Case, rng: random.Random) -> None:
    if case.config is not None:
        key = rng.choice(["r", "lora_alpha", "use_rslora"])
        case.config[key] = rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 0, -1, 8.0, "8", True, 1e308, float("inf")])
        case.labels.append(f"{key}={_short(case.config[key])}")


def _tensor_name(case: Case, rng: random.Random) -> None:
    if not case.tensors:
        return
    old = rng.choice(sorted(case.tensors))
    how = rng.choice(["short", "shorter", "default", "layer9", "layer00", "block", "garbage", "arabic", "newline"])
    new = {
        "short": old.replace("base_model.model.", ""), "shorter": old.replace("base_model.model.model.", ""),
        "default": old.replace(".weight", ".default.weight"), "layer9": old.replace("layers.1.", "layers.9."),
        "layer00": old.replace("layers.0.", "layers.00."),
        "block": old.replace("self_attn", "mlp") if "self_attn" in old else old.replace("mlp", "self_attn"),
        "garbage": old + ".x", "arabic": old.replace("layers.1.", "layers.\u0661."), "newline": old + "\n",
    }[how]
    case.tensors[new] = case.tensors.pop(old)
    case.labels.append(f"name:{how}")


def _tensor_drop_or_add(case: Case, rng: random.Random) -> None:
    if not case.tensors:
        return
    key = rng.choice(sorted(case.tensors))
    if rng.random() < 0.5:
        del case.tensors[key]
        case.labels.append("tensor:drop")
    else:
        case.tensors[key.replace("lora_A", "lora_embedding_A")] = case.tensors[key].clone()
        case.labels.append("tensor:extra")


def _tensor_value(case: Case, rng: random.Random) -> None:
    if not case.tensors:
        return
    key = rng.choice(sorted(case.tensors))
    t = case.tensors[key]
    how = rng.choice(["f16", "bf16", "f64", "i32", "u8", "bool", "nan", "inf", "big", "wide", "narrow", "transpose",
                      "scalar", "3d", "empty_rows"])
    if how in ("f16", "bf16", "f64", "i32", "u8", "bool"):
        dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64, "i32": torch.int32,
                 "u8": torch.uint8, "bool": torch.bool}[how]
        t = t.to(dtype)
    elif how in ("nan", "inf", "big"):
        t = t.clone()
        t.view(-1)[rng.randrange(t.numel())] = {"nan": float("nan"), "inf": float("inf"), "big": 3e38}[how]
    elif how == "wide":
        t = torch.zeros(t.shape[0], t.shape[1] + 1)
    elif how == "narrow":
        t = t[:, :-1].contiguous() if t.shape[1] > 1 else t
    elif how == "transpose":
        t = t.t().contiguous()
    elif how == "scalar":
        t = torch.tensor(1.0)
    elif how == "3d":
        t = t.unsqueeze(0).contiguous()
    else:
        t = t[:0].contiguous()
    case.tensors[key] = t
    case.labels.append(f"value:{how}")


def _header(case: Case, rng: random.Random) -> None:
    """Edit the serialized file: the header's JSON or length, or the bytes after it."""
    if case.tensors is None:
        return
    blob = case.weights_raw if case.weights_raw is not None else save(case.tensors, metadata={"format": "pt"})
    n = int.from_bytes(blob[:8], "little")
    try:
        header = json.loads(blob[8 : 8 + n])
    except ValueError:
        return
    data = blob[8 + n :]
    names = [k for k in header if k != "__metadata__"]
    how = rng.choice(["len+1", "len-1", "truncate", "append", "offset", "gap", "dtype", "shape", "meta", "pad",
                      "count", "dup_offsets"])
    name = rng.choice(names) if names else None
    if how in ("offset", "gap") and name:
        header[name]["data_offsets"][1 if how == "offset" else 0] += rng.choice([1, 2, 4])
    elif how == "dtype" and name:
        header[name]["dtype"] = rng.choice(["F4", "F8_E8M0", "f32", "XYZ", "C64", "I64", 7])
    elif how == "shape" and name:
        header[name]["shape"] = rng.choice([[-1, 4], [0], [2**40, 2**40], "8", [1.5]])
    elif how == "meta":
        header["__metadata__"] = rng.choice([{"format": 1}, [], "x", {"k": "v"}])
    elif how == "count":  # many tiny tensors past the config's modules
        for i in range(rng.choice([40, 2000])):
            header[f"extra.{i}"] = {"dtype": "U8", "shape": [0], "data_offsets": [len(data), len(data)]}
    elif how == "dup_offsets" and len(names) > 1:
        header[names[1]]["data_offsets"] = list(header[names[0]]["data_offsets"])
    raw = json.dumps(header).encode()
    if how == "pad":
        raw += b" " * rng.choice([7, 1000])
    blob = len(raw).to_bytes(8, "little") + raw + data
    if how == "len+1":
        blob = (len(raw) + 1).to_bytes(8, "little") + blob[8:]
    elif how == "len-1":
        blob = (len(raw) - 1).to_bytes(8, "little") + blob[8:]
    elif how == "truncate":
        blob = blob[: max(8, len(blob) - rng.choice([1, 8, 1000]))]
    elif how == "append":
        blob += b"\0" * rng.choice([1, 8])
    case.weights_raw = blob
    case.labels.append(f"header:{how}")


def _files(case: Case, rng: random.Random) -> None:
    name = rng.choice([CONFIG, WEIGHTS])
    how = rng.choice(["link_out", "link_inside", "fifo", "dir", "missing", "dev_null", "etc_passwd", "sparse_big"])
    if how == "missing":
        if name == CONFIG:
            case.config, case.config_raw = None, None
        else:
            case.tensors, case.weights_raw = None, None
    else:
        case.post.append({"link_out": link_out(name), "link_inside": link_inside(name), "fifo": fifo(name),
                          "dir": as_dir(name), "dev_null": link_abs(name, "/dev/null"),
                          "etc_passwd": link_abs(name, "/etc/passwd"),
                          "sparse_big": sparse(name, (300 << 10) if name == CONFIG else (2 << 30) + 1)}[how])
    case.labels.append(f"file:{name.split('.')[0]}:{how}")


def _config_bytes(case: Case, rng: random.Random) -> None:
    text = json.dumps(case.config if case.config is not None else {})
    how = rng.choice(["truncate", "bom", "trailing", "dup_key", "nan_literal", "padding"])
    raw = {
        "truncate": text[: rng.randrange(max(1, len(text)))], "bom": "\ufeff" + text, "trailing": text + " x",
        "dup_key": text[:-1] + ', "peft_type": "IA3"}' if text.endswith("}") and len(text) > 2 else text,
        "nan_literal": text.replace('"lora_alpha": ', '"lora_alpha": NaN, "x_": ', 1),
        "padding": text + " " * rng.choice([10, 200_000]),
    }[how]
    case.config_raw = raw.encode()
    case.labels.append(f"config_bytes:{how}")


MUTATIONS = [_config_key, _config_key, _config_drop, _unknown_key, _targets, _targets, _patterns, _rank, _tensor_name,
             _tensor_drop_or_add, _tensor_value, _tensor_value, _header, _header, _files, _config_bytes]


def _short(value: object, limit: int = 24) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
