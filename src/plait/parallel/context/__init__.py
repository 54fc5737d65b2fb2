"""Context parallelism: attention split along the sequence over the cp axis.

The home of blockwise (online-softmax) attention, ring attention and all-to-all
(Ulysses) attention. ``parallel.cp > 1`` is refused before any process starts until
they land; the mesh already carries the cp axis, and the optimizer takes its
reduction groups from the mesh, so cp joins them without new plumbing.
"""
