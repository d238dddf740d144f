"""The fuzz campaign's oracle: is an adapter folder valid, judged without the worker's loader.

Valid means (issue 49): its config passes the accepted-config rule (`config_rules.RULES`, the
spec: every key implemented exactly or irrelevant at its value) and its files are sound. Sound is
decided by the reference libraries and the documented caps:

- the files: regular, inside the folder once links are resolved, within the caps (config bytes,
  safetensors header bytes, total bytes);
- the config: UTF-8 JSON that `peft.LoraConfig` accepts, the implemented keys' values of the
  right kind; every regex finishes within a budget (a helper process with a timeout) and compiles;
- the model PEFT builds from it (`get_peft_model` on the demo base): it adapts only the linear
  layers the worker adapts, and its `lora_A`/`lora_B` names and shapes (and with `use_dora` its
  `lora_magnitude_vector`s) are the only tensors the file may hold (in PEFT's saved naming, or
  without the wrapper prefixes; A and B also with ".default");
- the weights: `safetensors.safe_open` reads them; floating point; both halves of every module
  and, with `use_dora`, its magnitude vector; finite, also once B is scaled by alpha/r in the
  serving dtype.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import stat
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from lorafleet.worker.lora.config_rules import RULES, is_off

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PICKLES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
FLOATS = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}
MAGNITUDE = ".lora_magnitude_vector"  # a DoRA module's magnitude, as PEFT saves it
REGEX_CPU_S = 3  # CPU seconds for PEFT's matching of one config (the worker allows 0.5)
REGEX_WALL_S = 120.0


@dataclass(frozen=True, slots=True)
class Verdict:
    valid: bool
    why: str


@dataclass(frozen=True, slots=True)
class Caps:
    config_bytes: int = 256 << 10
    header_bytes: int = 1 << 20
    total_bytes: int = 2 << 30
    max_rank: int = 64
    dtype: torch.dtype = torch.float32


class Judge:
    def __init__(self, model_dir: Path, caps: Caps = Caps()) -> None:
        import transformers

        self.caps = caps
        self.base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.names = [n for n, _ in self.base.named_modules()]
        # config JSON -> (expected tensor shapes, scaling per module), or why it is invalid
        self._expected: dict[str, tuple[dict, dict] | str] = {}

    def __call__(self, folder: Path) -> Verdict:
        try:
            return Verdict(True, self._judge(folder))
        except Invalid as why:
            return Verdict(False, str(why))

    def _judge(self, folder: Path) -> str:
        real_root = os.path.realpath(folder)
        cfg_raw = self._read(folder, CONFIG, self.caps.config_bytes, real_root)
        try:
            cfg = json.loads(cfg_raw.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise Invalid(f"config JSON: {type(exc).__name__}") from None
        if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
            raise Invalid("not a LORA config object")
        for key, value in cfg.items():
            rule = RULES.get(key)
            if (rule is None and not is_off(value)) or (rule is not None and not rule.accepts(value)):
                raise Invalid(f"config key {key} not served at {value!r:.40}")
        expected = self._expected_tensors(cfg)
        if not os.path.lexists(folder / WEIGHTS):
            raise Invalid("pickle only" if any(os.path.lexists(folder / p) for p in PICKLES) else "no weights")
        self._check_file(folder, WEIGHTS, self.caps.total_bytes, real_root)
        with open(folder / WEIGHTS, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
        if n > self.caps.header_bytes:
            raise Invalid("header over cap")
        tensors = self._safetensors(folder / WEIGHTS)
        if not tensors:
            raise Invalid("no tensors")
        seen: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            key = peft_key(name)
            if key not in expected:
                raise Invalid(f"tensor {name!r} is not one PEFT's model has")
            if key in seen:
                raise Invalid(f"two tensors for {key}")
            if tuple(t.shape) != expected[key]:
                raise Invalid(f"{key} shape {tuple(t.shape)} != {expected[key]}")
            seen[key] = t
        scaling = self._scalings(cfg)
        dora = cfg.get("use_dora") is True
        for key, t in seen.items():
            if key.endswith(MAGNITUDE):
                others = [key[: -len(MAGNITUDE)] + h for h in (".lora_A.weight", ".lora_B.weight")]
            else:
                module = key.split(".lora_A.")[0] if ".lora_A." in key else key.split(".lora_B.")[0]
                others = [module + (".lora_B.weight" if ".lora_A." in key else ".lora_A.weight")]
                others += [module + MAGNITUDE] if dora else []
            missing = [o for o in others if o not in seen]
            if missing:
                raise Invalid(f"{key} without {missing[0].rsplit('.', 2)[-2]}")
            if not torch.isfinite(t.to(self.caps.dtype)).all():
                raise Invalid(f"{key} not finite in the serving dtype")
            if "lora_B" in key:
                scaled = (t.float() * scaling[key.split(".lora_B")[0]]).to(self.caps.dtype)
                if not torch.isfinite(scaled).all():
                    raise Invalid(f"{key} overflows once scaled")
        return "valid"

    # -- files ------------------------------------------------------------------------------------
    def _check_file(self, folder: Path, name: str, cap: int, real_root: str) -> None:
        path = folder / name
        if not os.path.lexists(path):
            raise Invalid(f"no {name}")
        real = os.path.realpath(path)
        if not real.startswith(real_root + os.sep):
            raise Invalid(f"{name} resolves outside the folder")
        try:
            st = os.stat(path)
        except OSError:
            raise Invalid(f"{name} unreadable") from None
        if not stat.S_ISREG(st.st_mode):
            raise Invalid(f"{name} not a regular file")
        if st.st_size > cap:
            raise Invalid(f"{name} over cap")

    def _read(self, folder: Path, name: str, cap: int, real_root: str) -> bytes:
        self._check_file(folder, name, cap, real_root)
        return (folder / name).read_bytes()

    def _safetensors(self, path: Path) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                out = {}
                for k in f.keys():
                    dtype = f.get_slice(k).get_dtype()
                    if dtype not in FLOATS:
                        raise Invalid(f"{k} dtype {dtype} not floating point")
                    out[k] = f.get_tensor(k)
                return out
        except Invalid:
            raise
        except Exception as exc:  # noqa: BLE001 - any refusal of the reference reader
            raise Invalid(f"safetensors refuses it: {type(exc).__name__}") from None

    # -- config → the tensors PEFT's model holds -------------------------------------------------------
    def _expected_tensors(self, cfg: dict) -> dict[str, tuple[int, ...]]:
        key = json.dumps(cfg, sort_keys=True)
        if key not in self._expected:
            try:
                self._expected[key] = self._build(cfg)
            except Invalid as why:
                self._expected[key] = str(why)
        got = self._expected[key]
        if isinstance(got, str):
            raise Invalid(got)
        return got[0]

    def _build(self, cfg: dict) -> dict[str, tuple[int, ...]]:
        import peft

        r, alpha = cfg.get("r", 8), cfg.get("lora_alpha", 8)
        if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
            raise Invalid("r")
        if not (isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha)):
            raise Invalid("lora_alpha")
        if not isinstance(cfg.get("use_rslora", False), bool):
            raise Invalid("use_rslora")
        for pk, ok in (("rank_pattern", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1),
                       ("alpha_pattern", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v))):
            pv = cfg.get(pk)
            if pv is not None and not (isinstance(pv, dict) and all(ok(v) for v in pv.values())):
                raise Invalid(pk)
        targets = cfg.get("target_modules")
        if not (isinstance(targets, str) and targets or isinstance(targets, list) and targets
                and all(isinstance(t, str) for t in targets)):
            raise Invalid("target_modules")
        self._regexes_finish(cfg)
        fields = {f for f in peft.LoraConfig.__dataclass_fields__}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                config = peft.LoraConfig(**{k: v for k, v in cfg.items() if k in fields and k != "peft_type"})
                model = peft.get_peft_model(copy.deepcopy(self.base), config)
        except Exception as exc:  # noqa: BLE001 - PEFT refuses the config on this model
            raise Invalid(f"PEFT refuses it: {type(exc).__name__}: {str(exc)[:60]}") from None
        adapted = {n for n, m in model.base_model.model.named_modules() if hasattr(m, "lora_A")}
        linear = {f"model.layers.{i}.{b}.{t}" for i in range(len(self.base.model.layers))
                  for b, ts in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                                ("mlp", ("gate_proj", "up_proj", "down_proj"))) for t in ts}
        if not adapted <= linear:
            raise Invalid(f"adapts {sorted(adapted - linear)[0]!r}")
        state = peft.get_peft_model_state_dict(model)
        shapes = {k: tuple(v.shape) for k, v in state.items()}
        if max(s[0] for k, s in shapes.items() if "lora_A" in k) > self.caps.max_rank:
            raise Invalid("rank over the worker's max_lora_rank")
        if set(shapes) != {k for k in shapes if ".lora_A." in k or ".lora_B." in k or k.endswith(MAGNITUDE)}:
            raise Invalid("PEFT's model holds more than LoRA A/B and DoRA magnitudes")
        scales = {f"base_model.model.{n}": m.scaling["default"] for n, m in model.base_model.model.named_modules()
                  if hasattr(m, "lora_A")}
        return shapes, scales

    def _scalings(self, cfg: dict) -> dict[str, float]:
        return self._expected[json.dumps(cfg, sort_keys=True)][1]

    def _regexes_finish(self, cfg: dict) -> None:
        """PEFT's regex matching of this config on the model's names, in a process with a timeout."""
        targets = cfg.get("target_modules")
        patterns = [*(cfg.get("rank_pattern") or {}), *(cfg.get("alpha_pattern") or {})]
        if not (isinstance(targets, str) and targets != "all-linear") and not patterns:
            return
        # CPU seconds, not wall time: a busy machine must not turn a sound pattern into a verdict.
        code = ("import re, resource, sys, json\n"
                f"resource.setrlimit(resource.RLIMIT_CPU, ({REGEX_CPU_S}, {REGEX_CPU_S}))\n"
                "d = json.load(sys.stdin)\nfor n in d['names']:\n"
                "    if isinstance(d['t'], str): re.fullmatch(d['t'], n)\n"
                "    for k in d['p']: re.match(rf'(.*\\.)?({k})$', n)\n")
        try:
            done = subprocess.run([sys.executable, "-I", "-S", "-c", code], timeout=REGEX_WALL_S,
                                  input=json.dumps({"names": self.names, "t": targets, "p": patterns}).encode(),
                                  capture_output=True)
        except subprocess.TimeoutExpired:
            raise Invalid("a regex does not finish") from None
        if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            raise Invalid("a regex does not finish")
        if done.returncode != 0:
            raise Invalid("a regex does not compile")


class Invalid(Exception):
    pass


def peft_key(name: str) -> str:
    """A tensor name in PEFT's saved form: the wrapper prefixes and the adapter name restored."""
    key = name.replace(".default.weight", ".weight") if name.endswith(".default.weight") else name
    if key.startswith("layers."):
        key = "model." + key
    if key.startswith("model."):
        key = "base_model.model." + key
    return key
