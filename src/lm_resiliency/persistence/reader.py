"""An open, header-validated shard whose data is read on demand.

:meth:`ShardStore.open_reader <lm_resiliency.persistence.store.ShardStore.open_reader>`
validates everything but the data (path safety, header limits and schema,
identity, tensor table, file size) and returns a :class:`ShardReader`. Its
bytes are then either read whole (:meth:`ShardReader.read_all`, every chunk
CRC verified) or read chunk by chunk (:meth:`ShardReader.read_into`) by a
consumer that verifies them itself against :meth:`ShardReader.checksums`, as a
peer transfer does end to end.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from lm_resiliency._safefs import preadinto_exact
from lm_resiliency.capture import Layout
from lm_resiliency.capture.target import Target
from lm_resiliency.persistence.format import ShardHeader, read_data, read_into_target
from lm_resiliency.persistence.reasons import UnavailableReason, unavailable


class ShardReader:
    """An open shard file (closed by :meth:`close` or leaving the ``with`` block)."""

    def __init__(self, fd: int, header: ShardHeader, path: Path, owner_rank: int, step: int):
        self._fd: int | None = fd
        with contextlib.suppress(OSError):  # consumers read front to back: read ahead further
            os.posix_fadvise(fd, header.data_offset, 0, os.POSIX_FADV_SEQUENTIAL)
        self.header = header
        self.path = path
        self.owner_rank = owner_rank
        self.step = step

    @property
    def layout(self) -> Layout:
        return self.header.doc.layout

    @property
    def state_document(self) -> dict[str, Any]:
        return self.header.doc.state

    @property
    def total_bytes(self) -> int:
        return self.header.doc.layout.total_bytes

    def checksums(self) -> tuple[int, list[int]] | None:
        """``(chunk_bytes, crcs)`` stored with the data, or ``None`` if written without."""
        integ = self.header.doc.integrity
        return None if integ is None else (integ.chunk_bytes, list(integ.chunks))

    def read_all(self, into: torch.Tensor | None = None) -> torch.Tensor:
        """Every data byte, each chunk's CRC verified (see ``format.read_data``)."""
        return read_data(self._open_fd(), self.header, self.path, into=into)

    def read_into_target(self, target: Target) -> None:
        """Every data byte straight into ``target``'s live tensors, each chunk's CRC verified.

        Raises ``ShardUnavailable`` (a checksum, a short file, an I/O error; the target's
        bytes are then garbage) or ``ValueError`` (the target's layout is another one).
        """
        try:
            read_into_target(self._open_fd(), self.header, self.path, target)
        except OSError as exc:
            raise unavailable(
                UnavailableReason.IO_ERROR, self.path, f"reading its data failed: {exc}"
            ) from None

    def read_into(self, offset: int, out: torch.Tensor) -> None:
        """Fill ``out`` (flat ``uint8`` CPU) with data bytes from ``offset``; not verified."""
        if offset < 0 or offset + out.numel() > self.total_bytes:
            raise ValueError(
                f"bytes {offset}..{offset + out.numel()} are outside the shard's "
                f"{self.total_bytes} data bytes"
            )
        view = memoryview(out.numpy())  # type: ignore[arg-type]
        try:
            got = preadinto_exact(self._open_fd(), view, self.header.data_offset + offset)
        except OSError as exc:
            raise unavailable(
                UnavailableReason.IO_ERROR, self.path, f"reading its data failed: {exc}"
            ) from None
        if got != len(view):
            raise unavailable(
                UnavailableReason.TRUNCATED,
                self.path,
                f"the file ended {self.total_bytes - offset - got} bytes early",
            )

    def _open_fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"shard reader of {self.path} is closed")
        return self._fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
