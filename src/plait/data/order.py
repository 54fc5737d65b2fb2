"""The visiting order of a set's windows in each epoch, evaluated per position.

An order maps the positions ``p`` of the endless sequence of epochs (epoch ``p // n``,
offset ``p % n``, ``n`` windows) to window indices: a fresh seeded permutation of
``[0, n)`` each epoch. Two algorithms exist; a sampler's state records which one it runs
(``ORDERS``):

* ``"feistel"`` (the default since issue 44): the permutation is a seeded bijection
  evaluated index by index, a balanced Feistel network of :data:`ROUNDS` rounds over
  ``[0, 4^h)`` (the smallest power of four not below ``n``) with cycle-walking into
  ``[0, n)``: a value that lands outside is enciphered again until it is inside (a
  permutation of the larger domain restricted this way is a permutation of ``[0, n)``;
  at most four tries on average, as the domain is below ``4n``). Memory is the positions
  asked for, whatever ``n``: a rank evaluates only its slice of a step, vectorised in
  numpy.
* ``"randperm"`` (what plait ran before): ``torch.randperm(n)`` per epoch, held whole
  (4 bytes a window, the two most recent epochs cached). Kept so that a run started with
  it resumes with exactly its order; new runs never choose it.
"""

from __future__ import annotations

from typing import Literal, Protocol

import numpy as np
import torch

OrderName = Literal["feistel", "randperm"]
ORDERS: tuple[OrderName, ...] = ("feistel", "randperm")
DEFAULT_ORDER: OrderName = "feistel"
LEGACY_ORDER: OrderName = "randperm"
"""The order of a loader state that names none (written before issue 44)."""

ROUNDS = 6
"""Feistel rounds (Luby-Rackoff: 4 give a pseudo-random permutation; 6 for margin)."""

_M64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser on one 64-bit value."""
    z = x & _M64
    z = ((z ^ (z >> 30)) * 0xBF58_476D_1CE4_E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D0_49BB_1331_11EB) & _M64
    return z ^ (z >> 31)


def epoch_seed(seed: int, epoch: int) -> int:
    """Deterministic 63-bit seed of one epoch's permutation (splitmix64-style mixing)."""
    return mix64(seed * 0x9E37_79B9_7F4A_7C15 + (epoch + 1) * 0xBF58_476D_1CE4_E5B9) >> 1


_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_C1, _C2 = np.uint64(0xBF58_476D_1CE4_E5B9), np.uint64(0x94D0_49BB_1331_11EB)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`mix64` on a uint64 array (array arithmetic wraps without a warning)."""
    z = x ^ (x >> _S30)
    z = z * _C1
    z = z ^ (z >> _S27)
    z = z * _C2
    return z ^ (z >> _S31)


class Order(Protocol):
    """Window indices of positions of the endless sequence of epochs."""

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """``(k,)`` int64 window indices of ``(k,)`` int64 positions."""
        ...


class FeistelPermutation:
    """A seeded bijection of ``[0, n)`` (see the module's docstring), ``n >= 1``."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got n={n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)  # bits of each half
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [
            np.uint64(mix64(seed + (r + 1) * 0x9E37_79B9_7F4A_7C15)) for r in range(ROUNDS)
        ]

    def _encipher(self, x: np.ndarray) -> np.ndarray:
        """One pass of the network over ``[0, 4^half)``, uint64 in and out."""
        h, mask = np.uint64(self.half), self.mask
        left, right = x >> h, x & mask
        for key in self.keys:
            left, right = right, left ^ (_mix64_array(right ^ key) & mask)
        return (left << h) | right

    def __call__(self, offsets: np.ndarray) -> np.ndarray:
        """``(k,)`` int64 images of ``(k,)`` offsets in ``[0, n)``."""
        x = self._encipher(np.asarray(offsets, dtype=np.uint64).reshape(-1))
        outside = np.flatnonzero(x >= np.uint64(self.n))
        while outside.size:  # cycle-walking: encipher again until inside [0, n)
            x[outside] = self._encipher(x[outside])
            outside = outside[x[outside] >= np.uint64(self.n)]
        return x.astype(np.int64)


class FeistelOrder:
    """Each epoch a :class:`FeistelPermutation` keyed by the epoch's seed."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self._perms: dict[int, FeistelPermutation] = {}

    def _perm(self, epoch: int) -> FeistelPermutation:
        perm = self._perms.get(epoch)
        if perm is None:
            if len(self._perms) >= 4:
                self._perms.pop(min(self._perms))
            perm = self._perms[epoch] = FeistelPermutation(self.n, epoch_seed(self.seed, epoch))
        return perm

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        epochs, offsets = np.divmod(pos, self.n)
        out = np.empty(len(pos), dtype=np.int64)
        for e in np.unique(epochs).tolist():  # a slice spans at most a few epochs
            sel = epochs == e
            out[sel] = self._perm(int(e))(offsets[sel])
        return out


class RandpermOrder:
    """The order before issue 44: ``torch.randperm`` of the epoch's seed, held whole."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self._perms: dict[int, np.ndarray] = {}  # the two most recent epochs

    def permutation(self, epoch: int) -> np.ndarray:
        """Visiting order of the windows in ``epoch``, ``(n,)`` (int32 when it fits)."""
        perm = self._perms.get(epoch)
        if perm is None:
            gen = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            full = torch.randperm(self.n, generator=gen, device="cpu").numpy()
            perm = full.astype(np.int32) if self.n < 2**31 else full
            del full
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        epochs, offsets = np.divmod(pos, self.n)
        out = np.empty(len(pos), dtype=np.int64)
        for e in np.unique(epochs).tolist():
            sel = epochs == e
            out[sel] = self.permutation(int(e))[offsets[sel]]
        return out


def make_order(name: str, n: int, seed: int) -> Order:
    """The order ``name`` (one of :data:`ORDERS`) of ``n`` windows under ``seed``."""
    if name == "feistel":
        return FeistelOrder(n, seed)
    if name == "randperm":
        return RandpermOrder(n, seed)
    raise ValueError(f"unknown data order {name!r}; plait knows {', '.join(ORDERS)}")
