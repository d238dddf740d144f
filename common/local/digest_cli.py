"""`lorafleet adapters digest SOURCE ...`: the content digest a worker would report for an adapter
(`lorafleet.adapter_digest`), for a LoraAdapter's `spec.sha256` or a load's `sha256`.

SOURCE is a local folder, `s3://BUCKET/PREFIX` or `hf://OWNER/NAME[/SUBFOLDER][@REVISION]`; remote
ones are fetched the way a worker fetches them (the AWS environment, `HF_ENDPOINT`, `HF_TOKEN`) into
a temporary folder, removed afterwards. Prints the 64 hex digits (one source), or "HEX  SOURCE" per
line (several, as sha256sum does). Exit status 1 if a source cannot be read.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from lorafleet.adapter_digest import FILES, folder_digest


def digest_of(source: str, scratch: Path, max_bytes: int = 2 << 30) -> str:
    """The digest of one source ("sha256:<hex>"); ValueError or OSError with a reason if it cannot be had."""
    if "://" not in source:
        missing = [n for n in FILES if not (Path(source) / n).is_file()]
        if missing:
            raise ValueError(f"{source}: no {' or '.join(missing)} (not a PEFT adapter folder)")
        return folder_digest(source)
    from lorafleet.worker.lora.fetch import AdapterFetcher  # the worker's fetcher; torch comes with it
    from lorafleet.worker.lora.sources import LocalSource, parse_source

    parsed = parse_source(source)
    if isinstance(parsed, LocalSource):
        raise ValueError(f"{source}: not a folder, s3:// or hf:// source")
    fetcher = AdapterFetcher(scratch, max_cache_bytes=1 << 62)
    return folder_digest(fetcher.fetch(parsed, max_bytes))


def main(sources: list[str], max_bytes: int = 2 << 30) -> int:
    failed = False
    with tempfile.TemporaryDirectory(prefix="lorafleet-digest-") as scratch:
        for source in sources:
            try:
                digest = digest_of(source, Path(scratch), max_bytes).removeprefix("sha256:")
            except (ValueError, OSError) as exc:  # AdapterError is a ValueError
                print(f"lorafleet adapters digest: {exc}", file=sys.stderr)
                failed = True
                continue
            print(digest if len(sources) == 1 else f"{digest}  {source}")
    return 1 if failed else 0
