"""A control channel between a trainer rank and the engine rank on its device: small JSON frames over a
local TCP connection, each wait bounded. The colocated (IPC) path uses it so that per bucket only a
message of a few dozen bytes crosses, instead of an HTTP request through the engine's server."""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

_HEADER = struct.Struct("!I")
MAX_FRAME = 64 << 20  # a frame carries at most a few pickled handles


class ChannelError(ConnectionError):
    pass


def _recv_exact(sock: socket.socket, n: int, deadline: float, what: str, bound: float) -> bytes:
    chunks, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {what} within {bound:.0f} s")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(n - got, 1 << 20))
        except socket.timeout:
            raise TimeoutError(f"no {what} within {bound:.0f} s") from None
        except OSError as exc:
            raise ChannelError(f"the control channel broke while waiting for {what} ({exc})") from None
        if not chunk:
            raise ChannelError(f"the peer closed the control channel while this side waited for {what}")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class Channel:
    """One connected end: ``send(dict)`` and ``recv(timeout_s)`` of JSON frames."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock

    @classmethod
    def connect(cls, address: str, timeout_s: float) -> "Channel":
        host, _, port = address.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        except OSError as exc:
            raise ChannelError(f"could not connect to the control channel at {address} ({exc})") from None
        return cls(sock)

    def send(self, frame: dict) -> None:
        data = json.dumps(frame, separators=(",", ":")).encode()
        try:
            self.sock.sendall(_HEADER.pack(len(data)) + data)
        except OSError as exc:
            raise ChannelError(f"the control channel broke while sending ({exc})") from None

    def recv(self, timeout_s: float, what: str = "message") -> dict:
        deadline = time.monotonic() + timeout_s
        (n,) = _HEADER.unpack(_recv_exact(self.sock, _HEADER.size, deadline, what, timeout_s))
        if n > MAX_FRAME:
            raise ChannelError(f"a control frame of {n} bytes (more than {MAX_FRAME}): not a weightstream peer")
        try:
            frame = json.loads(_recv_exact(self.sock, n, deadline, what, timeout_s))
        except ValueError as exc:
            raise ChannelError(f"a control frame that is not JSON ({exc})") from None
        if not isinstance(frame, dict):
            raise ChannelError("a control frame that is not an object")
        return frame

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Listener:
    """The trainer's end: a listening socket kept across updates, on which the engine rank connects."""

    def __init__(self, host: str = "127.0.0.1"):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.sock.listen(4)
        self.address = f"{host}:{self.sock.getsockname()[1]}"

    def accept(self, timeout_s: float, abandon: Any = None) -> Channel:
        """The next connection, within ``timeout_s``; ``abandon()`` (polled) may give up earlier by
        returning a reason."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the engine did not connect to the control channel {self.address} within "
                                   f"{timeout_s:.0f} s")
            self.sock.settimeout(min(left, 0.2))
            try:
                sock, _ = self.sock.accept()
                sock.settimeout(None)
                return Channel(sock)
            except socket.timeout:
                reason = abandon() if abandon is not None else None
                if reason:
                    raise ChannelError(reason) from None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
