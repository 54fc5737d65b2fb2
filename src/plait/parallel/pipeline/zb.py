"""Zero-bubble backward split: input gradient now (``I``), weight gradients later (``W``).

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism") split a stage's backward into the
gradient with respect to its input, on the pipeline's critical path, and the weight
gradients, which can wait. With autograd this is done on the recorded graph of one
piece and one micro-batch:

1. The *input path* is every graph node from which the piece's input is reachable. A
   *consumer* is an input-path node with a child off that path that leads to parameters
   (a linear layer's matmul node: one child carries ``dL/dx`` on, the other leads to the
   weight through ``t()`` to its ``AccumulateGrad``).
2. ``I``: ``autograd.grad(out, [input])`` with the graph retained, keeping the gradients
   flowing into the consumers (``dL/dy`` of each linear output): the engine captures
   them itself, each consumer's ``GradientEdge`` being one more differentiated input (a
   Python pre-hook only on consumers without a closed form, which need all their
   outputs' gradients).
3. ``W``: per consumer, the weight gradient from the kept gradient. The two consumer
   kinds of a transformer have a closed form, computed directly from the node's saved
   tensors: a matrix product ``y = x @ w.t()`` (``MmBackward0`` -> ``TBackward0`` ->
   the weight) gets ``dL/dy.t() @ x`` (in the weight's own layout, so no copy), an
   element-wise product with a weight (``MulBackward0`` -> the weight, e.g. RMSNorm's
   scale) gets ``dL/dy * x`` summed to the weight's shape, as autograd computes it;
   into an existing ``.grad`` (micro-batches after the first, or a view into a
   data-parallel bucket) a matrix product is added in place by one ``addmm_``, with no
   temporary and no second pass over the gradient. The same products as the full
   backward's (a first gradient bit-for-bit equal to it on the CPU measured; in
   general, and when ``addmm_`` accumulates, up to summation order). Any other consumer runs
   ``autograd.grad`` from that node's outputs (``GradientEdge``) with the kept
   gradients, towards its own parameters only, so only the off-path part runs and
   nothing of the input path is recomputed or counted twice. The results are added
   into ``.grad``.

So ``I + W`` costs about one full backward, as in the paper. The closed forms matter on
small pieces: with one ``autograd.grad`` call per consumer (36 for four transformer
blocks, each setting up the engine and walking the graph under its node) and the
transposed results copied into the weights' layout, ``I + W`` cost 7.5 ms more CPU time
than the full backward (22 ms) of four dim-256 blocks on 2 x 64 tokens; with the closed
forms 3.3 ms more (PyTorch's own split, ``torch.distributed.pipelining``'s
``stage_backward_input`` / ``stage_backward_weight``: 5.6 ms more). The Python
pre-hooks on every consumer, a temporary plus ``add_`` per accumulated weight gradient
and a graph walk keyed by ``id()`` still cost 2.7 ms more than the full backward (21.4
ms, gradients accumulating over micro-batches); with the engine capturing the kept
gradients, ``addmm_`` and nodes as their own keys, 0.9 ms more (0.65 ms of it this
setup's graph walk, which creates a Python object per node of the fresh graph).
Parameters no consumer
reaches (none in the built-in transformer; and the first piece, whose input is token ids
and has no gradient) get theirs from ``backward(inputs=...)`` on the retained graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def _graph(root: Node) -> tuple[list[Node], list[tuple], dict[Node, list[Node]]]:
    """Every node under ``root``, each one's ``next_functions`` (read once: every read
    builds the tuple anew) and each node's parents. (A node's Python object is the same
    for every reference to it while one is held, so nodes are their own keys.)"""
    nodes: list[Node] = [root]
    kids: list[tuple] = []
    parents: dict[Node, list[Node]] = {root: []}
    i = 0
    while i < len(nodes):
        n = nodes[i]
        i += 1
        nf = n.next_functions
        kids.append(nf)
        for c, _ in nf:
            if c is None:
                continue
            ps = parents.get(c)
            if ps is None:
                parents[c] = [n]
                nodes.append(c)
            else:
                ps.append(n)
    return nodes, kids, parents


def _leaves_under(node: Node, wanted: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """The wanted leaf tensors whose ``AccumulateGrad`` lies under ``node``."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        var = getattr(n, "variable", None)
        if var is not None and id(var) in wanted:
            out.append(var)
            continue
        stack.extend(c for c, _ in n.next_functions if c is not None)
    return out


@dataclass(frozen=True)
class _Direct:
    """A closed form for one consumer's weight gradient (see the module doc)."""

    kind: str
    """"mm_t": ``y = x @ w.t()``; "mul_self" / "mul_other": ``y = a * b`` with the
    weight as ``b`` (gradient ``dy * a``) / as ``a`` (gradient ``dy * b``)."""
    param: torch.Tensor
    """The weight (a leaf)."""


def _direct_form(
    node: Node, off: list[tuple[int, Node]], wanted: dict[int, torch.Tensor]
) -> _Direct | None:
    """The closed form of ``node``'s weight gradient, if it is one of the known kinds:
    one off-path child ``off = [(input index, child)]`` leading straight to one wanted
    leaf of the same shape, dtype and layout as the formula's result."""
    if len(off) != 1:
        return None
    j, child = off[0]
    name = type(node).__name__
    if name == "MmBackward0" and j == 1 and type(child).__name__ == "TBackward0":
        ((acc, _),) = child.next_functions
        p = getattr(acc, "variable", None)
        if p is None or id(p) not in wanted or p.dim() != 2:
            return None
        x = node._saved_self  # type: ignore[attr-defined]  # (tokens, in)
        ok = x.dim() == 2 and x.shape[1] == p.shape[1] and x.dtype == p.dtype
        return _Direct("mm_t", p) if ok else None
    if name == "MulBackward0":
        p = getattr(child, "variable", None)
        if p is None or id(p) not in wanted:
            return None
        other = node._saved_self if j == 1 else node._saved_other  # type: ignore[attr-defined]
        if other is None or other.dtype != p.dtype:
            return None
        return _Direct("mul_self" if j == 1 else "mul_other", p)
    return None


def _add_direct(node: Node, d: _Direct, gy: torch.Tensor) -> None:
    """Add the weight gradient of ``node`` for the kept output gradient ``gy`` into
    ``d.param.grad``: the product autograd's ``mm_mat2_backward`` computes (transposed
    back by ``TBackward0``), formed directly in the weight's layout -- into an existing
    gradient as one ``addmm_`` (no temporary, no second pass over the gradient); or
    ``mul_tensor_backward`` and the engine's reduction to the input's shape."""
    p = d.param
    if d.kind == "mm_t":
        x = node._saved_self  # type: ignore[attr-defined]  # (tokens, in)
        if p.grad is not None:
            p.grad.addmm_(gy.t(), x)  # (out, in) += (out, tokens) @ (tokens, in)
        else:
            _accumulate(p, gy.t().mm(x), True)  # (out, in), the weight's layout
        return
    a = node._saved_self if d.kind == "mul_self" else node._saved_other  # type: ignore[attr-defined]
    g = gy * a
    _accumulate(p, g.sum_to_size(p.shape) if g.shape != p.shape else g, True)


def _accumulate(p: torch.Tensor, g: torch.Tensor, fresh: bool) -> None:
    """Add ``g`` into ``p.grad``. A first gradient is stored with ``p``'s layout, as
    ``AccumulateGrad`` stores it; ``g`` itself is kept only when it is ``fresh`` (no
    other tensor shares its memory) and already has that layout."""
    if p.grad is None:
        same = fresh and g.stride() == p.stride() and g.storage_offset() == 0
        p.grad = g.detach() if same else torch.empty_like(p).copy_(g)
    else:
        p.grad.add_(g)


class BackwardSplit:
    """The ``I`` / ``W`` split of one piece's backward for one micro-batch.

    ``out`` is the piece's output (or its scaled loss), ``inp`` its input (a leaf that
    requires grad), ``params`` the piece's trainable parameters.
    """

    def __init__(
        self, out: torch.Tensor, inp: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> None:
        self.out = out
        self.inp = inp
        self.params = list(params)
        self._consumers: list[tuple[Node, list[torch.Tensor], _Direct | None]] = []
        self._grads: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self._rest: list[torch.Tensor] = list(self.params)
        self._grad_out: torch.Tensor | None = None
        root = out.grad_fn
        if root is None:
            return
        nodes, kids, parents = _graph(root)
        start = get_gradient_edge(inp).node if inp.requires_grad else None  # its AccumulateGrad
        on_path: set[Node] = set()
        stack = [start] if start in parents else []
        while stack:  # every node from which the input is reachable
            n = stack.pop()
            if n not in on_path:
                on_path.add(n)
                stack.extend(parents[n])
        wanted = {id(p): p for p in self.params}
        covered: set[int] = set()
        for n, nf in zip(nodes, kids, strict=True):
            if n not in on_path or n is start:
                continue
            own: list[torch.Tensor] = []
            off: list[tuple[int, Node]] = []
            for j, (c, _) in enumerate(nf):
                if c is not None and c not in on_path:
                    off.append((j, c))
                    own += _leaves_under(c, wanted)
            if own:
                direct = _direct_form(n, off, wanted) if len(own) == 1 else None
                self._consumers.append((n, own, direct))
                covered.update(id(p) for p in own)
        self._rest = [p for p in self.params if id(p) not in covered]

    def input_grad(self, grad: torch.Tensor | None) -> torch.Tensor:
        """``I``: the gradient with respect to the input (graph kept for ``W``).

        The gradient entering each closed-form consumer (one output: ``dL/dy``) is
        captured by the engine itself, the consumer's ``GradientEdge`` being one more
        differentiated input; the other consumers keep theirs with a pre-hook (all of
        their outputs' gradients)."""
        self._grad_out = grad
        direct = [node for node, _, d in self._consumers if d is not None]
        hooks = []
        for node, _, d in self._consumers:
            if d is not None:
                continue

            def keep(grads: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
                self._grads[id(node)] = grads

            hooks.append(node.register_prehook(keep))
        try:
            g, *kept = torch.autograd.grad(
                self.out,
                [get_gradient_edge(self.inp), *(GradientEdge(n, 0) for n in direct)],
                grad,
                retain_graph=True,
                allow_unused=True,
            )
        finally:
            for h in hooks:
                h.remove()
        if g is None:
            raise RuntimeError("zero-bubble split: the piece's output does not depend on its input")
        for node, gy in zip(direct, kept, strict=True):
            self._grads[id(node)] = (gy,)
        return g

    def weight_grads(self) -> None:
        """``W``: accumulate every parameter's gradient into ``.grad``."""
        with torch.no_grad():  # saved inputs require grad: build no graph
            for node, own, direct in self._consumers:
                grads = self._grads.pop(id(node), None)
                if grads is None:  # pragma: no cover - every consumer runs in I
                    raise RuntimeError("zero-bubble split: a consumer node did not run in I")
                if direct is not None:
                    if grads[0] is not None:
                        _add_direct(node, direct, grads[0])
                    continue
                edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
                given = [g for g in grads if g is not None]
                found = torch.autograd.grad(edges, own, given, retain_graph=True)
                for p, g in zip(own, found, strict=True):
                    _accumulate(p, g, False)
        if self._rest:
            torch.autograd.backward(self.out, self._grad_out, inputs=self._rest)
        self.out = self.inp = self._grad_out = None  # type: ignore[assignment]
        self._consumers = []
