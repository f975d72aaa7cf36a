"""Slow, independent reference implementation of MGRIT (nonlinear FAS form).

This module is a deliberately naive restatement of docs/design.md section 2 (the
MGRIT algorithm).  It is used only by the test suite, to check the real solver
number by number.  It does not import anything from the ``mgrit`` package and
is written as plain Python loops over lists of numpy arrays: clarity over speed.

Notation
--------
Level 0 has points n = 0..N, h = (t1 - t0) / N.  Level l+1 keeps every m_l-th
point of level l.  On level l a step from point j covers dt = h * M_l, where
M_l = m_0 * ... * m_{l-1} (the factors of all finer levels), and starts
at time t0 + (j * M_l) * h.  C-points of level l are the multiples of m_l;
all other points are F-points.

Per level we store u (solution), v (injected values) and g (FAS right-hand
side).  Every relaxation uses the update u[j] = g[j] + Phi_l(u[j-1]).
"""

import math

import numpy as np


def reference_mgrit(step, u0, num_steps, t0, t1, *, levels, coarsening, cf_sweeps, c_weight=1.0,
                    cycle="V", initial_guess="zero", max_iter=10, tol=0.0, min_coarse=1):
    """Return (residuals: list[float], states: np.ndarray of shape (num_steps+1, *u0.shape))."""
    u0 = np.asarray(u0)
    N = int(num_steps)
    h = (t1 - t0) / N

    # ------------------------------------------------------------------
    # Level hierarchy
    # ------------------------------------------------------------------
    n = [N]            # number of steps on each level
    stride = [1]       # M_l: fine-grid steps per step on level l
    min_c = max(min_coarse, 1)
    while len(n) < levels:
        m = coarsening[len(n) - 1]
        n_next = n[-1] // m
        if n_next < min_c:
            break
        n.append(n_next)
        stride.append(stride[-1] * m)
    L = len(n)  # number of levels actually built; level L-1 is the coarsest

    def phi(l, u, j):
        """One step on level l from point j to j+1."""
        fine_index = j * stride[l]
        t = t0 + fine_index * h
        dt = h * stride[l]
        return step(u, l, j, t, dt)

    # ------------------------------------------------------------------
    # Storage
    # ------------------------------------------------------------------
    def zeros_like_u0():
        return np.zeros_like(u0)

    u = []
    v = []
    g = []
    for l in range(L):
        u.append([zeros_like_u0() for _ in range(n[l] + 1)])
        v.append([zeros_like_u0() for _ in range(n[l] + 1)])
        g.append([zeros_like_u0() for _ in range(n[l] + 1)])
        u[l][0] = u0.copy()

    # ------------------------------------------------------------------
    # Building blocks
    # ------------------------------------------------------------------
    def relax_point(l, j):
        return g[l][j] + phi(l, u[l][j - 1], j - 1)

    def f_relax(l):
        m = coarsening[l]
        for c in range(0, n[l] + 1, m):
            for k in range(1, m):
                if c + k > n[l]:
                    break
                u[l][c + k] = relax_point(l, c + k)

    def c_relax(l):
        m = coarsening[l]
        w = c_weight
        for c in range(m, n[l] + 1, m):
            new = relax_point(l, c)
            if w == 1.0:
                u[l][c] = new
            else:
                u[l][c] = w * new + (1.0 - w) * u[l][c]

    def coarsest_solve(l):
        for j in range(1, n[l] + 1):
            u[l][j] = relax_point(l, j)

    def restrict(l):
        m = coarsening[l]
        for j in range(n[l + 1] + 1):
            v[l + 1][j] = u[l][j * m].copy()
        for j in range(1, n[l + 1] + 1):
            jm = j * m
            fine_res = (g[l][jm] - u[l][jm]) + phi(l, u[l][jm - 1], jm - 1)
            g[l + 1][j] = fine_res + v[l + 1][j] - phi(l + 1, v[l + 1][j - 1], j - 1)
        for j in range(n[l + 1] + 1):
            u[l + 1][j] = v[l + 1][j].copy()

    def correct(l):
        m = coarsening[l]
        for j in range(n[l + 1] + 1):
            u[l][j * m] = u[l][j * m] + (u[l + 1][j] - v[l + 1][j])

    def run_cycle(l, kind, first_f):
        if l == L - 1:
            coarsest_solve(l)
            return
        if first_f:
            f_relax(l)
        for _ in range(cf_sweeps[l]):
            c_relax(l)
            f_relax(l)
        restrict(l)
        run_cycle(l + 1, kind, True)
        correct(l)
        f_relax(l)
        if l > 0 and kind == "F":
            run_cycle(l, "V", False)

    def residual():
        if L == 1:
            return 0.0
        m = coarsening[0]
        total = 0.0
        for j in range(m, n[0] + 1, m):
            r = phi(0, u[0][j - 1], j - 1) - u[0][j]
            total += float(np.sum(np.abs(r) ** 2))
        return math.sqrt(total)

    # ------------------------------------------------------------------
    # Initial guess
    # ------------------------------------------------------------------
    if isinstance(initial_guess, str):
        if initial_guess == "zero":
            pass  # u_0 is already zero except u_0[0] = u0
        elif initial_guess == "nested":
            if L > 1:
                coarsest_solve(L - 1)
                for l in range(L - 2, -1, -1):
                    m = coarsening[l]
                    for j in range(n[l + 1] + 1):
                        u[l][j * m] = u[l + 1][j].copy()
                    if l > 0:
                        run_cycle(l, "V", True)
        else:
            raise ValueError("unknown initial_guess %r" % (initial_guess,))
    else:
        guess = np.asarray(initial_guess)
        for j in range(N + 1):
            u[0][j] = np.array(guess[j], dtype=u0.dtype, copy=True)
        u[0][0] = u0.copy()

    # ------------------------------------------------------------------
    # Iterations
    # ------------------------------------------------------------------
    residuals = []
    for it in range(max_iter):
        run_cycle(0, cycle, it == 0)
        r = residual()
        residuals.append(r)
        if r <= tol:
            break
    if max_iter == 0 and L > 1:
        # no cycle (from a nested start): the guess F-relaxed once, and its residual
        f_relax(0)
        residuals.append(residual())

    states = np.array([np.asarray(x) for x in u[0]])
    return residuals, states
