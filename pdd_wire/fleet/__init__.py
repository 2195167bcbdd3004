"""Membership and discovery on etcd (docs/operator.md, "A fleet"): each agent registers a record
under a lease (:mod:`.record`, :mod:`.membership`), watches everyone else's, and opens sessions
only when they are needed (:mod:`.peering`). The router builds its pools from the same records."""

from .etcd import EtcdClient, EtcdError, EtcdUnavailable
from .membership import Membership
from .metrics import FleetMetrics
from .record import EngineRec, Live, MemberRecord

__all__ = ["EngineRec", "EtcdClient", "EtcdError", "EtcdUnavailable", "FleetMetrics", "Live", "MemberRecord",
           "Membership"]
