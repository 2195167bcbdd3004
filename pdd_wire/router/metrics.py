"""The router's Prometheus metrics (``/metrics``; the table in docs/router.md). Names and labels
are a public surface: dashboards and ``scripts/bench`` read them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2)
SHARE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0)
ROUND_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
TOKEN_BUCKETS = (0, 1, 4, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384, 65536)
BYTE_BUCKETS = (0, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20,
                1 << 30, 4 << 30, 16 << 30)


class RouterMetrics:
    """The router's metrics, in a registry of its own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pddwire_router_requests", "Requests by endpoint, pipeline and outcome",
                                ["endpoint", "pipeline", "outcome"], registry=r)
        self.ttft = Histogram("pddwire_router_ttft_seconds", "Time to the first output token (streamed requests)",
                              ["pipeline"], buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("pddwire_router_time_per_output_token_seconds",
                              "Mean time between output tokens after the first, one sample per streamed request",
                              ["pipeline"], buckets=TPOT_BUCKETS, registry=r)
        self.latency = Histogram("pddwire_router_request_seconds", "Whole request, arrival to last byte",
                                 ["pipeline"], buckets=TTFT_BUCKETS, registry=r)
        self.output_tokens = Counter("pddwire_router_output_tokens", "Output tokens relayed, by pool that made them",
                                     ["pool"], registry=r)
        self.pipelines = Counter("pddwire_router_pipeline_choices", "Pipeline chosen per request, with its reason",
                                 ["pipeline", "reason"], registry=r)
        self.fallbacks = Counter("pddwire_router_fallbacks", "Requests that left their pipeline's path, by kind",
                                 ["kind"], registry=r)
        self.handoffs = Counter("pddwire_router_handoffs", "P-RLD-MD requests by how their output ended: "
                                "switched (RLD to MD), rld_finished, no_clean_boundary (RLD finished: a due "
                                "switch found no clean text boundary), md_failed, md_not_ready, rld_failed (MD "
                                "took over), failed (the client got an error), cancelled (client gone, deadline)",
                                ["mode", "outcome"], registry=r)
        self.deferred = Counter("pddwire_router_handoff_deferrals",
                                "RLD events after which a due switch waited for a clean text boundary (one "
                                "event of one token with whole text)", registry=r)
        self.modes = Counter("pddwire_router_handoff_modes", "Handoff mode chosen per P-RLD-MD request once MD "
                             "held the KV, with its reason", ["mode", "reason"], registry=r)
        self.stall = Histogram("pddwire_router_handoff_stall_seconds",
                               "Between RLD's last token relayed and MD's first", ["mode"],
                               buckets=TTFT_BUCKETS, registry=r)
        self.extend = Histogram("pddwire_router_handoff_extend_tokens",
                                "Prompt tokens MD computed for its continuation at the switch (its usage: prompt "
                                "tokens less those it had cached)", ["mode"], buckets=TOKEN_BUCKETS, registry=r)
        self.rounds = Histogram("pddwire_router_catchup_rounds", "Absorb rounds MD ran before a catch-up switch",
                                buckets=ROUND_BUCKETS, registry=r)
        self.absorbed = Counter("pddwire_router_catchup_absorbed_tokens",
                                "RLD output tokens MD absorbed into its prefix cache during catch-up", registry=r)
        self.rld_share = Histogram("pddwire_router_rld_share", "Fraction of a P-RLD-MD request's output tokens that "
                                   "RLD made", buckets=SHARE_BUCKETS, registry=r)
        self.wan_bytes = Histogram("pddwire_router_wan_kv_bytes",
                                   "KV bytes a request's prefill sends to MD's site, as planned at the choice: the "
                                   "prompt's blocks MD's prefix inventory lacked x block bytes (before lz4)",
                                   ["pipeline"], buckets=BYTE_BUCKETS, registry=r)
        self.unclean = Counter("pddwire_router_unclean_splices",
                               "Output handed to another engine after a failure inside a character: its text may "
                               "miss that character (the token ids are exact)", registry=r)
        self.prompt_tokens = Counter("pddwire_router_prompt_tokens",
                                     "Prompt tokens of requests whose pipeline P's agent chose: held in MD's "
                                     "prefix cache (md_prefix) or not (missing)", ["source"], registry=r)
        self.inflight = Gauge("pddwire_router_inflight", "Requests in flight per pool member",
                              ["pool", "member"], registry=r)
        self.requests_inflight = Gauge("pddwire_router_requests_inflight", "Client requests to /v1/completions "
                                       "and /v1/chat/completions in flight (request.max_inflight)", registry=r)
        self.refused = Counter("pddwire_router_requests_refused", "Client requests answered 503 at once: "
                               "request.max_inflight were in flight", ["endpoint"], registry=r)
        self.rld_load = Gauge("pddwire_router_rld_load", "RLD members' last load figure read from their /metrics",
                              ["member"], registry=r)
        self.draining = Gauge("pddwire_router_draining", "Warm requests left to finish after their request "
                              "ended (P's KV delivered, MD's prefix cache filled)", registry=r)
        self.drains = Counter("pddwire_router_drains", "Warm requests left to finish, by how they ended: "
                              "answered, failed, timed_out, closed", ["outcome"], registry=r)
        self.load_scrapes = Counter("pddwire_router_rld_load_scrapes", "Scrapes of RLD members' /metrics",
                                    ["outcome"], registry=r)
