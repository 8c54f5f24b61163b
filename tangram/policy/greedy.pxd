# C types for greedy.py's sum in numpy's order when setup.py compiles the module (greedy.py stays
# plain Python and the source of truth): C doubles add as Python floats do, without a float object
# per addition.
import cython

@cython.locals(total=cython.double, r0=cython.double, r1=cython.double, r2=cython.double, r3=cython.double,
               r4=cython.double, r5=cython.double, r6=cython.double, r7=cython.double, i=cython.Py_ssize_t,
               stop=cython.Py_ssize_t, half=cython.Py_ssize_t)
cpdef double _pairwise_sum(list values, Py_ssize_t lo, Py_ssize_t n) except? -1.0


# the merge greedy eviction goes on popping prefix after prefix: its counters as C integers
cdef class _Merge:
    cdef public Py_ssize_t t, joined, total
    cdef public dict counts
    cdef public list heap
