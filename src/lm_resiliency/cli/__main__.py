from __future__ import annotations

import sys

from lm_resiliency.cli.main import main

sys.exit(main())
