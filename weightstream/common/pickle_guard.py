"""Bounds on a pickle from outside, checked before it is unpickled.

A pickle can refer to an object it built before (``DUP``, memo ``GET``) instead of building it again, so a few
bytes can stand for a structure far larger than themselves: ``(t, t)`` nested 40 deep is 80 bytes and
2**40 items. Unpickling it is quick, but what the unpickler then does with it is not: used as a dictionary
key, it is hashed item by item (a tuple does not keep its hash), which takes hours; turned into a string, it
fills the memory. :func:`check_pickle` reads the pickle's opcodes without building anything (time and
memory linear in its length; a string's bytes are skipped, not decoded) and follows what each does to the
unpickler's stack and memo, keeping for every object its *expanded size*: what it would hold if every shared reference
were a copy (an item counts 1, a string or bytes item 1 + its length). The sum it checks grows by each new
item and by the whole expanded size of each object referred to again; it bounds the expanded size of
everything the pickle builds, and so the work of hashing, comparing or printing any of it. A pickle whose
sum passes :attr:`PickleBounds.per_byte` per byte of pickle (plus :attr:`PickleBounds.floor`), which nests
objects deeper than :attr:`PickleBounds.max_depth`, which is longer than :attr:`PickleBounds.max_bytes`, or
which changes an object after referring to it again (a structure that contains itself, whose expanded size
has no bound) is refused with :class:`PickleBoundError`, one line saying which bound and where. A pickle
whose opcodes do not fit together is refused with :class:`pickle.UnpicklingError` before any of it is
unpickled.

What real pickles measure, per byte: a torch_dist ``.metadata`` written by Megatron-Core 0.16 about 3.2, a
legacy ``data.pkl`` about 1.1 (1.1 to 27 KB, dense and MoE, with and without the training state), an IPC
payload of a bucket 1.6 to 2.4: a tenth of the bound or less. The measure costs about 1.2 us per opcode: 28 ms
for the 60 KB ``.metadata`` of a 4-rank MoE save (23,143 opcodes), which unpickles in 1.5 ms.
"""

from __future__ import annotations

import pickle
import pickletools
from dataclasses import dataclass, replace

__all__ = ["PickleBoundError", "PickleBounds", "PickleMeasure", "check_pickle"]


class PickleBoundError(pickle.UnpicklingError):
    """A pickle that would build more than its bounds allow; its message is one line."""


@dataclass(frozen=True, slots=True)
class PickleBounds:
    """What a pickle from outside may build: at most ``max_bytes`` long; an expanded size (see the module doc) of
    at most ``floor + per_byte * len(pickle)``, and never more than ``ceiling``; objects nested at most
    ``max_depth`` deep."""

    max_bytes: int = 1 << 30
    per_byte: int = 32
    floor: int = 1 << 20
    ceiling: int = 1 << 31
    max_depth: int = 256

    def limit(self, nbytes: int) -> int:
        return min(self.ceiling, self.floor + self.per_byte * nbytes)


@dataclass(frozen=True, slots=True)
class PickleMeasure:
    """What :func:`check_pickle` found: the pickle's length, opcodes, expanded size and deepest nesting."""

    nbytes: int
    opcodes: int
    expanded: int
    depth: int


class _Node:
    """One object the pickle builds: its expanded size, how deep it nests, and whether anything refers to it
    besides the place it was made in (then it must not change: its size is counted as it is)."""

    __slots__ = ("depth", "shared", "size")

    def __init__(self, size: int, depth: int = 0):
        self.size, self.depth, self.shared = size, depth, False


_MARK = _Node(0)  # a mark on the stack (``MARK``), never an object

# What an opcode does to the stack and memo.
_ATOM, _MAKE, _ADD, _GET, _PUT, _MEMOIZE, _DUP, _PUSH_MARK, _POP, _POP_MARK, _NOTHING, _STOP = range(12)
_KINDS: dict[str, tuple[int, int]] = {  # name: (kind, objects popped: a count, or -1 down to the last mark)
    **dict.fromkeys(("TUPLE", "LIST", "DICT", "FROZENSET", "OBJ", "INST"), (_MAKE, -1)),
    "TUPLE1": (_MAKE, 1), "TUPLE2": (_MAKE, 2), "TUPLE3": (_MAKE, 3), "REDUCE": (_MAKE, 2), "NEWOBJ": (_MAKE, 2),
    "NEWOBJ_EX": (_MAKE, 3), "STACK_GLOBAL": (_MAKE, 2), "BINPERSID": (_MAKE, 1),
    "APPEND": (_ADD, 1), "SETITEM": (_ADD, 2), "BUILD": (_ADD, 1), **dict.fromkeys(("APPENDS", "SETITEMS",
                                                                                     "ADDITEMS"), (_ADD, -1)),
    **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), (_GET, 0)),
    **dict.fromkeys(("PUT", "BINPUT", "LONG_BINPUT"), (_PUT, 0)),
    "MEMOIZE": (_MEMOIZE, 0), "DUP": (_DUP, 0), "MARK": (_PUSH_MARK, 0), "POP": (_POP, 0),
    "POP_MARK": (_POP_MARK, 0), "STOP": (_STOP, 0),
    **dict.fromkeys(("PROTO", "FRAME", "READONLY_BUFFER"), (_NOTHING, 0)),
}


@dataclass(frozen=True, slots=True)
class _Opcode:
    """An opcode and how its argument is laid out: ``fixed`` bytes, or a length of ``prefix`` bytes then that
    many bytes, or ``lines`` newline-terminated lines (or none of these: no argument)."""

    name: str
    kind: int
    pops: int
    fixed: int = 0
    prefix: int = 0
    signed: bool = False
    lines: int = 0
    memo: bool = False  # its argument is a memo index (GET, PUT and their binary forms)


_PREFIX = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
           pickletools.TAKEN_FROM_ARGUMENT4U: (4, False), pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}


def _opcode(op: pickletools.OpcodeInfo) -> _Opcode:
    kind, pops = _KINDS.get(op.name, (_ATOM, 0))
    if kind == _ATOM and (op.stack_before or len(op.stack_after) != 1):
        raise AssertionError(f"pickle opcode {op.name} has no stack effect here")  # a pickle protocol after 5
    n = op.arg.n if op.arg is not None else 0
    plain = _Opcode(op.name, kind, pops, memo=kind in (_GET, _PUT))
    if n > 0:
        return replace(plain, fixed=n)
    if n == pickletools.UP_TO_NEWLINE:
        return replace(plain, lines=2 if op.name in ("GLOBAL", "INST") else 1)
    if n in _PREFIX:
        width, signed = _PREFIX[n]
        return replace(plain, prefix=width, signed=signed)
    return plain


_OPCODES: list[_Opcode | None] = [None] * 256
for _op in pickletools.opcodes:
    _OPCODES[ord(_op.code)] = _opcode(_op)


def _truncated(op: _Opcode, pos: int) -> pickle.UnpicklingError:
    return pickle.UnpicklingError(f"the pickle ends inside the argument of {op.name} at byte {pos}")


def _read_arg(data: bytes | bytearray, at: int, op: _Opcode, pos: int) -> tuple[int, int, int]:
    """Where the argument of ``op`` (its opcode at ``pos``) that starts at ``at`` ends, the weight of what it
    pushes, and its memo index (for the memo's opcodes)."""
    if op.fixed:
        end = at + op.fixed
        if end > len(data):
            raise _truncated(op, pos)
        return end, 1, int.from_bytes(data[at:end], "little") if op.memo else 0
    if op.prefix:
        end = at + op.prefix
        length = int.from_bytes(data[at:end], "little", signed=op.signed)
        if end > len(data) or length < 0 or end + length > len(data):
            raise _truncated(op, pos)
        return end + length, 1 + length, 0
    end = at
    for _ in range(op.lines):
        end = data.find(b"\n", end) + 1
        if end == 0:
            raise _truncated(op, pos)
    index = 0
    if op.memo:
        text = data[at:end - 1]
        if not text.isdigit():
            raise pickle.UnpicklingError(f"{op.name} at byte {pos} names memo entry {text!r}, not a number")
        index = int(text)
    return end, 1 + (end - at), index


class _Walk:
    """The unpickler's stack and memo as :class:`_Node` s, and the running sum of expanded sizes."""

    def __init__(self, bounds: PickleBounds, nbytes: int):
        self.bounds, self.nbytes, self.limit = bounds, nbytes, bounds.limit(nbytes)
        self.stack: list[_Node] = []
        self.memo: dict[int, _Node] = {}
        self.total = 0
        self.depth = 0

    def pop(self, count: int, pos: int) -> list[_Node]:
        """The top ``count`` objects (``-1``: those above the last mark, and the mark)."""
        stack = self.stack
        if count < 0:
            at = len(stack) - 1
            while at >= 0 and stack[at] is not _MARK:
                at -= 1
            if at < 0:
                raise pickle.UnpicklingError(f"the opcode at byte {pos} needs a mark that is not on the stack")
            taken = stack[at + 1:]
            del stack[at:]
            return taken
        taken = stack[len(stack) - count:]
        if count > len(stack) or _MARK in taken:
            raise pickle.UnpicklingError(f"the opcode at byte {pos} needs more objects than the stack holds")
        del stack[len(stack) - count:]
        return taken

    def count(self, size: int, pos: int) -> None:
        self.total += size
        if self.total > self.limit:
            raise PickleBoundError(
                f"its pickle expands to more than {self.limit:,} items (objects and bytes of strings, a shared "
                f"object counted at each reference) by byte {pos:,} of {self.nbytes:,}; the bound is "
                f"{self.bounds.floor:,} + {self.bounds.per_byte} per byte of pickle")

    def grow(self, node: _Node, parts: list[_Node], pos: int) -> None:
        """``parts`` put into ``node`` (and so shared from now on)."""
        if node.shared:
            raise PickleBoundError(f"its pickle changes an object after referring to it again (by byte {pos:,}): "
                                   "a structure that contains itself")
        for part in parts:
            part.shared = True
            node.size += part.size
            node.depth = max(node.depth, part.depth + 1)
        self.depth = max(self.depth, node.depth)
        if node.depth > self.bounds.max_depth:
            raise PickleBoundError(f"its pickle nests objects more than {self.bounds.max_depth} deep (by byte {pos:,})")

    def refer(self, node: _Node, pos: int) -> None:
        """``node`` pushed again (``DUP``, memo ``GET``): its whole expanded size counts again."""
        node.shared = True
        self.count(node.size, pos)
        self.stack.append(node)

    def top(self, op: _Opcode, pos: int) -> _Node:
        if not self.stack or self.stack[-1] is _MARK:
            raise pickle.UnpicklingError(f"{op.name} at byte {pos} needs an object on the stack")
        return self.stack[-1]


def _step(walk: _Walk, op: _Opcode, weight: int, index: int, pos: int) -> None:
    """What ``op`` (at byte ``pos``, its argument weighing ``weight``, naming memo entry ``index``) does, but for
    what :func:`_scan` does itself."""
    kind = op.kind
    if kind == _MAKE:
        node = _Node(1)
        walk.count(1, pos)
        walk.grow(node, walk.pop(op.pops, pos), pos)
        walk.stack.append(node)
    elif kind == _ADD:
        parts = walk.pop(op.pops, pos)
        walk.grow(walk.top(op, pos), parts, pos)
    elif kind == _GET:
        if index not in walk.memo:
            raise pickle.UnpicklingError(f"{op.name} at byte {pos} reads memo entry {index}, never written")
        walk.refer(walk.memo[index], pos)
    elif kind == _PUT or kind == _MEMOIZE:
        walk.memo[index if kind == _PUT else len(walk.memo)] = walk.top(op, pos)
    elif kind == _DUP:
        walk.refer(walk.top(op, pos), pos)
    elif kind == _POP:
        walk.pop(1 if walk.stack and walk.stack[-1] is not _MARK else -1, pos)
    elif kind == _POP_MARK:
        walk.pop(-1, pos)


def _scan(walk: _Walk, data: bytes | bytearray) -> int:
    """Every opcode of ``data`` up to its ``STOP``, followed on ``walk``; how many there were. What most of any
    pickle is (constants, marks, the memo) is followed here, the rest by :func:`_step`."""
    at, opcodes, end = 0, 0, len(data)
    stack, memo, limit = walk.stack, walk.memo, walk.limit
    while at < end:
        op = _OPCODES[data[at]]
        if op is None:
            raise pickle.UnpicklingError(f"byte {at} of the pickle ({data[at]:#04x}) is not an opcode")
        pos, opcodes, kind = at, opcodes + 1, op.kind
        if op.fixed:
            at += 1 + op.fixed
            if at > end:
                raise _truncated(op, pos)
            weight, index = 1, (int.from_bytes(data[pos + 1:at], "little") if op.memo else 0)
        elif op.prefix or op.lines:
            at, weight, index = _read_arg(data, at + 1, op, pos)
        else:
            at, weight, index = at + 1, 1, 0
        if kind == _ATOM:
            walk.total += weight
            if walk.total > limit:
                walk.count(0, pos)
            stack.append(_Node(weight))
        elif kind == _MEMOIZE and stack and stack[-1] is not _MARK:
            memo[len(memo)] = stack[-1]
        elif kind == _GET and index in memo:
            walk.refer(memo[index], pos)
        elif kind == _PUSH_MARK:
            stack.append(_MARK)
        elif kind == _STOP:
            return opcodes
        elif kind != _NOTHING:
            _step(walk, op, weight, index, pos)
    raise pickle.UnpicklingError(f"the pickle ends after {end:,} bytes without its STOP opcode")


def check_pickle(data: bytes | bytearray, bounds: PickleBounds | None = None) -> PickleMeasure:
    """Check ``data`` (one pickle, up to its ``STOP``) against ``bounds`` (by default :class:`PickleBounds`)
    without unpickling it: :class:`PickleBoundError` where it would build more than they allow,
    :class:`pickle.UnpicklingError` where its opcodes do not fit together (see the module doc)."""
    bounds = bounds or PickleBounds()
    if len(data) > bounds.max_bytes:
        raise PickleBoundError(f"its pickle is {len(data):,} bytes long, more than the {bounds.max_bytes:,} allowed")
    walk = _Walk(bounds, len(data))
    opcodes = _scan(walk, data)
    return PickleMeasure(len(data), opcodes, walk.total, walk.depth)
