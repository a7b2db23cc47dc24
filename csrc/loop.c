/*
 * loop.c - attachment of a Worker to one asyncio event loop at a time.
 * Owns nothing itself: attaching gives the worker (worker.c owns them) a
 * reference to the loop, the reader on its fd, the progress Task and, in
 * the thread modes, the progress thread; detach (or worker close) drops
 * them.  Only the loop's public API is used: add_reader/remove_reader,
 * call_soon, create_future, create_task, is_closed, is_running.
 */
#include "ucxx.h"

int
ucxx_call_soon(WorkerObject *w, PyObject *cb, PyObject *arg)
{
    ucxx_state *st = w->st;
    PyObject *res;

    w->wakeups++;
    if (w->loop == NULL) {
        res = arg ? ucxx_call1(cb, arg) : PyObject_CallNoArgs(cb);
    } else {
        res = PyObject_CallMethodObjArgs(w->loop, st->s_call_soon, cb, arg,
                                         NULL);
    }
    if (res == NULL) {
        return -1;
    }
    Py_DECREF(res);
    return 0;
}

/* A new future on the worker's loop: asyncio.Future(loop=loop), which is
 * what BaseEventLoop.create_future returns, without its Python-level call;
 * loop.create_future() on loops that define their own. */
PyObject *
ucxx_worker_new_future(WorkerObject *w, ucxx_state *st)
{
    if (w->direct_future) {
        return PyObject_Call(st->Future, st->empty_tuple, w->future_kw);
    }
    return ucxx_call_method0(w->loop, st->s_create_future);
}

static int
loop_is_closed(ucxx_state *st, PyObject *loop)
{
    PyObject *res = ucxx_call_method0(loop, st->s_is_closed);
    int closed;

    if (res == NULL) {
        PyErr_Clear();
        return 1;
    }
    closed = PyObject_IsTrue(res);
    Py_DECREF(res);
    return closed;
}

int
ucxx_loop_is_running(PyObject *loop)
{
    PyObject *res = PyObject_CallMethod(loop, "is_running", NULL);
    int running = res != NULL && PyObject_IsTrue(res) == 1;

    Py_XDECREF(res);
    PyErr_Clear();
    return running;
}

/* Thread modes: unregister the loop's reader of notify_fd (while that fd is
 * still open: a closed fd's number is soon reused), then join the thread. */
void
ucxx_worker_stop_thread(WorkerObject *w)
{
    PyObject *res;

    if (!w->thread_running) {
        return;
    }
    if (w->loop != NULL &&
        !loop_is_closed(w->st, w->loop)) {
        res = PyObject_CallMethod(w->loop, "remove_reader", "i",
                                  w->notify_fd);
        Py_XDECREF(res);
        PyErr_Clear();
    }
    ucxx_thread_stop(w);
}

/* End a detached progress Task: resolve its waiter (on an open loop) so
 * that the coroutine sees it is detached and returns on its next step.
 * The Task is ours and may never run again (its loop closed, or never run
 * again): collected pending, asyncio would log "Task was destroyed but it
 * is pending", so that log is turned off for it. */
static void
end_progress_task(ucxx_state *st, PyObject *task, PyObject *waiter,
                  int closed)
{
    PyObject *res;

    if (task != NULL &&
        PyObject_SetAttrString(task, "_log_destroy_pending", Py_False) < 0) {
        PyErr_Clear();
    }
    if (waiter != NULL && !closed) {
        res = ucxx_call_method0(waiter, st->s_done);
        if (res == Py_False) {
            Py_DECREF(res);
            res = ucxx_call_method1(waiter, st->s_set_result, Py_None);
        }
        Py_XDECREF(res);
        PyErr_Clear();
    }
}

/* Leave the current loop: remove the reader, let the progress task end. */
void
ucxx_worker_detach(WorkerObject *w)
{
    ucxx_state *st = w->st;
    PyObject *loop = w->loop, *task = w->task, *waiter = w->waiter, *res;
    int closed;

    if (loop == NULL) {
        return;
    }
    ucxx_worker_stop_thread(w);
    w->loop = NULL;
    w->task = NULL;
    w->waiter = NULL;
    Py_CLEAR(w->coro);
    w->direct_future = 0;
    Py_CLEAR(w->future_kw);
    w->armed = 0;
    w->rearm_scheduled = 0;
    w->slice_start = 0.0;
    w->loop_busy = 0;
    w->dispatched_at = 0.0;
    closed = loop_is_closed(st, loop);
    if (!closed && w->mode == UCXX_MODE_BLOCKING && w->efd >= 0) {
        res = PyObject_CallMethod(loop, "remove_reader", "i", w->efd);
        Py_XDECREF(res);
        PyErr_Clear();
    }
    end_progress_task(st, task, waiter, closed);
    Py_XDECREF(waiter);
    Py_XDECREF(task);
    Py_DECREF(loop);
}

int
ucxx_worker_attach(WorkerObject *w, PyObject *loop)
{
    ucxx_state *st = w->st;
    PyObject *res, *coro = NULL;

    if (w->loop == loop) {
        return 0;
    }
    if (ucxx_worker_check(w) < 0) {
        return -1;
    }
    if (w->loop != NULL && ucxx_loop_is_running(w->loop)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "this ucxx Worker is driven by another running "
                        "event loop; use it from that loop's thread");
        return -1;
    }
    ucxx_worker_detach(w);
    w->loop = Py_NewRef(loop);
    w->thread_id = PyThread_get_thread_ident();
    {
        PyObject *mine = PyObject_GetAttr((PyObject *)Py_TYPE(loop),
                                          st->s_create_future);
        PyObject *base = PyObject_GetAttr(st->BaseEventLoop,
                                          st->s_create_future);

        w->direct_future = mine != NULL && mine == base;
        Py_XDECREF(mine);
        Py_XDECREF(base);
        PyErr_Clear();
        if (w->direct_future) {
            w->future_kw = Py_BuildValue("{s:O}", "loop", loop);
            if (w->future_kw == NULL) {
                return -1;
            }
        }
    }
    if (w->mode == UCXX_MODE_BLOCKING || UCXX_THREADED(w)) {
        int threaded = UCXX_THREADED(w);
        PyObject *cb = PyObject_GetAttrString(
            (PyObject *)w, threaded ? "_on_notify" : "_on_efd");

        if (cb == NULL) {
            goto error;
        }
        if (threaded && ucxx_thread_start(w) < 0) {
            Py_DECREF(cb);
            goto error;
        }
        res = PyObject_CallMethod(loop, "add_reader", "iO",
                                  threaded ? w->notify_fd : w->efd, cb);
        Py_DECREF(cb);
        if (res == NULL) {
            goto error;
        }
        Py_DECREF(res);
    }
    coro = ucxx_progress_new(w, loop);
    if (coro == NULL) {
        goto error;
    }
    w->coro = Py_NewRef(coro);
    w->task = ucxx_call_method1(loop, st->s_create_task, coro);
    Py_DECREF(coro);
    if (w->task == NULL) {
        goto error;
    }
    return 0;

error:
    {
        PyObject *exc = PyErr_GetRaisedException_compat();
        ucxx_worker_detach(w);
        PyErr_SetRaisedException_compat(exc);
    }
    return -1;
}
