/* The event loop of simulator/engine/engine_fast.py in C: the same model, the same arithmetic in the same order
 * (compiled with -ffp-contract=off), the same (time, sequence) order of timers, so every op gets the same
 * start, end and slowdown, bit for bit (tests/test_sim_engine_fast.py checks both loops against the SimPy
 * reference, tests/test_sim_engine_native.py this one against engine_fast on larger programs). Read
 * engine_fast.py first: every function is named after its counterpart. engine_native_state.h holds the
 * state and its containers, engine_native_loop.h the model; this file takes the arguments and writes the
 * results back.
 *
 * What differs is only where the loop's state lives. The ops and collectives stay the Python objects the
 * step programs built; before the loop, one pass in memory order copies what it reads of every op (duration,
 * collective, dependencies as op numbers) into C arrays (`number_ops`), the loop runs on those (its misses
 * on ~10^6 scattered objects in event order were most of its time), and one pass writes the times back into
 * the ops' __slots__ (`op_times`, through the member descriptors' offsets), with the same values. The
 * streams, the ready queue, the timer heap, the collectives' running state and the lists of waiting streams
 * are C arrays too. A waiting list of an op is a chain of nodes whose last index is kept per op (`OpRec.wait`).
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
    PyMem_Free(L->o_obj);
    PyMem_Free(L->rec);
    PyMem_Free(L->pe);
    PyMem_Free(L->o_slow);
    PyMem_Free(L->dep);
    if (L->fc_obj)
        for (Py_ssize_t k = 0; k < FC_SIZE; k++) Py_XDECREF(L->fc_obj[k]);
    PyMem_Free(L->fc_obj);
    PyMem_Free(L->fc_bits);
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

/* ---- the ops as arrays ------------------------------------------------------------------------------
 * Each op's number is kept in its `done` slot while `number_ops` resolves the dependencies, as a tagged
 * integer (2 g + 1: never an object's address); `done` is None before a run (checked) and again after
 * (`untag`). The garbage collector is off meanwhile (`run`): it would read the slot as an object, and no
 * Python code runs in between. */
#define TAG(g) ((PyObject *)(((uintptr_t)(g) << 1) | 1))
#define IS_TAG(o) (((uintptr_t)(o)) & 1)
#define UNTAG(o) ((Py_ssize_t)(((uintptr_t)(o)) >> 1))

static void untag(Loop *L)
{
    for (Py_ssize_t g = 0; g < L->n_tagged; g++) SLOT(L->o_obj[g], L->o_done) = Py_None; /* never DECREF'd */
    L->n_tagged = 0;
}

/* which of the metrics' phase ends op counts for (engine_native_measure.h: phase_slot) and its step; the
 * phase strings are classified once per distinct object */
static void phase_kind(Loop *L, PyObject *op, OpRec *o, int compute)
{
    PyObject *so = SLOT(op, L->o_step), *ph = SLOT(op, L->o_phase);
    long s = -1;
    if (so && PyLong_CheckExact(so)) {
        int over;
        s = PyLong_AsLongAndOverflow(so, &over);
        if (over || (s == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            s = -1;
        }
    }
    if (s < 0 || s >= INT_MAX) { /* the metrics' own scans then (engine_native_measure.h) */
        L->steps_ok = 0;
        s = 0;
    }
    o->step = (int)s;
    if (s > L->max_step) L->max_step = (int)s;
    int j = 0;
    while (j < 8 && L->ph_obj[j] != NULL && L->ph_obj[j] != ph) j++;
    char k;
    if (j < 8 && L->ph_obj[j] == ph) {
        k = L->ph_kind[j];
    } else {
        k = (char)phase_class(ph);
        if (j < 8) { /* borrowed: its ops hold it until the run ends */
            L->ph_obj[j] = ph;
            L->ph_kind[j] = k;
        }
    }
    o->pk = (char)phase_slot(k, compute);
}

static int number_ops(Loop *L)
{
    Py_ssize_t n = 0;
    for (Py_ssize_t k = 0; k < L->n_streams; k++) {
        L->st[k].base = n;
        n += L->st[k].n;
    }
    if (n >= INT_MAX) {
        PyErr_SetString(PyExc_OverflowError, "more ops than the compiled loop numbers (2^31)");
        return -1;
    }
    L->n_ops = n;
#define OALLOC(p, m) \
    do { \
        (p) = PyMem_Calloc((size_t)(m) ? (size_t)(m) : 1, sizeof(*(p))); \
        if (!(p)) { PyErr_NoMemory(); return -1; } \
    } while (0)
    OALLOC(L->o_obj, n); OALLOC(L->rec, n); OALLOC(L->o_slow, n);
    OALLOC(L->fc_obj, FC_SIZE); OALLOC(L->fc_bits, FC_SIZE);
    for (Py_ssize_t k = 0; k < L->n_streams; k++) {
        Stream *s = &L->st[k];
        for (Py_ssize_t i = 0; i < s->n; i++) {
            PyObject *op = PyList_GET_ITEM(s->ops, i);
            if (!PyObject_TypeCheck(op, L->op_type)) {
                PyErr_SetString(PyExc_TypeError, "a stream holds something that is not a simulator.engine.engine.Op");
                return -1;
            }
            if (SLOT(op, L->o_done) != Py_None) {
                PyErr_SetString(PyExc_ValueError, "an op is in two streams, or ran before (Cluster.clear_times)");
                return -1;
            }
            Py_ssize_t g = s->base + i;
            L->o_obj[g] = op;
            SLOT(op, L->o_done) = TAG(g); /* None's reference is kept for `untag` */
            L->n_tagged = g + 1;
            L->rec[g].wait = -1;
        }
    }
    Py_ssize_t cap = 0, nd = 0;
    for (Py_ssize_t g = 0, sk = 0; g < n; g++) {
        while (g >= L->st[sk].base + L->st[sk].n) sk++; /* the stream of op g */
        PyObject *op = L->o_obj[g];
        PyObject *deps = SLOT(op, L->o_deps);
        if (!PyTuple_Check(deps) && !PyList_Check(deps)) {
            PyErr_SetString(PyExc_TypeError, "an op's deps must be a tuple or list of ops");
            return -1;
        }
        Py_ssize_t m = PySequence_Fast_GET_SIZE(deps);
        PyObject **items = PySequence_Fast_ITEMS(deps);
        if (m >= INT_MAX) {
            PyErr_SetString(PyExc_OverflowError, "an op with more dependencies than the compiled loop counts");
            return -1;
        }
        int *to = L->rec[g].in;
        if (m > R_INLINE) {
            while (nd + m >= cap)
                if (grow((void **)&L->dep, &cap, nd + m, sizeof(int), 1 << 16) < 0) return -1;
            L->rec[g].dep0 = nd;
            to = L->dep + nd;
            nd += m;
        }
        L->rec[g].ndep = (int)m;
        for (Py_ssize_t k = 0; k < m; k++) {
            PyObject *d = items[k];
            if (!PyObject_TypeCheck(d, L->op_type)) {
                PyErr_SetString(PyExc_TypeError, "an op depends on something that is not a simulator.engine.engine.Op");
                return -1;
            }
            PyObject *t = SLOT(d, L->o_done);
            if (!IS_TAG(t)) {
                PyErr_SetString(PyExc_ValueError, "an op depends on an op in none of the cluster's streams");
                return -1;
            }
            to[k] = (int)UNTAG(t);
        }
        phase_kind(L, op, &L->rec[g], L->st[sk].compute);
        PyObject *co = SLOT(op, L->o_coll);
        if (co == Py_None) {
            L->rec[g].cix = -1;
            if (as_double(SLOT(op, L->o_dur), &L->rec[g].dur) < 0) return -1;
        } else {
            Py_ssize_t c = coll_index(L, co);
            if (c < 0) return -1;
            L->rec[g].cix = (int)c;
        }
    }
    return 0;
}

/* new reference to a float equal to v: the last one made for v's slot in a small table (ops that start or end
 * at the same time share one object, as the loop's clock float was shared) */
static PyObject *time_float(Loop *L, double v)
{
    uint64_t b;
    memcpy(&b, &v, sizeof b);
    size_t h = (size_t)((b * 0x9E3779B97F4A7C15ULL) >> 52) & (FC_SIZE - 1);
    PyObject *f = L->fc_obj[h];
    if (f == NULL || L->fc_bits[h] != b) {
        f = PyFloat_FromDouble(v);
        if (!f) return NULL;
        Py_XSETREF(L->fc_obj[h], f);
        L->fc_bits[h] = b;
    }
    Py_INCREF(f);
    return f;
}

/* every op's start, end and slowdown, from the arrays; and the metrics' phase ends per step (`pe`: forward,
 * backward, optimizer, backward communication; simulator.engine.metrics._phase_ends' maxima of the same ends),
 * where every op's step is an int in 0..PE_STEPS - 1 (else `measure` scans the ops itself) */
#define PE_STEPS 65536
static int op_times(Loop *L)
{
    Py_ssize_t ns = L->max_step + 1;
    if (L->steps_ok && ns > 0 && ns <= PE_STEPS) {
        L->pe = PyMem_Calloc(4 * ns, sizeof(double));
        if (!L->pe) { PyErr_NoMemory(); return -1; }
    }
    for (Py_ssize_t g = 0; g < L->n_ops; g++) {
        char set = L->rec[g].set;
        if (!set) continue;
        PyObject *op = L->o_obj[g], *a, *b;
        int c = L->rec[g].cix;
        if (c >= 0) {
            a = shared_float(&L->c_start_obj[c], L->c_start[c]);
            b = a ? shared_float(&L->c_end_obj[c], L->c_endt[c]) : NULL;
        } else {
            a = (set & O_START) ? time_float(L, L->rec[g].t0) : Py_NewRef(Py_None);
            b = !a ? NULL : (set & O_END) ? time_float(L, L->rec[g].t1) : Py_NewRef(Py_None);
        }
        if (!a || !b) { Py_XDECREF(a); return -1; }
        set_slot(op, L->o_start, a);
        set_slot(op, L->o_end, b);
        if (L->pe && (set & O_END) && L->rec[g].pk >= 0) {
            double ev = c >= 0 ? L->c_endt[c] : L->rec[g].t1, *best = &L->pe[L->rec[g].pk * ns + L->rec[g].step];
            if (ev > *best) *best = ev;
        }
        if (set & O_SLOWED) {
            PyObject *sl = PyFloat_FromDouble(L->o_slow[g]);
            if (!sl) return -1;
            set_slot(op, L->o_slowed, sl);
        }
    }
    return 0;
}

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
    PyObject *pe = Py_NewRef(Py_None);
    if (L->pe) { /* ([forward], [backward], [optimizer], [backward communication]) per step 0..max_step */
        Py_ssize_t ns = L->max_step + 1;
        Py_SETREF(pe, PyTuple_New(4));
        for (int k = 0; pe && k < 4; k++) {
            PyObject *l = PyList_New(ns);
            if (!l) { Py_CLEAR(pe); break; }
            PyTuple_SET_ITEM(pe, k, l);
            for (Py_ssize_t s = 0; s < ns; s++) {
                PyObject *f = PyFloat_FromDouble(L->pe[k * ns + s]);
                if (!f) { Py_CLEAR(pe); break; }
                PyList_SET_ITEM(l, s, f);
            }
        }
        if (!pe) { Py_DECREF(busy); Py_DECREF(sm); return NULL; }
    }
    return Py_BuildValue("(ddNNN)", L->now, L->late, busy, sm, pe);
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
    L->max_step = -1;
    L->steps_ok = 1;
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
        (L->o_step = slot_offset(op_type, "step")) < 0 || (L->o_phase = slot_offset(op_type, "phase")) < 0 ||
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
        s->compute = (char)compute;
        if (ready_push(L, k) < 0) goto fail;
    }
    /* the stream lists must not change size while the loop holds their items */
    int gc_was = PyGC_Disable(); /* while ops are tagged (number_ops) */
    if (number_ops(L) == 0 && main_loop(L) == 0) {
        untag(L);
        if (op_times(L) == 0) result = write_back(L);
    }
    untag(L);
    if (gc_was) PyGC_Enable();
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
