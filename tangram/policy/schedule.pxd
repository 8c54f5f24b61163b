# The C layout of schedule.py's candidate when setup.py compiles the module (schedule.py stays plain
# Python and the source of truth): its fields are read and set several times per candidate a round.
cdef class _Candidate:
    cdef public object action, node, pools, units, place_mem, hits, group, slot
