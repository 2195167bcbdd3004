"""Moved to :mod:`pdd_wire.transport.bulk`; kept until agent.py imports it from there."""

from .transport.bulk import BulkHandler, Compression, bulk_send

__all__ = ["BulkHandler", "Compression", "bulk_send"]
