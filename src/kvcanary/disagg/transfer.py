"""Transfer backends: the link between the prefill and the decode worker.

A link carries *messages*: a small JSON-able body, optionally followed by one flat uint8
payload (a request's KV pages, see :mod:`.pages`). Contracts of every backend:

* messages arrive complete, in send order, each with its payload;
* ``send`` never waits for the peer to *act* on a message (only, at most, for the bytes to
  be taken), and gives up after ``timeout_s``;
* once the peer is gone (crashed, closed, timed out) every call raises
  :class:`TransferError` with the reason; nothing blocks forever.

Backends::

    InProcessLink    both workers in one process (unit tests, benchmarks)
    TorchDistLink    torch.distributed point-to-point between two processes: control over
                     gloo (a receiver thread always has the next header posted, so sends
                     never wait on the peer's main loop); payloads over the data backend
                     (gloo on CPU, NCCL on CUDA), received by the main thread

Wire format of one message on :class:`TorchDistLink`::

    tag 1 (control)  int64[2]  = [body_nbytes, payload_nbytes]
    tag 2 (control)  uint8[body_nbytes]  = UTF-8 JSON body
    tag 3 (data)     uint8[payload_nbytes]  (only when payload_nbytes > 0)
"""

from __future__ import annotations

import datetime
import json
import queue
import threading
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, NamedTuple

import torch

_TAG_HEADER, _TAG_BODY, _TAG_DATA = 1, 2, 3
_CLOSE = "_close"  # body type ending a link cleanly (the receiver thread exits on it)
# The receiver thread waits for the next message without a deadline (a worker may be idle
# for long); liveness comes from connection errors (a crashed peer closes its sockets) and
# from the per-request deadlines of the workers.
_IDLE_TIMEOUT = datetime.timedelta(days=7)


class TransferError(RuntimeError):
    """The link to the peer worker failed: the peer crashed, closed or timed out."""


class Message(NamedTuple):
    body: dict[str, Any]
    payload: torch.Tensor | None


class TransferLink(ABC):
    """One endpoint of an ordered, reliable message channel to the peer worker."""

    @abstractmethod
    def send(self, body: dict[str, Any], payload: torch.Tensor | None = None) -> None:
        """Queue one message (raises :class:`TransferError` if the peer is gone)."""

    @abstractmethod
    def poll(self) -> list[Message]:
        """Every message received since the last call (never blocks on an idle peer)."""

    @abstractmethod
    def close(self) -> None:
        """End the link; safe to call twice and after a failure."""


# ---------------------------------------------------------------------------- in-process


class InProcessLink(TransferLink):
    """Half of a pair of in-memory queues. Payloads are handed over as they are (the
    sender's gather already made a fresh tensor)."""

    def __init__(self, inbox: deque[Message], outbox: deque[Message], state: dict[str, bool]):
        self._inbox, self._outbox, self._state = inbox, outbox, state

    @classmethod
    def pair(cls) -> tuple[InProcessLink, InProcessLink]:
        a_to_b: deque[Message] = deque()
        b_to_a: deque[Message] = deque()
        state = {"closed": False}
        return cls(b_to_a, a_to_b, state), cls(a_to_b, b_to_a, state)

    def send(self, body: dict[str, Any], payload: torch.Tensor | None = None) -> None:
        if self._state["closed"]:
            raise TransferError("in-process link is closed")
        self._outbox.append(Message(json.loads(json.dumps(body)), payload))

    def poll(self) -> list[Message]:
        out = list(self._inbox)
        self._inbox.clear()
        if not out and self._state["closed"]:
            raise TransferError("in-process link is closed")
        return out

    def close(self) -> None:
        self._state["closed"] = True


# ---------------------------------------------------------------------------- torch.distributed


def resolve_dist_backend(name: str, device: torch.device) -> str:
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and device.type != "cuda":
        raise ValueError(f"--disagg-dist-backend=nccl needs a CUDA device (got {device})")
    return name


class TorchDistLink(TransferLink):
    """Rank 0 (prefill) and rank 1 (decode) of a two-process torch.distributed group."""

    def __init__(
        self,
        rank: int,
        *,
        master_addr: str,
        master_port: int,
        device: torch.device,
        dist_backend: str = "auto",
        timeout_s: float = 60.0,
        connect_timeout_s: float = 120.0,
    ):
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.peer = rank, 1 - rank
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        backend = resolve_dist_backend(dist_backend, device)
        if device.type == "cuda":  # NCCL: one GPU per worker (devices given by the configs)
            torch.cuda.set_device(device)
        store = dist.TCPStore(
            master_addr, master_port, world_size=2, is_master=rank == 0,
            timeout=datetime.timedelta(seconds=connect_timeout_s),
        )  # fmt: skip
        dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=_IDLE_TIMEOUT)
        self._data_group = dist.group.WORLD
        self._ctrl_group = (
            self._data_group
            if backend == "gloo"
            else dist.new_group([0, 1], backend="gloo", timeout=_IDLE_TIMEOUT)
        )
        self._inbox: queue.Queue[Message | BaseException] = queue.Queue()
        self._error: TransferError | None = None
        self._closed = False
        self._peer_closed = False
        self._receiver = threading.Thread(target=self._receive_loop, daemon=True)
        self._receiver.start()

    # -------------------------------------------------------------- threads
    def _receive_loop(self) -> None:
        """Receive control messages until the peer's close (or a failure)."""
        dist = self._dist
        try:
            while True:
                header = torch.empty(2, dtype=torch.int64)
                dist.recv(header, self.peer, group=self._ctrl_group, tag=_TAG_HEADER)
                body_nbytes, payload_nbytes = (int(x) for x in header)
                raw = torch.empty(body_nbytes, dtype=torch.uint8)
                dist.recv(raw, self.peer, group=self._ctrl_group, tag=_TAG_BODY)
                body = json.loads(bytes(raw.numpy()).decode())
                body["_payload_nbytes"] = payload_nbytes
                self._inbox.put(Message(body, None))
                if body.get("type") == _CLOSE:
                    return
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            self._inbox.put(e)

    def _p2p(self, op: Any, tensor: torch.Tensor, group: Any, tag: int, what: str) -> None:
        """``op`` (isend/irecv) with the peer, waited for at most ``timeout_s``."""
        try:
            op(tensor, self.peer, group=group, tag=tag).wait(timeout=self.timeout)
        except RuntimeError as e:
            self._fail(f"{what}: {e}")

    def _fail(self, reason: str) -> None:
        if self._error is None:
            self._error = TransferError(f"link to rank {self.peer} failed: {reason}")
        raise self._error

    # -------------------------------------------------------------- api
    def send(self, body: dict[str, Any], payload: torch.Tensor | None = None) -> None:
        if self._error is not None:
            raise self._error
        if self._closed or self._peer_closed:
            raise TransferError(f"link to rank {self.peer} is closed")
        self._send(body, payload)

    def _send(self, body: dict[str, Any], payload: torch.Tensor | None) -> None:
        dist = self._dist
        raw = torch.frombuffer(bytearray(json.dumps(body).encode()), dtype=torch.uint8)
        nbytes = 0 if payload is None else payload.numel()
        header = torch.tensor([raw.numel(), nbytes], dtype=torch.int64)
        self._p2p(dist.isend, header, self._ctrl_group, _TAG_HEADER, "send header")
        self._p2p(dist.isend, raw, self._ctrl_group, _TAG_BODY, "send body")
        if payload is not None and nbytes:
            data = payload.to(self.device).contiguous()
            self._p2p(dist.isend, data, self._data_group, _TAG_DATA, "send payload")

    def poll(self) -> list[Message]:
        if self._error is not None:
            raise self._error
        out: list[Message] = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return out
            if isinstance(item, BaseException):
                self._error = TransferError(f"link to rank {self.peer} failed: receive: {item}")
                if out:  # hand over what arrived before the failure; raise on the next call
                    return out
                raise self._error
            nbytes = item.body.pop("_payload_nbytes")
            payload = None
            if nbytes:
                payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                self._p2p(self._dist.irecv, payload, self._data_group, _TAG_DATA, "receive payload")
            if item.body.get("type") == _CLOSE:
                self._peer_closed = True
                continue
            out.append(Message(item.body, payload))

    def close(self) -> None:
        """Tell the peer we are done, wait (bounded) for its close, tear the group down."""
        dist = self._dist
        if self._closed or not dist.is_initialized():
            return
        self._closed = True
        clean = self._error is None
        if clean:
            try:
                self._send({"type": _CLOSE}, None)
            except TransferError:
                clean = False
        self._receiver.join(timeout=self.timeout.total_seconds() if clean else 0)
        if clean and not self._receiver.is_alive():
            dist.destroy_process_group()
        # else: a thread may still be blocked in a receive on the group; the process exit
        # releases it (destroying the group under it could hang).
