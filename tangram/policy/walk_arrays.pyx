# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""``walk.walk`` on C arrays: the same statements in the same order, so the same floats.

``walk.py`` is the source of truth (and what Cython compiles with the C types of ``walk.pxd``):
there the completions are a Python list of ``(end, units)`` tuples and the waiters tuples, so
each read unboxes a tuple and each insertion builds one. Here both are copied once per call
into C arrays (times as doubles, units as C longs, each waiter's counts flattened) and the walk,
its bounded search included, runs on them: ~3.8x faster on the benchmark's estimates
(``docs/scheduling.md``, "The cost of one round"). ``tests/test_policy_compiled.py`` compares
the two on random completions, waiters and depths, bit for bit: a change to ``walk.py``'s walk
is made here too, or that test fails.

Built by ``setup.py`` beside the compiled ``walk`` (optional like it); ``tangram.policy.compiled``
runs it only while this file has the digest recorded at the build. Unlike ``walk.walk`` it
leaves the caller's list of completions as it was (no caller reads it after the walk).
"""
from libc.math cimport INFINITY
from libc.stdlib cimport free as c_free
from libc.stdlib cimport malloc
from libc.string cimport memcpy, memmove

COMPILED = True


cdef struct Waiters:
    Py_ssize_t n
    long* umin
    double* dmin
    char* has  # the waiter has counts to choose from (walk.py: options is not None)
    Py_ssize_t* off  # its counts are ou[off[i]:off[i + 1]], their durations od[...]
    long* ou
    double* od


cdef inline Py_ssize_t _insert(double* ts, long* us, Py_ssize_t size, double end, long units,
                               Py_ssize_t lo) noexcept nogil:
    """walk.insert: after every pair that sorts before or equal to ``(end, units)``; the new size."""
    cdef Py_ssize_t hi = size, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if end < ts[mid] or (end == ts[mid] and units < us[mid]):
            hi = mid
        else:
            lo = mid + 1
    memmove(&ts[lo + 1], &ts[lo], (size - lo) * sizeof(double))
    memmove(&us[lo + 1], &us[lo], (size - lo) * sizeof(long))
    ts[lo] = end
    us[lo] = units
    return size + 1


cdef inline Py_ssize_t _start_time(const double* ts, const long* us, Py_ssize_t size, Py_ssize_t k,
                                   long* free, double* now, long units) noexcept nogil:
    """walk.start_time: take completions from ``k`` until ``units`` are free (none left: take them as
    free); ``free`` and ``now`` updated in place, the new ``k`` returned."""
    cdef double t
    while free[0] < units:
        if k == size:
            free[0] = units
            break
        t = ts[k]
        free[0] += us[k]
        k += 1
        if t > now[0]:
            now[0] = t
    return k


cdef double _walk(double* ts, long* us, Py_ssize_t size, Py_ssize_t k, long free, double now,
                  const Waiters* w, Py_ssize_t i, int explore, double** bt, long** bu) noexcept nogil:
    """walk.walk from waiter ``i``; ``bt``/``bu``: one spare pair of arrays per search level below."""
    cdef double total = 0.0, best, d, end, rest, best_end, b_now = 0.0, dmin
    cdef long u, umin, b_free = 0
    cdef Py_ssize_t n = w.n, j, b_k, hsize
    if explore > 0:
        while i < n:
            umin = w.umin[i]
            dmin = w.dmin[i]
            if w.has[i]:
                best = INFINITY
                for j in range(w.off[i], w.off[i + 1]):
                    u = w.ou[j]
                    d = w.od[j]
                    k = _start_time(ts, us, size, k, &free, &now, u)  # continued from the previous count
                    end = now + d
                    if i + 1 == n:
                        rest = end
                    else:  # walk.py's copy of what is left with this end inserted (its last_end the same)
                        hsize = size - k
                        memcpy(bt[0], &ts[k], hsize * sizeof(double))
                        memcpy(bu[0], &us[k], hsize * sizeof(long))
                        hsize = _insert(bt[0], bu[0], hsize, end, u, 0)
                        rest = end + _walk(bt[0], bu[0], hsize, 0, free - u, now, w, i + 1, explore - 1,
                                           bt + 1, bu + 1)
                    if rest < best:
                        best = rest
                return total + best
            k = _start_time(ts, us, size, k, &free, &now, umin)
            total += now + dmin
            size = _insert(ts, us, size, now + dmin, umin, k)
            free -= umin
            i += 1
        return total
    # nothing left to explore: walk.py's hot loop
    while i < n:
        umin = w.umin[i]
        dmin = w.dmin[i]
        if w.has[i] and w.off[i + 1] - w.off[i] > 1:
            best_end = INFINITY
            b_k = -1
            for j in range(w.off[i], w.off[i + 1]):
                u = w.ou[j]
                d = w.od[j]
                k = _start_time(ts, us, size, k, &free, &now, u)
                if now + d < best_end or b_k < 0:
                    best_end = now + d
                    umin = u
                    dmin = d
                    b_free = free
                    b_now = now
                    b_k = k
            free = b_free
            now = b_now
            k = b_k
        else:
            k = _start_time(ts, us, size, k, &free, &now, umin)
        end = now + dmin
        total += end
        size = _insert(ts, us, size, end, umin, k)
        free -= umin
        i += 1
    return total


def walk(list ends, Py_ssize_t k, long free, double now, waiters, Py_ssize_t i, int explore):
    """``walk.walk(ends, k, free, now, waiters, i, explore)``: the same float for the inputs the
    estimate passes (``0 <= k <= len(ends)``, ``i >= 0``, units that fit a C long, durations that
    are numbers or +inf, never NaN); ``ends`` is not changed. ``k`` or ``i`` out of that range
    raise IndexError."""
    cdef Py_ssize_t m = len(ends), n = len(waiters), counts = 0, levels, cap, x, c
    if not 0 <= k <= m:
        raise IndexError(f"k={k} outside the {m} completions")
    if i < 0:
        raise IndexError(f"i={i}")
    if i >= n:
        return 0.0  # no waiter to walk: walk.py's total
    for x in range(i, n):
        options = waiters[x][2]
        if options is not None:
            counts += len(options)
    levels = min(max(explore, 0), n - i)
    cap = (m - k) + (n - i) + 1  # each waiter walked adds one completion; a copy drops those before k
    cdef Waiters w
    w.n = n
    # one block; 8-byte items first (pointers, doubles, Py_ssize_t), then the longs (4 bytes where a C
    # long is), then the chars, so that every array is aligned for its type
    cdef char* block = <char*>malloc((levels + 1) * (sizeof(double*) + sizeof(long*))
                                     + ((levels + 1) * cap + n + counts) * sizeof(double)
                                     + (n + 1) * sizeof(Py_ssize_t)
                                     + ((levels + 1) * cap + n + counts) * sizeof(long)
                                     + n * sizeof(char))
    if block == NULL:
        raise MemoryError()
    cdef double** bt
    cdef long** bu
    cdef char* p = block
    try:
        bt = <double**>p
        p += (levels + 1) * sizeof(double*)
        bu = <long**>p
        p += (levels + 1) * sizeof(long*)
        for x in range(levels + 1):
            bt[x] = <double*>p
            p += cap * sizeof(double)
        w.dmin = <double*>p
        p += n * sizeof(double)
        w.od = <double*>p
        p += counts * sizeof(double)
        w.off = <Py_ssize_t*>p
        p += (n + 1) * sizeof(Py_ssize_t)
        for x in range(levels + 1):
            bu[x] = <long*>p
            p += cap * sizeof(long)
        w.umin = <long*>p
        p += n * sizeof(long)
        w.ou = <long*>p
        p += counts * sizeof(long)
        w.has = p
        for x in range(k, m):
            t_u = ends[x]
            bt[0][x - k] = t_u[0]
            bu[0][x - k] = t_u[1]
        c = 0
        for x in range(n):
            w.off[x] = c
            if x < i:  # never read
                w.has[x] = 0
                continue
            umin, dmin, options = waiters[x]
            w.umin[x] = umin
            w.dmin[x] = dmin
            w.has[x] = options is not None
            if options is not None:
                for u_d in options:
                    if c == counts:
                        raise ValueError("a waiter's counts changed while they were copied")
                    w.ou[c] = u_d[0]
                    w.od[c] = u_d[1]
                    c += 1
        w.off[n] = c
        return _walk(bt[0], bu[0], m - k, 0, free, now, &w, i, explore, bt + 1, bu + 1)
    finally:
        c_free(block)
