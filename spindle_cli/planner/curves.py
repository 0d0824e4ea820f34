"""Piecewise alpha-beta fitting of scaling curves (paper section 3.2).

Input: the best feasible time per profiled device count of one operator signature. Output:
contiguous `CurvePiece`s with T(n) = alpha + beta * B / n, evaluated by
`spindle_cli.planner.scaling`.

How the fit works:
- Monotone clean-up first: a count that is slower than a smaller count takes the running
  minimum of the times before it (giving an operator more devices never has to make it slower:
  the planner would just not use them). The raw point stays in the profile; only the fit sees
  the cleaned value, so `max_rel_error` shows the difference.
- Between consecutive counts n_i < n_{i+1} the piece passes exactly through both cleaned
  points (two equations, two unknowns in b = B / n), so the fit is exact on data that is
  piecewise linear in b with breaks at the profiled counts. After the clean-up the slope is
  never negative, so beta >= 0 holds without clamping; the clamp below guards rounding.
- Piece k covers (n_k, n_{k+1}] and carries the strategy of its right end, because
  `scaling.strategy(curve, n)` picks the first piece with n <= n_hi. When the first count uses
  another strategy than the first piece, a zero-width piece [n_0, n_0] carries it.
- The last piece extends to n -> infinity, so its alpha is the floor. A superlinear last
  segment would have alpha < 0 and predict negative times far out; then a zero-width tail
  piece [n_last, n_last] with alpha = 0 extrapolates by ideal (linear) scaling instead.
- One count alone gives a flat piece (beta = 0): no scaling is assumed that was not seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spindle_cli.artifacts.profile import Curve, CurvePiece, MemoryModel, ProfilePoint
from spindle_cli.planner import scaling


@dataclass(frozen=True, slots=True, kw_only=True)
class Sample:
    """The best feasible time at one device count."""

    num_devices: int
    time_ms: float
    strategy: str
    work_devices: float = 0.0
    """The count whose B / n matches the per-device batch actually run (ceil(B / groups) per
    group): differs from num_devices when n does not divide B; 0 means num_devices."""

    @property
    def compare_at(self) -> float:
        """Where the curve is compared with this sample."""
        return self.work_devices or self.num_devices


def monotone(samples: Sequence[Sample]) -> list[Sample]:
    """Samples sorted by count with each time replaced by the running minimum (the strategy
    stays the count's own)."""
    out: list[Sample] = []
    best = float("inf")
    for s in sorted(samples, key=lambda s: s.num_devices):
        best = min(best, s.time_ms)
        out.append(
            Sample(
                num_devices=s.num_devices,
                time_ms=best,
                strategy=s.strategy,
                work_devices=s.work_devices,
            )
        )
    return out


def _segment(batch_size: int, lo: Sample, hi: Sample) -> tuple[float, float]:
    """(alpha, beta) of the line in b = B / n through two samples."""
    b_lo = batch_size / lo.num_devices
    b_hi = batch_size / hi.num_devices
    beta = max(0.0, (lo.time_ms - hi.time_ms) / (b_lo - b_hi))
    return hi.time_ms - beta * b_hi, beta


def fit_pieces(samples: Sequence[Sample], batch_size: int) -> tuple[CurvePiece, ...]:
    """Fit contiguous pieces through the (cleaned) samples; see the module docstring."""
    if not samples:
        raise ValueError("cannot fit a curve without a feasible sample")
    counts = [s.num_devices for s in samples]
    if len(set(counts)) != len(counts):
        raise ValueError(f"duplicate device counts in {counts}")
    clean = monotone(samples)
    if len(clean) == 1:
        (s,) = clean
        return (
            CurvePiece(
                n_lo=s.num_devices,
                n_hi=s.num_devices,
                alpha_ms=s.time_ms,
                beta_ms=0.0,
                strategy=s.strategy,
            ),
        )
    pieces: list[CurvePiece] = []
    for lo, hi in zip(clean, clean[1:], strict=False):
        alpha, beta = _segment(batch_size, lo, hi)
        pieces.append(
            CurvePiece(
                n_lo=lo.num_devices,
                n_hi=hi.num_devices,
                alpha_ms=alpha,
                beta_ms=beta,
                strategy=hi.strategy,
            )
        )
    first = clean[0]
    if first.strategy != pieces[0].strategy:
        head = pieces[0]
        pieces.insert(
            0,
            CurvePiece(
                n_lo=first.num_devices,
                n_hi=first.num_devices,
                alpha_ms=head.alpha_ms,
                beta_ms=head.beta_ms,
                strategy=first.strategy,
            ),
        )
    last = clean[-1]
    if pieces[-1].alpha_ms < 0:
        pieces.append(
            CurvePiece(
                n_lo=last.num_devices,
                n_hi=last.num_devices,
                alpha_ms=0.0,
                beta_ms=last.time_ms * last.num_devices / batch_size,
                strategy=last.strategy,
            )
        )
    return tuple(pieces)


def max_rel_error(curve: Curve, samples: Sequence[Sample]) -> float:
    """Largest |T_curve(n) - T(n)| / T(n) over the samples (0 for none), each compared at the
    per-device batch it ran with (`Sample.compare_at`)."""
    worst = 0.0
    for s in samples:
        predicted = scaling.time_ms(curve, s.compare_at)
        worst = max(worst, abs(predicted - s.time_ms) / s.time_ms)
    return worst


def fit_curve(
    *,
    signature: str,
    batch_size: int,
    samples: Sequence[Sample],
    points: tuple[ProfilePoint, ...],
    memory: MemoryModel,
    heldout: Sequence[Sample] = (),
    validated: bool = False,
) -> Curve:
    """The fitted Curve of one signature: pieces from `samples` (best feasible time per fitted
    count), fit error against the raw samples, and with `validated` the error at the held-out
    samples that lie inside the fitted range (None when not validated)."""
    pieces = fit_pieces(samples, batch_size)
    draft = Curve(
        signature=signature,
        batch_size=batch_size,
        points=points,
        pieces=pieces,
        memory=memory,
        max_rel_error=0.0,
    )
    lo, hi = pieces[0].n_lo, pieces[-1].n_hi
    inside = [s for s in heldout if lo <= s.num_devices <= hi]
    return Curve(
        signature=signature,
        batch_size=batch_size,
        points=points,
        pieces=pieces,
        memory=memory,
        max_rel_error=max_rel_error(draft, samples),
        heldout_rel_error=max_rel_error(draft, inside) if validated else None,
    )
