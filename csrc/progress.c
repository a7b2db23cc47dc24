/*
 * progress.c - ProgressCoroutine, the one coroutine that drives a Worker on
 * one event loop, for as long as the worker stays attached to that loop.
 * Owns a reference to the worker and the loop; the worker owns the Task
 * that runs it and drops it on detach, after which the coroutine returns.
 *
 * Blocking mode, one step: DRAIN (ucp_worker_progress until 0), ARM
 * (UCS_ERR_BUSY -> DRAIN again), WAIT on a waiter future.  Events on the
 * worker's fd are handled by the fd reader (Worker._on_efd), which drains
 * and re-arms inline between tasks; the waiter is resolved only to end the
 * coroutine (detach) or when a drain ran out of budget.
 * Polling mode, one step: DRAIN, then a bare yield (one loop turn).
 */
#include "ucxx.h"

typedef struct {
    PyObject_HEAD
    WorkerObject *worker;   /* strong */
    PyObject *loop;         /* strong */
    int finished;
} ProgressObject;

PyObject *
ucxx_progress_new(WorkerObject *w, PyObject *loop)
{
    ucxx_state *st = w->st;
    ProgressObject *p = PyObject_GC_New(ProgressObject, st->ProgressType);

    if (p == NULL) {
        return NULL;
    }
    p->worker = (WorkerObject *)Py_NewRef((PyObject *)w);
    p->loop = Py_NewRef(loop);
    p->finished = 0;
    PyObject_GC_Track(p);
    return (PyObject *)p;
}

static int
progress_attached(ProgressObject *p)
{
    WorkerObject *w = p->worker;

    return !p->finished && w->handle != NULL && w->coro == (PyObject *)p;
}

static PySendResult
Progress_am_send(ProgressObject *p, PyObject *arg, PyObject **presult)
{
    WorkerObject *w = p->worker;
    ucxx_state *st;
    PyObject *fut;
    int rc;

    if (!progress_attached(p)) {
        p->finished = 1;
        *presult = Py_NewRef(Py_None);
        return PYGEN_RETURN;
    }
    Py_CLEAR(w->waiter);
    w->slice_start = 0.0;       /* the loop gave this task a turn */
    if (w->mode == UCXX_MODE_POLLING) {
        unsigned long wakeups = w->wakeups;

        ucxx_worker_drain(w, UCXX_DRAIN_BUDGET);
        if (w->wakeups != wakeups) {
            /* the woken tasks tell how busy the loop is (busy yield) */
            w->dispatched_at = ucxx_now_us();
        }
        *presult = Py_NewRef(Py_None);
        return PYGEN_NEXT;
    }
    /* Thread modes: the thread progresses; we only keep the task alive. */
    rc = UCXX_THREADED(w) ? 0 : ucxx_worker_arm(w, 0);
    if (rc < 0) {
        *presult = NULL;
        return PYGEN_ERROR;
    }
    if (rc == 1) {
        /* Drain budget spent: let other tasks run, then continue. */
        *presult = Py_NewRef(Py_None);
        return PYGEN_NEXT;
    }
    st = ucxx_state_of((PyObject *)p);
    fut = ucxx_worker_new_future(w, st);
    if (fut == NULL) {
        *presult = NULL;
        return PYGEN_ERROR;
    }
    if (PyObject_SetAttr(fut, st->s_blocking, Py_True) < 0) {
        Py_DECREF(fut);
        *presult = NULL;
        return PYGEN_ERROR;
    }
    w->waiter = Py_NewRef(fut);
    *presult = fut;
    return PYGEN_NEXT;
}

static PyObject *
Progress_iternext(ProgressObject *p)
{
    PyObject *res;

    switch (Progress_am_send(p, Py_None, &res)) {
    case PYGEN_NEXT:
        return res;
    case PYGEN_RETURN:
        Py_DECREF(res);
        return NULL; /* StopIteration(None) */
    default:
        return NULL;
    }
}

PyDoc_STRVAR(Progress_send_doc,
"send($self, value, /)\n--\n\nRun one step of the progress loop.");

static PyObject *
Progress_send(ProgressObject *p, PyObject *arg)
{
    PyObject *res = Progress_iternext(p);

    if (res == NULL && !PyErr_Occurred()) {
        PyErr_SetNone(PyExc_StopIteration);
    }
    return res;
}

/* The task is being cancelled (loop shutdown) or closed: detach. */
static void
progress_finish(ProgressObject *p)
{
    if (progress_attached(p)) {
        ucxx_worker_detach(p->worker);
    }
    p->finished = 1;
}

PyDoc_STRVAR(Progress_throw_doc,
"throw($self, typ, val=None, tb=None, /)\n--\n\n"
"Detach the worker from the loop and re-raise.");

static PyObject *
Progress_throw(ProgressObject *p, PyObject *const *args, Py_ssize_t nargs)
{
    progress_finish(p);
    return ucxx_throw(args, nargs);
}

PyDoc_STRVAR(Progress_close_doc,
"close($self, /)\n--\n\nDetach the worker from the loop.");

static PyObject *
Progress_close(ProgressObject *p, PyObject *unused)
{
    progress_finish(p);
    Py_RETURN_NONE;
}

static PyObject *
Progress_await(ProgressObject *p)
{
    return Py_NewRef((PyObject *)p);
}

static PyObject *
Progress_get_worker(ProgressObject *p, void *closure)
{
    return Py_NewRef((PyObject *)p->worker);
}

static int
Progress_traverse(ProgressObject *p, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE((PyObject *)p));
    Py_VISIT(p->worker);
    Py_VISIT(p->loop);
    return 0;
}

static int
Progress_clear(ProgressObject *p)
{
    Py_CLEAR(p->worker);
    Py_CLEAR(p->loop);
    return 0;
}

static void
Progress_dealloc(ProgressObject *p)
{
    PyTypeObject *tp = Py_TYPE((PyObject *)p);

    PyObject_GC_UnTrack(p);
    Progress_clear(p);
    PyObject_GC_Del(p);
    Py_DECREF(tp);
}

static PyMethodDef Progress_methods[] = {
    {"send", (PyCFunction)Progress_send, METH_O, Progress_send_doc},
    {"throw", (PyCFunction)(void (*)(void))Progress_throw, METH_FASTCALL,
     Progress_throw_doc},
    {"close", (PyCFunction)Progress_close, METH_NOARGS, Progress_close_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Progress_getset[] = {
    {"worker", (getter)Progress_get_worker, NULL, "The driven Worker.", NULL},
    {NULL},
};

PyDoc_STRVAR(Progress_doc,
"The coroutine driving a Worker on one event loop (see Worker.start).");

static PyType_Slot Progress_slots[] = {
    {Py_tp_doc, (void *)Progress_doc},
    {Py_tp_dealloc, Progress_dealloc},
    {Py_tp_traverse, Progress_traverse},
    {Py_tp_clear, Progress_clear},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, Progress_iternext},
    {Py_tp_methods, Progress_methods},
    {Py_tp_getset, Progress_getset},
    {Py_am_await, Progress_await},
    {Py_am_send, Progress_am_send},
    {0, NULL},
};

PyType_Spec ucxx_progress_spec = {
    .name = "ucxx._ucxx.ProgressCoroutine",
    .basicsize = sizeof(ProgressObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Progress_slots,
};
