"""Rank 0 -> worker commands through a shared-memory buffer: grown when needed, never cut."""
import os
import pickle
import secrets
import struct
from multiprocessing.shared_memory import SharedMemory

DEFAULT_CAPACITY = 1 << 20  # 1 MiB, as upstream; a step's command is usually a few KiB
_HEADER = struct.Struct("<QQ")  # (command number, payload length in bytes)
_MOVED = "__moved__"  # channel-internal: this command lives in a new, bigger segment


def unique_name(prefix: str = "nanovllm") -> str:
    """A segment name no other engine on this machine will pick."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"


class CommandChannel:
    """One writer (rank 0) publishes pickled (method, args) commands; each worker reads them all.

    Segment layout (bytes):

        0          8          16                               16 + length      capacity
        | number   | length   | pickle.dumps((method, args))   | unused ...     |

    The writer may only overwrite a command after every reader has read it: workers read
    before they join the step's collectives. A command too big moves the channel: the writer
    writes it to a segment twice as big (or more) and leaves (_MOVED, new_name) in the old one.
    """

    def __init__(self, shm: SharedMemory, owner: bool):
        self.shm = shm
        self.owner = owner
        self.number = 0  # last command written (writer) or read (reader)

    @classmethod
    def create(cls, capacity: int | None = None) -> "CommandChannel":
        """The writer's end: a new segment with a unique name (DEFAULT_CAPACITY bytes)."""
        capacity = DEFAULT_CAPACITY if capacity is None else capacity
        if capacity <= _HEADER.size:
            raise ValueError(f"capacity={capacity} must exceed the {_HEADER.size}-byte header")
        return cls(SharedMemory(unique_name(), create=True, size=capacity), owner=True)

    @classmethod
    def attach(cls, name: str) -> "CommandChannel":
        """A reader's end, attached to the writer's segment by name."""
        return cls(SharedMemory(name), owner=False)

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def capacity(self) -> int:
        return self.shm.size

    def write(self, method: str, args: tuple) -> None:
        """Publish one command; grows the segment when the command does not fit."""
        assert self.owner, "only the channel's creator writes"
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        self.number += 1
        if _HEADER.size + len(payload) <= self.capacity:
            self._put(self.shm, payload)
            return
        old, capacity = self.shm, self.capacity
        while capacity < _HEADER.size + len(payload):
            capacity *= 2
        self.shm = SharedMemory(unique_name(), create=True, size=capacity)
        self._put(self.shm, payload)
        self._put(old, pickle.dumps((_MOVED, self.shm.name)))
        # Readers attached to `old` keep their own mapping, so its name can go now.
        old.close()
        old.unlink()

    def _put(self, shm: SharedMemory, payload: bytes) -> None:
        shm.buf[_HEADER.size:_HEADER.size + len(payload)] = payload
        _HEADER.pack_into(shm.buf, 0, self.number, len(payload))

    def read(self) -> tuple[str, tuple]:
        """The next command as (method, args); follows the channel when it has moved."""
        number, length = _HEADER.unpack_from(self.shm.buf, 0)
        if number != self.number + 1:
            raise RuntimeError(f"command channel out of step: expected command "
                               f"{self.number + 1}, found {number}")
        method, args = pickle.loads(bytes(self.shm.buf[_HEADER.size:_HEADER.size + length]))
        if method == _MOVED:
            self.shm.close()
            self.shm = SharedMemory(args)
            return self.read()
        self.number = number
        return method, args

    def close(self) -> None:
        """Unmap the segment; the writer also removes its name. Safe to call twice."""
        if self.shm is None:
            return
        shm, self.shm = self.shm, None
        shm.close()
        if self.owner:
            try:
                shm.unlink()
            except FileNotFoundError:
                pass  # already removed, e.g. by the resource tracker after a crash
