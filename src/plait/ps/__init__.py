"""Parameter-server training: a server holds the weights, workers push gradients.

Synchronous, asynchronous and bounded-staleness consistency (:mod:`plait.ps.server`),
over :mod:`plait.comm` point-to-point messages; ``plait ps-train`` runs it.
"""
