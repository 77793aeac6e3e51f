/* State of the compiled event loop (engine_native.c): the loop's record, its growable containers (the
 * ready queue, the timer heap, the chains of waiting streams) and direct access to the Python objects'
 * __slots__. See engine_native.c for the whole picture. */
#ifndef DMUON_ENGINE_NATIVE_STATE_H
#define DMUON_ENGINE_NATIVE_STATE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <stdint.h>
#include <limits.h>
#define FC_SIZE 4096 /* time floats remembered (engine_native.c: time_float) */
#define K_END 0
#define K_SLOW_END 1
#define K_COLL_END 2
#define K_COLL_SLOW 3

typedef struct { double t; long long seq; long long ver; Py_ssize_t obj; int kind; } Entry;

typedef struct {
    PyObject *ops; /* list of Op, borrowed from the argument */
    Py_ssize_t i, n, base; /* base: the number of its first op in the loop's op arrays */
    int rank;
    char arrived, slow, comm_slow, compute;
} Stream;

/* the running slowed compute op of a rank: engine_fast's st = [rem, rate, since, version, stream, op, end,
 * end's sequence number, live timer's time]; active: the op has not ended (st[5] is not None) */
typedef struct {
    double rem, rate, since, end, live;
    long long ver, endseq;
    Py_ssize_t stream;
    int active;
} Slow;

typedef struct { Py_ssize_t stream, next; } Node;

/* one op in the loop (64 bytes): duration, start, end, the last of the streams waiting on it (a chain of
 * nodes, -1: none), its dependencies (ndep op numbers: in `in` where they fit, most ops wait on one or two,
 * else dep[dep0 ..]), its collective's index (-1: compute), what of its times is set (O_*), which of the
 * metrics' phase ends it counts for (engine_native.c: `phase_ends_of`; -1: none) and its step */
#define R_INLINE 2
typedef struct {
    double dur, t0, t1;
    Py_ssize_t wait, dep0;
    int ndep, cix;
    int in[R_INLINE];
    char set, pk;
    int step;
} OpRec;

typedef struct { Py_ssize_t *a; Py_ssize_t n, cap; } IVec;

typedef struct {
    /* arguments */
    Py_ssize_t o_start, o_end, o_done, o_dur, o_coll, o_deps, o_slowed, c_done;
    PyTypeObject *op_type, *coll_type;
    int n_ranks, slow, comm_slow, track;
    double ovl, comm_rate, max_sm;
    /* clock */
    double now, late;
    long long seq;
    /* the ops, numbered stream after stream (engine_native.c: `number_ops`, `op_times`): each op's object,
     * what the loop reads and writes of it (one record: the fields of an op share its cache lines), its
     * slowdown, and the dependencies of all, as op numbers */
    Py_ssize_t n_ops;
    PyObject **o_obj;
    OpRec *rec;
    double *o_slow;
    int *dep;
    Py_ssize_t n_tagged; /* ops whose `done` slot holds their number (engine_native.c: untag) */
    Py_ssize_t o_step, o_phase; /* slot offsets, and the phase strings seen with their kinds (phase_kind) */
    PyObject *ph_obj[8];
    char ph_kind[8];
    int max_step, steps_ok; /* the largest step; 0 where some op's step is not an int in 0..2^31 */
    double *pe; /* the metrics' phase ends (engine_native.c: op_times) */
    PyObject **fc_obj; /* recent time floats (time_float) */
    uint64_t *fc_bits;
    /* streams and the ready queue (a ring of stream indices) */
    Stream *st;
    Py_ssize_t n_streams;
    Py_ssize_t *rq;
    Py_ssize_t rq_head, rq_len, rq_cap;
    /* timers */
    Entry *heap;
    Py_ssize_t hn, hcap;
    /* waiting streams */
    Node *nodes;
    Py_ssize_t n_nodes, nodes_cap, free_node;
    IVec scratch;
    /* collectives */
    PyObject **coll;
    Py_ssize_t n_coll;
    Py_ssize_t *c_n, *c_arrived, *c_off, *c_head, *c_tail;
    int *c_ranks;
    double *c_cost, *c_sm, *c_start, *c_endt, *c_rem, *c_rate, *c_since;
    long long *c_ver;
    char *c_started, *c_ended;
    PyObject **c_start_obj, **c_end_obj; /* per collective its start / end as one float its ops share */
    /* ranks */
    long *busy;
    double *sm_used;
    char *computing;
    Slow *running;
    IVec *coll_running;
    long *mark;
    long stamp;
} Loop;

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

static void set_slot(PyObject *o, Py_ssize_t off, PyObject *v) /* steals v */
{
    PyObject *old = SLOT(o, off);
    SLOT(o, off) = v;
    Py_XDECREF(old);
}

/* make room for one more element in a growable array *a of *cap elements of `size` bytes holding n:
 * doubled when full (first: `first` elements); -1 with MemoryError set when out of memory */
static int grow(void **a, Py_ssize_t *cap, Py_ssize_t n, size_t size, Py_ssize_t first)
{
    if (n < *cap) return 0;
    Py_ssize_t c = *cap ? 2 * *cap : first;
    void *p = PyMem_Realloc(*a, (size_t)c * size);
    if (!p) { PyErr_NoMemory(); return -1; }
    *a = p;
    *cap = c;
    return 0;
}

static int ivec_push(IVec *v, Py_ssize_t x)
{
    if (grow((void **)&v->a, &v->cap, v->n, sizeof(Py_ssize_t), 8) < 0) return -1;
    v->a[v->n++] = x;
    return 0;
}

static int as_double(PyObject *o, double *out)
{
    if (PyFloat_CheckExact(o)) { *out = PyFloat_AS_DOUBLE(o); return 0; }
    *out = PyFloat_AsDouble(o);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* new reference to a float equal to v, kept in *cell and shared while it holds v bit for bit: every
 * participant's op of a collective gets the same start and end objects (one float per collective instead
 * of two per op: ~3.7 M fewer allocations and frees at Kimi-K2-like, 4096 GPUs; values unchanged) */
static PyObject *shared_float(PyObject **cell, double v)
{
    if (*cell != NULL) {
        double have = PyFloat_AS_DOUBLE(*cell);
        if (memcmp(&have, &v, sizeof v) == 0) {
            Py_INCREF(*cell);
            return *cell;
        }
    }
    PyObject *f = PyFloat_FromDouble(v);
    if (!f) return NULL;
    Py_XSETREF(*cell, f);
    Py_INCREF(f);
    return f;
}

#define O_START 1 /* t0 holds the op's start */
#define O_END 2 /* t1 its end (a collective's op: both are its collective's) */
#define O_SLOWED 4 /* o_slow its slowdown */

/* ---- ready queue ------------------------------------------------------------------------------ */
static int ready_push(Loop *L, Py_ssize_t s)
{
    if (L->rq_len == L->rq_cap) {
        Py_ssize_t cap = L->rq_cap * 2;
        Py_ssize_t *a = PyMem_Malloc(cap * sizeof(Py_ssize_t));
        if (!a) { PyErr_NoMemory(); return -1; }
        for (Py_ssize_t k = 0; k < L->rq_len; k++) a[k] = L->rq[(L->rq_head + k) % L->rq_cap];
        PyMem_Free(L->rq);
        L->rq = a;
        L->rq_head = 0;
        L->rq_cap = cap;
    }
    L->rq[(L->rq_head + L->rq_len) % L->rq_cap] = s;
    L->rq_len++;
    return 0;
}

static Py_ssize_t ready_pop(Loop *L)
{
    Py_ssize_t s = L->rq[L->rq_head];
    L->rq_head = (L->rq_head + 1) % L->rq_cap;
    L->rq_len--;
    return s;
}

/* ---- timers: a binary heap ordered by (time, sequence); sequences are unique, so the pop order is
 * the one heapq gives for the same pushes ------------------------------------------------------- */
static inline int before(const Entry *a, const Entry *b)
{
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static int push(Loop *L, double t, long long seq, int kind, Py_ssize_t obj, long long ver)
{
    if (grow((void **)&L->heap, &L->hcap, L->hn, sizeof(Entry), 1024) < 0) return -1;
    Entry e = {t, seq, ver, obj, kind};
    Py_ssize_t k = L->hn++;
    while (k > 0) {
        Py_ssize_t p = (k - 1) >> 1;
        if (!before(&e, &L->heap[p])) break;
        L->heap[k] = L->heap[p];
        k = p;
    }
    L->heap[k] = e;
    return 0;
}

static Entry pop(Loop *L)
{
    Entry top = L->heap[0];
    Entry last = L->heap[--L->hn];
    Py_ssize_t k = 0, n = L->hn;
    for (;;) {
        Py_ssize_t c = 2 * k + 1;
        if (c >= n) break;
        if (c + 1 < n && before(&L->heap[c + 1], &L->heap[c])) c++;
        if (!before(&L->heap[c], &last)) break;
        L->heap[k] = L->heap[c];
        k = c;
    }
    if (n > 0) L->heap[k] = last;
    return top;
}

/* ---- waiting streams ------------------------------------------------------------------------- */
static Py_ssize_t new_node(Loop *L, Py_ssize_t stream, Py_ssize_t next)
{
    Py_ssize_t k;
    if (L->free_node >= 0) {
        k = L->free_node;
        L->free_node = L->nodes[k].next;
    } else {
        if (grow((void **)&L->nodes, &L->nodes_cap, L->n_nodes, sizeof(Node), 4096) < 0) return -1;
        k = L->n_nodes++;
    }
    L->nodes[k].stream = stream;
    L->nodes[k].next = next;
    return k;
}

static int op_wait(Loop *L, Py_ssize_t g, Py_ssize_t s) /* op.done.append(s) */
{
    Py_ssize_t k = new_node(L, s, L->rec[g].wait); /* chained backwards: next = the previous waiter */
    if (k < 0) return -1;
    L->rec[g].wait = k;
    return 0;
}

static int op_release(Loop *L, Py_ssize_t g) /* ready.extend(op.done); op.done = None */
{
    Py_ssize_t k = L->rec[g].wait;
    if (k < 0) return 0;
    L->rec[g].wait = -1;
    L->scratch.n = 0;
    while (k >= 0) {
        if (ivec_push(&L->scratch, k) < 0) return -1;
        k = L->nodes[k].next;
    }
    for (Py_ssize_t j = L->scratch.n - 1; j >= 0; j--) { /* first waiter first */
        Py_ssize_t nd = L->scratch.a[j];
        if (ready_push(L, L->nodes[nd].stream) < 0) return -1;
        L->nodes[nd].next = L->free_node;
        L->free_node = nd;
    }
    return 0;
}

static int coll_wait(Loop *L, Py_ssize_t c, Py_ssize_t s) /* c.done.append(s) */
{
    Py_ssize_t k = new_node(L, s, -1);
    if (k < 0) return -1;
    if (L->c_tail[c] >= 0) L->nodes[L->c_tail[c]].next = k;
    else L->c_head[c] = k;
    L->c_tail[c] = k;
    return 0;
}

static int coll_release(Loop *L, Py_ssize_t c) /* ready.extend(c.done); c.done = [] */
{
    Py_ssize_t k = L->c_head[c];
    while (k >= 0) {
        Py_ssize_t next = L->nodes[k].next;
        if (ready_push(L, L->nodes[k].stream) < 0) return -1;
        L->nodes[k].next = L->free_node;
        L->free_node = k;
        k = next;
    }
    L->c_head[c] = L->c_tail[c] = -1;
    return 0;
}

static Py_ssize_t coll_index(Loop *L, PyObject *c)
{
    if (!PyObject_TypeCheck(c, L->coll_type)) {
        PyErr_SetString(PyExc_TypeError, "an op's coll is not a simulator.engine.engine.Collective");
        return -1;
    }
    PyObject *d = SLOT(c, L->c_done);
    if (d == NULL || !PyLong_CheckExact(d)) {
        PyErr_SetString(PyExc_ValueError, "an op's collective is not in its cluster's collectives");
        return -1;
    }
    return PyLong_AsSsize_t(d);
}

/* ---- rates ------------------------------------------------------------------------------------- */
#endif
