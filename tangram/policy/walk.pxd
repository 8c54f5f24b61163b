# C types for the locals of walk.py's hot loops: Cython reads this beside walk.py when setup.py
# compiles it (the .py stays plain Python and the source of truth). Units are C longs (the model
# counts integer units: Action.build refuses others, pools are typed int), times doubles.
import cython

@cython.locals(j=cython.Py_ssize_t, total=cython.double, k=cython.Py_ssize_t, now=cython.double,
               size=cython.Py_ssize_t, i=cython.Py_ssize_t, r=cython.double, units=cython.long,
               d=cython.double, t=cython.double, u=cython.long, end=cython.double)
cpdef tuple arrive(list ends, long free, units_before, total_before, leading, items)

@cython.locals(total=cython.double, n=cython.Py_ssize_t, umin=cython.long, dmin=cython.double,
               best=cython.double, size=cython.Py_ssize_t, last=cython.bint, one_after=cython.bint,
               u=cython.long, d=cython.double, t=cython.double, got=cython.long, end=cython.double,
               rest=cython.double, best_end=cython.double, b_k=cython.Py_ssize_t, b_free=cython.long,
               b_now=cython.double)
cpdef double walk(list ends, Py_ssize_t k, long free, double now, waiters, Py_ssize_t i, int explore)

@cython.locals(umin=cython.long, dmin=cython.double, size=cython.Py_ssize_t, pending=cython.bint,
               best=cython.double, u=cython.long, d=cython.double, t=cython.double, got=cython.long)
cpdef double last_end(list ends, Py_ssize_t k, long free, double now, waiter, extra)

@cython.locals(hi=cython.Py_ssize_t, mid=cython.Py_ssize_t, t=cython.double, u=cython.long)
cdef void insert(list ends, double end, long units, Py_ssize_t lo) except *

@cython.locals(size=cython.Py_ssize_t, t=cython.double, u=cython.long)
cpdef tuple start_time(list ends, Py_ssize_t k, long free, double now, long units)
