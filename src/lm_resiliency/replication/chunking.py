"""Choosing ``replication_chunk_size`` from measured training-communication slack."""

from __future__ import annotations

import math

from lm_resiliency.errors import ConfigError

MIN_CHUNK_BYTES = 64 * 1024
"""Smallest chunk: below this, per-message overhead dominates a transfer."""

MAX_CHUNK_BYTES = 64 * 1024 * 1024
"""Largest chunk: one message must never monopolise the NIC for long."""


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}={value!r} must be a finite number")
    return float(value)


def estimate_chunk_size(
    nic_bandwidth_gbps: float,
    layer_compute_ms: float,
    ag_time_ms: float,
    max_ag_delay_fraction: float,
) -> int:
    """The replication chunk size, in bytes, that fits the training's prefetch slack.

    FSDP-style training prefetches the next layer's all-gather while the current
    layer computes. The all-gather takes ``ag_time_ms`` of the layer's
    ``layer_compute_ms``, so the link is idle for the slack
    ``layer_compute_ms - ag_time_ms``. A replication chunk queued on the same NIC
    can delay the next all-gather by at most its own transfer time, and we allow
    it ``max_ag_delay_fraction`` of the slack::

        allowed_ms  = (layer_compute_ms - ag_time_ms) * max_ag_delay_fraction
        bytes_per_s = nic_bandwidth_gbps * 1e9 / 8
        chunk_bytes = bytes_per_s * allowed_ms / 1000

    The result is rounded to whole bytes and clamped to [64 KiB, 64 MiB]
    (:data:`MIN_CHUNK_BYTES`, :data:`MAX_CHUNK_BYTES`); with no slack
    (``ag_time_ms >= layer_compute_ms``) it is 64 KiB. Example: 400 Gb/s, 9.4 ms
    compute, 1.0 ms all-gather, 5 % -> 8.4 ms * 0.05 = 0.42 ms at 50 GB/s ->
    21,000,000 bytes.

    This is a bound from the numbers given, not a network measurement. Raises
    :class:`~lm_resiliency.errors.ConfigError` naming the value when the bandwidth
    is not positive, a time is negative, or the fraction is outside (0, 1].
    """
    bandwidth = _number("nic_bandwidth_gbps", nic_bandwidth_gbps)
    compute_ms = _number("layer_compute_ms", layer_compute_ms)
    ag_ms = _number("ag_time_ms", ag_time_ms)
    fraction = _number("max_ag_delay_fraction", max_ag_delay_fraction)
    if bandwidth <= 0:
        raise ConfigError(f"nic_bandwidth_gbps={nic_bandwidth_gbps!r} must be > 0")
    if compute_ms < 0:
        raise ConfigError(f"layer_compute_ms={layer_compute_ms!r} must be >= 0")
    if ag_ms < 0:
        raise ConfigError(f"ag_time_ms={ag_time_ms!r} must be >= 0")
    if not 0 < fraction <= 1:
        raise ConfigError(
            f"max_ag_delay_fraction={max_ag_delay_fraction!r} must be in (0, 1], e.g. 0.05"
        )
    slack_ms = compute_ms - ag_ms
    if slack_ms <= 0:
        return MIN_CHUNK_BYTES
    allowed_s = slack_ms * fraction / 1000.0
    # round(): the product carries float noise (21_000_000.000000004 for the worked
    # example of docs/replication.md); a fraction of a byte is noise, not a bound.
    chunk = round(bandwidth * 1e9 / 8 * allowed_s)
    return max(MIN_CHUNK_BYTES, min(MAX_CHUNK_BYTES, chunk))
