"""The plan: cost table, owner balancers and the execution plan both executors share (no torch)."""

from .types import Batch, Bucket, MatrixSpec, Plan

__all__ = ["Batch", "Bucket", "MatrixSpec", "Plan"]
