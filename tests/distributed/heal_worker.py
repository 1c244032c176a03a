"""A data-parallel replica (one rank) for the heal tests: real Gloo all-reduces across replicas.

Started by ``test_live_heal.py`` with the launcher's environment. The state is a linear model
``w`` and its momentum ``mom`` (``HEAL_TEST_DIM`` floats each) plus the step; the data is a
fixed synthetic dataset read through the global-batch sampler (``global_indices`` of the step,
split over the current members), so the sampler position is state. Each step every member
computes its share's gradient, weighted by ``n_i / B``, all-reduces it (SUM) on the epoch's
cross-replica ``ProcessGroupGloo`` with a polled wait, applies it, commits (the heartbeat
carries the step), and calls ``heal.at_boundary``. A process started after epoch 0 joins
through ``heal.join``. It stops once it committed ``HEAL_TEST_STEPS`` with all replicas in
the membership for 5 steps (or at ``HEAL_TEST_MAX_STEPS``, to stay bounded); each step also sleeps
``HEAL_TEST_STEP_S`` (the rest of a real step's compute). One JSON line per event on stdout; exit 0,
or 75/76 like the front door. Kill points: ``live.forward@s`` (before the step's all-reduce),
``live.heal_send``, ``live.heal_recv`` (``LM_RESILIENCY_TEST_KILL``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from lm_resiliency._killpoints import kill_point
from lm_resiliency.live import heal
from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.keys import Ack, EpochRecord
from lm_resiliency.live.membership import Membership
from lm_resiliency.live.sampler import global_indices, split
from lm_resiliency.live.view import CoordinatorLost, Evicted

SEED = 1234
SAMPLES = 96
BATCH = 12
LR = 0.05


def _say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


class _Lost(Exception):
    pass


class Replica:
    def __init__(self, m: Membership, dim: int) -> None:
        self.m = m
        gen = torch.Generator().manual_seed(SEED)
        self.x = torch.randn(SAMPLES, dim, generator=gen) / dim**0.5
        self.y = self.x @ torch.randn(dim, generator=gen) + 0.1 * torch.randn(
            SAMPLES, generator=gen
        )
        self.w = torch.zeros(dim)
        self.mom = torch.zeros(dim)
        self.step = 0
        self.compute_s = float(os.environ.get("HEAL_TEST_STEP_S", "0.02"))
        self.in_epoch = 0
        """Steps committed in the current epoch (the run ends 5 steps into a full world)."""
        self.pg: Any = None
        self.graveyard: list[Any] = []  # old groups are abandoned, never destroyed

    def tree(self) -> dict[str, Any]:
        return {"w": self.w, "mom": self.mom, "step": self.step,
                "sampler": {"seed": SEED, "position": self.step}}  # fmt: skip

    def load(self, tree: dict[str, Any]) -> dict[str, Any]:
        self.w.copy_(tree["w"])
        self.mom.copy_(tree["mom"])
        self.step = int(tree["sampler"]["position"])
        return self.tree()

    def digest(self) -> str:
        return heal.state_digest(self.tree())

    def build_group(self) -> None:
        m = self.m
        if self.pg is not None:
            self.graveyard.append(self.pg)
        store = dist.PrefixStore(m.keys.group_prefix(m.epoch, m.group_rank), m.store())
        timeout = timedelta(seconds=m.config.pg_timeout_s)
        self.pg = dist.ProcessGroupGloo(store, m.index, len(m.members), timeout)

    def allreduce(self, t: torch.Tensor) -> None:
        work = self.pg.allreduce([t])
        while not work.is_completed():
            cause = self.m.failed()
            if cause is not None:
                raise _Lost(cause)
            time.sleep(self.m.config.poll_slice_s)
        try:
            work.wait()
        except RuntimeError as exc:  # Gloo: connection reset/closed by peer
            self.m.report_failure(str(exc).splitlines()[0])
            raise _Lost(str(exc).splitlines()[0]) from None

    def train_step(self, s: int) -> list[int]:
        m = self.m
        ids = split(global_indices(SEED, s, SAMPLES, BATCH), m.index, len(m.members))
        kill_point("live.forward", step=s)
        x, y = self.x[ids], self.y[ids]
        grad = x.t() @ (x @ self.w - y) / BATCH  # this share's part of the global-batch mean
        time.sleep(self.compute_s)  # the rest of a real step's compute
        self.allreduce(grad)
        self.mom.mul_(0.9).add_(grad)
        self.w.sub_(LR * self.mom)
        self.step = s
        return ids

    def adopted(self, record: EpochRecord) -> None:
        _say("epoch", epoch=record.epoch, members=list(record.members), reason=record.reason,
             resume_step=record.resume_step, heal=record.heal, step=self.step)  # fmt: skip
        self.in_epoch = 0
        if self.m.replica in record.members:
            self.build_group()


def main() -> int:
    config = LiveConfig(**json.loads(os.environ["LIVE_TEST_CONFIG"]))
    total = int(os.environ["HEAL_TEST_STEPS"])
    chunk = int(os.environ.get("HEAL_TEST_CHUNK", str(1 << 16)))
    m = Membership.from_env(config)
    rep = Replica(m, int(os.environ.get("HEAL_TEST_DIM", "32768")))
    try:
        _say("ready", epoch=m.epoch, members=list(m.members), pid=os.getpid(),
             inc=m.incarnation, joining=m.joining)  # fmt: skip
        if m.joining:
            record, healed = heal.join(m, rep.load, chunk_bytes=chunk)
            assert healed is not None, f"epoch {record.epoch} started afresh, no heal"
            _say("healed", step=healed.step, digest=healed.digest, nbytes=healed.nbytes,
                 seconds=healed.seconds, epoch=record.epoch)  # fmt: skip
            m.set_committed(rep.step)
            rep.adopted(record)
        else:
            rep.build_group()
        cap = int(os.environ.get("HEAL_TEST_MAX_STEPS", "5000"))
        full = lambda: len(m.members) == m.replicas and rep.in_epoch >= 5  # noqa: E731
        while not (rep.step >= total and full()) and rep.step < cap:
            s = rep.step + 1
            try:
                ids = rep.train_step(s)
            except _Lost as cause:
                _say("failed", epoch=m.epoch, step=s, cause=str(cause))
                rep.adopted(m.reform(Ack(inc="", committed=rep.step)))
                continue
            m.set_committed(s)
            rep.in_epoch += 1
            _say("commit", step=s, epoch=m.epoch, members=list(m.members), ids=ids,
                 digest=rep.digest())  # fmt: skip
            record = heal.at_boundary(m, s, rep.tree, chunk_bytes=chunk)
            if record is not None:
                rep.adopted(record)
        _say("done", step=rep.step, digest=rep.digest(), members=list(m.members),
             finite=bool(torch.isfinite(rep.w).all()))  # fmt: skip
        code = 0
    except Evicted as exc:
        _say("evicted", epoch=exc.epoch, reason=exc.reason)
        code = 76
    except CoordinatorLost as exc:
        _say("lost", kind=type(exc).__name__, message=str(exc))
        code = 75
    finally:
        m.close()
    sys.stdout.flush()
    os._exit(code)  # abandoned Gloo groups may not be destroyed (docs/live-membership.md §3)


if __name__ == "__main__":
    main()
