"""estimate_chunk_size and the ``lm-resiliency chunk-size`` command."""

from __future__ import annotations

import math

import pytest

from lm_resiliency.cli.main import main
from lm_resiliency.errors import ConfigError
from lm_resiliency.replication.chunking import (
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    estimate_chunk_size,
)


def test_contract_example_is_exactly_21_million_bytes() -> None:
    assert estimate_chunk_size(400, 9.4, 1.0, 0.05) == 21_000_000
    assert (
        estimate_chunk_size(
            nic_bandwidth_gbps=400, layer_compute_ms=9.4, ag_time_ms=1.0, max_ag_delay_fraction=0.05
        )
        == 21_000_000
    )


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # 100 Gb/s = 12.5 GB/s; (10 - 2) ms * 0.1 = 0.8 ms -> 10,000,000 bytes.
        ((100, 10.0, 2.0, 0.1), 10_000_000),
        # 200 Gb/s, 5 ms slack, whole slack allowed -> 125,000,000, clamped to 64 MiB.
        ((200, 6.0, 1.0, 1.0), MAX_CHUNK_BYTES),
        # 1 Gb/s, 1 ms * 0.01 -> 1,250 bytes, clamped up to 64 KiB.
        ((1, 2.0, 1.0, 0.01), MIN_CHUNK_BYTES),
        # Exactly at the lower bound stays there: 8 Gb/s * 0.065536 ms = 65,536 bytes.
        ((8, 0.065536, 0.0, 1.0), 65_536),
    ],
)
def test_derivation_and_clamps(args: tuple[float, float, float, float], expected: int) -> None:
    assert estimate_chunk_size(*args) == expected


@pytest.mark.parametrize(("compute_ms", "ag_ms"), [(1.0, 1.0), (1.0, 3.0), (0.0, 0.0)])
def test_no_slack_gives_the_minimum(compute_ms: float, ag_ms: float) -> None:
    assert estimate_chunk_size(400, compute_ms, ag_ms, 0.05) == 64 * 1024


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 9.4, 1.0, 0.05), "nic_bandwidth_gbps=0 must be > 0"),
        ((-400, 9.4, 1.0, 0.05), "nic_bandwidth_gbps=-400 must be > 0"),
        ((400, -1.0, 1.0, 0.05), "layer_compute_ms=-1.0 must be >= 0"),
        ((400, 9.4, -0.5, 0.05), "ag_time_ms=-0.5 must be >= 0"),
        ((400, 9.4, 1.0, 0.0), "max_ag_delay_fraction=0.0 must be in (0, 1], e.g. 0.05"),
        ((400, 9.4, 1.0, 1.5), "max_ag_delay_fraction=1.5 must be in (0, 1], e.g. 0.05"),
        ((math.nan, 9.4, 1.0, 0.05), "nic_bandwidth_gbps=nan must be a finite number"),
        ((400, math.inf, 1.0, 0.05), "layer_compute_ms=inf must be a finite number"),
        ((400, "9.4", 1.0, 0.05), "layer_compute_ms='9.4' must be a finite number"),
        ((True, 9.4, 1.0, 0.05), "nic_bandwidth_gbps=True must be a finite number"),
    ],
)
def test_invalid_arguments_name_the_value(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        estimate_chunk_size(*args)  # type: ignore[arg-type]
    assert str(info.value) == message


def test_fraction_of_one_is_allowed() -> None:
    # 80 Gb/s = 10 GB/s; 1 ms -> 10,000,000 bytes.
    assert estimate_chunk_size(80, 1.5, 0.5, 1.0) == 10_000_000


def test_cli_prints_bytes_and_mib(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "chunk-size",
            "--nic-bandwidth-gbps",
            "400",
            "--layer-compute-ms",
            "9.4",
            "--ag-time-ms",
            "1.0",
            "--max-ag-delay-fraction",
            "0.05",
        ]
    )
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert out[0] == "replication_chunk_size = 21000000 bytes (20.03 MiB)"
    assert out[1] == "slack 8.4 ms x 0.05 = 0.42 ms at 400 Gb/s"


def test_cli_reports_clamping_and_no_slack(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["chunk-size", "--nic-bandwidth-gbps", "400", "--max-ag-delay-fraction", "0.05"]
    assert main([*argv, "--layer-compute-ms", "1", "--ag-time-ms", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "replication_chunk_size = 65536 bytes (0.06 MiB)",
        "no prefetch slack (-1 ms): using the minimum chunk",
    ]


def test_cli_invalid_argument_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "chunk-size",
            "--nic-bandwidth-gbps",
            "0",
            "--layer-compute-ms",
            "9.4",
            "--ag-time-ms",
            "1.0",
            "--max-ag-delay-fraction",
            "0.05",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "nic_bandwidth_gbps=0.0 must be > 0" in err
