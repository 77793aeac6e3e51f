/* The two scans of simulator/engine/metrics.py (`measure`) over a finished run's ops in C, with the same
 * comparisons and the same float arithmetic in the same order (tests/test_sim_symmetry_replay.py compares
 * both on every op). Why: they read every op of every simulated rank (~2.6 M at Kimi-K2-like, 4096 GPUs:
 * 0.8 s of interpreter time). After a run of the compiled loop `measure` takes the phase ends it gave
 * (`Cluster.phase_ends`, engine_native.c: op_times) and `phase_ends` here serves the other runs. Times must be Python floats (or None where an op did not run) and the queues
 * hold `Op`s; on anything else both functions return None and `measure` runs its Python loops.
 *
 * phase_ends(op_type, queues, step) -> (fwd_end, bwd_end, opt_end, grad_end) or None
 *   queues: [(ops, is_compute_stream)]; per step 0..step the latest end of: forward compute ops, backward
 *   compute ops, optimizer ops (any stream), backward ops of the other streams; 0.0 where none.
 * compute_gaps(op_type, ops, t0, t1, step) -> (waited, busy) or None
 *   over one rank's compute stream: its idle gaps before ops starting in (t0, t1], and the time of its
 *   "batch*" / "ns*" ops of step `step`. */
#ifndef DMUON_ENGINE_NATIVE_MEASURE_H
#define DMUON_ENGINE_NATIVE_MEASURE_H

static Py_ssize_t slot_offset(PyObject *type, const char *name);

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

static int phase_is(PyObject *ph, const char *want)
{
    return PyUnicode_Check(ph) && PyUnicode_CompareWithASCIIString(ph, want) == 0;
}

/* the metrics' phase of an op (simulator.engine.metrics._phase_ends): its phase string's class (0 fwd,
 * 1 bwd, 2 opt, -1 other), then the phase end it counts for on a compute stream or not (0 forward compute,
 * 1 backward compute, 2 optimizer on any stream, 3 backward on another stream, -1 none); the compiled loop
 * (engine_native.c: phase_kind) and `phase_ends` below both classify with these */
static int phase_class(PyObject *ph)
{
    return !ph ? -1 : phase_is(ph, "opt") ? 2 : phase_is(ph, "fwd") ? 0 : phase_is(ph, "bwd") ? 1 : -1;
}

static int phase_slot(int cls, int compute)
{
    return cls == 2 ? 2 : cls < 0 ? -1 : compute ? cls : cls == 1 ? 3 : -1;
}

static PyObject *phase_ends(PyObject *self, PyObject *args)
{
    PyObject *op_type, *queues;
    long step;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!l", &PyType_Type, &op_type, &PyList_Type, &queues, &step)) return NULL;
    Py_ssize_t o_step = slot_offset(op_type, "step"), o_end = slot_offset(op_type, "end");
    Py_ssize_t o_phase = slot_offset(op_type, "phase");
    if (o_step < 0 || o_end < 0 || o_phase < 0) return NULL;
    if (step < 0) {
        PyErr_SetString(PyExc_ValueError, "phase_ends: step must be >= 0");
        return NULL;
    }
    Py_ssize_t n = step + 1;
    PyObject *zero = PyFloat_FromDouble(0.0);
    if (!zero) return NULL;
    PyObject **best = PyMem_Calloc(4 * n, sizeof(PyObject *)); /* fwd, bwd, opt, grad per step */
    double *val = PyMem_Calloc(4 * n, sizeof(double));
    PyObject *out = NULL;
    if (!best || !val) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t k = 0; k < 4 * n; k++) best[k] = zero;
    for (Py_ssize_t q = 0; q < PyList_GET_SIZE(queues); q++) {
        PyObject *ops, *t = PyList_GET_ITEM(queues, q);
        int compute;
        if (!PyArg_ParseTuple(t, "O!p", &PyList_Type, &ops, &compute)) goto done;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ops); i++) {
            PyObject *op = PyList_GET_ITEM(ops, i);
            if (Py_TYPE(op) != (PyTypeObject *)op_type) goto python;
            PyObject *so = SLOT(op, o_step), *e = SLOT(op, o_end), *ph = SLOT(op, o_phase);
            if (!so || !e || !ph || !PyLong_CheckExact(so)) goto python;
            long s = PyLong_AsLong(so);
            if (s == -1 && PyErr_Occurred()) goto done;
            if (s > step || e == Py_None) continue;
            if (s < 0 || !PyFloat_CheckExact(e)) goto python;
            double ev = PyFloat_AS_DOUBLE(e);
            int k = phase_slot(phase_class(ph), compute);
            if (k >= 0 && ev > val[k * n + s]) {
                val[k * n + s] = ev;
                best[k * n + s] = e;
            }
        }
    }
    out = PyTuple_New(4);
    if (!out) goto done;
    for (int k = 0; k < 4; k++) {
        PyObject *l = PyList_New(n);
        if (!l) {
            Py_CLEAR(out);
            goto done;
        }
        for (Py_ssize_t s = 0; s < n; s++) {
            Py_INCREF(best[k * n + s]);
            PyList_SET_ITEM(l, s, best[k * n + s]);
        }
        PyTuple_SET_ITEM(out, k, l);
    }
    goto done;
python:
    out = Py_None;
    Py_INCREF(out);
done:
    PyMem_Free(best);
    PyMem_Free(val);
    Py_DECREF(zero);
    return out;
}

static PyObject *compute_gaps(PyObject *self, PyObject *args)
{
    PyObject *op_type, *ops, *out = NULL;
    double t0, t1;
    long step;
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!ddl", &PyType_Type, &op_type, &PyList_Type, &ops, &t0, &t1, &step))
        return NULL;
    Py_ssize_t o_step = slot_offset(op_type, "step"), o_end = slot_offset(op_type, "end");
    Py_ssize_t o_start = slot_offset(op_type, "start"), o_name = slot_offset(op_type, "name");
    if (o_step < 0 || o_end < 0 || o_start < 0 || o_name < 0) return NULL;
    PyObject *batch = PyUnicode_FromString("batch"), *ns = PyUnicode_FromString("ns");
    if (!batch || !ns) goto done;
    double waited = 0.0, busy = 0.0, prev_end = 0.0;
    int have_prev = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(ops); i++) {
        PyObject *op = PyList_GET_ITEM(ops, i);
        if (Py_TYPE(op) != (PyTypeObject *)op_type) goto python;
        PyObject *st = SLOT(op, o_start), *e = SLOT(op, o_end), *so = SLOT(op, o_step), *nm = SLOT(op, o_name);
        if (!st || !e || !so || !nm) goto python;
        if (st == Py_None) continue;
        if (!PyFloat_CheckExact(st) || !PyFloat_CheckExact(e) || !PyLong_CheckExact(so) || !PyUnicode_Check(nm))
            goto python;
        double start = PyFloat_AS_DOUBLE(st), end = PyFloat_AS_DOUBLE(e);
        if (have_prev && start > prev_end && t0 < start && start <= t1)
            waited += start - (t0 > prev_end ? t0 : prev_end); /* max(prev_end, t0), as Python picks it */
        long s = PyLong_AsLong(so);
        if (s == -1 && PyErr_Occurred()) goto done;
        if (s == step) {
            Py_ssize_t m = PyUnicode_Tailmatch(nm, batch, 0, PY_SSIZE_T_MAX, -1);
            if (m == 0) m = PyUnicode_Tailmatch(nm, ns, 0, PY_SSIZE_T_MAX, -1);
            if (m < 0) goto done;
            if (m) busy += end - start;
        }
        prev_end = end;
        have_prev = 1;
    }
    out = Py_BuildValue("dd", waited, busy);
    goto done;
python:
    out = Py_None;
    Py_INCREF(out);
done:
    Py_XDECREF(batch);
    Py_XDECREF(ns);
    return out;
}

#endif
