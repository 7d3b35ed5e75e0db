"""Peak resident memory of one context-parallel attention forward + backward per rank is linear in
the sequence: ring at CP=2 on two real gloo ranks, seq 4096 -> 8192 on the fused kernel (issue #19's
figure), 2048 -> 4096 on the tiled reference (make bench-flash's measurement: VmHWM after a reset,
glibc unmapping freed tensors, a fresh pair of processes per sequence). At shorter sequences the
kernels' fixed-size buffers make the per-rank ratio noisy (up to 2.27 at 1024 -> 2048).

The same measurement on the reference kernel in ONE tile -- the [chunk x chunk] scores at once, as
every schedule ran before the fused kernels -- grows with the square: the check can fail.
"""

import argparse
import sys

import pytest

from coc_inject.bench.cases import flash

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self (Linux)")


def peak_growth(kernel, seqs, reference_tile=None):
    peaks = []
    for seq in seqs:
        result = flash._run(argparse.Namespace(reps=0, measure="memory", reference_tile=reference_tile, sdpa=False),
                            seq=seq,
                            dtype="float32", link=None, threads=1, batch=1, heads=8, kv_groups=8, head_dim=64,
                            kernel=kernel)
        peaks.append(result["ring_peak_bytes"])
    return max(large / small for small, large in zip(*peaks)), peaks


def test_peak_memory_per_rank_grows_linearly_with_the_sequence():
    growth, peaks = peak_growth("fused", (4096, 8192))
    assert growth <= flash.TARGETS["memory_growth"], peaks
    tiled, peaks = peak_growth("reference", (2048, 4096))
    assert tiled <= flash.TARGETS["memory_growth"], peaks


def test_the_measurement_sees_a_quadratic_transient():
    growth, peaks = peak_growth("reference", (1024, 2048), reference_tile=1 << 30)
    assert growth >= 2.4, peaks  # measured 2.58 (the linear parts dilute the square at these lengths)
