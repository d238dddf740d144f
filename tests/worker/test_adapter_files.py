"""Opening an adapter's files: links confined to the bound, regular files only (a FIFO is refused,
not waited on), sizes capped before a byte is read."""

from __future__ import annotations

import os
import resource
import threading

import pytest

from lorafleet.worker.lora.adapter_files import open_checked, read_small
from lorafleet.worker.lora.errors import AdapterError


@pytest.fixture
def folder(tmp_path):
    f = tmp_path / "adapter"
    f.mkdir()
    (f / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    return f


def test_a_link_inside_the_folder_is_followed(folder):
    (folder / "cfg.json").symlink_to("adapter_config.json")
    assert read_small(folder / "cfg.json", folder, "cfg.json", 1024) == b'{"peft_type": "LORA"}'


@pytest.mark.parametrize("target", ["sibling", "/etc/passwd", "/dev/zero"])
def test_a_link_out_of_the_folder_is_refused(folder, target):
    if target == "sibling":
        (folder.parent / "secret").write_text("x")
        target = str(folder.parent / "secret")
    (folder / "x").symlink_to(target)
    with pytest.raises(AdapterError) as info:
        open_checked(folder / "x", folder, "x")
    assert info.value.reason == "link_outside_root" and str(folder) not in str(info.value)


def test_a_fifo_is_refused_without_waiting_for_a_writer(folder):
    os.mkfifo(folder / "pipe")
    done = threading.Event()
    result = {}

    def open_it():
        try:
            open_checked(folder / "pipe", folder, "pipe")
        except AdapterError as exc:
            result["reason"] = exc.reason
        done.set()

    threading.Thread(target=open_it, daemon=True).start()
    assert done.wait(10), "opening a FIFO blocked"
    assert result["reason"] == "not_regular_file"


def test_a_huge_config_is_refused_before_it_is_read(folder):
    with open(folder / "adapter_config.json", "r+b") as f:
        f.truncate(1 << 30)  # sparse: 1 GiB of zeros
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(AdapterError) as info:
        read_small(folder / "adapter_config.json", folder, "adapter_config.json", 256 << 10)
    assert info.value.reason == "too_large"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 << 10  # KiB: nothing was read


def test_a_missing_file_and_a_broken_link_are_named(folder):
    (folder / "dangling").symlink_to(folder / "nowhere")
    for name in ("absent", "dangling"):
        with pytest.raises(AdapterError) as info:
            open_checked(folder / name, folder, name)
        assert info.value.reason == "missing_file" and name in str(info.value)
