"""The scaling-curves profile: measured or analytic per-operator times at several device counts
and the fitted piecewise alpha-beta curves (`spindle profile`, `profiles/`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from spindle_cli.artifacts.base import DerivedArtifact
from spindle_cli.artifacts.cluster import ClusterSpec
from spindle_cli.artifacts.codec import meta
from spindle_cli.artifacts.io import load_recorded_input, register
from spindle_cli.artifacts.limits import (
    MAX_BATCH,
    MAX_BATCH_WHY,
    MAX_DEVICES,
    MAX_DEVICES_WHY,
    MAX_MS,
    MAX_MS_WHY,
    MIN_OPERATOR_MS,
)
from spindle_cli.errors import FieldError


def tp_degree(strategy: str) -> int:
    """The tensor-parallel degree of a strategy ('dp' -> 1)."""
    return 1 if strategy == "dp" else int(strategy[2:])


def check_strategy(strategy: str, where: str) -> None:
    """Raise FieldError unless `strategy` is 'dp' or 'tp<t>' with 2 <= t <= MAX_DEVICES."""
    digits = strategy[2:]
    # isdecimal() alone admits non-ASCII digits, and the length check keeps int() cheap
    ok = strategy == "dp" or (
        strategy.startswith("tp") and digits.isascii() and digits.isdecimal()
        and len(digits) <= 8 and 2 <= int(digits) <= MAX_DEVICES
    )
    if not ok:
        raise FieldError(where, f"unknown strategy {strategy!r} (expected 'dp' or 'tp<t>', "
                                f"2 <= t <= {MAX_DEVICES})")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfilePoint:
    """One profiled device count under one strategy."""

    num_devices: int = field(
        metadata=meta("device count n", ge=1, le=MAX_DEVICES, le_why=MAX_DEVICES_WHY)
    )
    strategy: str = field(metadata=meta("'dp' or 'tp<t>'"))
    feasible: bool = field(metadata=meta("false when the shape ran out of memory or timed out"))
    time_ms: float = field(metadata=meta("forward+backward time of one operator, ms", ge=0,
                                         le=MAX_MS, le_why=MAX_MS_WHY))
    peak_memory_bytes: int = field(metadata=meta("peak memory per device", ge=0))
    note: str = field(default="", metadata=meta("why a point is infeasible"))

    def __post_init__(self) -> None:
        check_strategy(self.strategy, "strategy")
        if self.feasible and not self.time_ms >= MIN_OPERATOR_MS:
            # what fitting and `spindle show --plot` divide by (an infeasible point's is 0)
            raise FieldError("time_ms", f"a feasible point takes at least {MIN_OPERATOR_MS:g} "
                                        f"ms, got {self.time_ms}")


@dataclass(frozen=True, slots=True, kw_only=True)
class CurvePiece:
    """T(n) = alpha_ms + beta_ms * (B / n) for n in [n_lo, n_hi]."""

    n_lo: int = field(
        metadata=meta("lower device count of the piece", ge=1, le=MAX_DEVICES,
                      le_why=MAX_DEVICES_WHY)
    )
    n_hi: int = field(
        metadata=meta("upper device count of the piece", ge=1, le=MAX_DEVICES,
                      le_why=MAX_DEVICES_WHY)
    )
    alpha_ms: float = field(
        metadata=meta("fixed cost per operator, ms (may be negative where T(n) stays positive "
                      "over the counts the piece covers)")
    )
    beta_ms: float = field(metadata=meta("cost per sample on one device, ms", ge=0))
    strategy: str = field(metadata=meta("strategy used on this piece"))

    def __post_init__(self) -> None:
        check_strategy(self.strategy, "strategy")
        if self.n_hi < self.n_lo:
            raise FieldError("n_hi", f"{self.n_hi} < n_lo {self.n_lo}")


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryModel:
    """Memory of one operator (layer) per device, by category (mixed-precision Adam)."""

    param_bytes: int = field(metadata=meta("parameters (training dtype) per layer", ge=0))
    grad_bytes: int = field(metadata=meta("gradients per layer", ge=0))
    optimizer_bytes: int = field(
        metadata=meta("optimizer state per layer: Adam moments, and fp32 master weights with a "
                      "16-bit dtype", ge=0)
    )
    activation_bytes_per_sample: int = field(
        metadata=meta("activations kept for backward per sample per layer", ge=0)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Curve:
    """The scaling curve of one operator signature."""

    signature: str = field(metadata=meta("operator signature (layer kind, dims, shape)"))
    batch_size: int = field(
        metadata=meta("global batch B of the signature", ge=1, le=MAX_BATCH, le_why=MAX_BATCH_WHY)
    )
    points: tuple[ProfilePoint, ...] = field(metadata=meta("raw profiled points"))
    pieces: tuple[CurvePiece, ...] = field(metadata=meta("fitted pieces, ascending in n"))
    memory: MemoryModel = field(metadata=meta("per-layer memory model (data parallel)"))
    max_rel_error: float = field(metadata=meta("max relative fit error at profiled points", ge=0))
    heldout_rel_error: float | None = field(
        default=None, metadata=meta("max relative error at held-out counts (--validate)")
    )

    def __post_init__(self) -> None:
        if not self.pieces:
            raise FieldError("pieces", "a curve needs at least one piece")
        first: dict[tuple[int, str], int] = {}
        for j, q in enumerate(self.points):
            i = first.setdefault((q.num_devices, q.strategy), j)
            if i != j:
                raise FieldError(f"points[{j}]", f"a second point at n = {q.num_devices} "
                                                 f"under {q.strategy!r} (the first is "
                                                 f"points[{i}])")
        if self.points and not any(q.feasible for q in self.points):
            # pieces are fitted to feasible points (a hand-made curve may give none at all)
            raise FieldError("points", "no point is feasible, so there is nothing the pieces "
                                       "could have been fitted to")
        for i in range(1, len(self.pieces)):
            if self.pieces[i].n_lo != self.pieces[i - 1].n_hi:
                raise FieldError(f"pieces[{i}].n_lo", "pieces must be contiguous")
        last = len(self.pieces) - 1
        for i, p in enumerate(self.pieces):
            t = tp_degree(p.strategy)
            if t > p.n_hi:
                # its counts are all below the degree: a group it could never form
                raise FieldError(f"pieces[{i}].strategy", f"{p.strategy!r} on {p.n_lo} to "
                                                          f"{p.n_hi} devices: fewer than one "
                                                          "tensor-parallel group")
            # T(n) = alpha + beta * B / n falls with n (beta >= 0), so its least value over the
            # counts a piece covers is at the highest: n_hi, or for the last piece (which
            # extends up) the most devices the batch can use, t * B under 'tp<t>'. Lines
            # fitted through two points may have a negative alpha; only T itself must stay
            # positive, since the planner divides by it.
            most = self.batch_size * tp_degree(p.strategy)
            n = most if i == last else min(p.n_hi, most)
            if n < p.n_lo:
                continue  # counts beyond what the batch can use: never read
            t_ms = p.alpha_ms + p.beta_ms * self.batch_size / n
            slowest = p.alpha_ms + p.beta_ms * self.batch_size / p.n_lo
            if not slowest <= MAX_MS:
                raise FieldError(f"pieces[{i}]", f"T(n) = alpha_ms + beta_ms * B / n is "
                                                 f"{slowest:.6g} ms at n = {p.n_lo}, above "
                                                 f"{MAX_MS:g} ms ({MAX_MS_WHY})")
            if not t_ms >= MIN_OPERATOR_MS:
                raise FieldError(
                    f"pieces[{i}]",
                    f"T(n) = alpha_ms + beta_ms * B / n is {t_ms:.6g} ms at n = {n} "
                    f"(B = {self.batch_size}); an operator must take at least "
                    f"{MIN_OPERATOR_MS:g} ms at every device count its piece covers",
                )


@dataclass(frozen=True, slots=True, kw_only=True)
class Fingerprint:
    """Where a profile's numbers came from."""

    hardware: str = field(metadata=meta("'local' (measured) or an analytic device model"))
    device_name: str = field(metadata=meta("device the numbers describe", name=True))
    torch_version: str = field(metadata=meta("torch version used to measure ('' if analytic)"))
    dtype: str = field(metadata=meta("compute dtype"))


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerCost:
    """Time of one AdamW step on one device: a fixed cost per parameter tensor stepped (the
    executor steps one flat tensor per gradient bucket) plus a cost per parameter."""

    ms_per_tensor: float = field(metadata=meta("fixed cost per parameter tensor, ms", ge=0,
                                               le=MAX_MS, le_why=MAX_MS_WHY))
    ms_per_million_params: float = field(
        metadata=meta("cost per million parameters (fp32 optimizer state), ms", ge=0,
                      le=MAX_MS, le_why=MAX_MS_WHY)
    )

    def time_ms(self, num_tensors: int, num_params: float) -> float:
        """One step over `num_tensors` tensors holding `num_params` parameters in all."""
        if num_params <= 0:
            return 0.0
        return num_tensors * self.ms_per_tensor + num_params / 1e6 * self.ms_per_million_params


@register
@dataclass(frozen=True, slots=True, kw_only=True)
class Profile(DerivedArtifact):
    """Scaling curves for every operator signature of a MetaOp graph."""

    KIND = "profile"
    INPUT_KINDS = ("metaop_graph", "model", "cluster")
    VERSION = 1

    source: Literal["measured", "analytic"] = field(metadata=meta("how the points were made"))
    fingerprint: Fingerprint = field(metadata=meta("hardware and software the profile describes"))
    counts: tuple[int, ...] = field(
        metadata=meta("profiled device counts", ge=1, le=MAX_DEVICES, le_why=MAX_DEVICES_WHY)
    )
    curves: tuple[Curve, ...] = field(metadata=meta("curves, sorted by signature"))
    optimizer: OptimizerCost | None = field(
        default=None,
        metadata=meta("AdamW step time on one device (absent: the simulator charges none)"),
    )

    def __post_init__(self) -> None:
        DerivedArtifact.__post_init__(self)
        sigs = [c.signature for c in self.curves]
        if len(set(sigs)) != len(sigs):
            raise FieldError("curves", "duplicate signature")
        if not self.counts:
            raise FieldError("counts", "a profile needs at least one device count")
        if list(self.counts) != sorted(set(self.counts)):
            raise FieldError("counts", "device counts must be ascending, each once")

    def curve(self, signature: str) -> Curve:
        """The curve of an operator signature."""
        for c in self.curves:
            if c.signature == signature:
                return c
        raise KeyError(signature)


def profiled_device(profile: Profile, profile_path: str) -> str:
    """The device (a cluster spec's `device.name`) whose times `profile` holds: the device
    model an analytic profile names, or the device of the cluster a measured profile was
    measured on (its recorded cluster input; ArtifactError when it records none, or that
    file is missing or has changed since)."""
    if profile.source == "analytic":
        return profile.fingerprint.device_name
    return load_recorded_input(profile, profile_path, ClusterSpec)[1].device.name
