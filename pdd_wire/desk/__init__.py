"""The agent's desks: per-request bookkeeping between its engines and its peer sessions.

``kv`` (posts, matching a KV_BEGIN to its post, unposted waits, send_kv fan-out, aborts, the
lease audit), ``handoff`` (drives the sans-IO state machines of ``handoff_protocol``), ``probes``
(link probes over scratch memory), ``inventory`` (the prefix inventory, pure) and ``admission``
(what every engine request passes). A desk calls only public methods of the sessions and of the
engine connections, and never imports the agent: the agent hands each desk its collaborators.
"""
