"""Size limits of a state document, enforced at encode and at validation.

The limits bound what a reader must accept from a peer or a file before it has
trusted anything: how deep the tree nests, how many values it holds, how long
one string may be, how large an integer may be, and how large the whole JSON
text may be. The encoder enforces the same limits, so a capture that succeeds
always produces a document its readers accept.
"""

from __future__ import annotations

from dataclasses import dataclass

from lm_resiliency.errors import ConfigError

#: Deepest nesting a reader may be asked to walk; keeps every recursive walk
#: (ours and ``json``'s) far below Python's recursion limit.
MAX_SUPPORTED_DEPTH = 128
#: Largest int a document may hold; Python refuses to print ints of more than
#: 4300 decimal digits (about 14,000 bits), so JSON could not carry them anyway.
MAX_SUPPORTED_INT_BITS = 8192


@dataclass(frozen=True)
class DocumentLimits:
    """Bounds on a state document. Every field is a positive ``int``.

    Raises ``ConfigError`` from ``__post_init__`` when a field is not a positive
    int or ``max_depth`` exceeds :data:`MAX_SUPPORTED_DEPTH`.
    """

    max_depth: int = 64
    """Most container levels (dict/list/tuple) nested in each other; the root is level 1."""

    max_items: int = 1_000_000
    """Most values in the tree: the root, every container element, every dict key and value."""

    max_bytes: int = 64 * 1024 * 1024
    """Most bytes of the document as compact JSON text (``dumps_document``)."""

    max_string_bytes: int = 16 * 1024 * 1024
    """Most UTF-8 bytes of one string, including the base64 text of inlined bytes and arrays."""

    max_int_bits: int = 4096
    """Most bits of one Python int (sign excluded); 128-bit NumPy RNG states need 128."""

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_items", "max_bytes", "max_string_bytes", "max_int_bits"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigError(f"DocumentLimits.{name}={value!r} must be a positive int")
        if self.max_int_bits > MAX_SUPPORTED_INT_BITS:
            raise ConfigError(
                f"DocumentLimits.max_int_bits={self.max_int_bits} exceeds the supported "
                f"{MAX_SUPPORTED_INT_BITS}; use a value <= {MAX_SUPPORTED_INT_BITS}"
            )
        if self.max_depth > MAX_SUPPORTED_DEPTH:
            raise ConfigError(
                f"DocumentLimits.max_depth={self.max_depth} exceeds the supported "
                f"{MAX_SUPPORTED_DEPTH}; flatten the state or use a value <= {MAX_SUPPORTED_DEPTH}"
            )


DEFAULT_LIMITS = DocumentLimits()
