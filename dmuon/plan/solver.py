"""HiGHS helpers shared by the MILP balancer (`milp`) and the configuration search (`colgen`).

The wall-clock safety net (`Budget`), silent HiGHS instances, pulp variables across PuLP versions and
pulp's HiGHS interface with a MIP start and a fixed seed. highspy and pulp are imported inside the
functions that need them (the plan package imports without them).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time


class Budget:
    """The wall-clock safety net of one solve: phases ask `expired(phase)` at their loop heads and give
    HiGHS `left_s()` as its time limit. Work limits end every phase first on the project's workloads;
    `stopped` names the phases the clock ended (their results may differ between runs)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.deadline = time.perf_counter() + seconds
        self.stopped: list[str] = []

    @property
    def timed_out(self) -> bool:
        return bool(self.stopped)

    def left_s(self) -> float:
        return max(0.0, self.deadline - time.perf_counter())

    def expired(self, phase: str, *, force: bool = False) -> bool:
        if force or time.perf_counter() >= self.deadline:
            if phase not in self.stopped:
                self.stopped.append(phase)
            return True
        return False


def stopped_by_clock(highs) -> bool:
    """Whether a highspy.Highs run ended at its time limit."""
    import highspy

    return highs.getModelStatus() == highspy.HighsModelStatus.kTimeLimit


@contextlib.contextmanager
def quiet_stdout():
    """Silence C-level stdout (HiGHS prints a banner when its first model is created)."""
    try:
        sys.stdout.flush()
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):
        yield
        return
    saved = os.dup(fd)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), fd)
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, fd)
        os.close(saved)


def new_highs(highspy):
    """A silent highspy.Highs (the banner of the first model in a process goes to C stdout)."""
    with quiet_stdout():
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    return h


def new_var(pulp, prob, name: str, low, up, cat: str):
    """A pulp variable attached to `prob` (PuLP >= 3.3 API; plain LpVariable on older PuLP)."""
    if hasattr(prob, "add_variable"):
        return prob.add_variable(name, low, up, cat=cat)
    return pulp.LpVariable(name, low, up, cat=cat)


def warm_highs(pulp, seed: int):
    """pulp.HiGHS with a MIP start (a dict name -> value), a fixed random seed and a silent banner."""

    class WarmHiGHS(pulp.HiGHS):
        """pulp's HiGHS with a MIP start, a fixed random seed and a silent banner."""

        def __init__(self, start, **kwargs):
            super().__init__(random_seed=seed, **kwargs)
            self.start = start

        def createAndConfigureSolver(self, lp):
            with quiet_stdout():
                super().createAndConfigureSolver(lp)

        def findSolutionValues(self, lp):
            """pulp's status mapping, plus the HiGHS stops it does not know (node / solution limits):
            the variable values are read either way; the status says whether a solution exists."""
            from pulp import constants

            try:
                return super().findSolutionValues(lp)
            except KeyError:
                found = lp.solverModel.getInfo().primal_solution_status != 0
                return (
                    constants.LpStatusNotSolved,
                    constants.LpSolutionIntegerFeasible if found else constants.LpSolutionNoSolutionFound,
                )

        def callSolver(self, lp):
            if self.start:
                import numpy as np

                cols = [v for v in lp.variables() if v.name in self.start]
                idx = np.array([v.index for v in cols], dtype=np.int32)
                val = np.array([self.start[v.name] for v in cols], dtype=np.float64)
                lp.solverModel.setSolution(len(cols), idx, val)
            lp.solverModel.run()

    return WarmHiGHS
