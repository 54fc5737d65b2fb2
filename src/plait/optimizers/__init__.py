"""Optimizers that see whole matrices: Muon (orthogonalised momentum) beside AdamW, and
Adafactor on pieces of matrices.

* :mod:`~plait.optimizers.newton_schulz`: the Newton-Schulz iteration and Muon's
  learning-rate adjustment, exactly as ``torch.optim.Muon`` computes them, with a choice
  of the iteration's dtype;
* :mod:`~plait.optimizers.split`: which parameters get Muon (2-D hidden matrices and the
  (out, in) slices of 3-D expert tensors) and which AdamW (embeddings, output head,
  norms, biases);
* :mod:`~plait.optimizers.muon`: :class:`~plait.optimizers.muon.Muon`, one
  ``torch.optim.Optimizer`` holding both kinds of group, whose matrix update can be
  computed elsewhere (ZeRO's owner ranks, :mod:`plait.parallel.zero.owners`);
* :mod:`~plait.optimizers.factored`: Adafactor's row and column sums of the piece of a
  parameter a rank holds (a ZeRO flat range of a tp or ep block), in the whole
  parameter's coordinates;
* :mod:`~plait.optimizers.adafactor`: :class:`~plait.optimizers.adafactor.
  ShardedAdafactor`, ``torch.optim.Adafactor`` over such pieces, its sums all-reduced;
* :mod:`~plait.optimizers.closure`: the step's closure, shared by both.

See docs/optimizers.md.
"""

from plait.optimizers.muon import Muon, MuonDefaults
from plait.optimizers.split import MuonSplit, split_params

__all__ = ["Muon", "MuonDefaults", "MuonSplit", "split_params"]
