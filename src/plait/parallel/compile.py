"""``torch.compile`` per transformer block, applied from outside the model.

As torchtitan does, plait compiles each block, not the whole model: the blocks of a
transformer share one code object, so one compiled graph serves every layer (parameters
are graph inputs: ``torch._dynamo.config.inline_inbuilt_nn_modules``), compile time does
not grow with depth, and everything between blocks — the data-parallel bucket hooks,
ZeRO's gather/free hooks, the pipeline schedule — stays eager and unchanged.

What is compiled is the block's ``forward`` (replaced on the instance, like
:mod:`plait.parallel.recompute` does), not ``Module.__call__``: forward pre-/post-hooks
registered on the block (ZeRO-3 gathers its parameters in a pre-hook and frees them in
a post-hook) run eagerly around the compiled graph, and parameter names stay unchanged.
When recomputation is on, the recompute wrapper is compiled with the block
(``torch.utils.checkpoint`` is traced as one higher-order op).

Graph breaks — only where a collective must stay outside the graph (plait's
collectives go through :mod:`plait.comm`, which counts every byte in Python and talks to
``torch.distributed`` directly, so they cannot be traced):

* **tensor / sequence parallelism**: each region boundary — the differentiable
  collectives of :mod:`plait.comm.regions` (``copy_to_region``,
  ``reduce_from_region``, ``gather_from_sequence``, ``reduce_scatter_to_sequence``, ...)
  run eagerly under compilation (``regions._eager``: dynamo skips them) — so a block
  compiles into the pieces between them (with sequence parallelism: norm | attention |
  residual + norm | MLP | residual);
* **context parallelism**: the ring or Ulysses attention core (point-to-point or
  all-to-all on the cp group) runs eagerly (:func:`_keep_eager`); the norms, projections
  and rotary before it and the rest of the block after it are compiled.

Every other collective (data-parallel buckets, ZeRO all-gathers and reduce-scatters,
pipeline sends) happens outside the blocks. See docs/compile.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from plait.errors import ConfigError
from plait.parallel.zero.flat import default_block_classes

COMPILED_ATTR = "_plait_compiled"
"""Set on each compiled block (``True``)."""


def _collective_modules() -> tuple[type[nn.Module], ...]:
    """Module classes whose forward calls a collective: they run eagerly (a graph break)."""
    from plait.parallel.context.ring_attention import RingAttention
    from plait.parallel.context.ulysses_attention import UlyssesAttention

    return (RingAttention, UlyssesAttention)


def _keep_eager(module: nn.Module) -> None:
    """Make dynamo skip ``module``'s forward (a clean graph break around it)."""
    if getattr(module, "_plait_eager", False):
        return
    module.forward = torch.compiler.disable(module.forward)
    module._plait_eager = True  # type: ignore[assignment]


def apply_compile(
    model: nn.Module,
    *,
    backend: str | Callable[..., Any] = "inductor",
    dynamic: bool = False,
    block_classes: Sequence[type[nn.Module]] | None = None,
) -> list[str]:
    """Compile the forward of every block of ``model`` with ``torch.compile``.

    Blocks are the modules of ``block_classes`` (default: as for ZeRO and recomputation:
    plait's ``Block``, torch's transformer layers, a Hugging Face model's
    ``_no_split_modules``). Collective-bearing submodules inside a block run eagerly (see
    the module docstring). Call it after recomputation is applied (the recompute wrapper
    is compiled with the block) and before the data-parallel / ZeRO wrapper. Returns the
    qualified names of the blocks compiled; raises ValueError when there is none.
    """
    classes = tuple(block_classes) if block_classes is not None else default_block_classes(model)
    eager = _collective_modules()
    names: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, classes) or getattr(m, COMPILED_ATTR, False):
            continue
        for sub in m.modules():
            if isinstance(sub, eager):
                _keep_eager(sub)
        m.forward = torch.compile(m.forward, backend=backend, dynamic=dynamic)
        setattr(m, COMPILED_ATTR, True)
        names.append(name)
    if not names:
        raise ValueError(
            f"compile: the model has no block of {[c.__name__ for c in classes]}; "
            "pass block_classes"
        )
    return names


def check_compile(enabled: bool, device: str) -> None:
    """Raise :class:`~plait.errors.ConfigError` (one line) when ``train.compile`` is on
    for the CPU and inductor's C++ backend has no working compiler (``CXX`` or g++ on
    the PATH): otherwise the first step would fail inside every rank."""
    if not enabled:
        return
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        return
    from torch._inductor import cpp_builder

    try:
        cpp_builder.get_cpp_compiler()
    except Exception as exc:  # inductor's InvalidCxxCompiler (no public import path)
        raise ConfigError(
            "train.compile on the CPU needs a C++ compiler for inductor (set CXX or put "
            f"g++ on the PATH): {str(exc).splitlines()[0]}. Or leave train.compile false."
        ) from None
