"""`s3://BUCKET/PREFIX` sources (S3 and S3-compatible stores), through boto3.

Credentials and endpoint come from boto3's standard chain (`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`/
`AWS_SESSION_TOKEN`, profiles, IRSA/pod identity; `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` for
MinIO, R2 and the like); nothing here logs or reports them. The prefix is listed (one LIST per
fetch), the content identity is the two objects' ETags and sizes, and each object is fetched with
`If-Match` on its listed ETag, so an object replaced mid-fetch is refused, never mixed. API calls are
retried by botocore itself (standard mode, `attempts` in all); an error while a body streams is a
`TransientError` the fetcher retries.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

from lorafleet.worker.lora.errors import AdapterError
from lorafleet.worker.lora.remote_files import RemoteFile, Resolved, TransientError, pick_files
from lorafleet.worker.lora.sources import S3Source

_READ_BYTES = 8 << 20
_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"}
_CHANGED = {"PreconditionFailed", "412"}
_UNAVAILABLE = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "500", "502", "503", "504"}
# Raised while a body streams (botocore, urllib3, the socket): the download is worth another try.
_STREAM_ERRORS = {"ResponseStreamingError", "ReadTimeoutError", "ProtocolError", "IncompleteReadError",
                  "ConnectionClosedError", "IncompleteRead", "ConnectionResetError", "ConnectionError", "TimeoutError"}


def _boto3():
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise AdapterError("sources_unavailable", "s3:// adapter sources need boto3: pip install 'lorafleet[sources]'") \
            from None
    return boto3, Config


class S3Backend:
    scheme = "s3"

    def __init__(self, attempts: int) -> None:
        self.attempts = attempts
        self._lock = threading.Lock()
        self._client = None

    def client(self):
        """The boto3 S3 client (created on first use, from the standard AWS environment)."""
        with self._lock:
            if self._client is None:
                boto3, config = _boto3()
                self._client = boto3.session.Session().client(
                    "s3", config=config(retries={"total_max_attempts": self.attempts, "mode": "standard"}))
            return self._client

    def resolve(self, source: S3Source, max_bytes: int) -> Resolved:
        """The objects directly under the prefix, the two files picked and checked against the caps."""
        listed: dict[str, tuple[int, tuple[str, str]]] = {}
        paginator = self.client().get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=source.bucket, Prefix=source.prefix, Delimiter="/"):
                for obj in page.get("Contents", ()):
                    listed[obj["Key"][len(source.prefix):]] = (int(obj["Size"]), (obj["Key"], obj["ETag"]))
        except Exception as exc:  # noqa: BLE001 - botocore's errors become reasons
            raise s3_error(source, exc) from None
        if not listed:
            raise AdapterError("not_found", f"adapter source {source}: no objects under this prefix")
        config, weights = pick_files(source, listed, max_bytes)
        identity = hashlib.sha256(json.dumps([source.bucket, source.prefix, config.ref[1], config.size, weights.ref[1],
                                              weights.size]).encode()).hexdigest()[:40]
        return Resolved(identity, config, weights)

    def download(self, source: S3Source, _resolved: Resolved, file: RemoteFile, dest: Path) -> None:
        """`file` into `dest`, exactly its listed size and ETag (a changed object is refused)."""
        key, etag = file.ref
        try:
            body = self.client().get_object(Bucket=source.bucket, Key=key, IfMatch=etag)["Body"]
        except Exception as exc:  # noqa: BLE001 - botocore's errors (after its own retries) become reasons
            raise s3_error(source, exc) from None
        written = 0
        try:
            with open(dest, "wb") as out:
                while chunk := body.read(_READ_BYTES):
                    written += len(chunk)
                    if written > file.size:
                        break
                    out.write(chunk)
        except Exception as exc:  # noqa: BLE001 - a stream cut off midway is retried
            if any(c.__name__ in _STREAM_ERRORS for c in type(exc).__mro__):
                raise TransientError(f"adapter source {source}: {file.name}'s download broke off "
                                     f"({type(exc).__name__})") from None
            raise s3_error(source, exc) from None
        finally:
            body.close()
        if written != file.size:
            raise AdapterError("changed", f"adapter source {source}: {file.name} changed while it was being fetched "
                               f"({written} bytes, listed {file.size}); retry")


def s3_error(source: S3Source, exc: Exception) -> AdapterError:
    """A botocore error as an AdapterError with a reason; the message names the source and S3's
    error code, never a credential."""
    code = str(getattr(exc, "response", {}).get("Error", {}).get("Code", "")) if hasattr(exc, "response") else ""
    name = type(exc).__name__
    if code in _NOT_FOUND:
        return AdapterError("not_found", f"adapter source {source}: {code}")
    if code in _DENIED:
        return AdapterError("access_denied", f"adapter source {source}: access denied ({code}); check the "
                            "worker's AWS credentials")
    if code in _CHANGED:
        return AdapterError("changed", f"adapter source {source} changed while it was being fetched; retry")
    if name in ("NoCredentialsError", "PartialCredentialsError"):
        return AdapterError("no_credentials", f"adapter source {source}: no AWS credentials found (set "
                            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, or a pod identity)")
    if code in _UNAVAILABLE or name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError",
                                        "ConnectionClosedError"):
        # botocore has already retried these with back-off: not retried again here.
        return AdapterError("unavailable", f"adapter source {source}: the store did not answer ({code or name})")
    return AdapterError("fetch_failed", f"adapter source {source}: {code or name}")
