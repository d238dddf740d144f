"""An adapter's content digest: what a worker reports in `GET /v1/adapters` (`digest`), what a
LoraAdapter's `spec.sha256` and a load's `sha256` pin, what `lorafleet adapters digest` prints.

    digest = sha256( adapter_config.json's bytes || 0x00 || adapter_model.safetensors's bytes || 0x00 )

The two files of a PEFT adapter folder, in that order, each followed by one NUL byte; nothing else in
the folder counts (README, tokenizer files, training state). Reported as "sha256:" + 64 lowercase hex
digits; manifests and load bodies take the bare hex (or the prefixed form). The same as

    python -c 'import hashlib,sys;d=sys.argv[1];print(hashlib.sha256(open(d+"/adapter_config.json","rb").read()+b"\\0"+open(d+"/adapter_model.safetensors","rb").read()+b"\\0").hexdigest())' FOLDER
"""

from __future__ import annotations

import hashlib
from pathlib import Path

FILES = ("adapter_config.json", "adapter_model.safetensors")
_CHUNK = 8 << 20


def folder_digest(folder: str | Path) -> str:
    """The digest of the adapter in `folder`, "sha256:<hex>" (OSError if a file is missing)."""
    h = hashlib.sha256()
    for name in FILES:
        with open(Path(folder) / name, "rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()
