"""``lm-resiliency coordinator``: its flags, and a bad value refused before it listens."""

from __future__ import annotations

import pytest

from lm_resiliency.cli.main import main

_BASE = ["coordinator", "--run-id", "r", "--replica-groups", "2", "--nproc-per-group", "1"]


def test_every_flag_has_help_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["coordinator", "--help"])
    out = capsys.readouterr().out
    for text in ("--lease-s S", "LiveConfig.lease_s in seconds (default 0.5)", "--ready-file",
                 "whole-job restart", "0 picks a free one"):  # fmt: skip
        assert text in out, out


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--lease-s", "0.1"], "LiveConfig.lease_s=0.1 must be >= 3 x heartbeat_s=0.1"),
        (["--min-replicas", "0"], "LiveConfig.min_replicas=0 must be >= 1"),
        (["--port", "70000"], "--port=70000 must be 0..65535"),
        (["--min-replicas", "3"], "min_replicas=3 exceeds replicas=2"),
    ],
)
def test_a_bad_value_exits_2_naming_it(flags, fragment, capsys) -> None:
    assert main([*_BASE, "--port", "0", *flags]) == 2
    assert fragment in capsys.readouterr().err
