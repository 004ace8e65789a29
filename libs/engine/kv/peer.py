"""KV pools one process maps from another on the same host: no bytes through Python.

A pool is one byte buffer (:class:`~.cache.PagedKVCache` carves its tensors out of it).
:func:`share` describes the buffer in a small handle; :func:`open_shared` in another process
maps the same memory:

* CUDA: a CUDA IPC handle of the buffer's allocation (what ``torch.multiprocessing`` sends
  between processes). The opener copies with device kernels, also from another GPU of the
  host (peer access).
* CPU: the buffer lives in an anonymous memory file (``memfd_create``); the opener maps
  ``/proc/<pid>/fd/<fd>`` of the owner. The mapping dies with neither process's crash leaking
  a file, since the memfd has no name on any file system.

A handle also names its host (hostname + boot id) and device kind, so an opener on another
host or device kind refuses it (:class:`PeerUnavailable`) and the caller sends bytes instead.
Pools opened in the process that shares them come back as the very tensor.
"""

from __future__ import annotations

import functools
import os
import pickle
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import torch


class PeerUnavailable(RuntimeError):
    """This process cannot map that pool (another host, device kind, or the owner is gone)."""


@functools.cache
def host_id() -> str:
    """Names this host (and boot): two processes with the same id share memory and devices."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class _Handle:
    pool_id: str
    host: str
    device_type: str  # "cuda" | "cpu"
    num_blocks: int
    nbytes: int
    pid: int
    fd: int = -1  # CPU: the memfd in the owner
    cuda: tuple[Any, ...] = ()  # CUDA: the storage's ``_share_cuda_()`` (ints, bytes, bools)


_LOCAL: dict[str, torch.Tensor] = {}  # pool id -> buffer, for pools of this very process
_MEMFDS: dict[int, int] = {}  # id(buffer storage) -> memfd, CPU buffers made by allocate()


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed uint8 buffer that :func:`share` can describe."""
    if device.type == "cuda":
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    if device.type != "cpu" or not hasattr(os, "memfd_create"):
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    fd = os.memfd_create("deepserve-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        buf = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)
    except BaseException:
        os.close(fd)
        raise
    _MEMFDS[buf.untyped_storage().data_ptr()] = fd
    return buf


def share(buffer: torch.Tensor, num_blocks: int) -> bytes | None:
    """A handle of ``buffer`` (from :func:`allocate`), or None if it cannot be shared."""
    pool_id = uuid.uuid4().hex
    common = dict(
        pool_id=pool_id,
        host=host_id(),
        device_type=buffer.device.type,
        num_blocks=num_blocks,
        nbytes=buffer.numel(),
        pid=os.getpid(),
    )
    if buffer.device.type == "cuda":
        if buffer.storage_offset() != 0:
            return None
        try:
            args = buffer.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
        except (RuntimeError, TypeError):  # e.g. expandable segments refuse IPC
            return None
        handle = _Handle(**common, cuda=tuple(args))  # type: ignore[arg-type]
    else:
        fd = _MEMFDS.get(buffer.untyped_storage().data_ptr())
        if fd is None:
            return None
        handle = _Handle(**common, fd=fd)  # type: ignore[arg-type]
    _LOCAL[pool_id] = buffer
    return pickle.dumps(handle)


def describe(handle: bytes) -> tuple[str, str, str]:
    """(pool id, host id, device kind) of a handle, without opening it."""
    h = _load(handle)
    return h.pool_id, h.host, h.device_type


def open_shared(handle: bytes) -> tuple[torch.Tensor, int]:
    """Map the buffer ``handle`` describes; returns it and its pool's number of blocks."""
    h = _load(handle)
    local = _LOCAL.get(h.pool_id)
    if local is not None:
        return local, h.num_blocks
    if h.host != host_id():
        raise PeerUnavailable(f"KV pool {h.pool_id} lives on host {h.host}, not this one")
    try:
        if h.device_type == "cuda":
            if not torch.cuda.is_available():
                raise PeerUnavailable("the KV pool is on CUDA and this process has no GPU")
            storage = torch.UntypedStorage._new_shared_cuda(*h.cuda)
            buf = torch.empty(0, dtype=torch.uint8, device=f"cuda:{h.cuda[0]}")
            buf.set_(storage, 0, (h.nbytes,), (1,))
        else:
            buf = torch.from_file(
                f"/proc/{h.pid}/fd/{h.fd}", shared=True, size=h.nbytes, dtype=torch.uint8
            )
    except PeerUnavailable:
        raise
    except (OSError, RuntimeError) as exc:
        raise PeerUnavailable(f"cannot map KV pool {h.pool_id} of pid {h.pid}: {exc}") from None
    return buf, h.num_blocks


def _load(handle: bytes) -> _Handle:
    # Handles come from KVTransfer peers: the unpickler builds this module's dataclass and
    # plain values, nothing else.
    try:
        h = _Unpickler(handle).load()
    except Exception as exc:  # noqa: BLE001 - any malformed handle is the same error
        raise PeerUnavailable(f"malformed KV pool handle: {exc}") from None
    if not isinstance(h, _Handle):
        raise PeerUnavailable("malformed KV pool handle")
    return h


class _Unpickler(pickle.Unpickler):
    _ALLOWED = {(__name__, "_Handle")}

    def __init__(self, data: bytes) -> None:
        import io

        super().__init__(io.BytesIO(data))

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a KV pool handle")
        return super().find_class(module, name)
