/*
 * engine.c - the progress engine of a Worker: DRAIN, ARM, the "touched"
 * rule, the readers the loop runs for the worker's fd, the busy yield and
 * the await spin.
 * Owns no Python object and no UCX handle (the Worker owns both); runs on
 * the loop's thread, with the worker lock held around UCX calls.
 *
 * The progress invariant (DESIGN.md): once ucp_worker_arm() succeeded the
 * loop may sleep on the event fd; any UCX call made after that must be
 * followed by a drain + re-arm before the loop polls again.  Every entry
 * point calls ucxx_worker_touched() after its UCX call, which clears
 * `armed` and queues the _rearm callback (loop.call_soon: it runs before
 * the loop's next blocking poll).  An await that is about to suspend
 * re-arms inline instead.
 *
 * The await spin (docs/ENGINE.md, "Spin"): an await that would suspend
 * first progresses the worker itself for a budget.  With spin_us="auto"
 * the budget adapts like KVM's halt polling: a completion that arrived
 * after the spin gave up, within UCXX_SPIN_CAP_US, with no other UCX
 * traffic of this process meanwhile, grows it to that wait (at least
 * doubling it, from UCXX_SPIN_GROW_US);
 * one that took longer, or came while this process was busy with its own
 * traffic, halves it (to 0 below UCXX_SPIN_GROW_US).  A spin ends when its request completes, when the
 * progress it makes wakes another task, when the budget is spent (the
 * await then sleeps) or when the time slice is: the loop gets a turn at
 * least every UCXX_SLICE_US while awaits complete inline, so that timers
 * and other tasks keep their timing (the idea of Tokio's task budget).
 */
#include "ucxx.h"
#include <time.h>
#include <unistd.h>

static void
unraisable(PyObject *obj)
{
    if (PyErr_Occurred()) {
        PyErr_WriteUnraisable(obj);
    }
}

void
ucxx_worker_queue_done(WorkerObject *w, RequestObject *r)
{
    UCXX_ASSERT_LOCKED(w);
    if (r->queued) {
        return;
    }
    assert(r->npending == 0 && r->next_done == NULL);
    r->queued = 1;
    if (w->done_tail != NULL) {
        w->done_tail->next_done = r;
    } else {
        w->done_head = r;
    }
    w->done_tail = r;
}

/* Anything UCX callbacks recorded that dispatch would act on. */
static inline int
has_work(WorkerObject *w)
{
    return w->done_head != NULL || !ucxx_list_empty(&w->errored) ||
           !ucxx_list_empty(&w->conn_ready) || !ucxx_list_empty(&w->am_ready);
}

/* Turn what UCX callbacks recorded into Python effects.  Never raises.
 * Everything but a request nobody awaits wakes somebody (w->wakeups). */
int
ucxx_worker_dispatch(WorkerObject *w)
{
    int n = 0;

    UCXX_ASSERT_LOCKED(w);
    if (w->dispatching) {
        return 0;
    }
    w->dispatching = 1;
    for (;;) {
        if (w->done_head != NULL) {
            RequestObject *r = w->done_head;

            assert(r->queued && r->npending == 0);
            w->done_head = r->next_done;
            if (w->done_head == NULL) {
                w->done_tail = NULL;
            }
            r->queued = 0;
            r->next_done = NULL;
            ucxx_request_dispatch(r);
        } else if (!ucxx_list_empty(&w->errored)) {
            EndpointObject *ep = UCXX_CONTAINER(w->errored.next,
                                                EndpointObject, elink);
            ucxx_list_del(&ep->elink);
            ep->err_queued = 0;
            ucxx_endpoint_report_error(ep);
            w->wakeups++;
        } else if (!ucxx_list_empty(&w->conn_ready)) {
            ListenerObject *l = UCXX_CONTAINER(w->conn_ready.next,
                                               ListenerObject, clink);
            ucxx_list_del(&l->clink);
            l->conn_queued = 0;
            ucxx_listener_deliver(l);
            w->wakeups++;
        } else if (!ucxx_list_empty(&w->am_ready)) {
            EndpointObject *ep = UCXX_CONTAINER(w->am_ready.next,
                                                EndpointObject, alink);
            ucxx_list_del(&ep->alink);
            ucxx_am_deliver(ep);
            w->wakeups++;
        } else {
            break;
        }
        n++;
    }
    w->dispatching = 0;
    return n;
}

/* Progress until idle or budget spent; returns 1 if work may remain.
 * Dispatching can call UCX (a failed endpoint is force-closed, a listener
 * creates endpoints): after a dispatch that did anything, progress again,
 * so that "drained" really means nothing is left before an arm. */
unsigned
ucxx_worker_drain(WorkerObject *w, unsigned budget)
{
    unsigned n = 0;

    UCXX_ASSERT_LOCKED(w);
    w->armed = 0;
    for (;;) {
        while (ucp_worker_progress(w->handle) != 0) {
            if (++n >= budget) {
                ucxx_worker_dispatch(w);
                return 1;
            }
        }
        if (ucxx_worker_dispatch(w) == 0) {
            return 0;
        }
        if (++n >= budget) {
            return 1;
        }
    }
}

/* DRAIN (unless the caller just did) + ARM.
 * 0: armed; 1: budget spent, call again; -1: error set. */
int
ucxx_worker_arm(WorkerObject *w, int drained)
{
    ucs_status_t status;

    for (int i = 0; i < 64; i++) {
        if (!drained && ucxx_worker_drain(w, UCXX_DRAIN_BUDGET)) {
            return 1;
        }
        drained = 0;
        status = ucp_worker_arm(w->handle);
        if (status == UCS_OK) {
            w->armed = 1;
            return 0;
        }
        if (status != UCS_ERR_BUSY) {
            ucxx_raise_status(w->st, status,
                              "ucp_worker_arm");
            return -1;
        }
    }
    return 1;
}

/* Queue _rearm to run before the loop's next blocking poll. */
static void
schedule_rearm(WorkerObject *w)
{
    if (w->rearm_scheduled || w->loop == NULL) {
        return;
    }
    if (ucxx_call_soon(w, w->rearm_cb, NULL) < 0) {
        /* The loop is closed: nobody will poll the fd any more. */
        PyErr_Clear();
        return;
    }
    w->rearm_scheduled = 1;
}

/* Called (lock held) after every UCX call made by an entry point. */
void
ucxx_worker_touched(WorkerObject *w)
{
    UCXX_ASSERT_LOCKED(w);
    w->st->ucx_calls++;
    if (w->armed) {
        w->armed = 0;
        if (w->mode == UCXX_MODE_BLOCKING) {
            schedule_rearm(w);
        } else if (w->thread_running) {
            ucxx_thread_wake(w);
        }
    }
}

/* Blocking mode, before the loop may sleep: drain and arm; if the drain
 * budget ran out, leave the rest to _rearm (the loop runs it before it
 * polls again).  -1 with an error set if UCX refused the arm. */
int
ucxx_worker_service(WorkerObject *w, int drained)
{
    int rc;

    if (w->handle == NULL) {
        return 0;
    }
    rc = ucxx_worker_arm(w, drained);
    if (rc == 1) {
        schedule_rearm(w);
    }
    return rc < 0 ? -1 : 0;
}

/* ---- the readers the loop runs ----------------------------------------- */

/* Following a large transfer: progress until UCX callbacks recorded work
 * (FOLLOW_WORK), UCXX_FOLLOW_IDLE_US pass without an event (FOLLOW_IDLE)
 * or slice_end comes (FOLLOW_SLICE).  The clock is read every 8 calls. */
enum { FOLLOW_WORK, FOLLOW_IDLE, FOLLOW_SLICE };

static int
follow_run(WorkerObject *w, double slice_end)
{
    double now, last = ucxx_now_us();
    unsigned i = 0;

    for (;;) {
        if (ucp_worker_progress(w->handle) != 0) {
            last = 0.0;         /* stamped at the next clock reading */
            if (has_work(w)) {
                return FOLLOW_WORK;
            }
        }
        if ((++i & 7) == 0) {
            now = ucxx_now_us();
            if (last == 0.0) {
                last = now;
            } else if (now - last >= UCXX_FOLLOW_IDLE_US) {
                return FOLLOW_IDLE;
            }
            if (now >= slice_end) {
                return FOLLOW_SLICE;
            }
        }
    }
}

/* 0 once UCXX_FOLLOW_MAX_US passed since following began without a large
 * request settling (request.c resets follow_since): a transfer that makes
 * no progress, to a peer UCX has not found dead yet, is then waited for on
 * the fd like any other, and the loop does not spin on it. */
static int
follow_allowed(WorkerObject *w, double now)
{
    if (w->follow_since == 0.0) {
        w->follow_since = now;
        return 1;
    }
    if (now - w->follow_since < UCXX_FOLLOW_MAX_US) {
        return 1;
    }
    if (!w->follow_stopped) {
        w->follow_stopped = 1;
        w->follow_stops++;
    }
    return 0;
}

/* The fd reader, a large transfer in flight and the worker drained: follow
 * it.  1 if it dispatched and queued _rearm (the loop gets its turn, then
 * the drain and arm); 0 if it went idle: arm as usual. */
static int
follow_from_reader(WorkerObject *w)
{
    if (!follow_allowed(w, w->dispatched_at)) {
        return 0;
    }
    w->follows++;
    if (follow_run(w, w->dispatched_at + UCXX_SLICE_US) == FOLLOW_IDLE) {
        return 0;
    }
    ucxx_worker_dispatch(w);
    schedule_rearm(w);
    return 1;
}

PyObject *
ucxx_worker_on_efd(WorkerObject *w, PyObject *unused)
{
    unsigned n = 0;

    if (w->handle == NULL) {
        Py_RETURN_NONE;
    }
    w->slice_start = 0.0;       /* the loop is taking a turn */
    w->dispatched_at = ucxx_now_us();
    w->armed = 0;
    while (ucp_worker_progress(w->handle) != 0) {
        if (w->done_head != NULL || ++n >= UCXX_DRAIN_BUDGET) {
            /* Requests completed: resolve them and let their tasks run
             * first; the rest of the drain and the arm happen in _rearm,
             * queued behind those tasks (they usually re-arm themselves
             * while they suspend again).  This keeps the final empty
             * progress call and ucp_worker_arm off the wakeup path. */
            ucxx_worker_dispatch(w);
            schedule_rearm(w);
            Py_RETURN_NONE;
        }
    }
    if (w->large_pending > 0 && !UCXX_THREADED(w) && follow_from_reader(w)) {
        Py_RETURN_NONE;
    }
    /* Dispatching may have called UCX: drain once more before the arm. */
    if (ucxx_worker_service(w, ucxx_worker_dispatch(w) == 0) < 0) {
        unraisable((PyObject *)w);
    }
    Py_RETURN_NONE;
}

PyObject *
ucxx_worker_on_notify(WorkerObject *w, PyObject *unused)
{
    uint64_t v;

    if (w->notify_fd >= 0 && read(w->notify_fd, &v, sizeof(v)) < 0) {
        /* EAGAIN: nothing to read, dispatch anyway */
    }
    w->slice_start = 0.0;
    w->dispatched_at = ucxx_now_us();
    ucxx_lock(w);
    w->notified = 0;
    ucxx_worker_dispatch(w);
    ucxx_unlock(w);
    Py_RETURN_NONE;
}

/* _rearm: drain and arm before the loop polls. */
PyObject *
ucxx_worker_rearm(WorkerObject *w, PyObject *unused)
{
    w->rearm_scheduled = 0;
    if (!w->armed && ucxx_worker_service(w, 0) < 0) {
        unraisable((PyObject *)w);
    }
    Py_RETURN_NONE;
}

/* A suspended await resumed: if its completion waited long for the loop
 * (other callbacks ran first), the loop is busy. */
void
ucxx_worker_resumed(WorkerObject *w)
{
    w->slice_start = 0.0;
    if (w->dispatched_at > 0.0) {
        w->loop_busy = ucxx_now_us() - w->dispatched_at >= UCXX_BUSY_GAP_US;
        w->dispatched_at = 0.0;
    }
}

/* ---- the await spin and the time slice ---------------------------------- */

double
ucxx_now_us(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

/* An await that completed at once: 1 if the task should give the loop a
 * turn first (the slice is spent).  The clock is read once every
 * UCXX_SLICE_CHECK such awaits only: they cost well under a microsecond
 * each, so the slice is overrun by a few microseconds at most. */
int
ucxx_slice_spent(WorkerObject *w)
{
    double now;

    if (++w->inline_count < UCXX_SLICE_CHECK) {
        return 0;
    }
    w->inline_count = 0;
    now = ucxx_now_us();
    if (w->slice_start == 0.0) {
        w->slice_start = now;
        return 0;
    }
    return now - w->slice_start >= UCXX_SLICE_US;
}

/*
 * What a task yields to give the loop its turn when the slice is spent: a
 * future resolved by a timer due now (loop.call_later(0, ...)), which the
 * loop runs after the timers already due, so that a task woken by one of
 * those (its wake-up is queued when the timer runs) runs before this one
 * resumes.  A bare yield (as asyncio.sleep(0)) would put the task back in
 * the ready queue ahead of those wake-ups, and the loop would run a whole
 * slice of it first.  A task running on another loop than the worker's
 * (the worker not attached yet, or its loop closed and a new one running:
 * an await of a done request does not attach) yields None, a bare yield.
 */
PyObject *
ucxx_slice_yield(WorkerObject *w)
{
    ucxx_state *st = w->st;
    PyObject *fut, *res, *running;

    w->slice_start = 0.0;
    w->slice_yields++;
    if (w->loop == NULL) {
        return Py_NewRef(Py_None);
    }
    running = PyObject_CallNoArgs(st->get_running_loop);
    if (running == NULL) {
        PyErr_Clear();          /* awaited outside a running loop */
        return Py_NewRef(Py_None);
    }
    Py_DECREF(running);
    if (running != w->loop) {
        return Py_NewRef(Py_None);
    }
    fut = ucxx_worker_new_future(w, st);
    if (fut == NULL) {
        return NULL;
    }
    res = PyObject_CallMethodObjArgs(w->loop, st->s_call_later, st->zero,
                                     st->slice_wake, fut, NULL);
    if (res == NULL || PyObject_SetAttr(fut, st->s_blocking, Py_True) < 0) {
        Py_XDECREF(res);
        Py_DECREF(fut);
        return NULL;
    }
    Py_DECREF(res);
    return fut;
}

/*
 * The completion of r, which slept: adapt the auto budget.  Waits longer
 * than the cap shrink it.  A shorter wait that outlasted the budget grows
 * it only if nothing in this process called UCX while r slept: the reply
 * came from a peer, and spinning on would have caught it at no cost to
 * anyone.  If other tasks of this thread posted or closed something
 * meanwhile, the reply may well have needed them (both ends in one
 * process: the reply is the other task's send), and spinning would only
 * have delayed them: shrink.
 */
void
ucxx_spin_adapt(WorkerObject *w, double block_us, int busy)
{
    double b = w->spin_us;

    if (!w->spin_auto || block_us <= b) {
        return;
    }
    if (w->spin_backoff > 0) {
        w->spin_backoff--;
        return;
    }
    if (block_us <= UCXX_SPIN_CAP_US && !busy) {
        if (b < UCXX_SPIN_CAP_US) {
            /* At least double, and at once to what this wait needed: a
             * ping-pong's ends each have to spin long enough for the
             * other's reply before either catches one. */
            b = b * 2 > block_us ? b * 2 : block_us;
            b = b < UCXX_SPIN_GROW_US ? UCXX_SPIN_GROW_US : b;
            w->spin_us = b > UCXX_SPIN_CAP_US ? UCXX_SPIN_CAP_US : b;
            w->spin_grows++;
        }
    } else if (b > 0) {
        w->spin_us = b / 2 < UCXX_SPIN_GROW_US ? 0.0 : b / 2;
        w->spin_shrinks++;
    }
}

void
ucxx_spin_feedback(RequestObject *r)
{
    ucxx_state *st = ucxx_state_of((PyObject *)r);

    ucxx_spin_adapt(r->worker, ucxx_now_us() - r->wait_start,
                    st->ucx_calls != r->sleep_calls);
}

/* Stop spinning for a while: UCXX_SPIN_BACKOFF sleeps, doubled (up to
 * UCXX_SPIN_BACKOFF_MAX) each time it starts again before a spin caught a
 * completion cleanly; then start afresh (the budget has to grow through a
 * few misses before both ends of a ping-pong spin long enough to catch
 * each other's replies). */
static void
spin_back_off(WorkerObject *w)
{
    w->spin_us = 0.0;
    w->spin_backoff = w->spin_backoff_len;
    if (w->spin_backoff_len < UCXX_SPIN_BACKOFF_MAX) {
        w->spin_backoff_len *= 2;
    }
    w->spin_hit_rate = 1.0;
    w->spin_shrinks++;
}

/* An auto spin expired with nothing.  While most spins do (the machine is
 * oversubscribed: the peer's reply waits for a CPU, which spinning only
 * keeps busy), stop spinning for a while. */
void
ucxx_spin_missed(WorkerObject *w)
{
    if (!w->spin_auto) {
        return;
    }
    w->spin_hit_rate -= w->spin_hit_rate / 8;
    if (w->spin_hit_rate < 0.5) {
        spin_back_off(w);
    }
}

/* The outcome of an auto spin. */
static void
spin_outcome(WorkerObject *w, int rc, int expired, int preempted)
{
    if (!w->spin_auto) {
        return;
    }
    if (preempted && w->mode != UCXX_MODE_THREAD) {
        /* The thread lost its CPU while spinning (a few progress calls took
         * far too long): that CPU is wanted elsewhere, maybe by the very
         * peer the spin waits for.  Not in thread mode: there the taker is
         * mostly this worker's progress thread, woken by the fd for the
         * reply the spin then finds. */
        spin_back_off(w);
    } else if (expired) {
        ucxx_spin_missed(w);
    } else if (rc == UCXX_SPIN_DONE) {
        w->spin_hit_rate += (1.0 - w->spin_hit_rate) / 8;
        w->spin_backoff_len = UCXX_SPIN_BACKOFF;
    }
}

/* One spin step: progress, unless a progress thread owns that; 1 if UCX
 * callbacks recorded something to dispatch.  Thread mode: the progress
 * thread sleeps on the fd between messages, so the loop thread progresses
 * while it spins (if the thread is not progressing right now); in
 * thread-polling mode the thread progresses all the time and the spin
 * only watches for what it delivers. */
static int
spin_step(WorkerObject *w)
{
    if (!UCXX_THREADED(w)) {
        ucp_worker_progress(w->handle);
        return has_work(w);
    }
    if (w->mode == UCXX_MODE_THREAD && pthread_mutex_trylock(&w->lock) == 0) {
        UCXX_LOCK_ACQUIRED(w);
        ucp_worker_progress(w->handle);
        w->spin_progressed = 1;
        UCXX_LOCK_RELEASING(w);
        pthread_mutex_unlock(&w->lock);
    }
    return __atomic_load_n(&w->done_head, __ATOMIC_ACQUIRE) != NULL ||
           __atomic_load_n(&w->notified, __ATOMIC_ACQUIRE);
}

/* Thread modes, lock held: the batch the progress thread announced on
 * notify_fd is being dispatched here, so the loop need not wake for it. */
static void
spin_take_notify(WorkerObject *w)
{
    uint64_t v;

    if (w->notified) {
        if (read(w->notify_fd, &v, sizeof(v)) < 0) {
            /* EAGAIN: already read */
        }
        w->notified = 0;
    }
}

/* A spin step and, if it found work, its dispatch: 1 if it dispatched. */
static int
spin_step_dispatch(WorkerObject *w)
{
    if (!spin_step(w)) {
        return 0;
    }
    ucxx_lock(w);
    spin_take_notify(w);
    ucxx_worker_dispatch(w);
    ucxx_unlock(w);
    return 1;
}

/* Thread mode, after spin steps: if the loop thread called UCX while the
 * progress thread slept on an armed worker, the thread drains and
 * re-arms. */
static void
spin_progressed_touched(WorkerObject *w)
{
    if (w->spin_progressed) {
        ucxx_lock(w);
        ucxx_worker_touched(w);
        ucxx_unlock(w);
    }
}

/* The await of r on a busy loop, before a busy yield or resumed after one
 * (resumed: the iteration since the yield tells whether the loop is still
 * busy): one spin step.  UCXX_SPIN_DONE if r completed; UCXX_SPIN_YIELD
 * while the loop is busy (iterations of UCXX_BUSY_GAP_US or more): yield,
 * poll again next iteration; UCXX_SPIN_SLEEP once it is not: suspend
 * until the completion. */
int
ucxx_busy_step(RequestObject *r, int resumed)
{
    WorkerObject *w = r->worker;

    if (resumed) {
        w->loop_busy = ucxx_now_us() - r->busy_yield_at >= UCXX_BUSY_GAP_US;
        r->busy_yield_at = 0.0;
        w->slice_start = 0.0;
    }
    if (r->status == UCS_INPROGRESS && w->handle != NULL) {
        w->busy_polls++;
        if (UCXX_THREADED(w)) {
            w->spin_progressed = 0;
            spin_step_dispatch(w);
            spin_progressed_touched(w);
        } else {
            /* Touched first (an armed worker queues _rearm): should r's
             * task go on without suspending, the worker is re-armed before
             * the loop sleeps.  A drain, as the fd reader's: a large
             * message may need many progress calls. */
            ucxx_worker_touched(w);
            ucxx_worker_drain(w, UCXX_DRAIN_BUDGET);
        }
    }
    if (r->status != UCS_INPROGRESS) {
        return UCXX_SPIN_DONE;
    }
    return w->loop_busy && w->handle != NULL ? UCXX_SPIN_YIELD
                                             : UCXX_SPIN_SLEEP;
}

/*
 * An await of a large request r (blocking and polling mode): follow the
 * transfer.  UCXX_SPIN_DONE if r completed, UCXX_SPIN_YIELD if the slice
 * is spent (the loop gets one turn, then the await follows on),
 * UCXX_SPIN_SLEEP once UCXX_FOLLOW_IDLE_US passed without an event or the
 * progress woke another task.
 */
int
ucxx_follow(RequestObject *r)
{
    WorkerObject *w = r->worker;
    unsigned long wakeups = w->wakeups;
    double slice_end;

    if (w->handle == NULL) {
        return UCXX_SPIN_SLEEP;
    }
    if (w->slice_start == 0.0) {
        w->slice_start = ucxx_now_us();
    }
    if (!follow_allowed(w, w->slice_start)) {
        return UCXX_SPIN_SLEEP;
    }
    slice_end = w->slice_start + UCXX_SLICE_US;
    w->follows++;
    ucxx_worker_touched(w);
    for (;;) {
        switch (follow_run(w, slice_end)) {
        case FOLLOW_IDLE:
            return UCXX_SPIN_SLEEP;
        case FOLLOW_SLICE:
            return UCXX_SPIN_YIELD;
        }
        ucxx_lock(w);
        ucxx_worker_dispatch(w);
        ucxx_unlock(w);
        if (r->status != UCS_INPROGRESS) {
            return UCXX_SPIN_DONE;
        }
        if (w->wakeups != wakeups) {
            return UCXX_SPIN_SLEEP;
        }
    }
}

/*
 * Progress the worker for r's await: UCXX_SPIN_DONE if r completed,
 * UCXX_SPIN_SLEEP if the await must suspend until the completion (budget
 * spent, or the spin woke another task), UCXX_SPIN_YIELD if the slice is
 * spent and the task should give the loop one turn, then spin on.
 * The clock is read every 8 steps only (a reading costs about as much as a
 * shared-memory progress call).
 */
int
ucxx_spin(RequestObject *r)
{
    WorkerObject *w = r->worker;
    double now, last, deadline, slice_end;
    unsigned long wakeups = w->wakeups;
    unsigned i = 0;
    int rc, preempted = 0;

    if (w->handle == NULL) {
        return UCXX_SPIN_SLEEP;
    }
    now = last = ucxx_now_us();
    if (r->wait_start == 0.0) {
        r->wait_start = now;
    }
    if (w->slice_start == 0.0) {
        w->slice_start = now;
    }
    deadline = r->wait_start + w->spin_us;
    slice_end = w->slice_start + UCXX_SLICE_US;
    if (now >= deadline) {
        return UCXX_SPIN_SLEEP;
    }
    if (now >= slice_end) {
        return UCXX_SPIN_YIELD;
    }
    /* Thread modes: the lock is taken per step, never across the spin
     * (the progress thread must be able to progress meanwhile). */
    w->spin_progressed = 0;
    if (!UCXX_THREADED(w)) {
        ucxx_worker_touched(w);
    }
    for (;;) {
        if (spin_step_dispatch(w)) {
            if (r->status != UCS_INPROGRESS) {
                rc = UCXX_SPIN_DONE;
                preempted |= ucxx_now_us() - last > UCXX_SPIN_GAP_US;
                break;
            }
            if (w->wakeups != wakeups) {
                rc = UCXX_SPIN_SLEEP;
                break;
            }
        }
        if ((++i & 7) == 0) {
            now = ucxx_now_us();
            preempted |= now - last > UCXX_SPIN_GAP_US;
            last = now;
            if (now >= deadline) {
                rc = UCXX_SPIN_SLEEP;
                break;
            }
            if (now >= slice_end) {
                rc = UCXX_SPIN_YIELD;
                break;
            }
        }
    }
    spin_progressed_touched(w);
    if (rc == UCXX_SPIN_DONE) {
        w->spin_hits++;
    }
    spin_outcome(w, rc, rc == UCXX_SPIN_SLEEP && w->wakeups == wakeups,
                 preempted);
    return rc;
}
