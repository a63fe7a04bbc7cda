"""Token-budget micro-batches over length buckets, shuffled per epoch, addressed by one global index g.

Build once: sort sequences by length and cut the sorted run greedily into micro-batches with
    batch_size * longest_in_batch <= token_budget   (padding counted)   and   batch_size <= max_batch_size.
Every epoch uses the same batches (so num_batches is fixed) in a different order: a permutation drawn from
(seed, epoch). With shuffle_members=W > 0, each epoch also re-deals the sequences among every run of W
consecutive batches of the same size (a sequence of a size-b batch is <= token_budget // b long, so any re-deal
among size-b batches keeps the budget; neighbours in sorted order keep the padding low).

The whole position is g, the global micro-batch index across epochs: (epoch, i) = divmod(g, num_batches). The
trainer saves the next g; `batches_from(g)` continues from exactly there without replaying anything. Producers
split the stream deterministically: micro-batch g belongs to target rank g % n_ranks
(`batches_from(g, rank, n_ranks)`), and every rank computes the same plan from the same lengths and seed.
"""
import hashlib
from itertools import count

import numpy as np


class BatchPlan:
    def __init__(self, lengths, token_budget: int, max_batch_size: int | None = None, seed: int = 0,
                 shuffle_members: int = 0, drop_overlong: bool = False):
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or len(lengths) == 0:
            raise ValueError("BatchPlan needs a non-empty 1-D list of sequence lengths")
        if lengths.min() < 1:
            raise ValueError(f"{int((lengths < 1).sum())} sequences have length < 1")
        if token_budget < 1 or (max_batch_size is not None and max_batch_size < 1):
            raise ValueError(f"token_budget={token_budget} and max_batch_size={max_batch_size} must be >= 1")
        over = np.flatnonzero(lengths > token_budget)
        if len(over) and not drop_overlong:
            raise ValueError(
                f"{len(over)} of {len(lengths)} sequences are longer than token_budget={token_budget} tokens "
                f"(longest {int(lengths.max())}): raise the token budget to >= {int(lengths.max())}, re-prepare the "
                f"data with --max-len <= {token_budget}, or pass drop_overlong=True to skip them")
        self.lengths, self.token_budget, self.seed = lengths, token_budget, seed
        self.max_batch_size = max_batch_size or len(lengths)
        self.shuffle_members = shuffle_members
        self.dropped = over.tolist()  # indices left out because they do not fit the budget

        keep = np.flatnonzero(lengths <= token_budget)
        order = keep[np.argsort(lengths[keep], kind="stable")]  # ascending length, ties by index: deterministic
        self.batches: list[list[int]] = []  # the fixed batches, in sorted-length order
        cur = []
        for idx in order.tolist():
            n, longest = len(cur) + 1, int(lengths[idx])  # sorted: the newcomer is the longest
            if cur and (n > self.max_batch_size or n * longest > token_budget):
                self.batches.append(cur)
                cur = []
            cur.append(idx)
        if cur:
            self.batches.append(cur)
        if not self.batches:
            raise ValueError(f"no sequence fits token_budget={token_budget}")
        self.num_batches = len(self.batches)
        self._cache = (None, None)

    # ---- one epoch -------------------------------------------------------------------------------------------

    def epoch(self, e: int) -> list[list[int]]:
        """The micro-batches of epoch e, in training order (lists of sequence indices)."""
        if self._cache[0] != e:
            rng = np.random.default_rng([self.seed, e])
            batches = self._deal(rng) if self.shuffle_members else self.batches
            self._cache = (e, [batches[j] for j in rng.permutation(self.num_batches).tolist()])
        return self._cache[1]

    def _deal(self, rng) -> list[list[int]]:
        """Re-deal sequences among runs of `shuffle_members` consecutive same-size batches (sizes stay)."""
        out, j = [], 0
        while j < self.num_batches:
            size, k = len(self.batches[j]), j
            while k < self.num_batches and k - j < self.shuffle_members and len(self.batches[k]) == size:
                k += 1
            pool = rng.permutation(np.concatenate([self.batches[t] for t in range(j, k)])).tolist()
            out += [pool[t * size:(t + 1) * size] for t in range(k - j)]
            j = k
        return out

    # ---- global index g --------------------------------------------------------------------------------------

    def position(self, g: int) -> tuple[int, int]:
        """g -> (epoch, index inside the epoch)."""
        return divmod(g, self.num_batches)

    def batch(self, g: int) -> list[int]:
        e, i = self.position(g)
        return self.epoch(e)[i]

    def batches_from(self, g: int = 0, rank: int = 0, n_ranks: int = 1, stop: int | None = None):
        """Yield (g, batch) for g >= `g` with g % n_ranks == rank, up to `stop` (exclusive; None: forever)."""
        first = g + (rank - g) % n_ranks
        for gg in (range(first, stop, n_ranks) if stop is not None else count(first, n_ranks)):
            yield gg, self.batch(gg)

    # ---- stats -----------------------------------------------------------------------------------------------

    def padding_waste(self, e: int | None = None) -> float:
        """Fraction of padded slots that are padding (of the base batches, or of epoch e's batches)."""
        batches = self.batches if e is None else self.epoch(e)
        real = sum(int(self.lengths[b].sum()) for b in batches)
        padded = sum(len(b) * int(self.lengths[b].max()) for b in batches)
        return 1.0 - real / padded

    def stats(self) -> dict:
        sizes = np.array([len(b) for b in self.batches])
        return {"sequences": int(sizes.sum()), "dropped": len(self.dropped), "num_batches": self.num_batches,
                "mean_batch_size": round(float(sizes.mean()), 2), "max_batch_size": int(sizes.max()),
                "tokens": int(self.lengths[np.concatenate(self.batches)].sum()),
                "padding_waste": round(self.padding_waste(), 4)}

    def fingerprint(self) -> str:
        """sha256 of the settings and the batches: store it with g, compare on resume (a changed dataset, budget
        or numpy shuffle would otherwise silently move g to different data)."""
        h = hashlib.sha256(repr((self.token_budget, self.max_batch_size, self.seed, self.shuffle_members)).encode())
        h.update(self.lengths.tobytes())
        for b in self.epoch(0):
            h.update(np.asarray(b, dtype=np.int64).tobytes() + b"|")
        return h.hexdigest()
