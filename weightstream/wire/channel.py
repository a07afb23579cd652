"""A control channel between a trainer rank and the engine rank on its device: small JSON frames over a
local Unix-domain socket (Linux's abstract namespace: no file to clean up), each wait bounded. The
colocated (IPC) path uses it so that per bucket only a message of a few dozen bytes crosses, instead of an
HTTP request through the engine's server. What crosses is declared in :mod:`weightstream.wire.frames`: each
end sends and receives those frames only (a length prefix, then the frame's JSON object).

A frame may carry open file descriptors (``SCM_RIGHTS``): on the CPU, shared memory crosses as the
descriptor of its unnamed file, so nothing is named in /dev/shm and only the process handed the descriptor
can map it. Each end learns from the kernel which process is at the other end (``SO_PEERCRED``); a peer
running as another user is refused. The connection doubles as the trainer's lease on what the engine
mapped of it: when the trainer's end closes (it exits, however it exits) the engine sees it at once.
"""

from __future__ import annotations

import array
import json
import os
import select
import socket
import struct
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weightstream.wire.frames import Descriptors, Frame, FrameError, decode, encode

__all__ = [
    "MAX_FRAME", "MAX_FDS", "ChannelError", "Peer", "peer_of", "fd_peer", "address_problem", "Channel", "Listener"
]


_HEADER = struct.Struct("!I")
MAX_FRAME = 64 << 20  # a frame carries at most a few pickled handles
MAX_FDS = 1 << 16  # descriptors one frame may carry
_FD_CHUNK = 250  # descriptors per message (the kernel's SCM_MAX_FD is 253)
_PREFIX = "unix:@"


class ChannelError(ConnectionError):
    pass


@dataclass(frozen=True, slots=True)
class Peer:
    """The process at the other end, as the kernel saw it when the connection was made."""

    pid: int
    uid: int


def peer_of(sock: socket.socket) -> Peer:
    """Who is at the other end of a connected Unix socket (for a socket pair: the process that made it)."""
    pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return Peer(pid, uid)


def fd_peer(fd: int) -> Peer:
    """:func:`peer_of` the socket behind descriptor ``fd`` (not closed)."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        return peer_of(sock)


def address_problem(address: Any) -> str | None:
    """What is wrong with a control channel's address (``unix:@NAME``), or None."""
    if not isinstance(address, str) or not address.startswith(_PREFIX) or not 0 < len(address) - len(_PREFIX) <= 100:
        return f"a control channel's address is 'unix:@NAME' (NAME: 1 to 100 characters), got {str(address)[:120]!r}"
    return None


def _close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class Channel:
    """One connected end: ``send(frame, fds)``, ``recv(timeout_s)`` and ``recv_fds(timeout_s)`` of
    :mod:`~weightstream.wire.frames` frames. A frame the peer sends that is not one of them raises
    :class:`~weightstream.wire.frames.FrameError` (read whole: the channel stays usable, to answer it)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.peer = peer_of(sock)
        if self.peer.uid != os.getuid():
            sock.close()
            raise ChannelError(f"the control channel's peer (process {self.peer.pid}) runs as user {self.peer.uid}, "
                               f"not {os.getuid()}")

    @classmethod
    def connect(cls, address: str, timeout_s: float) -> Channel:
        problem = address_problem(address)
        if problem:
            raise ChannelError(problem)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + address[len(_PREFIX):])
        except OSError as exc:
            sock.close()
            raise ChannelError(f"could not connect to the control channel at {address} ({exc})") from None
        sock.settimeout(None)
        return cls(sock)

    # -- sending ---------------------------------------------------------------------------------

    def send(self, frame: Frame, fds: Sequence[int] = ()) -> None:
        """``frame``, and the descriptors ``fds`` with it (they stay open here: the peer gets its own). The
        descriptors go first, in chunks, each with a :class:`~weightstream.wire.frames.Descriptors` frame
        that counts them."""
        if len(fds) > MAX_FDS:
            raise ChannelError(f"{len(fds)} descriptors with one frame: at most {MAX_FDS}")
        data = _pack(frame)
        try:
            for i in range(0, len(fds), _FD_CHUNK):
                chunk = array.array("i", fds[i:i + _FD_CHUNK])
                self._sendmsg(_pack(Descriptors(len(chunk))), chunk)
            self.sock.sendall(data)
        except OSError as exc:
            raise ChannelError(f"the control channel broke while sending ({exc})") from None

    def _sendmsg(self, data: bytes, fds: array.array) -> None:
        sent = self.sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
        if sent < len(data):  # the descriptors went with the first byte
            self.sock.sendall(data[sent:])

    # -- receiving -------------------------------------------------------------------------------

    def recv(self, timeout_s: float, what: str = "message") -> Frame:
        """The next frame; one that carries descriptors is refused (they are closed)."""
        frame, fds = self.recv_fds(timeout_s, what)
        if fds:
            _close_all(fds)
            raise ChannelError(f"{what}: the peer sent {len(fds)} descriptors where none belong")
        return frame

    def recv_fds(self, timeout_s: float, what: str = "message") -> tuple[Frame, list[int]]:
        """The next frame and the descriptors that came with it (the caller closes them)."""
        deadline = time.monotonic() + timeout_s
        fds: list[int] = []
        declared = 0
        try:
            while True:
                frame = self._frame(deadline, what, timeout_s, fds)
                if not isinstance(frame, Descriptors):
                    break
                declared += frame.count
                if declared != len(fds):
                    raise ChannelError(f"{what}: {declared} descriptors announced so far, {len(fds)} came")
            if declared != len(fds):
                raise ChannelError(f"{what}: {len(fds)} descriptors came with a frame that announced none")
        except BaseException:
            _close_all(fds)
            raise
        return frame, fds

    def _frame(self, deadline: float, what: str, bound: float, fds: list[int]) -> Frame:
        """The next frame, read whole (a bad one raises :class:`FrameError` with the channel still in step)."""
        (n,) = _HEADER.unpack(self._recv_exact(_HEADER.size, deadline, what, bound, fds))
        if n > MAX_FRAME:
            raise ChannelError(f"a control frame of {n} bytes (more than {MAX_FRAME}): not a weightstream peer")
        data = self._recv_exact(n, deadline, what, bound, fds)
        try:
            raw = json.loads(data)
        except ValueError as exc:
            raise FrameError(None, [f"{what}: not JSON ({exc})"]) from None
        return decode(raw)

    def _recv_exact(self, n: int, deadline: float, what: str, bound: float, fds: list[int]) -> bytes:
        chunks, got = [], 0
        room = socket.CMSG_SPACE(_FD_CHUNK * array.array("i").itemsize)
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {what} within {bound:.0f} s")
            self.sock.settimeout(left)
            try:
                chunk, ancillary, flags, _ = self.sock.recvmsg(min(n - got, 1 << 20), room)
            except TimeoutError:
                raise TimeoutError(f"no {what} within {bound:.0f} s") from None
            except OSError as exc:
                raise ChannelError(f"the control channel broke while waiting for {what} ({exc})") from None
            fds.extend(_descriptors(ancillary))
            if flags & socket.MSG_CTRUNC:
                raise ChannelError(f"{what}: descriptors were cut off in transit (is this process's open-file "
                                   "limit, ulimit -n, lower than what it maps?)")
            if len(fds) > MAX_FDS:
                raise ChannelError(f"{what}: more than {MAX_FDS} descriptors")
            if not chunk:
                raise ChannelError(f"the peer closed the control channel while this side waited for {what}")
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    # -- as a lease ------------------------------------------------------------------------------

    def ended(self) -> bool:
        """Whether the peer closed its end (or broke the protocol by sending while none was asked for): a
        check that does not wait."""
        readable, _, _ = select.select([self.sock], [], [], 0)
        if not readable:
            return False
        try:
            self.sock.setblocking(False)
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return False
        except OSError:
            return True
        finally:
            self.sock.setblocking(True)
        return True  # end of stream, or a byte no one asked for

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _pack(frame: Frame) -> bytes:
    data = json.dumps(encode(frame), separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise ChannelError(f"a {frame.kind!r} frame of {len(data)} bytes: at most {MAX_FRAME}")
    return _HEADER.pack(len(data)) + data


def _descriptors(ancillary) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            got = array.array("i")
            got.frombytes(data[: len(data) - len(data) % got.itemsize])
            fds.extend(got)
    return fds


class Listener:
    """The trainer's end: a listening socket kept across updates, on which the engine rank connects."""

    def __init__(self):
        name = f"weightstream-{os.getpid()}-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + name)
        self.sock.listen(4)
        self.address = _PREFIX + name

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
            except TimeoutError:
                reason = abandon() if abandon is not None else None
                if reason:
                    raise ChannelError(reason) from None
                continue
            sock.settimeout(None)
            try:
                return Channel(sock)
            except (ChannelError, OSError):  # another user's process, or one gone already: not the engine
                sock.close()

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
