"""Storage targets of shards: local directories (one per SSD or server) and S3 buckets.

A target maps a key (``<hex[:2]>/<hex>.<shard>``) to bytes. Every method is blocking (run it
in a worker thread). A target that cannot be reached raises :class:`TargetDown`; a key it does
not hold reads as ``None``. The two are different on purpose: a missing shard on a healthy
target is damage (repair it), a target that is down may come back (never delete metadata
because of it).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

MARKER = ".deepserve-target"  # an unmounted SSD shows an empty mount point: not this target
TMP_SUFFIX = ".tmp"


class TargetDown(OSError):
    """The target does not answer (directory gone or unmounted, S3 endpoint unreachable)."""


class Target(Protocol):
    name: str

    def prepare(self) -> None: ...
    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...
    def delete(self, key: str) -> None: ...
    def keys(self) -> Iterator[tuple[str, float]]:
        """Every key with its modification time (temporary files end in ``.tmp``)."""
        ...


class DirTarget:
    """A directory; writes go to a temporary file, fsync, rename, fsync of the directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.name = str(self.root)

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / MARKER).touch()

    def _up(self) -> None:
        if not (self.root / MARKER).is_file():
            raise TargetDown(f"target {self.name} is down (no {MARKER}: gone or unmounted)")

    def put(self, key: str, data: bytes) -> None:
        self._up()
        path = self.root / key
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}{TMP_SUFFIX}"
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename survives a power cut before the metadata is written
        finally:
            os.close(dir_fd)

    def get(self, key: str) -> bytes | None:
        try:
            return (self.root / key).read_bytes()
        except FileNotFoundError:
            self._up()
            return None

    def delete(self, key: str) -> None:
        self._up()
        (self.root / key).unlink(missing_ok=True)

    def keys(self) -> Iterator[tuple[str, float]]:
        self._up()
        for sub in self.root.iterdir():
            if sub.is_dir():
                for p in sub.iterdir():
                    try:
                        yield f"{sub.name}/{p.name}", p.stat().st_mtime
                    except FileNotFoundError:  # renamed or deleted while listing
                        continue


class S3Target:
    """A bucket through boto3 (any S3 endpoint; SeaweedFS in tests). A PUT is atomic in S3."""

    def __init__(self, bucket: str, client: Any) -> None:
        self.bucket, self.client = bucket, client
        self.name = f"s3://{bucket}"

    def _call(self, fn: Any, **kw: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kw)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise TargetDown(f"target {self.name}: {exc}") from None
        except BotoCoreError as exc:
            raise TargetDown(f"target {self.name} is down: {exc}") from None

    def prepare(self) -> None:
        from botocore.exceptions import ClientError

        try:
            self.client.head_bucket(Bucket=self.bucket)
        except ClientError:
            self._call(self.client.create_bucket)

    def put(self, key: str, data: bytes) -> None:
        self._call(self.client.put_object, Key=key, Body=data)

    def get(self, key: str) -> bytes | None:
        r = self._call(self.client.get_object, Key=key)
        return None if r is None else bytes(r["Body"].read())

    def delete(self, key: str) -> None:
        self._call(self.client.delete_object, Key=key)

    def keys(self) -> Iterator[tuple[str, float]]:
        token: dict[str, str] = {}
        while True:
            r = self._call(self.client.list_objects_v2, **token)
            for o in (r or {}).get("Contents", []):
                yield o["Key"], o["LastModified"].timestamp()
            if not r or not r.get("IsTruncated"):
                return
            token = {"ContinuationToken": r["NextContinuationToken"]}


def s3_client(endpoint: str = "", region: str = "us-east-1") -> Any:
    """A boto3 S3 client; credentials come from the usual AWS variables or files."""
    import boto3
    from botocore.config import Config

    cfg = Config(
        retries={"max_attempts": 2, "mode": "standard"},
        connect_timeout=2,
        read_timeout=30,
        max_pool_connections=32,
    )
    return boto3.client("s3", endpoint_url=endpoint or None, region_name=region, config=cfg)


def open_targets(specs: list[str], s3_endpoint: str = "") -> list[Target]:
    """``DIR`` or ``s3://bucket`` per spec."""
    client = None
    out: list[Target] = []
    for spec in specs:
        if spec.startswith("s3://"):
            client = client or s3_client(s3_endpoint)
            out.append(S3Target(spec[5:].strip("/"), client))
        else:
            out.append(DirTarget(Path(spec)))
    return out


def shard_key(block_hex: str, index: int, attempt: str = "") -> str:
    """``<hex[:2]>/<hex>.<attempt>.<index>``: every put attempt writes shards of its own names
    (write-once), so two puts of one block never mix shards; ``attempt`` "" is the layout of
    stores written before attempts existed (``<hex>.<index>``)."""
    if attempt:
        return f"{block_hex[:2]}/{block_hex}.{attempt}.{index:02d}"
    return f"{block_hex[:2]}/{block_hex}.{index:02d}"


def new_attempt() -> str:
    """A put attempt's id: 48 random bits (a collision needs ~16M attempts of one block)."""
    return uuid.uuid4().hex[:12]


def parse_shard_key(key: str) -> tuple[str, str, int] | None:
    """(block hex, attempt, shard index) of a shard key, None for anything else (temporary
    files too)."""
    parts = key.rsplit("/", 1)[-1].split(".")
    if len(parts) == 2:
        parts.insert(1, "")
    if len(parts) != 3 or len(parts[0]) != 64 or not parts[2].isdigit():
        return None
    if parts[1] and not parts[1].isalnum():
        return None
    return parts[0], parts[1], int(parts[2])
