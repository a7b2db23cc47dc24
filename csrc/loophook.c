/*
 * loophook.c - LoopHook, which lets a stdlib selector event loop hand the
 * readiness of a worker's fd to the worker as soon as the selector reports
 * it, instead of one loop iteration later.
 *
 * A selector loop's iteration (BaseEventLoop._run_once) is: select, then
 * _process_events (one Handle queued per ready fd), then it runs the Handles
 * that are ready at that point.  Callbacks queued while those run wait for
 * the next iteration.  A worker's fd reader resolves the futures of the
 * requests that completed, and asyncio queues their tasks' wake-ups with
 * call_soon, so with a plain add_reader every message costs two iterations
 * (two epoll_wait calls): one to run the reader, one to run the task.
 *
 * A LoopHook replaces the loop instance's _process_events (an instance
 * attribute in front of the class's method).  It runs the reader of every
 * ready fd that belongs to one of its workers right there and passes the
 * remaining events on to the loop's own _process_events, so the wake-ups
 * the reader queued run in the same iteration.  The workers' fds stay
 * registered with add_reader (the selector, fd bookkeeping and
 * remove_reader work as usual); only the delivery moves earlier.  One hook
 * per loop, shared by its workers; removed when the last one detaches.
 */
#include "ucxx.h"

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;   /* LoopHook_call */
    PyObject *orig;      /* strong: the loop's _process_events before us */
    PyObject *workers;   /* strong: list of the WorkerObjects served */
    int orig_is_base;    /* orig is BaseSelectorEventLoop's own method,
                            which does nothing with an empty list */
} LoopHookObject;

static WorkerObject *
hook_match(LoopHookObject *h, PyObject *event)
{
    PyObject *key, *fd_obj;
    long fd, mask;
    Py_ssize_t i;

    /* event: (SelectorKey(fileobj, fd, events, data), mask) */
    if (!PyTuple_Check(event) || PyTuple_GET_SIZE(event) != 2) {
        return NULL;
    }
    key = PyTuple_GET_ITEM(event, 0);
    if (!PyTuple_Check(key) || PyTuple_GET_SIZE(key) < 2) {
        return NULL;
    }
    fd_obj = PyTuple_GET_ITEM(key, 1);
    mask = PyLong_AsLong(PyTuple_GET_ITEM(event, 1));
    fd = PyLong_AsLong(fd_obj);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return NULL;
    }
    if (!(mask & 1)) {                  /* selectors.EVENT_READ */
        return NULL;
    }
    for (i = 0; i < PyList_GET_SIZE(h->workers); i++) {
        WorkerObject *w = (WorkerObject *)PyList_GET_ITEM(h->workers, i);

        if (ucxx_worker_loop_fd(w) == fd) {
            return w;
        }
    }
    return NULL;
}

/* hook(event_list): the loop's _process_events, ours first. */
static PyObject *
LoopHook_call(LoopHookObject *h, PyObject *const *args, size_t nargsf,
              PyObject *kwnames)
{
    PyObject *events, *rest = NULL, *res;
    Py_ssize_t i, n;

    if (PyVectorcall_NARGS(nargsf) != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError,
                        "_process_events() takes one argument");
        return NULL;
    }
    events = args[0];
    if (!PyList_CheckExact(events) || PyList_GET_SIZE(h->workers) == 0) {
        return PyObject_CallOneArg(h->orig, events);
    }
    n = PyList_GET_SIZE(events);
    for (i = 0; i < n; i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        WorkerObject *w = hook_match(h, ev);

        if (w == NULL) {
            if (rest != NULL && PyList_Append(rest, ev) < 0) {
                Py_DECREF(rest);
                return NULL;
            }
            continue;
        }
        if (rest == NULL) {
            rest = PyList_GetSlice(events, 0, i);
            if (rest == NULL) {
                return NULL;
            }
        }
        /* The reader may close the worker (a callback it runs): keep it. */
        Py_INCREF(w);
        res = ucxx_worker_on_loop_fd(w);
        if (res == NULL) {
            PyErr_WriteUnraisable((PyObject *)w);
        }
        Py_XDECREF(res);
        Py_DECREF(w);
    }
    if (rest != NULL && PyList_GET_SIZE(rest) == 0 && h->orig_is_base) {
        /* Only our fds were ready (the usual case): nothing left to pass. */
        Py_DECREF(rest);
        Py_RETURN_NONE;
    }
    res = PyObject_CallOneArg(h->orig, rest != NULL ? rest : events);
    Py_XDECREF(rest);
    return res;
}

/* The loop's hook if it has ours (new reference), else NULL (no error). */
static LoopHookObject *
hook_of(ucxx_state *st, PyObject *loop)
{
    PyObject *cur = PyObject_GetAttr(loop, st->s_process_events);

    if (cur == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (!Py_IS_TYPE(cur, st->LoopHookType)) {
        Py_DECREF(cur);
        return NULL;
    }
    return (LoopHookObject *)cur;
}

/* Whether `bound` is BaseSelectorEventLoop._process_events itself (not a
 * subclass's override, which might do something on every iteration). */
static int
orig_is_base(ucxx_state *st, PyObject *bound)
{
    PyObject *func = PyObject_GetAttrString(bound, "__func__");
    PyObject *base = PyObject_GetAttr(st->BaseSelectorEventLoop,
                                      st->s_process_events);
    int same = func != NULL && func == base;

    Py_XDECREF(func);
    Py_XDECREF(base);
    PyErr_Clear();
    return same;
}

/* Serve w's loop fd through loop's hook (installed on first use). Returns
 * the hook (new reference), or NULL without an exception when the loop is
 * not a stdlib selector loop (the worker then relies on its reader). */
PyObject *
ucxx_loophook_add(PyObject *loop, WorkerObject *w)
{
    ucxx_state *st = ucxx_state_of((PyObject *)w);
    LoopHookObject *h;
    PyObject *orig;

    if (PyObject_IsInstance(loop, st->BaseSelectorEventLoop) != 1) {
        PyErr_Clear();
        return NULL;
    }
    h = hook_of(st, loop);
    if (h == NULL) {
        orig = PyObject_GetAttr(loop, st->s_process_events);
        if (orig == NULL) {
            PyErr_Clear();
            return NULL;
        }
        h = PyObject_GC_New(LoopHookObject, st->LoopHookType);
        if (h == NULL) {
            Py_DECREF(orig);
            PyErr_Clear();
            return NULL;
        }
        h->vectorcall = (vectorcallfunc)LoopHook_call;
        h->orig = orig;
        h->orig_is_base = orig_is_base(st, orig);
        h->workers = PyList_New(0);
        PyObject_GC_Track(h);
        if (h->workers == NULL ||
            PyObject_SetAttr(loop, st->s_process_events, (PyObject *)h) < 0) {
            Py_DECREF(h);
            PyErr_Clear();
            return NULL;
        }
    }
    if (PyList_Append(h->workers, (PyObject *)w) < 0) {
        Py_DECREF(h);
        PyErr_Clear();
        return NULL;
    }
    return (PyObject *)h;
}

/* Stop serving w; the last worker out restores the loop's own method. */
void
ucxx_loophook_remove(PyObject *hook, PyObject *loop, WorkerObject *w)
{
    ucxx_state *st = ucxx_state_of((PyObject *)w);
    LoopHookObject *h = (LoopHookObject *)hook, *cur;
    Py_ssize_t i;

    for (i = 0; i < PyList_GET_SIZE(h->workers); i++) {
        if (PyList_GET_ITEM(h->workers, i) == (PyObject *)w) {
            PyList_SetSlice(h->workers, i, i + 1, NULL);
            break;
        }
    }
    if (PyList_GET_SIZE(h->workers) > 0) {
        return;
    }
    cur = hook_of(st, loop);
    if (cur == h && PyObject_DelAttr(loop, st->s_process_events) < 0) {
        PyErr_Clear();
    }
    Py_XDECREF(cur);
}

static int
LoopHook_traverse(LoopHookObject *h, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(h));
    Py_VISIT(h->orig);
    Py_VISIT(h->workers);
    return 0;
}

static int
LoopHook_clear(LoopHookObject *h)
{
    Py_CLEAR(h->orig);
    Py_CLEAR(h->workers);
    return 0;
}

static void
LoopHook_dealloc(LoopHookObject *h)
{
    PyTypeObject *tp = Py_TYPE(h);

    PyObject_GC_UnTrack(h);
    LoopHook_clear(h);
    tp->tp_free(h);
    Py_DECREF(tp);
}

static PyObject *
LoopHook_tp_call(PyObject *h, PyObject *args, PyObject *kw)
{
    return PyVectorcall_Call(h, args, kw);
}

static PyObject *
LoopHook_get_workers(LoopHookObject *h, void *c)
{
    return PyList_AsTuple(h->workers);
}

static PyMemberDef LoopHook_members[] = {
    {"__vectorcalloffset__", T_PYSSIZET, offsetof(LoopHookObject, vectorcall),
     READONLY},
    {NULL},
};

static PyGetSetDef LoopHook_getset[] = {
    {"workers", (getter)LoopHook_get_workers, NULL,
     "The workers whose fd this hook serves.", NULL},
    {NULL},
};

PyDoc_STRVAR(LoopHook_doc,
"An event loop's _process_events that first runs the fd readers of its\n"
"ucxx workers (installed by Worker on stdlib selector loops).");

static PyType_Slot LoopHook_slots[] = {
    {Py_tp_doc, (void *)LoopHook_doc},
    {Py_tp_dealloc, LoopHook_dealloc},
    {Py_tp_traverse, LoopHook_traverse},
    {Py_tp_clear, LoopHook_clear},
    {Py_tp_call, LoopHook_tp_call},
    {Py_tp_getset, LoopHook_getset},
    {Py_tp_members, LoopHook_members},
    {0, NULL},
};

PyType_Spec ucxx_loophook_spec = {
    .name = "ucxx._ucxx._LoopHook",
    .basicsize = sizeof(LoopHookObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_DISALLOW_INSTANTIATION |
             Py_TPFLAGS_IMMUTABLETYPE,
    .slots = LoopHook_slots,
};
