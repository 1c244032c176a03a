"""Live membership: survive a lost data-parallel replica without restarting the survivors.

The design is ``docs/live-membership.md``. This package sits above ``transactions`` and
``replication`` and below the front door; nothing below it imports it.

* :mod:`.keys`: the coordinator protocol's key names and record codecs (strict JSON).
* :mod:`.view`: :class:`~.view.MembershipView`, what the cross-replica group, the reducer and
  the transaction need from the membership (implemented by :mod:`.membership`).
"""
