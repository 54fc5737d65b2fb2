"""Helpers for testing distributed code on CPU: a persistent pool of gloo ranks."""

from plait.testing.pool import WorkerContext, WorkerError, WorkerPool, body_address

__all__ = ["WorkerContext", "WorkerError", "WorkerPool", "body_address"]
