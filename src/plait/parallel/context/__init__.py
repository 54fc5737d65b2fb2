"""Context parallelism: attention split along the sequence over the cp axis.

With ``parallel.cp > 1`` each cp rank holds 1/cp of every sequence.
:func:`~plait.parallel.context.context_parallel.apply_context_parallel` (step 2 of
``parallelize``) replaces every attention core of the built-in transformer with ring
attention (:mod:`.ring_attention`: K/V blocks pass around the cp ring, zigzag layout
for causal load balance) or all-to-all attention (:mod:`.ulysses_attention`: sequence
shards re-partitioned to head shards and back), and the positions module with one
that uses the tokens' global positions; :mod:`.layout` says which tokens each rank
holds. Parameters are replicated over cp, so gradients (and ZeRO shards) reduce over
the combined dp x cp group.
"""
