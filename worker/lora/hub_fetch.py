"""`hf://OWNER/NAME[/SUBFOLDER][@REVISION]` sources (Hugging Face Hub model repos), through
huggingface_hub.

The revision (default: the repo's default branch) is resolved to its commit once, by the repo's
file listing (`GET /api/models/{repo}/revision/{revision}?blobs=true`), and both files are then
downloaded at that commit (`HEAD` + `GET /{repo}/resolve/{commit}/{path}`): a branch that moves
mid-fetch never mixes two versions. The content identity is the commit, the folder and the files'
blob ids (an LFS file's is its sha256, which the download is checked against). `HF_ENDPOINT` (a
mirror, a private Hub) and `HF_TOKEN` (or the token `hf auth login` saved) are huggingface_hub's
own settings; the token is never logged or put in a message.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.remote_files import RemoteFile, Resolved, TransientError, pick_files
from lorafleet.worker.lora.sources import HubSource

_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# Transport failures of httpx (huggingface_hub >= 1.0), its fork httpx2, and requests (older releases).
_TRANSPORT_ERRORS = {"TransportError", "TimeoutException", "ConnectionError", "Timeout", "ChunkedEncodingError",
                     "ConnectionResetError", "TimeoutError"}
_TIMEOUT_S = 30.0


def _hub():
    try:
        import huggingface_hub
    except ImportError:
        raise AdapterError("sources_unavailable", "hf:// adapter sources need huggingface_hub: "
                           "pip install 'lorafleet[sources]'") from None
    return huggingface_hub


class HubBackend:
    scheme = "hf"

    def __init__(self, endpoint: str | None = None, token: str | None = None) -> None:
        self.endpoint = endpoint  # None: huggingface_hub's (HF_ENDPOINT, else https://huggingface.co)
        self._token = token  # None: huggingface_hub's (HF_TOKEN, else the saved login)

    def _token_in_use(self) -> bool:
        return bool(self._token or _hub().get_token())

    def resolve(self, source: HubSource, max_bytes: int) -> Resolved:
        hub = _hub()
        try:
            info = hub.HfApi(endpoint=self.endpoint, token=self._token).model_info(
                source.repo_id, revision=source.revision, files_metadata=True, timeout=_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors become reasons
            raise self.error(source, exc) from None
        if not info.sha:
            raise AdapterError("fetch_failed", f"adapter source {source}: the Hub's answer names no commit")
        folder = source.subfolder + "/" if source.subfolder else ""
        listed: dict[str, tuple[int, tuple[str, str, str | None]]] = {}
        for sibling in info.siblings or ():
            name = sibling.rfilename[len(folder):] if sibling.rfilename.startswith(folder) else None
            if name and "/" not in name:
                lfs_sha = sibling.lfs.sha256 if sibling.lfs is not None else None
                size = sibling.lfs.size if sibling.lfs is not None else sibling.size
                listed[name] = (int(size or 0), (sibling.rfilename, lfs_sha or sibling.blob_id or "", lfs_sha))
        if not listed:
            where = f"folder {source.subfolder!r}" if source.subfolder else "repo"
            raise AdapterError("not_found", f"adapter source {source}: the {where} has no files at commit {info.sha}")
        config, weights = pick_files(source, listed, max_bytes)
        identity = hashlib.sha256(json.dumps([self.endpoint or hub.constants.ENDPOINT, source.repo_id, info.sha,
                                              source.subfolder, config.ref[1], config.size, weights.ref[1],
                                              weights.size]).encode()).hexdigest()[:40]
        return Resolved(identity, config, weights, commit=info.sha)

    def download(self, source: HubSource, resolved: Resolved, file: RemoteFile, dest: Path) -> None:
        """`file` at the resolved commit into `dest`: its listed size, and its sha256 for an LFS file."""
        hub = _hub()
        path, _blob, lfs_sha = file.ref
        # huggingface_hub's local-folder mode keeps its own metadata beside the file: a scratch
        # folder inside the fetcher's partial folder, removed with it.
        with tempfile.TemporaryDirectory(prefix=".hub-", dir=dest.parent) as scratch:
            try:
                got = hub.hf_hub_download(source.repo_id, path, revision=resolved.commit, local_dir=scratch,
                                          endpoint=self.endpoint, token=self._token, etag_timeout=_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - huggingface_hub's errors become reasons
                raise self.error(source, exc, file.name) from None
            os.replace(got, dest)
        size = dest.stat().st_size
        if size != file.size:
            raise TransientError(f"adapter source {source}: {file.name} arrived with {size} bytes, listed {file.size}")
        if lfs_sha is not None:
            digest = hashlib.sha256()
            with open(dest, "rb") as f:
                while chunk := f.read(8 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != lfs_sha:
                raise TransientError(f"adapter source {source}: {file.name} does not match the sha256 the Hub lists")

    def error(self, source: HubSource, exc: Exception, file: str | None = None) -> AdapterError:
        """A huggingface_hub error as an AdapterError with a reason (transient ones as `TransientError`).
        The message names the source and the Hub's status, never the token."""
        if isinstance(exc, AdapterError):
            return exc
        errors = _hub().errors
        response = getattr(exc, "response", None)
        status = getattr(response, "status_code", None)
        what = f"adapter source {source}"
        if isinstance(exc, errors.GatedRepoError):
            return AdapterError("access_denied", f"{what}: the repo is gated; accept its conditions on the Hub and "
                                "set HF_TOKEN to a token of an account that did")
        if isinstance(exc, errors.RepositoryNotFoundError) or status == 401:
            if status == 401 and not self._token_in_use():
                return AdapterError("access_denied", f"{what}: the Hub answered 401: the repo does not exist, or it "
                                    "is private or gated and no HF_TOKEN is set")
            if status == 401:
                return AdapterError("access_denied", f"{what}: the Hub answered 401: the repo does not exist, or "
                                    "HF_TOKEN cannot read it (a wrong or expired token)")
            return AdapterError("not_found", f"{what}: no such repo on the Hub (or HF_TOKEN cannot see it)")
        if isinstance(exc, errors.RevisionNotFoundError):
            return AdapterError("not_found", f"{what}: revision {source.revision!r} not found in the repo")
        # RemoteEntryNotFoundError from huggingface_hub 1.0, EntryNotFoundError before.
        if isinstance(exc, getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)):
            return AdapterError("not_found", f"{what}: {file or 'a file'} not found at the resolved commit")
        if status == 403:
            return AdapterError("access_denied", f"{what}: the Hub answered 403; HF_TOKEN lacks read access")
        if status in _TRANSIENT_STATUS:
            return TransientError(f"{what}: the Hub answered {status}")
        if status is not None:
            return AdapterError("fetch_failed", f"{what}: the Hub answered {status}")
        if any(c.__name__ in _TRANSPORT_ERRORS for c in type(exc).__mro__):
            return TransientError(f"{what}: cannot reach the Hub ({type(exc).__name__})")
        if isinstance(exc, OSError) and "Consistency check failed" in str(exc):
            return TransientError(f"{what}: {file or 'a file'} arrived incomplete")
        return AdapterError("fetch_failed", f"{what}: {type(exc).__name__}")
