"""Scaling-law fits of NE against training compute C (FLOPs).

- ``fit_log_linear``: NE = a - b*log10(C) by least squares; R^2, the parameter covariance and a 95% band for the
  mean (Student t on n - 2 degrees of freedom). ``b`` is the NE gained per decade of compute.
- ``fit_power_law``: NE = E + A*(C/C0)^-alpha by ``scipy.optimize.curve_fit`` (C0 = the smallest C, so A is the
  excess NE over E at the smallest point); band by the delta method on curve_fit's covariance.
- ``frontier``: the compute-optimal points, i.e. the lower envelope of NE vs C (no cheaper point is better).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats


@dataclass
class LogLinearFit:
    a: float
    b: float  # NE gained per decade of compute
    r2: float
    n: int
    decades: float  # log10(max C / min C)
    cov: np.ndarray  # 2x2 covariance of (a, b)
    sigma2: float  # residual variance

    def predict(self, c) -> np.ndarray:
        return self.a - self.b * np.log10(np.asarray(c, dtype=np.float64))

    def band(self, c, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        """Confidence band of the fitted mean at ``c``."""
        x = np.log10(np.asarray(c, dtype=np.float64))
        design = np.stack([np.ones_like(x), -x], -1)
        se = np.sqrt(np.einsum("...i,ij,...j->...", design, self.cov, design))
        t = stats.t.ppf(0.5 + level / 2, max(self.n - 2, 1))
        mid = self.predict(c)
        return mid - t * se, mid + t * se

    def slope_ci(self, level: float = 0.95) -> tuple[float, float]:
        t = stats.t.ppf(0.5 + level / 2, max(self.n - 2, 1))
        se = math.sqrt(max(self.cov[1, 1], 0.0))
        return self.b - t * se, self.b + t * se


@dataclass
class PowerLawFit:
    e: float  # irreducible NE
    a: float  # excess NE at C0
    alpha: float
    c0: float
    r2: float
    n: int
    cov: np.ndarray  # 3x3 covariance of (E, A, alpha)

    def predict(self, c) -> np.ndarray:
        return _power(np.asarray(c, dtype=np.float64) / self.c0, self.e, self.a, self.alpha)

    def band(self, c, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(c, dtype=np.float64) / self.c0
        p = x ** (-self.alpha)
        grad = np.stack([np.ones_like(x), p, -self.a * p * np.log(x)], -1)  # d f / d (E, A, alpha)
        se = np.sqrt(np.maximum(np.einsum("...i,ij,...j->...", grad, self.cov, grad), 0.0))
        t = stats.t.ppf(0.5 + level / 2, max(self.n - 3, 1))
        mid = self.predict(c)
        return mid - t * se, mid + t * se


def _power(x, e, a, alpha):
    return e + a * x ** (-alpha)


def _check(compute, ne, min_points: int) -> tuple[np.ndarray, np.ndarray]:
    c = np.asarray(compute, dtype=np.float64)
    y = np.asarray(ne, dtype=np.float64)
    if c.shape != y.shape or c.ndim != 1:
        raise ValueError(f"compute and NE must be 1-d and equally long, got {c.shape} and {y.shape}")
    if not (np.isfinite(c).all() and np.isfinite(y).all()) or (c <= 0).any():
        raise ValueError("compute must be positive and finite and NE finite")
    if len(c) < min_points:
        raise ValueError(f"a fit needs at least {min_points} points, got {len(c)}")
    return c, y


def r_squared(y: np.ndarray, predicted: np.ndarray) -> float:
    total = float(((y - y.mean()) ** 2).sum())
    resid = float(((y - predicted) ** 2).sum())
    return 1.0 - resid / total if total > 0 else (1.0 if resid == 0 else 0.0)


def fit_log_linear(compute, ne) -> LogLinearFit:
    c, y = _check(compute, ne, 2)
    x = np.log10(c)
    if np.ptp(x) == 0:
        raise ValueError("all points have the same compute: no slope to fit")
    design = np.stack([np.ones_like(x), -x], 1)
    (a, b), *_ = np.linalg.lstsq(design, y, rcond=None)
    pred = design @ np.array([a, b])
    n = len(y)
    sigma2 = float(((y - pred) ** 2).sum() / (n - 2)) if n > 2 else 0.0
    cov = sigma2 * np.linalg.inv(design.T @ design)
    return LogLinearFit(float(a), float(b), r_squared(y, pred), n, float(np.ptp(x)), cov, sigma2)


def fit_power_law(compute, ne) -> PowerLawFit:
    """Raises ``ValueError`` when there are fewer than 4 points or curve_fit does not converge."""
    c, y = _check(compute, ne, 4)
    c0 = float(c.min())
    x = c / c0
    span = max(float(np.ptp(y)), 1e-6)
    p0 = (float(y.min()) - 0.1 * span, span, 0.3)
    try:
        params, cov = optimize.curve_fit(
            _power, x, y, p0=p0, bounds=([-np.inf, 0.0, 0.0], [np.inf, np.inf, 5.0]), maxfev=20_000
        )
    except (RuntimeError, optimize.OptimizeWarning) as err:
        raise ValueError(f"power-law fit did not converge: {err}") from err
    pred = _power(x, *params)
    cov = np.where(np.isfinite(cov), cov, 0.0)
    return PowerLawFit(*(float(p) for p in params), c0, r_squared(y, pred), len(y), cov)


def frontier(compute, ne) -> np.ndarray:
    """Indices of the compute-optimal points, by increasing compute: each beats every cheaper point."""
    c, y = _check(compute, ne, 1)
    best, keep = math.inf, []
    for i in np.argsort(c, kind="stable"):
        if y[i] < best:
            best = y[i]
            keep.append(int(i))
    return np.array(keep, dtype=np.int64)
