"""What the kernels' tuning files share (`kernels/lora/tunings/`, `kernels/quant/tunings/`): one JSON
object a device, chosen by the device's name, with an override from the environment (a path to a
JSON file or inline JSON of the fields to change). No torch at import: the files are pure data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DEFAULT_FILE = "default.json"


def read_object(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a tuning file holds one JSON object")
    return data


def device_file(device_name: str, tunings_dir: Path) -> Path:
    """The tuning file for a device: the first (by name) whose "device" is a substring of the device's
    name, case-insensitive; else default.json."""
    lowered = device_name.lower()
    for path in sorted(tunings_dir.glob("*.json")):
        if path.name == DEFAULT_FILE:
            continue
        device = read_object(path).get("device")
        if isinstance(device, str) and device.lower() in lowered:
            return path
    return tunings_dir / DEFAULT_FILE


def read_override(override: str, variable: str) -> dict[str, Any] | None:
    """`variable`'s value (a path to a JSON file or inline JSON) -> the fields it changes; None if unset."""
    text = override.strip()
    if not text:
        return None
    try:
        data = json.loads(text) if text.startswith("{") else json.loads(Path(text).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{variable} must be a JSON object or a path to one: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{variable} must be a JSON object or a path to one")
    return data


def current_device_name(interpreting: bool) -> str:
    """The CUDA device's name, or "" on the CPU and under Triton's interpreter (default.json)."""
    try:
        import torch
    except ImportError:
        return ""
    if interpreting or not torch.cuda.is_available():
        return ""
    return str(torch.cuda.get_device_name())
