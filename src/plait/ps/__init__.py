"""Parameter-server training: a server holds the weights, workers push gradients.

Synchronous, asynchronous and bounded-staleness consistency, the optimizer step and the
grant policy in one transport-free core (:mod:`plait.ps.core`), carried by
:mod:`plait.comm` point-to-point messages (:mod:`plait.ps.server`; ``plait ps-train``
runs it) or by Ray actors (:mod:`plait.ps.ray_server`; ``plait ps-train --ray``).
"""
