"""Per-peer reliability and fairness: the handshake, priority lanes, credits, acks, resume.

* :mod:`.protocol`: the sans-IO core (credits, chunks in flight, acks, NACK repair, resume);
* :mod:`.peer`: :class:`PeerSession`, the async shell around it (dialing, frames, timers);
* :mod:`.sending` / :mod:`.receiving`: the two directions of KV transfers;
* :mod:`.tokens`: token-ID relay, exactly once, on the TOKEN lane of the control connection;
* :mod:`.estimator`: the live link estimate; :mod:`.host`: what the session needs of the agent.
"""

from .host import SessionHost
from .peer import PeerSession
from .protocol import code_name

__all__ = ["PeerSession", "SessionHost", "code_name"]
