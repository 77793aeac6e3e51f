/* The event loop of simulator/engine/engine_fast.py in C: the same model, the same arithmetic in the same order
 * (compiled with -ffp-contract=off), the same (time, sequence) order of timers, so every op gets the same
 * start, end and slowdown, bit for bit (tests/test_sim_engine_fast.py checks both loops against the SimPy
 * reference, tests/test_sim_engine_native.py this one against engine_fast on larger programs). Read
 * engine_fast.py first: every function is named after its counterpart. engine_native_state.h holds the
 * state and its containers, engine_native_loop.h the model; this file takes the arguments and writes the
 * results back.
 *
 * What differs is only where the loop's state lives. The ops and collectives stay the Python objects the
 * step programs built (their __slots__ are read and written in place through the member descriptors'
 * offsets); the streams, the ready queue, the timer heap, the collectives' running state and the lists of
 * waiting streams are C arrays. A waiting list of an op is a chain of nodes whose last index is kept in the
 * op's `done` slot (a Python int while anything waits on it, None otherwise, as engine_fast leaves it).
 * The running state of a slowed compute op is one record per rank (a rank runs one compute op at a time):
 * its version only grows, so a timer of an earlier op of the rank never matches a later op's version.
 */
#include "engine_native_state.h"
#include "engine_native_loop.h"
#include "engine_native_replay.h"
#include "engine_native_measure.h"

static Py_ssize_t slot_offset(PyObject *type, const char *name)
{
    PyObject *d = PyObject_GetAttrString(type, name);
    if (!d) return -1;
    if (!PyObject_TypeCheck(d, &PyMemberDescr_Type) ||
        ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
        Py_DECREF(d);
        PyErr_Format(PyExc_TypeError, "%s is not an object slot of its class", name);
        return -1;
    }
    Py_ssize_t off = ((PyMemberDescrObject *)d)->d_member->offset;
    Py_DECREF(d);
    return off;
}

static void loop_free(Loop *L)
{
    Py_XDECREF(L->now_obj);
    PyMem_Free(L->st);
    PyMem_Free(L->rq);
    PyMem_Free(L->heap);
    PyMem_Free(L->nodes);
    PyMem_Free(L->scratch.a);
    PyMem_Free(L->coll);
    PyMem_Free(L->c_n);
    PyMem_Free(L->c_arrived);
    PyMem_Free(L->c_off);
    PyMem_Free(L->c_head);
    PyMem_Free(L->c_tail);
    PyMem_Free(L->c_ranks);
    PyMem_Free(L->c_cost);
    PyMem_Free(L->c_sm);
    PyMem_Free(L->c_start);
    PyMem_Free(L->c_endt);
    PyMem_Free(L->c_rem);
    PyMem_Free(L->c_rate);
    PyMem_Free(L->c_since);
    PyMem_Free(L->c_ver);
    if (L->c_start_obj)
        for (Py_ssize_t c = 0; c < L->n_coll; c++) Py_XDECREF(L->c_start_obj[c]);
    if (L->c_end_obj)
        for (Py_ssize_t c = 0; c < L->n_coll; c++) Py_XDECREF(L->c_end_obj[c]);
    PyMem_Free(L->c_start_obj);
    PyMem_Free(L->c_end_obj);
    PyMem_Free(L->c_started);
    PyMem_Free(L->c_ended);
    PyMem_Free(L->busy);
    PyMem_Free(L->sm_used);
    PyMem_Free(L->computing);
    PyMem_Free(L->running);
    if (L->coll_running)
        for (int r = 0; r < L->n_ranks; r++) PyMem_Free(L->coll_running[r].a);
    PyMem_Free(L->coll_running);
    PyMem_Free(L->mark);
    PyMem_Free(snapshot.a);
    snapshot.a = NULL;
    snapshot.n = snapshot.cap = 0;
}

#define ALLOC(p, n) \
    do { \
        (p) = PyMem_Calloc((size_t)(n) ? (size_t)(n) : 1, sizeof(*(p))); \
        if (!(p)) { PyErr_NoMemory(); goto fail; } \
    } while (0)

static PyObject *write_back(Loop *L) /* the collectives' times and participants; (now, late, busy, sm_used) */
{
    for (Py_ssize_t c = 0; c < L->n_coll; c++) {
        PyObject *co = L->coll[c];
        PyObject *v = PyLong_FromSsize_t(L->c_arrived[c]);
        if (!v || PyObject_SetAttrString(co, "arrived", v) < 0) { Py_XDECREF(v); return NULL; }
        Py_DECREF(v);
        if (L->c_started[c]) {
            v = shared_float(&L->c_start_obj[c], L->c_start[c]);
            if (!v || PyObject_SetAttrString(co, "start", v) < 0) { Py_XDECREF(v); return NULL; }
            Py_DECREF(v);
        }
        if (L->c_ended[c]) {
            v = shared_float(&L->c_end_obj[c], L->c_endt[c]);
            if (!v || PyObject_SetAttrString(co, "end", v) < 0) { Py_XDECREF(v); return NULL; }
            Py_DECREF(v);
        }
        if (L->track) {
            PyObject *ranks = PyObject_GetAttrString(co, "ranks");
            if (!ranks) return NULL;
            Py_ssize_t m = L->c_arrived[c] < L->c_n[c] ? L->c_arrived[c] : L->c_n[c];
            for (Py_ssize_t k = 0; k < m; k++) {
                PyObject *r = PyLong_FromLong(L->c_ranks[L->c_off[c] + k]);
                if (!r || PyList_Append(ranks, r) < 0) { Py_XDECREF(r); Py_DECREF(ranks); return NULL; }
                Py_DECREF(r);
            }
            Py_DECREF(ranks);
        }
        v = PyList_New(0);
        if (!v) return NULL;
        set_slot(co, L->c_done, v);
    }
    PyObject *busy = PyList_New(L->n_ranks), *sm = PyList_New(L->n_ranks);
    if (!busy || !sm) { Py_XDECREF(busy); Py_XDECREF(sm); return NULL; }
    for (int r = 0; r < L->n_ranks; r++) {
        PyObject *b = PyLong_FromLong(L->busy[r]), *u = PyFloat_FromDouble(L->sm_used[r]);
        if (!b || !u) { Py_XDECREF(b); Py_XDECREF(u); Py_DECREF(busy); Py_DECREF(sm); return NULL; }
        PyList_SET_ITEM(busy, r, b);
        PyList_SET_ITEM(sm, r, u);
    }
    return Py_BuildValue("(ddNN)", L->now, L->late, busy, sm);
}

/* run(streams, collectives, n_ranks, slow, comm_slow, ovl, comm_rate, max_sm_share, Op, Collective)
 * streams: [(ops list, rank, is_compute)] in start order (engine_fast's `order`) */
static PyObject *run(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *streams, *colls, *op_type, *coll_type;
    int n_ranks, slow, comm_slow;
    double ovl, comm_rate, max_sm;
    if (!PyArg_ParseTuple(args, "O!O!ippdddOO", &PyList_Type, &streams, &PyList_Type, &colls, &n_ranks, &slow,
                          &comm_slow, &ovl, &comm_rate, &max_sm, &op_type, &coll_type))
        return NULL;
    if (!PyType_Check(op_type) || !PyType_Check(coll_type)) {
        PyErr_SetString(PyExc_TypeError, "Op and Collective must be classes");
        return NULL;
    }
    if (n_ranks <= 0) {
        PyErr_SetString(PyExc_ValueError, "n_ranks must be positive");
        return NULL;
    }
    Loop LL;
    memset(&LL, 0, sizeof LL);
    Loop *L = &LL;
    L->free_node = -1;
    L->op_type = (PyTypeObject *)op_type;
    L->coll_type = (PyTypeObject *)coll_type;
    L->n_ranks = n_ranks;
    L->slow = slow;
    L->comm_slow = comm_slow;
    L->track = slow || comm_slow;
    L->ovl = ovl;
    L->comm_rate = comm_rate;
    L->max_sm = max_sm;
    PyObject *result = NULL;
    if ((L->o_start = slot_offset(op_type, "start")) < 0 || (L->o_end = slot_offset(op_type, "end")) < 0 ||
        (L->o_done = slot_offset(op_type, "done")) < 0 || (L->o_dur = slot_offset(op_type, "dur")) < 0 ||
        (L->o_coll = slot_offset(op_type, "coll")) < 0 || (L->o_deps = slot_offset(op_type, "deps")) < 0 ||
        (L->o_slowed = slot_offset(op_type, "slowed_s")) < 0 ||
        (L->c_done = slot_offset(coll_type, "done")) < 0)
        return NULL;

    /* collectives: index in each one's done slot, state in arrays */
    Py_ssize_t nc = PyList_GET_SIZE(colls);
    L->n_coll = nc;
    ALLOC(L->coll, nc); ALLOC(L->c_n, nc); ALLOC(L->c_arrived, nc); ALLOC(L->c_off, nc + 1);
    ALLOC(L->c_head, nc); ALLOC(L->c_tail, nc); ALLOC(L->c_cost, nc); ALLOC(L->c_sm, nc);
    ALLOC(L->c_start, nc); ALLOC(L->c_endt, nc); ALLOC(L->c_rem, nc); ALLOC(L->c_rate, nc);
    ALLOC(L->c_since, nc); ALLOC(L->c_ver, nc); ALLOC(L->c_started, nc); ALLOC(L->c_ended, nc);
    ALLOC(L->c_start_obj, nc); ALLOC(L->c_end_obj, nc);
    for (Py_ssize_t c = 0; c < nc; c++) {
        PyObject *co = PyList_GET_ITEM(colls, c);
        if (!PyObject_TypeCheck(co, L->coll_type)) {
            PyErr_SetString(PyExc_TypeError, "cluster.collectives holds something that is not a Collective");
            goto fail;
        }
        L->coll[c] = co;
        PyObject *v = PyObject_GetAttrString(co, "n");
        if (!v) goto fail;
        L->c_n[c] = PyLong_AsSsize_t(v);
        Py_DECREF(v);
        if (L->c_n[c] == -1 && PyErr_Occurred()) goto fail;
        v = PyObject_GetAttrString(co, "cost_s");
        if (!v) goto fail;
        int bad = as_double(v, &L->c_cost[c]);
        Py_DECREF(v);
        if (bad < 0) goto fail;
        v = PyObject_GetAttrString(co, "sm_share");
        if (!v) goto fail;
        bad = as_double(v, &L->c_sm[c]);
        Py_DECREF(v);
        if (bad < 0) goto fail;
        L->c_off[c + 1] = L->c_off[c] + (L->track ? L->c_n[c] : 0);
        L->c_head[c] = L->c_tail[c] = -1;
        v = PyLong_FromSsize_t(c);
        if (!v) goto fail;
        set_slot(co, L->c_done, v);
    }
    ALLOC(L->c_ranks, L->c_off[nc]);

    /* ranks */
    ALLOC(L->busy, n_ranks); ALLOC(L->sm_used, n_ranks); ALLOC(L->computing, n_ranks);
    ALLOC(L->running, n_ranks); ALLOC(L->coll_running, n_ranks); ALLOC(L->mark, n_ranks);

    /* streams, all ready in the given order */
    Py_ssize_t ns = PyList_GET_SIZE(streams);
    L->n_streams = ns;
    ALLOC(L->st, ns);
    L->rq_cap = 1024;
    while (L->rq_cap < ns + 1) L->rq_cap *= 2;
    ALLOC(L->rq, L->rq_cap);
    for (Py_ssize_t k = 0; k < ns; k++) {
        PyObject *t = PyList_GET_ITEM(streams, k);
        PyObject *ops;
        int rank, compute;
        if (!PyArg_ParseTuple(t, "O!ip", &PyList_Type, &ops, &rank, &compute)) goto fail;
        if (rank < 0 || rank >= n_ranks) {
            PyErr_Format(PyExc_ValueError, "stream of rank %d outside 0..%d", rank, n_ranks - 1);
            goto fail;
        }
        Stream *s = &L->st[k];
        s->ops = ops;
        s->n = PyList_GET_SIZE(ops);
        s->rank = rank;
        s->slow = (char)(compute && slow);
        s->comm_slow = (char)(compute && comm_slow);
        if (ready_push(L, k) < 0) goto fail;
    }
    /* the stream lists must not change size while the loop holds their items */
    if (main_loop(L) < 0) goto fail;
    result = write_back(L);
fail:
    loop_free(L);
    return result;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS, "Run a cluster's streams to completion (simulator.engine.engine_native.run_native)."},
    {"replay", replay, METH_VARARGS, "One rank's ops from a step template (engine_native_replay.h)."},
    {"phase_ends", phase_ends, METH_VARARGS, "Phase ends of a finished run (engine_native_measure.h)."},
    {"compute_gaps", compute_gaps, METH_VARARGS, "A compute stream's idle and NS time (engine_native_measure.h)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_engine_native", NULL, -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__engine_native(void) { return PyModule_Create(&module); }
