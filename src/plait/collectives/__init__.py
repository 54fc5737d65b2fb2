"""Collective algorithms written on point-to-point messages, and their costs.

For study and for validating the cost model: naive, central (parameter server), ring,
recursive doubling / halving, tree and all-to-all exchange all-reduces
(:mod:`~plait.collectives.algorithms`), each equal to the library all-reduce, with their
step counts and bytes (:mod:`~plait.collectives.costs`). Everything runs over
:mod:`plait.comm`, so the messages are counted like any other traffic.
"""
