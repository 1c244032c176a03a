"""The end-to-end GEMINI demo: a real torchrun training job that is killed and recovers.

Pieces, one concept each:

* :mod:`~lm_resiliency.demo.worker`: the training script torchrun runs on every rank
  (``python -m lm_resiliency.demo.worker``);
* :mod:`~lm_resiliency.demo.training`: the tiny GPT, its data and its captured state;
* :mod:`~lm_resiliency.demo.events`: the JSON-lines records workers leave in the run
  folder, the only channel from workers to the parent (no pickle);
* :mod:`~lm_resiliency.demo.timeline`: what those records say (fault, detection,
  restart, agreement, load, sources per rank, lost steps);
* :mod:`~lm_resiliency.demo.launch`: starting a job under torchrun and comparing the
  final state of two runs bit for bit.

``lm-resiliency demo`` (:mod:`lm_resiliency.cli.demo`), the crash and node-loss tests
and ``benchmarks/recovery.py`` are built from these.
"""

from __future__ import annotations
