"""Named tolerances of the floating-point comparisons that several test modules share.

Each says which class of tests/README.md's rule it is and why it is what it is.
"""

from __future__ import annotations

import torch

PARAM_TOL = 1e-5
"""Distributed parameters against tests/reference.py's float64 simulator, absolute
(tests/README.md class 3): the tiny model's parameters are of order 1 and below (norm
weights start at 1, the rest at std 0.02), where float32's spacing is at most 1.2e-7, so
1e-5 is 80 float32 ulps at the largest value and more below: room for the float32 roundings
of a few training steps and syncs against float64, while a wrong formula (anchors from step
0, a wrong divisor, a skipped unit) moves whole tensors by 1e-3 and more."""
LOSS_RTOL = 16 * torch.finfo(torch.float32).eps
"""A float32 loss computed in another order than the one it is compared to (another split of
the batch into microbatches, shards, stages or tensor-parallel halves), relative (class 2):
a mean over the batch's tokens rounds a few times differently, and 16 ulps (1.9e-6 relative,
1.5e-5 at a loss of 8) covers the kernels of an AVX2 and an AVX-512 CPU; a wrong batch,
stage or sync moves a loss by 1e-3 and more."""
RUN_LOSS_RTOL = 3.2e-5
"""Two CLI runs of one training computed in another partition (pipeline stages,
tensor-parallel halves) that then train on, their losses relative (class 4):
they start a few float32 ulps apart and the difference grows through ten steps of
clipping, syncs and the outer optimizer; the largest seen is 9e-5 at a loss of 6.2 (1.5e-5
relative, the bf16 interleaved Hugging Face case of test_pp_train). 3.2e-5 is the absolute
2e-4 these tests had, at the uniform loss log(512) = 6.24, made relative; a stage that
drops a microbatch or a missed sync moves the losses by 1e-2 and more."""


def rel_diff(a: float, ref: float) -> float:
    """|a - ref| / |ref|: the relative difference the LOSS_RTOL comparisons use."""
    return abs(a - ref) / abs(ref)


def worst_rel_diff(got: dict, want: dict) -> float:
    """The largest :func:`rel_diff` of ``got[k]`` against ``want[k]`` over ``want``'s keys
    (both per-step losses, say)."""
    return max(rel_diff(got[k], want[k]) for k in want)
