"""Prometheus metrics, one registry per agent (so several agents can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 0.5, 1, 2.5)
_XFER = (1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        self._children: dict[tuple, object] = {}
        r = self.registry = CollectorRegistry(auto_describe=True)
        p = "pddwire_"
        self.bytes = Counter(p + "bytes", "Bytes moved, by peer, lane and direction",
                             ["peer", "lane", "direction"], registry=r)
        self.chunks = Counter(p + "chunks", "KV chunks moved", ["peer", "direction"], registry=r)
        self.inline_chunks = Counter(p + "kv_inline_chunks", "KV chunks sent or received on the control connection "
                                     "(inline.v1: chunks of at most transfer.inline_bytes)", ["peer", "direction"],
                                     registry=r)
        self.frames = Counter(p + "frames", "Control-connection frames", ["peer", "lane", "direction"],
                              registry=r)
        self.transfers = Counter(p + "transfers", "Transfers finished, by outcome",
                                 ["peer", "direction", "outcome"], registry=r)
        self.inflight = Gauge(p + "transfers_in_flight", "Open transfers", ["direction"], registry=r)
        self.inflight_bytes = Gauge(p + "kv_bytes_in_flight", "Unacknowledged KV bytes sent", ["peer"],
                                    registry=r)
        self.transfer_seconds = Histogram(p + "transfer_seconds", "Transfer time, announce to done",
                                          ["direction"], buckets=_XFER, registry=r)
        self.chunk_seconds = Histogram(p + "chunk_seconds", "Chunk time, dispatch to acknowledgement",
                                       buckets=_LAT + (5, 10), registry=r)
        self.token_seconds = Histogram(p + "token_frame_seconds",
                                       "Token frame round trip, send to acknowledgement", buckets=_LAT,
                                       registry=r)
        self.rtt_seconds = Histogram(p + "control_rtt_seconds", "Control-lane ping round trip", ["peer"],
                                     buckets=_LAT, registry=r)
        self.retransmits = Counter(p + "retransmits", "Chunks sent again", ["peer", "reason"], registry=r)
        self.duplicates = Counter(p + "duplicate_chunks", "Chunks received again after they were verified",
                                  ["peer"], registry=r)
        self.checksum_failures = Counter(p + "checksum_failures", "Chunks whose payload checksum failed",
                                         ["peer"], registry=r)
        self.offers = Counter(p + "kv_offers", "KV_OFFERs: sent (a receive posted for the peer), taken by a send, "
                              "unfit (sizes differ: sent the normal way), stale (for a request already being sent), "
                              "dropped (over the per-peer bound), ignored (offers not agreed: a side did not advertise "
                              "offer.v1)", ["peer", "event"], registry=r)
        self.chunks_held = Counter(p + "chunks_held", "Chunks of offered transfers that arrived before their KV_BEGIN "
                                   "was handled: held (their bulk connection paused), expired (dropped after the wait)",
                                   ["peer", "outcome"], registry=r)
        self.errors = Counter(p + "errors", "Errors by code", ["code"], registry=r)
        self.peer_up = Gauge(p + "peer_up", "1 while the control connection to a peer is up", ["peer"],
                             registry=r)
        self.bulk_streams = Gauge(p + "bulk_streams_up", "Bulk connections up", ["peer"], registry=r)
        self.reconnects = Counter(p + "reconnects", "Control connections re-established", ["peer"],
                                  registry=r)
        self.engines = Gauge(p + "engines_connected", "Engines on the engine socket", registry=r)
        self.regions = Gauge(p + "regions_registered", "Registered memory regions", registry=r)
        self.region_bytes = Gauge(p + "region_bytes", "Bytes of registered memory", registry=r)
        self.token_gaps = Counter(p + "token_gaps", "Token frames that arrived after a gap (resend asked)",
                                  ["peer"], registry=r)
        self.pipelines = Counter(p + "pipeline_choices", "Pipelines chosen for requests, by reason",
                                 ["pipeline", "reason"], registry=r)
        self.tokens = Counter(p + "tokens", "Token IDs relayed", ["peer", "direction"], registry=r)
        self.token_frames_waited = Counter(p + "token_frames_waited", "Relayed token frames left unacknowledged "
                                           "because the engine they were for had a quarter of "
                                           "limits.engine_queue_bytes unread (asked for again once it "
                                           "reads: nothing lost)", ["peer"], registry=r)
        self.tokens_dropped = Counter(p + "tokens_dropped", "Relayed token IDs no engine took: no owner claimed "
                                      "the request in time (unowned), a peer not tied to it (foreign_site), "
                                      "over the per-peer bounds (over_bounds)", ["peer", "reason"], registry=r)
        self.request_aborts = Counter(p + "request_aborts", "REQUEST_ABORTs sent (an engine aborted) and received",
                                      ["direction"], registry=r)
        self.leases_expired = Counter(p + "leases_expired", "Memory handed back because its lease ran out",
                                      ["kind"], registry=r)
        self.pinned_blocks = Gauge(p + "pinned_blocks", "Engine blocks the agent holds for peers, by kind",
                                   ["kind"], registry=r)
        self.stranded_blocks = Gauge(p + "stranded_blocks", "Pinned blocks past their lease (engine gone, peer "
                                     "gone, or post past its ttl): should read 0", registry=r)
        self.link_bandwidth = Gauge(p + "link_bandwidth_bytes_per_second", "Live estimate: KV delivery rate "
                                    "while busy", ["peer"], registry=r)
        self.link_rtt = Gauge(p + "link_rtt_seconds", "Live estimate: median control-lane RTT", ["peer"],
                              registry=r)
        self.link_jitter = Gauge(p + "link_jitter_seconds", "Live estimate: mean RTT change", ["peer"], registry=r)
        self.link_loss = Gauge(p + "link_loss_ratio", "Live estimate: PINGs unanswered (last 100)", ["peer"],
                               registry=r)
        self.link_queue = Gauge(p + "link_queue_bytes", "KV bytes accepted for a peer, not yet acknowledged",
                                ["peer"], registry=r)
        self.prefix_bytes_saved = Counter(p + "prefix_bytes_saved", "KV bytes not sent: the receiver's node held "
                                          "the prefix", ["peer"], registry=r)
        self.prefix_hit_ratio = Histogram(p + "prefix_hit_ratio", "Share of a transfer's blocks the receiver held",
                                          buckets=(0, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0), registry=r)
        self.inventory_blocks = Gauge(p + "prefix_inventory_blocks", "Blocks in this node's prefix inventory",
                                      registry=r)
        self.prefix_leases_broken = Counter(p + "prefix_leases_broken", "Leased prefix blocks evicted anyway "
                                            "(the transfer fell back to sending them)", registry=r)
        self.wan_prediction = Histogram(p + "wan_prediction_ratio", "Real WAN time of a request's KV over the "
                                        "pipeline policy's prediction", buckets=(0.25, 0.5, 0.8, 0.9, 1.0, 1.1, 1.25,
                                                                                2, 4, 10), registry=r)
        self.compression_on = Gauge(p + "compression_on", "1 while lz4 compresses KV chunks to a peer", ["peer"],
                                    registry=r)
        self.compression_ratio = Gauge(p + "compression_ratio", "lz4 ratio measured on this link's chunks",
                                       ["peer"], registry=r)
        self.compressed_chunks = Gauge(p + "compressed_chunks", "KV chunks sent lz4-compressed (count so far)",
                                       ["peer"], registry=r)
        self.compression_saved = Gauge(p + "compression_bytes_saved", "Bytes not sent thanks to lz4 (so far)",
                                       ["peer"], registry=r)
        self.tokens_unacked = Gauge(p + "tokens_unacked", "Token IDs relayed to a peer and not yet acknowledged, "
                                    "each frame kept counting 5 more (limits.max_unacked_tokens)", ["peer"],
                                    registry=r)
        self.handoffs = Counter(p + "handoffs", "Handoffs settled, by role, mode and reason (who owns the output)",
                                ["role", "mode", "reason"], registry=r)
        self.handoff_modes = Counter(p + "handoff_modes", "Handoff modes chosen by RLD, by reason",
                                     ["mode", "reason"], registry=r)
        self.handoff_seconds = Histogram(p + "handoff_seconds",
                                         "MD ready (its KV arrived) to ownership passed (RLD: MD's TAKEN; MD: "
                                         "it starts emitting)", ["role", "mode"], buckets=_LAT + (5, 10, 30),
                                         registry=r)
        self.handoffs_open = Gauge(p + "handoffs_open", "Handoffs this agent tracks", ["role"], registry=r)
        self.loop_stalls = Counter(p + "loop_stalls", "Times the event loop did not turn for "
                                   "timeouts.loop_stall_warn_s or more (logged with its stack)", registry=r)
        self.loop_stall_seconds = Histogram(p + "loop_stall_seconds", "Length of each such stall",
                                            buckets=(1, 2, 5, 10, 20, 30, 60, 120), registry=r)
        self.handoff_errors = Counter(p + "handoff_protocol_errors", "Handoff messages that broke the protocol",
                                      ["peer"], registry=r)

    def error(self, code) -> None:
        self.child(self.errors, getattr(code, "name", str(code))).inc()

    def child(self, metric, *values: str):
        """``metric.labels(*values)`` (in the metric's label order), looked up once: hot paths
        count per frame and per chunk, and ``labels()`` costs microseconds. Label values are
        peers, lanes, directions and codes: a bounded set."""
        key = (id(metric), values)  # the metrics live as long as this object
        c = self._children.get(key)
        if c is None:
            c = self._children[key] = metric.labels(*values)
        return c

    def drop_children(self, value: str) -> None:
        """Forget the looked-up children with ``value`` among their labels (their series are
        being removed: a child kept here would count into a series no longer exported)."""
        for key in [k for k in self._children if value in k[1]]:
            del self._children[key]

    def render(self) -> bytes:
        return generate_latest(self.registry)
