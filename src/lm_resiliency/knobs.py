"""Internal tunables, in one place, each with the reason for its value.

These are not configuration: users set :class:`~lm_resiliency.InMemoryCkptConfig`
and friends. The modules that use a knob import it from here under its own name and never re-alias
it, so a test overrides one through that module's attribute of the same name.
"""

from __future__ import annotations

MiB = 1 << 20

REPLICATION_CHUNK_BYTES = 16 * MiB
"""Default ``replication_chunk_size`` and ``estimate_chunk_size``'s fallback: small enough
to bound the head-of-line delay it adds to training collectives, large enough that the
per-message cost of Gloo stays a few percent of a GiB transfer."""

CRC_CHUNK_BYTES = 16 * MiB
"""CRC-32C granularity of shards, memory slots and transfers: a damaged chunk is named by
its index, the last chunk's checksum (which overlaps no I/O) costs ~2 ms, and 1 GiB needs
only 64 entries in a header."""

MAX_IN_FLIGHT_CHUNKS = 4
"""Chunks outstanding per replication direction: enough to keep a TCP pipe full without
pinning much memory in Gloo's buffers."""

READ_AHEAD_CHUNKS = 2
"""How far a streamed source (a replica file being sent home) is read ahead of the sends."""

HOST_COPY_PIECE_BYTES = 8 * MiB
"""Host copies under a rate limit are split into pieces of this size so the limit can pace
them and one huge tensor does not hold a core for a second."""

REPLICATION_TIMEOUT_S = 60.0
"""Default bound on every replication wait (``replication_timeout_s``)."""

REPLICATION_REBUILD_ATTEMPTS = 3
"""Connects one rebuild of a broken replication edge tries, within one cycle, once both
endpoints have met in the store (see :mod:`lm_resiliency.replication._rebuild`)."""

SIDECAR_RETRY_S = 2.0
"""How long a status-sidecar reader retries bytes that do not decode (a remote filesystem
client can briefly see a half-replaced file)."""

OWN_STORAGE_BYTES = 1 * MiB
"""Restored tensors smaller than this get storage of their own: ``torch.set_rng_state``
ignores a view's storage offset, and copying small tensors costs nothing."""

SLOT_RECORD_RESERVE_BYTES = 64 * 1024
"""Room reserved for a memory slot's commit record at allocation; a larger record (a big
non-tensor document) extends the file instead."""

MEMORY_LOCK_WAIT_S = 10.0
"""How long a new process waits for the previous owner of a rank's memory folder to exit
(torchrun stops old workers before it starts new ones)."""

MAX_WAIT_S = 30 * 24 * 3600.0
"""Largest timeout or deadline a config accepts (``control_timeout_s`` and friends): far
below what every timer it reaches can hold (``threading`` waits cap at ~2.9e2 years,
``timedelta`` and Gloo's int64 milliseconds higher), and a wait longer than a month is a
hang, not a bound."""

CAPTURE_WORKER_POLL_S = 0.5
"""How often a caller waiting on the capture worker checks that the thread is still alive
(a worker that died without releasing its waiters must never hang the training loop)."""
