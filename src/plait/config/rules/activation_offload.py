"""Rules on activation offloading (``train.activation_offload``,
``train.activation_offload_blocks``).

See :mod:`plait.config.rules`.
"""

from __future__ import annotations

import math

from plait.errors import ConfigError


def check_offload_blocks(enabled: bool, blocks: int) -> None:
    """The count of offloaded blocks: 0 (every block) or positive, and only with
    offloading on."""
    if blocks < 0:
        raise ConfigError(
            f"train.activation_offload_blocks must be 0 (every block) or positive, got {blocks}."
        )
    if blocks and not enabled:
        raise ConfigError(
            f"train.activation_offload_blocks = {blocks} needs train.activation_offload = true."
        )


def check_activation_offload(enabled: bool, blocks: int, n_layers: int, pp: int) -> None:
    """Offloading the first ``blocks`` blocks of each rank's model: a rank (a pipeline
    stage) holds at most ``ceil(n_layers / pp)`` of them."""
    check_offload_blocks(enabled, blocks)
    held = math.ceil(n_layers / pp)
    if enabled and blocks > held:
        where = f"model.n_layers = {n_layers}"
        if pp > 1:
            where += f" over parallel.pp = {pp} stages"
        raise ConfigError(
            f"train.activation_offload_blocks = {blocks} is more blocks than a rank holds "
            f"({where}: at most {held}); 0 offloads every block."
        )
