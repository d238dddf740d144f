"""An adapter's digest: the sha256 of its config and weights over the bytes read once, reused for
unchanged files (`DIGEST_CACHE`), completed at exit, and never waited for by a load."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

from lorafleet.worker.config import EngineConfig
from lorafleet.worker.lora import adapter as adapter_mod
from lorafleet.worker.lora.adapter import adapter_digest, load_adapter
from tests.worker.lora_harness import CONFIG, WEIGHTS, make_registry


def test_digest_is_the_sha256_of_config_and_weights(model, demo_adapters):
    reg = make_registry(model, torch.float32)
    for name, folder in demo_adapters.items():
        raw = (folder / CONFIG).read_bytes() + b"\0" + (folder / WEIGHTS).read_bytes() + b"\0"
        want = "sha256:" + hashlib.sha256(raw).hexdigest()
        assert adapter_digest(folder) == want, name
        assert load_adapter(folder, model, 64, 1 << 30).digest.value == want, name
        assert reg.read(str(folder)).digest.value == want, name


def test_digest_reused_for_unchanged_files_and_recomputed_after_a_change(tmp_path, model, demo_adapters, monkeypatch):
    """A second read of the same unchanged folder skips sha256; rewriting the weights (even with
    the same size and the old mtime put back) changes the ctime, so the new content is hashed."""
    import os
    import shutil

    from lorafleet.worker.lora import adapter as adapter_mod

    folder = tmp_path / "a"
    shutil.copytree(next(iter(demo_adapters.values())), folder)
    hashed = []
    real = adapter_mod.Sha256Thread
    monkeypatch.setattr(adapter_mod, "Sha256Thread", lambda parts, **kw: hashed.append(1) or real(parts, **kw))
    first = adapter_mod.load_adapter(folder, model, 64, 1 << 30)
    first.digest.value  # noqa: B018 - the hash is complete (and cached) before the second read
    second = adapter_mod.load_adapter(folder, model, 64, 1 << 30)
    assert len(hashed) == 1 and second.digest.value == first.digest.value == adapter_mod.adapter_digest(folder)

    weights = folder / adapter_mod.WEIGHTS_FILE
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # same size: flip a bit in the last tensor's bytes
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime back; ctime moves on
    third = adapter_mod.load_adapter(folder, model, 64, 1 << 30)
    assert len(hashed) == 2 and third.digest.value == adapter_mod.adapter_digest(folder) != first.digest.value


def test_a_folder_removed_after_its_read_keeps_its_digest_out_of_the_cache(tmp_path, model, demo_adapters,
                                                                         monkeypatch, caplog):
    """An operator may delete a folder once it is loaded: the hash still completes (over the mapped
    bytes) with the right value, nothing is logged as an error and nothing is cached for the path."""
    from lorafleet.worker.lora.digest import Sha256Thread

    held = []

    class Deferred:  # runs the hash when the test says so, after the folder is gone
        def __init__(self, parts, on_done=None):
            held.append((parts, on_done))

    monkeypatch.setattr(adapter_mod, "DIGEST_CACHE", type(adapter_mod.DIGEST_CACHE)())
    folder = tmp_path / "a"
    shutil.copytree(next(iter(demo_adapters.values())), folder)
    want = adapter_digest(folder)
    monkeypatch.setattr(adapter_mod, "Sha256Thread", Deferred)
    adapter_mod.load_adapter(folder, model, 64, 1 << 30)
    shutil.rmtree(folder)
    (parts, on_done), = held
    with caplog.at_level("ERROR"):
        assert "sha256:" + Sha256Thread(parts, on_done=on_done).hexdigest() == want  # joins: on_done has run
    assert not caplog.records and not adapter_mod.DIGEST_CACHE._items


def test_a_digest_under_way_at_exit_completes_first(tmp_path):
    """A process that exits while an adapter's sha256 is still running waits for it (its `on_done`
    runs) instead of finalizing the interpreter under the thread (pytorch/pytorch#38228: a daemon
    thread ended inside a C++ frame aborts the process)."""
    import subprocess
    import sys

    out = tmp_path / "done"
    script = (
        "import time\n"
        "from lorafleet.worker.lora.digest import Sha256Thread\n"
        "def done(h):\n"
        "    time.sleep(0.2)\n"
        f"    open({str(out)!r}, 'w').write(h)\n"
        "Sha256Thread([bytes(1 << 24)] * 8, on_done=done)\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120, cwd=tmp_path)
    want = hashlib.sha256()
    for _ in range(8):
        want.update(bytes(1 << 24))
    assert out.read_text() == want.hexdigest()


def test_a_load_does_not_wait_for_its_digest(tmp_path, demo_model, demo_adapters, monkeypatch):
    """The adapter serves while its sha256 is still running (the hash is held back here); what
    needs the value (a second load under the same name) gets the right one once it is done."""
    import threading

    from lorafleet.worker.engine.engine import LLMEngine
    from lorafleet.worker.engine.sequence import SamplingParams
    from lorafleet.worker.lora.registry import AdapterConflict

    gate = threading.Event()
    real = adapter_mod.Sha256Thread

    class HeldBack(real):
        def _run(self, parts):
            gate.wait(60)
            super()._run(parts)

    monkeypatch.setattr(adapter_mod, "Sha256Thread", HeldBack)
    monkeypatch.setattr(adapter_mod, "DIGEST_CACHE", type(adapter_mod.DIGEST_CACHE)())  # no earlier digests
    names = list(demo_adapters)
    a, other = tmp_path / "a", tmp_path / "b"
    shutil.copytree(demo_adapters[names[0]], a)
    shutil.copytree(demo_adapters[names[1]], other)
    engine = LLMEngine(demo_model, EngineConfig(max_loras=2, max_cpu_loras=4, num_kv_blocks=64))
    served = []
    worker = threading.Thread(target=lambda: served.append(
        (engine.load_adapter("a", str(a)),
         engine.generate(["Hello"], SamplingParams(max_tokens=3, ignore_eos=True), [(("a", 1.0),)]))))
    worker.start()
    worker.join(60)
    assert served and served[0][0] is True and len(served[0][1][0].token_ids) == 3  # loaded and served ...
    entry = engine.registry.entries["a"]
    assert not entry.digest.ready  # ... with the hash still held back
    gate.set()
    assert entry.digest.value == adapter_digest(a)
    assert engine.load_adapter("a", str(a)) is False  # same content: a no-op
    with pytest.raises(AdapterConflict):
        engine.load_adapter("a", str(other))
