"""A plain worker process holding a live ``Membership`` (no process group), for the tests.

Started by ``test_live_coordinator.py`` with the launcher's environment. It commits a fixed
step (``LIVE_TEST_COMMITTED``) and then loops on ``failed()``; on a failure it acks and reforms.
Every event is one JSON line on stdout. SIGTERM ends it cleanly (exit 0); SIGUSR1 finishes
it as the end of training does (``Membership.finish``, then exit 0); ``Evicted`` exits 76,
``CoordinatorLost`` (and ``BelowMinReplicas``) 75, ``RunFinished`` 0, as the front door will.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time

from lm_resiliency.live.config import LiveConfig
from lm_resiliency.live.keys import Ack
from lm_resiliency.live.membership import Membership
from lm_resiliency.live.view import CoordinatorLost, Evicted, RunFinished

_stop = False
_finish = False


def _say(event: str, **fields: object) -> None:
    print(json.dumps({"event": event, "t": time.time(), **fields}), flush=True)


def _on_term(*_: object) -> None:
    global _stop
    _stop = True


def _on_usr1(*_: object) -> None:
    global _stop, _finish
    _stop = _finish = True


def main() -> int:
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGUSR1, _on_usr1)
    config = LiveConfig(**json.loads(os.environ["LIVE_TEST_CONFIG"]))
    committed = int(os.environ["LIVE_TEST_COMMITTED"])
    try:
        m = Membership.from_env(config)
    except RunFinished as exc:
        _say("run_finished", epoch=exc.epoch, step=exc.step, message=str(exc), pid=os.getpid())
        return 0
    try:
        if m.joining:  # the run began before: only a fresh start names it here (no heals)
            m.await_admission()
        m.set_committed(committed)
        _say("ready", epoch=m.epoch, members=list(m.members), pid=os.getpid(), inc=m.incarnation)
        while not _stop:
            cause = m.failed()
            if cause is not None:
                _say("failed", epoch=m.epoch, cause=cause)
                time.sleep(float(os.environ.get("LIVE_TEST_ACK_DELAY_S", "0")))  # busy in a step
                record = m.reform(Ack(inc="", committed=committed))
                change = dataclasses.asdict(m.last_change) if m.last_change else None
                _say("epoch", epoch=record.epoch, members=list(record.members), change=change)
            time.sleep(config.poll_slice_s)
        if _finish:
            _say("finished", epoch=m.epoch, all_done=m.finish(committed))
    except Evicted as exc:
        _say("evicted", epoch=exc.epoch, reason=exc.reason)
        return 76
    except CoordinatorLost as exc:
        _say("lost", kind=type(exc).__name__, message=str(exc))
        return 75
    except RunFinished as exc:  # a joiner: every member finished while it waited
        _say("run_finished", epoch=exc.epoch, step=exc.step, message=str(exc), pid=os.getpid())
        return 0
    finally:
        m.close()
    _say("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
