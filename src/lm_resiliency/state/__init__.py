"""State trees: split nested training state into tensors plus a schema-checked
JSON document, and rebuild it, without pickle.

``encode_state`` runs at capture time and raises ``StateEncodingError`` for
anything it cannot represent; ``decode_state`` and ``validate_document`` run on
documents from peers or files and raise ``StateSchemaError`` for anything
malformed. See ``docs/state-format.md`` for the document schema.
"""

from __future__ import annotations

from lm_resiliency.state.codec import (
    Deferred,
    EncodedState,
    PartialEncoding,
    begin_encoding,
    decode_state,
    encode_state,
)
from lm_resiliency.state.limits import DEFAULT_LIMITS, DocumentLimits
from lm_resiliency.state.schema import (
    SCHEMA_VERSION,
    dumps_document,
    loads_document,
    validate_document,
)

__all__ = [
    "DEFAULT_LIMITS",
    "SCHEMA_VERSION",
    "Deferred",
    "EncodedState",
    "DocumentLimits",
    "PartialEncoding",
    "begin_encoding",
    "decode_state",
    "dumps_document",
    "encode_state",
    "loads_document",
    "validate_document",
]
