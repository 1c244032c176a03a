"""``python -m mtgs.trainer``: the MTGS trainer (same options as ``lm-resiliency train``)."""

from __future__ import annotations

import sys

from lm_resiliency.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
