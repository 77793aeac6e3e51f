/* The model of the compiled event loop (engine_native.c): rates, collectives starting and ending, compute
 * re-timed when collectives start or end on its rank, streams advanced, timers popped. Each function is
 * named after its counterpart in simulator/engine/engine_fast.py and does the same arithmetic in the same order. */
#ifndef DMUON_ENGINE_NATIVE_LOOP_H
#define DMUON_ENGINE_NATIVE_LOOP_H
#include "engine_native_state.h"

static inline double rank_rate(Loop *L, int r)
{
    if (!L->busy[r]) return 1.0;
    double u = L->sm_used[r];
    return (1.0 - (u < L->max_sm ? u : L->max_sm)) / L->ovl; /* (1 - min(MAX_SM_SHARE, used)) / ovl */
}

static int busy_changed(Loop *L, Py_ssize_t c, int delta)
{
    double dsm = (double)delta * L->c_sm[c];
    int *ranks = L->c_ranks + L->c_off[c];
    Py_ssize_t m = L->c_arrived[c] < L->c_n[c] ? L->c_arrived[c] : L->c_n[c];
    for (Py_ssize_t k = 0; k < m; k++) {
        int r = ranks[k];
        long b = L->busy[r] + delta;
        L->busy[r] = b;
        L->sm_used[r] = b ? L->sm_used[r] + dsm : 0.0;
        Slow *st = &L->running[r];
        if (st->active) {
            st->rem -= (L->now - st->since) * st->rate;
            st->rate = rank_rate(L, r);
            st->since = L->now;
            L->seq++;
            double t = L->now + (st->rem > 0.0 ? st->rem : 0.0) / st->rate;
            st->end = t;
            st->endseq = L->seq;
            if (t < st->live) {
                st->ver++;
                st->live = t;
                if (push(L, t, L->seq, K_SLOW_END, r, st->ver) < 0) return -1;
            } else if (t > L->late) {
                L->late = t;
            }
        }
    }
    return 0;
}

static int coll_timer(Loop *L, Py_ssize_t c)
{
    int *ranks = L->c_ranks + L->c_off[c];
    int any = 0;
    for (Py_ssize_t k = 0; k < L->c_arrived[c] && k < L->c_n[c]; k++)
        if (L->computing[ranks[k]]) { any = 1; break; }
    L->c_rate[c] = any ? L->comm_rate : 1.0;
    L->c_since[c] = L->now;
    L->c_ver[c]++;
    L->seq++;
    return push(L, L->now + L->c_rem[c] / L->c_rate[c], L->seq, K_COLL_SLOW, c, L->c_ver[c]);
}

static int end_coll(Loop *L, Py_ssize_t c)
{
    if (L->slow && busy_changed(L, c, -1) < 0) return -1;
    L->c_endt[c] = L->now;
    L->c_ended[c] = 1;
    return coll_release(L, c);
}

/* each distinct participant once (Python's `for r in set(c.ranks)`; only per-rank effects follow) */
#define FOR_DISTINCT(L, c, r) \
    for (Py_ssize_t _k = ((L)->stamp++, 0); _k < (L)->c_arrived[c] && _k < (L)->c_n[c]; _k++) \
        if ((r = (L)->c_ranks[(L)->c_off[c] + _k]), \
            (L)->mark[r] != (L)->stamp && ((L)->mark[r] = (L)->stamp, 1))

static int finish_coll_slow(Loop *L, Py_ssize_t c)
{
    int r;
    L->c_ver[c] = -1; /* no timer of it counts any more */
    FOR_DISTINCT(L, c, r) {
        IVec *v = &L->coll_running[r];
        for (Py_ssize_t j = 0; j < v->n; j++)
            if (v->a[j] == c) {
                memmove(v->a + j, v->a + j + 1, (v->n - j - 1) * sizeof(Py_ssize_t));
                v->n--;
                break;
            }
    }
    return end_coll(L, c);
}

static IVec snapshot;

static int set_computing(Loop *L, int r, int on)
{
    L->computing[r] = (char)on;
    IVec *v = &L->coll_running[r];
    if (!v->n) return 0;
    snapshot.n = 0;
    for (Py_ssize_t j = 0; j < v->n; j++)
        if (ivec_push(&snapshot, v->a[j]) < 0) return -1;
    for (Py_ssize_t j = 0; j < snapshot.n; j++) {
        Py_ssize_t c = snapshot.a[j];
        double elapsed = L->now - L->c_since[c];
        if (elapsed >= L->c_rem[c] / L->c_rate[c]) L->c_rem[c] = 0.0;
        else L->c_rem[c] -= elapsed * L->c_rate[c];
        double cost = L->c_cost[c];
        if (L->c_rem[c] <= 1e-15 * (cost > 1.0 ? cost : 1.0)) {
            if (finish_coll_slow(L, c) < 0) return -1;
        } else if (coll_timer(L, c) < 0) {
            return -1;
        }
    }
    return 0;
}

/* the last participant arrived: 1 when the collective is already over (no time), -1 on error */
static int start_coll(Loop *L, Py_ssize_t c)
{
    L->c_start[c] = L->now;
    L->c_started[c] = 1;
    double cost = L->c_cost[c];
    if (cost <= 0) {
        L->c_endt[c] = L->now;
        L->c_ended[c] = 1;
        return coll_release(L, c) < 0 ? -1 : 1;
    }
    if (L->slow && busy_changed(L, c, +1) < 0) return -1;
    if (L->comm_slow) {
        L->c_rem[c] = cost;
        L->c_rate[c] = 1.0;
        L->c_since[c] = L->now;
        L->c_ver[c] = 0;
        if (cost <= 1e-15 * (cost > 1.0 ? cost : 1.0)) return end_coll(L, c) < 0 ? -1 : 1;
        int r;
        FOR_DISTINCT(L, c, r) {
            if (ivec_push(&L->coll_running[r], c) < 0) return -1;
        }
        if (coll_timer(L, c) < 0) return -1;
    } else {
        L->seq++;
        if (push(L, L->now + cost, L->seq, K_COLL_END, c, 0) < 0) return -1;
    }
    return 0;
}

/* op g's start and end are its collective's (written to the op by `op_times`): op.start, op.end = c.start, c.end */
#define COLL_TIMES(L, g) ((L)->rec[g].set |= O_START | O_END)

static int finish_op(Loop *L, Py_ssize_t si, Py_ssize_t g)
{
    Stream *s = &L->st[si];
    if (s->comm_slow && set_computing(L, s->rank, 0) < 0) return -1;
    L->rec[g].t1 = L->now;
    L->rec[g].set |= O_END;
    if (op_release(L, g) < 0) return -1;
    s->i++;
    return ready_push(L, si);
}

/* advance stream si: issue its ops until one has to wait */
static int advance(Loop *L, Py_ssize_t si)
{
    Stream *s = &L->st[si];
    Py_ssize_t i = s->i, n = s->n, base = s->base;
    if (s->arrived) { /* woken by the end of the collective it joined */
        s->arrived = 0;
        COLL_TIMES(L, base + i);
        i++;
    }
    while (i < n) {
        Py_ssize_t g = base + i;
        int blocked = 0;
        const OpRec *o = &L->rec[g];
        const int *ds = o->ndep <= R_INLINE ? o->in : L->dep + o->dep0;
        for (int k = 0; k < o->ndep; k++) {
            Py_ssize_t d = ds[k];
            int c = L->rec[d].cix;
            if (c >= 0) {
                if (!L->c_ended[c]) {
                    if (coll_wait(L, c, si) < 0) return -1;
                    blocked = 1;
                    break;
                }
            } else if (!(L->rec[d].set & O_END)) {
                if (op_wait(L, d, si) < 0) return -1;
                blocked = 1;
                break;
            }
        }
        if (blocked) break;
        Py_ssize_t c = L->rec[g].cix;
        if (c < 0) {
            L->rec[g].t0 = L->now;
            L->rec[g].set |= O_START;
            double dur = L->rec[g].dur;
            if (dur > 0) {
                if (s->comm_slow && set_computing(L, s->rank, 1) < 0) return -1;
                L->seq++;
                if (s->slow) {
                    int r = s->rank;
                    double rt = rank_rate(L, r);
                    double t = L->now + dur / rt;
                    Slow *st = &L->running[r];
                    st->rem = dur;
                    st->rate = rt;
                    st->since = L->now;
                    st->ver++;
                    st->stream = si;
                    st->active = 1;
                    st->end = t;
                    st->endseq = L->seq;
                    st->live = t;
                    if (push(L, t, L->seq, K_SLOW_END, r, st->ver) < 0) return -1;
                } else if (push(L, L->now + dur, L->seq, K_END, si, 0) < 0) {
                    return -1;
                }
                break;
            }
            L->rec[g].t1 = L->now;
            L->rec[g].set |= O_END;
            if (op_release(L, g) < 0) return -1;
            i++;
            continue;
        }
        L->c_arrived[c]++;
        if (L->track && L->c_arrived[c] <= L->c_n[c]) L->c_ranks[L->c_off[c] + L->c_arrived[c] - 1] = s->rank;
        if (L->c_arrived[c] == L->c_n[c]) {
            int over = start_coll(L, c);
            if (over < 0) return -1;
            if (over) {
                COLL_TIMES(L, g);
                i++;
                continue;
            }
        }
        if (coll_wait(L, c, si) < 0) return -1;
        s->arrived = 1;
        break;
    }
    s->i = i;
    return 0;
}

static int main_loop(Loop *L)
{
    long long turns = 0;
    for (;;) {
        while (L->rq_len) {
            if (advance(L, ready_pop(L)) < 0) return -1;
            if ((++turns & 0xFFFFF) == 0 && PyErr_CheckSignals() < 0) return -1;
        }
        if (!L->hn) break;
        Entry e = pop(L);
        L->now = e.t;
        if (e.kind == K_SLOW_END) {
            Slow *st = &L->running[e.obj];
            if (st->ver != e.ver || !st->active) continue;
            if (e.seq != st->endseq) { /* the live timer of a deferred end: push that end (busy_changed) */
                st->ver++;
                st->live = st->end;
                if (push(L, st->end, st->endseq, K_SLOW_END, e.obj, st->ver) < 0) return -1;
                continue;
            }
            Py_ssize_t si = st->stream;
            st->active = 0;
            Py_ssize_t g = L->st[si].base + L->st[si].i;
            L->o_slow[g] = L->now - L->rec[g].t0 - L->rec[g].dur;
            L->rec[g].set |= O_SLOWED;
            if (finish_op(L, si, g) < 0) return -1;
        } else if (e.kind == K_END) {
            Stream *s = &L->st[e.obj];
            if (finish_op(L, e.obj, s->base + s->i) < 0) return -1;
        } else if (e.kind == K_COLL_END) {
            if (end_coll(L, e.obj) < 0) return -1;
        } else if (L->c_ver[e.obj] == e.ver) { /* K_COLL_SLOW, not stale */
            if (finish_coll_slow(L, e.obj) < 0) return -1;
        }
    }
    return 0;
}

#endif
