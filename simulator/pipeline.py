"""Pipeline schedules, simulated op by op: 1F1B (PipeDream-Flush, Narayanan et al. 2021, arXiv:2104.04473,
Sec. 2.2.1) and the interleaved schedule (ibid. Sec. 2.2.2; vpp model chunks per stage), in the order
Megatron-LM's `forward_backward_pipelining_with_interleaving` / `..._without_interleaving` issue them:

  per stage s of p, with v chunks and m micro-batches (m v forwards and m v backwards):
    warm-up forwards W = (p - s - 1) x 2 + (v - 1) x p   (v = 1: p - s - 1), at most m v
    then one forward and one backward alternately, then the remaining backwards;
    the k-th forward runs chunk (k mod p v) // p on micro-batch (k // p v) p + k mod p; backwards walk the
    chunks in reverse.
  F(s, c, i) waits for F(s - 1, c, i) (or, on stage 0, F(p - 1, c - 1, i)) plus one send;
  B(s, c, i) waits for B(s + 1, c, i) (or, on the last stage, B(0, c + 1, i)) plus one send, and the last
  chunk's backward on the last stage for its own forward.
Each stage runs its ops one after another in that order, each as soon as its stage is free and its input
has arrived. Sends do not occupy the compute stream (Megatron posts them as async isend / irecv). With
equal stages and free sends this gives the textbook step (m + p - 1)(F + B) for v = 1: a bubble of
(p - 1) / m of the ideal time, and (p - 1) / (m v) interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineResult:
    end_s: list[float]  # per stage: when its last op ends
    busy_f_s: list[float]  # per stage: its forward ops' summed time
    busy_b_s: list[float]  # per stage: its backward ops' summed time

    @property
    def makespan_s(self) -> float:
        return max(self.end_s)

    @property
    def bubble_s(self) -> float:
        """Makespan less the busiest stage's work: the time that stage waits."""
        return self.makespan_s - max(f + b for f, b in zip(self.busy_f_s, self.busy_b_s, strict=True))


def stage_order(p: int, v: int, m: int, s: int) -> list[tuple[str, int, int]]:
    """Stage s's ops in issue order: ("F" | "B", chunk, micro-batch) (module docstring)."""
    total = m * v
    warm = min(total, (p - s - 1) * 2 + (v - 1) * p if v > 1 else p - s - 1)

    def op(kind: str, k: int) -> tuple[str, int, int]:
        chunk = (k % (p * v)) // p
        if kind == "B":
            chunk = v - 1 - chunk
        return kind, chunk, (k // (p * v)) * p + k % p

    out = [op("F", k) for k in range(warm)]
    for i in range(total - warm):
        out += [op("F", warm + i), op("B", i)]
    out += [op("B", k) for k in range(total - warm, total)]
    return out


def simulate_pipeline(p: int, v: int, m: int, f_s, b_s, send_f_s: float = 0.0, send_b_s: float = 0.0,
                      first_f_extra=None, last_b_extra=None) -> PipelineResult:
    """Run the schedule. f_s[s][c], b_s[s][c]: one micro-batch's forward / backward seconds of chunk c on
    stage s; send_*: one stage-to-stage send; first_f_extra[s] / last_b_extra[s]: seconds added to stage
    s's first forward / last backward (its data-parallel gathers / reductions, once per step)."""
    if v > 1 and m % p:
        raise ValueError(f"the interleaved schedule needs micro-batches ({m}) a multiple of pp ({p})")
    orders = [stage_order(p, v, m, s) for s in range(p)]
    done: dict[tuple[str, int, int, int], float] = {}
    pos, free = [0] * p, [0.0] * p
    bf, bb = [0.0] * p, [0.0] * p
    remaining = sum(len(o) for o in orders)
    while remaining:
        moved = False
        for s in range(p):
            order = orders[s]
            while pos[s] < len(order):
                kind, c, i = order[pos[s]]
                if kind == "F":
                    dep = (("F", s - 1, c, i), send_f_s) if s > 0 else (
                        (("F", p - 1, c - 1, i), send_f_s) if c > 0 else None)
                else:
                    dep = (("B", s + 1, c, i), send_b_s) if s < p - 1 else (
                        (("B", 0, c + 1, i), send_b_s) if c < v - 1 else (("F", s, c, i), 0.0))
                ready = 0.0
                if dep is not None:
                    (k, ds, dc, di), lag = dep
                    t = done.get((k, ds, dc, di))
                    if t is None:
                        break
                    ready = t + lag
                dur = (f_s if kind == "F" else b_s)[s][c]
                if kind == "F" and pos[s] == 0 and first_f_extra:
                    dur += first_f_extra[s]
                if kind == "B" and pos[s] == len(order) - 1 and last_b_extra:
                    dur += last_b_extra[s]
                start = max(free[s], ready)
                free[s] = start + dur
                done[(kind, s, c, i)] = free[s]
                if kind == "F":
                    bf[s] += dur
                else:
                    bb[s] += dur
                pos[s] += 1
                remaining -= 1
                moved = True
        if not moved:
            raise RuntimeError("pipeline schedule deadlocked (a bug in stage_order)")
    return PipelineResult(free, bf, bb)
