"""The batching DP of one shape class (`balance.WorkModel.best_split`): the cheapest batch sizes that hold
k matrices, for every k, without storing a size tuple per k.

Entry j holds the least total time of batches holding j matrices, their count, and the negated number
of batches of each usable size (largest size first). Ties (equal time) go to fewer batches, then to
larger batches first, i.e. the lexicographically largest descending size tuple; for tuples of the same
length that is the lexicographically smallest negated count vector, so the vectors decide the tie
exactly as the tuples would (O(sizes) per entry instead of O(j)).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class SplitDP:
    desc: tuple[int, ...]  # usable sizes, largest first
    cost: list[float]
    nb: list[int]
    negs: list[tuple[int, ...]]

    @classmethod
    def start(cls, desc: tuple[int, ...]) -> SplitDP:
        return cls(desc, [0.0], [0], [(0,) * len(desc)])

    def extend(self, k: int, times_s: dict[int, float]) -> None:
        """Fill the entries up to k (times_s: batch size -> seconds of one call)."""
        desc, cost, nb, negs = self.desc, self.cost, self.nb, self.negs
        times = [times_s[b] for b in desc]
        for j in range(len(cost), k + 1):
            best_c, best_n, best_v = math.inf, 0, None
            for idx, b in enumerate(desc):
                if b > j:
                    continue
                c, n = cost[j - b] + times[idx], nb[j - b] + 1
                if c > best_c or (c == best_c and n > best_n):
                    continue
                prev = negs[j - b]
                vec = prev[:idx] + (prev[idx] - 1,) + prev[idx + 1 :]
                if c < best_c or n < best_n or vec < best_v:
                    best_c, best_n, best_v = c, n, vec
            cost.append(best_c)
            nb.append(best_n)
            negs.append(best_v)

    def sizes(self, k: int) -> tuple[int, ...]:
        """Entry k's batch sizes, largest first."""
        return tuple(b for b, neg in zip(self.desc, self.negs[k], strict=True) for _ in range(-neg))


def descending_sum(dp: SplitDP, k: int, times_s: dict[int, float], pre: dict) -> float:
    """sum(times_s[b] for b in dp.sizes(k)) as that sum adds them (largest first, the same float), from
    `pre`: the partial sums of count-vector prefixes already seen (shared between entries)."""
    key: tuple[int, ...] = ()
    acc = 0.0
    for b, neg in zip(dp.desc, dp.negs[k], strict=True):
        c = -neg
        n = c
        while n > 0 and key + (n,) not in pre:
            n -= 1
        acc = pre[key + (n,)] if n else pre[key]
        for m in range(n + 1, c + 1):
            acc += times_s[b]
            pre[key + (m,)] = acc
        key += (c,)
        pre[key] = acc
    return acc


def suffix_argmin(costs: list[float]) -> list[int]:
    """best[k] = the j >= k with the least costs[j] (ties: the smallest j)."""
    best = [len(costs) - 1] * len(costs)
    for j in range(len(costs) - 2, -1, -1):
        best[j] = j if costs[j] <= costs[best[j + 1]] else best[j + 1]
    return best
