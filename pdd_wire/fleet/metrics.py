"""The fleet's Prometheus metrics, in a registry given by the owner (the agent's, the router's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class FleetMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        p = "pddwire_fleet_"
        self.etcd_up = Gauge(p + "etcd_up", "1 while etcd answers this member (register, keep-alive, watch)",
                             registry=r)
        self.etcd_lost = Counter(p + "etcd_lost", "Times etcd stopped answering (the last membership is kept)",
                                 registry=r)
        self.registrations = Counter(p + "registrations", "This member's record written with a new lease: "
                                     "first (at start) or again (its lease was gone when etcd came back)",
                                     ["kind"], registry=r)
        self.writes = Counter(p + "etcd_requests", "Requests this member sent etcd, by kind (put, grant and revoke "
                              "are raft writes; keepalive is answered by the leader; get: an unknown member's "
                              "HELLO)", ["kind"], registry=r)
        self.resyncs = Counter(p + "resyncs", "Membership brought up to date after a watch ended: resume (the "
                               "watch went on from its revision) or full (listed again: first, compacted or reset)",
                               ["kind"], registry=r)
        self.members = Gauge(p + "members", "Other members known (the last membership while etcd is away)",
                             registry=r)
        self.events = Counter(p + "member_events", "Membership changes seen: join, update, leave", ["kind"],
                              registry=r)
        self.task_errors = Counter(p + "task_errors", "Answers the membership could not use (a refused request, a "
                                   "bad answer, a failing callback), by task; each is retried, none ends the task",
                                   ["task"], registry=r)
        self.duplicates = Counter(p + "duplicates", "Times this member found its key held under another lease "
                                  "(another agent with the same site and node): it waits for that lease to end",
                                  registry=r)
        self.rewritten = Counter(p + "own_record_rewritten", "This member's record written again because another "
                                 "writer changed it, by cause: deleted, own_lease (put over under this member's "
                                 "lease), no_lease (put over with no lease: taken back)", ["cause"], registry=r)
        self.ignored = Counter(p + "records_ignored", "Records under the prefix that were not used, by reason",
                               ["reason"], registry=r)
        self.admissions = Counter(p + "admissions", "Inbound HELLOs from members without a session, by outcome",
                                  ["outcome"], registry=r)
        self.sessions = Gauge(p + "sessions", "Sessions with fleet members now open", registry=r)
        self.dials = Counter(p + "lazy_sessions", "Sessions opened on first need, by who: dial (this agent "
                             "dials) or knock (it asked the peer to dial)", ["how"], registry=r)
        self.closed = Counter(p + "sessions_closed", "Sessions with fleet members closed, by reason: idle, "
                              "left (its lease expired), moved (new address), restarted (a new incarnation), down (a "
                              "listener's session down and idle for dial_wait_s), unreachable, dial_timeout, "
                              "dropped_by_peer (a dialer's: the listener kept nothing of it; it goes on afresh), "
                              "resume_declined (a dialer's: the listener resumed a session this agent had dropped "
                              "and was asked to drop it too)",
                              ["reason"], registry=r)
