"""Zero-bubble backward split: input gradient now (``I``), weight gradients later (``W``).

Qi et al. 2023 ("Zero Bubble Pipeline Parallelism") split a stage's backward into the
gradient with respect to its input, on the pipeline's critical path, and the weight
gradients, which can wait. With autograd this is done on the recorded graph of one
piece and one micro-batch:

1. The *input path* is every graph node from which the piece's input is reachable. A
   *consumer* is an input-path node with a child off that path that leads to parameters
   (a linear layer's matmul node: one child carries ``dL/dx`` on, the other leads to the
   weight through ``t()`` to its ``AccumulateGrad``).
2. ``I``: ``autograd.grad(out, [input])`` with the graph retained; pre-hooks on the
   consumers keep the gradients flowing into them (``dL/dy`` of each linear output).
3. ``W``: per consumer, ``autograd.grad`` from that node's outputs (``GradientEdge``)
   with the kept gradients, towards its own parameters only, so only the off-path part
   runs (``dL/dW = dL/dy^T x``) and nothing of the input path is recomputed or counted
   twice. The results are added into ``.grad``.

So ``I + W`` costs about one full backward, as in the paper. Parameters no consumer
reaches (none in the built-in transformer; and the first piece, whose input is token ids
and has no gradient) get theirs from ``backward(inputs=...)`` on the retained graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


def _graph(root: Node) -> tuple[list[Node], dict[int, list[Node]]]:
    """Every node under ``root`` and each node's parents (by id)."""
    nodes: list[Node] = []
    parents: dict[int, list[Node]] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        nodes.append(n)
        for c, _ in n.next_functions:
            if c is not None:
                parents.setdefault(id(c), []).append(n)
                stack.append(c)
    return nodes, parents


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
        self._consumers: list[tuple[Node, list[torch.Tensor]]] = []
        self._grads: dict[int, tuple[torch.Tensor | None, ...]] = {}
        self._rest: list[torch.Tensor] = list(self.params)
        self._grad_out: torch.Tensor | None = None
        root = out.grad_fn
        if root is None:
            return
        nodes, parents = _graph(root)
        start = [n for n in nodes if getattr(n, "variable", None) is inp]
        start_ids = {id(n) for n in start}
        on_path: set[int] = set()
        stack = list(start)
        while stack:  # every node from which the input is reachable
            n = stack.pop()
            if id(n) in on_path:
                continue
            on_path.add(id(n))
            stack.extend(parents.get(id(n), []))
        wanted = {id(p): p for p in self.params}
        covered: set[int] = set()
        for n in nodes:
            if id(n) not in on_path or id(n) in start_ids:
                continue
            own: list[torch.Tensor] = []
            for c, _ in n.next_functions:
                if c is not None and id(c) not in on_path:
                    own += _leaves_under(c, wanted)
            if own:
                self._consumers.append((n, own))
                covered.update(id(p) for p in own)
        self._rest = [p for p in self.params if id(p) not in covered]

    def input_grad(self, grad: torch.Tensor | None) -> torch.Tensor:
        """``I``: the gradient with respect to the input (graph kept for ``W``)."""
        self._grad_out = grad
        hooks = []
        for node, _ in self._consumers:

            def keep(grads: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
                self._grads[id(node)] = grads

            hooks.append(node.register_prehook(keep))
        try:
            (g,) = torch.autograd.grad(self.out, [self.inp], grad, retain_graph=True)
        finally:
            for h in hooks:
                h.remove()
        return g

    def weight_grads(self) -> None:
        """``W``: accumulate every parameter's gradient into ``.grad``."""
        for node, own in self._consumers:
            grads = self._grads.pop(id(node), None)
            if grads is None:  # pragma: no cover - every consumer runs in I
                raise RuntimeError("zero-bubble split: a consumer node did not run in I")
            edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
            given = [g for g in grads if g is not None]
            found = torch.autograd.grad(edges, own, given, retain_graph=True)
            for p, g in zip(own, found, strict=True):
                if p.grad is None:
                    p.grad = g.detach().clone()
                else:
                    p.grad.add_(g)
        if self._rest:
            torch.autograd.backward(self.out, self._grad_out, inputs=self._rest)
        self.out = self.inp = self._grad_out = None  # type: ignore[assignment]
        self._consumers = []
