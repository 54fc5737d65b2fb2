"""Helpers for testing distributed code on CPU: a persistent pool of gloo ranks."""

from plait.testing.pool import WorkerContext, WorkerError, WorkerPool

__all__ = ["WorkerContext", "WorkerError", "WorkerPool"]
