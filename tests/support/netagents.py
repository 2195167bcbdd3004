"""Agents in two network namespaces: :class:`pdd_wire.harness.NetnsAgents` (kept importable
under the name the tests use)."""

from pdd_wire.harness import NetnsAgents as NetAgents  # noqa: F401
