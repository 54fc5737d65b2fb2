"""Helpers for testing distributed code on CPU: a persistent pool of gloo ranks, and
the bytes of live tensor storages counted from the tensors (:class:`LiveBytes`)."""

from plait.testing.live_bytes import LiveBytes
from plait.testing.pool import WorkerContext, WorkerError, WorkerPool, body_address

__all__ = ["LiveBytes", "WorkerContext", "WorkerError", "WorkerPool", "body_address"]
