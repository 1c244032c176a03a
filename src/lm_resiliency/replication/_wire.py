"""Fixed-size control frames of the replication protocol.

One transfer on an edge (owner -> holder), every message on its own tag so a
protocol slip surfaces as an error, never as bytes landing in the wrong buffer::

    owner  -> holder  OFFER   (step, header bytes, chunk bytes)   or SKIP (step)
    owner  -> holder  header JSON bytes
    holder -> owner   ACCEPT (step)  or  REJECT (step, reason bytes, stream dirty?)
    holder -> owner   reason UTF-8 bytes                           (REJECT only)
    owner  -> holder  arena chunks, several in flight              (ACCEPT only)
    owner  -> holder  trailer bytes            (only if the header announces them)
    holder -> owner   ACK (step received, bytes received)

A trailer (``"trailer_bytes"`` in the header) carries what the sender only knows
once every chunk went out, e.g. checksums computed while sending.

Gloo pairs sends and receives of one tag in order and requires equal sizes, so
every frame is exactly :data:`FRAME_BYTES` and every variable-size message is
announced by the frame before it.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass

import torch

from lm_resiliency.errors import ReplicationError

_MAGIC = b"LMRR"
_PROTOCOL = 2  # 2: optional trailer after the chunks
_FORMAT = "<4sHHqqq"
FRAME_BYTES = struct.calcsize(_FORMAT)


class Kind(enum.IntEnum):
    """What a frame announces."""

    OFFER = 1
    SKIP = 2
    ACCEPT = 3
    REJECT = 4
    ACK = 5


class Tag(enum.IntEnum):
    """Gloo tags: one per message type of a transfer."""

    OFFER = 1
    HEADER = 2
    VERDICT = 3
    REASON = 4
    CHUNK = 5
    ACK = 6
    TRAILER = 7


@dataclass(frozen=True)
class Frame:
    """A control frame; the meaning of ``a`` and ``b`` depends on ``kind``.

    OFFER: a = header bytes, b = chunk bytes. REJECT: a = reason bytes,
    b = 1 when the sender left unconsumed messages on the edge. ACK: a = arena
    bytes received. Unused fields are 0.
    """

    kind: Kind
    step: int
    a: int = 0
    b: int = 0

    def pack(self) -> torch.Tensor:
        """The frame as a contiguous ``uint8`` CPU tensor of :data:`FRAME_BYTES`."""
        blob = struct.pack(_FORMAT, _MAGIC, _PROTOCOL, int(self.kind), self.step, self.a, self.b)
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8)

    @classmethod
    def unpack(cls, buf: torch.Tensor) -> Frame:
        """Parse a received frame; raises ``ReplicationError`` if it is not one of ours."""
        magic, protocol, kind, step, a, b = struct.unpack(_FORMAT, buf.numpy().tobytes())
        if magic != _MAGIC or protocol != _PROTOCOL:
            raise ReplicationError(
                f"received a frame with magic {magic!r} protocol {protocol}, expected "
                f"{_MAGIC!r} protocol {_PROTOCOL} (peer runs another lm-resiliency version?)"
            )
        try:
            return cls(Kind(kind), step, a, b)
        except ValueError:
            raise ReplicationError(f"received a frame of unknown kind {kind}") from None


def empty_frame() -> torch.Tensor:
    """A receive buffer for one frame."""
    return torch.empty(FRAME_BYTES, dtype=torch.uint8)


def bytes_tensor(blob: bytes) -> torch.Tensor:
    """``blob`` as a contiguous ``uint8`` tensor (copied; the tensor owns its memory)."""
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)
