/* A template replay in C (simulator/programs/step_template.py, `TemplatePrograms._replay`): the ops of one
 * rank's forward and backward created from a recorded template, with the same fields, dependencies and
 * order as the Python loop there creates them (tests/test_sim_symmetry_replay.py compares both). Why: a
 * replayed op cost ~1 us of interpreter time (a 9-field tuple unpacked, its dependencies looked up, an
 * `Op(...)` call with twelve slot stores); Kimi-K2-like at 4096 GPUs replays ~2.4 M of them.
 *
 * replay(op_type, seq, rank, names, crefs, by_inst, ex, nflat, sizes) -> (flat, lists) or None
 *   seq     [(fi, si, pos, name, phase, step, dur, ci, refs)]: the template's ops in creation order (index
 *           in the record, stream index, position on the stream, the Op fields, index of its collective in
 *           crefs[si] (-1: a compute op), dependency references: >= 0 an op of the record, < 0 a placeholder)
 *   crefs   per stream its collectives as (group index, key id)
 *   by_inst per group index the rank's instance's collectives {key id: collective}; None is returned
 *           where one is missing (`_replay` creates them first; where it cannot, it builds the rank's step
 *           by the step logic)
 *   ex      placeholder reference -> tuple of this rank's ops it stands for
 *   sizes   per stream its op count; returns flat (nflat ops by record index) and per stream its ops.
 * An op whose dependency is created after it (it lay before it in memory) gets its dependencies once all
 * ops exist, as the Python loop's `late` list does. Values are shared, not copied (ints, floats and
 * strings are immutable): the same objects the Python loop would store. */
#ifndef DMUON_ENGINE_NATIVE_REPLAY_H
#define DMUON_ENGINE_NATIVE_REPLAY_H

#define R_NSLOTS 12
#define R_MEMO 64 /* reference tuples remembered (a direct-mapped table by address) */
static const char *R_SLOTS[R_NSLOTS] = {"rank", "stream", "name", "phase", "step", "dur", "coll", "deps",
                                        "start", "end", "done", "slowed_s"};

static Py_ssize_t slot_offset(PyObject *type, const char *name);

static void put(PyObject *o, Py_ssize_t off, PyObject *v) /* a fresh object's empty slot; borrows v */
{
    Py_INCREF(v);
    *(PyObject **)((char *)o + off) = v;
}

/* the dependency tuple of refs, or NULL with *late = 1 where a referenced op is not created yet */
static PyObject *replay_deps(PyObject *refs, PyObject *flat, PyObject *ex, int *late)
{
    Py_ssize_t nr = PyTuple_GET_SIZE(refs), total = 0;
    for (Py_ssize_t j = 0; j < nr; j++) {
        PyObject *ref = PyTuple_GET_ITEM(refs, j);
        Py_ssize_t i = PyLong_AsSsize_t(ref);
        if (i == -1 && PyErr_Occurred()) return NULL;
        if (i < 0) {
            PyObject *e = PyDict_GetItemWithError(ex, ref);
            if (!e) {
                if (!PyErr_Occurred()) PyErr_Format(PyExc_KeyError, "placeholder %zd", i);
                return NULL;
            }
            if (!PyTuple_Check(e)) {
                PyErr_SetString(PyExc_TypeError, "a placeholder's ops must be a tuple");
                return NULL;
            }
            total += PyTuple_GET_SIZE(e);
        } else {
            if (i >= PyList_GET_SIZE(flat)) {
                PyErr_Format(PyExc_IndexError, "dependency %zd outside the template", i);
                return NULL;
            }
            if (PyList_GET_ITEM(flat, i) == NULL) {
                *late = 1;
                return NULL;
            }
            total += 1;
        }
    }
    PyObject *deps = PyTuple_New(total);
    if (!deps) return NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t j = 0; j < nr; j++) {
        PyObject *ref = PyTuple_GET_ITEM(refs, j);
        Py_ssize_t i = PyLong_AsSsize_t(ref);
        if (i < 0) {
            PyObject *e = PyDict_GetItemWithError(ex, ref);
            for (Py_ssize_t m = 0; m < PyTuple_GET_SIZE(e); m++) {
                PyObject *d = PyTuple_GET_ITEM(e, m);
                Py_INCREF(d);
                PyTuple_SET_ITEM(deps, k++, d);
            }
        } else {
            PyObject *d = PyList_GET_ITEM(flat, i);
            Py_INCREF(d);
            PyTuple_SET_ITEM(deps, k++, d);
        }
    }
    return deps;
}

static PyObject *replay(PyObject *self, PyObject *args)
{
    PyObject *op_type, *seq, *rank, *names, *crefs, *by_inst, *ex, *sizes;
    Py_ssize_t nflat, off[R_NSLOTS];
    (void)self;
    if (!PyArg_ParseTuple(args, "O!O!OO!O!O!O!nO!", &PyType_Type, &op_type, &PyList_Type, &seq, &rank,
                          &PyList_Type, &names, &PyList_Type, &crefs, &PyList_Type, &by_inst, &PyDict_Type,
                          &ex, &nflat, &PyList_Type, &sizes))
        return NULL;
    for (int k = 0; k < R_NSLOTS; k++)
        if ((off[k] = slot_offset(op_type, R_SLOTS[k])) < 0) return NULL;
    Py_ssize_t ns = PyList_GET_SIZE(names);
    if (PyList_GET_SIZE(crefs) != ns || PyList_GET_SIZE(sizes) != ns || nflat < 0) {
        PyErr_SetString(PyExc_ValueError, "replay: names, crefs and sizes must have one item per stream");
        return NULL;
    }
    PyTypeObject *tp = (PyTypeObject *)op_type;
    PyObject *flat = PyList_New(nflat), *lists = PyList_New(ns), *late = NULL, *zero = NULL;
    if (!flat || !lists) goto fail;
    for (Py_ssize_t s = 0; s < ns; s++) {
        Py_ssize_t n = PyLong_AsSsize_t(PyList_GET_ITEM(sizes, s));
        if (n < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "replay: a negative stream size");
            goto fail;
        }
        PyObject *l = PyList_New(n);
        if (!l) goto fail;
        PyList_SET_ITEM(lists, s, l);
    }
    if (!(late = PyList_New(0)) || !(zero = PyFloat_FromDouble(0.0))) goto fail;
    Py_ssize_t nseq = PyList_GET_SIZE(seq);
    /* ops whose reference tuples are one object (`TemplatePrograms._template` makes equal ones one) share
     * one dependency tuple (equal, immutable): ~23% of a Kimi-K2-like replay's ops at 4096 GPUs */
    PyObject *memo_refs[R_MEMO] = {NULL}, *memo_deps[R_MEMO] = {NULL};
    for (Py_ssize_t q = 0; q < nseq; q++) {
        PyObject *t = PyList_GET_ITEM(seq, q);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 9) {
            PyErr_SetString(PyExc_TypeError, "replay: a template op must be a 9-tuple");
            goto fail;
        }
        Py_ssize_t fi = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 0)), si = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 1));
        Py_ssize_t pos = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 2)), ci = PyLong_AsSsize_t(PyTuple_GET_ITEM(t, 7));
        if (PyErr_Occurred()) goto fail;
        if (fi < 0 || fi >= nflat || si < 0 || si >= ns || PyList_GET_ITEM(flat, fi) != NULL) {
            PyErr_SetString(PyExc_IndexError, "replay: a template op outside its record or twice in it");
            goto fail;
        }
        PyObject *stream_ops = PyList_GET_ITEM(lists, si), *cs = PyList_GET_ITEM(crefs, si);
        if (pos < 0 || pos >= PyList_GET_SIZE(stream_ops) || PyList_GET_ITEM(stream_ops, pos) != NULL ||
            !PyList_Check(cs) || ci < -1 || ci >= PyList_GET_SIZE(cs)) {
            PyErr_SetString(PyExc_IndexError, "replay: a template op's position or collective out of range");
            goto fail;
        }
        PyObject *coll = Py_None;
        if (ci >= 0) {
            PyObject *cr = PyList_GET_ITEM(cs, ci), *inst;
            Py_ssize_t gi;
            if (!PyTuple_Check(cr) || PyTuple_GET_SIZE(cr) != 2 ||
                ((gi = PyLong_AsSsize_t(PyTuple_GET_ITEM(cr, 0))) == -1 && PyErr_Occurred()) ||
                gi < 0 || gi >= PyList_GET_SIZE(by_inst) || !PyDict_Check(inst = PyList_GET_ITEM(by_inst, gi))) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_IndexError, "replay: a collective reference outside by_inst");
                goto fail;
            }
            coll = PyDict_GetItemWithError(inst, PyTuple_GET_ITEM(cr, 1));
            if (!coll) {
                if (PyErr_Occurred()) goto fail;
                goto missing; /* this rank's instance lacks it: no replay */
            }
        }
        PyObject *refs = PyTuple_GET_ITEM(t, 8);
        if (!PyTuple_Check(refs)) {
            PyErr_SetString(PyExc_TypeError, "replay: dependency references must be a tuple");
            goto fail;
        }
        int is_late = 0;
        PyObject *deps;
        size_t h = ((size_t)refs >> 4) & (R_MEMO - 1);
        if (memo_refs[h] == refs && PyTuple_GET_SIZE(refs) > 0) { /* the same references: one tuple */
            deps = memo_deps[h];
            Py_INCREF(deps);
        } else {
            deps = replay_deps(refs, flat, ex, &is_late);
            if (!deps && !is_late) goto fail;
            if (deps) { /* borrowed: the op made below holds it until the replay returns */
                memo_refs[h] = refs;
                memo_deps[h] = deps;
            }
        }
        PyObject *o = tp->tp_alloc(tp, 0);
        if (!o) {
            Py_XDECREF(deps);
            goto fail;
        }
        put(o, off[0], rank);
        put(o, off[1], PyList_GET_ITEM(names, si));
        put(o, off[2], PyTuple_GET_ITEM(t, 3));
        put(o, off[3], PyTuple_GET_ITEM(t, 4));
        put(o, off[4], PyTuple_GET_ITEM(t, 5));
        put(o, off[5], PyTuple_GET_ITEM(t, 6));
        put(o, off[6], coll);
        put(o, off[8], Py_None);
        put(o, off[9], Py_None);
        put(o, off[10], Py_None);
        put(o, off[11], zero);
        if (deps) {
            *(PyObject **)((char *)o + off[7]) = deps; /* steals */
        } else {
            PyObject *pair = PyTuple_Pack(2, PyTuple_GET_ITEM(t, 0), refs);
            if (!pair || PyList_Append(late, pair) < 0) {
                Py_XDECREF(pair);
                Py_DECREF(o);
                goto fail;
            }
            Py_DECREF(pair);
        }
        Py_INCREF(o);
        PyList_SET_ITEM(stream_ops, pos, o);
        PyList_SET_ITEM(flat, fi, o);
    }
    for (Py_ssize_t q = 0; q < PyList_GET_SIZE(late); q++) {
        PyObject *pair = PyList_GET_ITEM(late, q);
        Py_ssize_t fi = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
        int is_late = 0;
        PyObject *deps = replay_deps(PyTuple_GET_ITEM(pair, 1), flat, ex, &is_late);
        if (!deps) {
            if (is_late) PyErr_SetString(PyExc_ValueError, "replay: a dependency on an op the template lacks");
            goto fail;
        }
        *(PyObject **)((char *)PyList_GET_ITEM(flat, fi) + off[7]) = deps;
    }
    for (Py_ssize_t i = 0; i < nflat; i++)
        if (PyList_GET_ITEM(flat, i) == NULL) {
            PyErr_SetString(PyExc_ValueError, "replay: the template does not create every op of its record");
            goto fail;
        }
    for (Py_ssize_t s = 0; s < ns; s++) {
        PyObject *l = PyList_GET_ITEM(lists, s);
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(l); i++)
            if (PyList_GET_ITEM(l, i) == NULL) {
                PyErr_SetString(PyExc_ValueError, "replay: a stream position the template leaves empty");
                goto fail;
            }
    }
    Py_DECREF(late);
    Py_DECREF(zero);
    PyObject *out = PyTuple_Pack(2, flat, lists);
    Py_DECREF(flat);
    Py_DECREF(lists);
    return out;
missing:
    Py_XDECREF(flat);
    Py_XDECREF(lists);
    Py_XDECREF(late);
    Py_XDECREF(zero);
    Py_RETURN_NONE;
fail:
    Py_XDECREF(flat);
    Py_XDECREF(lists);
    Py_XDECREF(late);
    Py_XDECREF(zero);
    return NULL;
}

#endif
