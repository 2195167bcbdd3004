"""Agents in two network namespaces: :class:`pdd_tools.harness.NetnsAgents` (kept importable
under the name the tests use)."""

from pdd_tools.harness import NetnsAgents as NetAgents  # noqa: F401
