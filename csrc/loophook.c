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
 *
 * On loops that keep BaseEventLoop's call_soon, the hook also puts a C
 * call_soon on the instance: the same Handle appended to loop._ready,
 * without the three Python frames (call_soon, _check_closed, _call_soon)
 * that every task wake-up otherwise costs (asyncio's futures and tasks
 * schedule through loop.call_soon).  A closed loop, debug mode or an
 * unexpected keyword go to the loop's own method, with its checks and
 * errors.  It is removed with the hook, as is the C get_debug put there
 * with it (asyncio asks it for every future and task it creates).
 *
 * On Python 3.11 such loops also get a C _run_once (the loop iteration):
 * iterations outside debug mode run in C (select, the hook, the due
 * timers, the ready callbacks, each inline in its context as Handle._run
 * does); those in debug mode or with cancelled timers to drop run the
 * loop's own method.  Removed with the hook.
 */
#include "ucxx.h"
#include <math.h>
#include <sys/epoll.h>

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;   /* LoopHook_call */
    PyObject *orig;      /* strong: the loop's _process_events before us */
    PyObject *workers;   /* strong: list of the WorkerObjects served */
    int orig_is_base;    /* orig is BaseSelectorEventLoop's own method,
                            which does nothing with an empty list */
    PyObject *loop;           /* strong: the loop (NULL: no call_soon) */
    PyObject *ready_append;   /* strong: loop._ready.append */
    PyObject *orig_call_soon; /* strong: the loop's own bound call_soon */
    PyObject *call_soon;      /* strong: ours, installed on the loop */
    /* Where asyncio.Handle keeps its slots, in HANDLE_SLOTS order, when
     * its __slots__ are the ones its __init__ below sets (slots_known;
     * else Handles are made by calling the class and read by attribute) */
    int slots_known;
    Py_ssize_t slot_offset[7];
    PyObject *get_debug;      /* strong: ours, installed on the loop */
    /* Our _run_once (NULL: not installed), see install_run_once. */
    PyObject *run_once;       /* strong: ours, installed on the loop */
    PyObject *orig_run_once;  /* strong: the loop's own bound _run_once */
    PyObject *ready;          /* strong: loop._ready (a deque) */
    PyObject *ready_popleft;  /* strong: loop._ready.popleft */
    PyObject *epoll_selector; /* strong: selectors.EpollSelector, or NULL */
    PyObject *heappop;        /* strong: heapq.heappop */
    PyObject *monotonic;      /* strong: time.monotonic (= loop.time) */
    PyObject *max_timeout;    /* strong: base_events.MAXIMUM_SELECT_TIMEOUT */
    Py_ssize_t min_timers;    /* base_events._MIN_SCHEDULED_TIMER_HANDLES */
    double cancelled_fraction; /* _MIN_CANCELLED_TIMER_HANDLES_FRACTION */
} LoopHookObject;

/* asyncio.Handle.__slots__ without __weakref__. */
static const char *HANDLE_SLOTS[7] = {
    "_callback", "_args", "_cancelled", "_loop", "_source_traceback",
    "_repr", "_context",
};
enum { H_CALLBACK, H_ARGS, H_CANCELLED, H_LOOP, H_TB, H_REPR, H_CONTEXT };

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

/* Whether loop.<name> is False (an error counts as "not False"). */
static int
attr_is_false(PyObject *loop, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(loop, name);

    if (v == NULL) {
        PyErr_Clear();
        return 0;
    }
    Py_DECREF(v);
    return v == Py_False;
}

/* asyncio.Handle(callback, args, loop, context) outside debug mode: what
 * Handle.__init__ does, written into the slots directly when we know them. */
static PyObject *
new_handle(LoopHookObject *h, ucxx_state *st, PyObject *callback,
           PyObject *cbargs, PyObject *context)
{
    PyTypeObject *tp = (PyTypeObject *)st->Handle;
    PyObject *handle, *ctx, *values[7];

    if (!h->slots_known) {
        PyObject *hargs[4] = {callback, cbargs, h->loop, context};

        return PyObject_Vectorcall(st->Handle, hargs, 4, NULL);
    }
    ctx = context == Py_None ? PyContext_CopyCurrent() : Py_NewRef(context);
    if (ctx == NULL) {
        return NULL;
    }
    handle = tp->tp_alloc(tp, 0);
    if (handle == NULL) {
        Py_DECREF(ctx);
        return NULL;
    }
    values[H_CALLBACK] = callback;
    values[H_ARGS] = cbargs;
    values[H_CANCELLED] = Py_False;
    values[H_LOOP] = h->loop;
    values[H_TB] = Py_None;
    values[H_REPR] = Py_None;
    values[H_CONTEXT] = ctx;
    for (int i = 0; i < 7; i++) {
        /* a new object's slots are NULL: what the descriptors' set does */
        *(PyObject **)((char *)handle + h->slot_offset[i]) =
            Py_NewRef(values[i]);
    }
    Py_DECREF(ctx);
    return handle;
}

/* loop.call_soon(callback, *args, context=None): BaseEventLoop.call_soon
 * for an open loop outside debug mode, in C. */
static PyObject *
hook_call_soon(PyObject *self, PyObject *const *args, Py_ssize_t nargs,
               PyObject *kwnames)
{
    LoopHookObject *h = (LoopHookObject *)self;
    ucxx_state *st = ucxx_state_of(self);
    PyObject *context = Py_None, *cbargs, *handle, *res;
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);

    if (h->loop == NULL || nargs < 1 || nkw > 1 ||
        (nkw == 1 && PyTuple_GET_ITEM(kwnames, 0) != st->s_context &&
         PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), st->s_context)) ||
        !attr_is_false(h->loop, st->s_closed) ||
        !attr_is_false(h->loop, st->s_debug)) {
        PyErr_Clear();
        if (h->orig_call_soon == NULL) { /* only after tp_clear */
            PyErr_SetString(PyExc_RuntimeError, "event loop hook cleared");
            return NULL;
        }
        return PyObject_Vectorcall(h->orig_call_soon, args, nargs, kwnames);
    }
    if (nkw == 1) {
        context = args[nargs];
    }
    cbargs = PyTuple_New(nargs - 1);
    if (cbargs == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 1; i < nargs; i++) {
        PyTuple_SET_ITEM(cbargs, i - 1, Py_NewRef(args[i]));
    }
    handle = new_handle(h, st, args[0], cbargs, context);
    Py_DECREF(cbargs);
    if (handle == NULL) {
        return NULL;
    }
    res = PyObject_CallOneArg(h->ready_append, handle);
    if (res == NULL) {
        Py_DECREF(handle);
        return NULL;
    }
    Py_DECREF(res);
    return handle;
}

static PyMethodDef hook_call_soon_def = {
    "call_soon", (PyCFunction)(void (*)(void))hook_call_soon,
    METH_FASTCALL | METH_KEYWORDS,
    "call_soon(callback, *args, context=None)\n--\n\n"
    "BaseEventLoop.call_soon in C (installed by ucxx's loop hook).",
};

/* loop.get_debug(): BaseEventLoop.get_debug (`return self._debug`) in C;
 * asyncio's futures and tasks ask it each time one is created. */
static PyObject *
hook_get_debug(PyObject *self, PyObject *unused)
{
    LoopHookObject *h = (LoopHookObject *)self;

    if (h->loop == NULL) { /* only after tp_clear */
        PyErr_SetString(PyExc_RuntimeError, "event loop hook cleared");
        return NULL;
    }
    return PyObject_GetAttr(h->loop, ucxx_state_of(self)->s_debug);
}

static PyMethodDef hook_get_debug_def = {
    "get_debug", (PyCFunction)hook_get_debug, METH_NOARGS,
    "get_debug()\n--\n\n"
    "BaseEventLoop.get_debug in C (installed by ucxx's loop hook).",
};

/* h->slot_offset[]: where asyncio.Handle keeps its slots, if its
 * __slots__ are exactly HANDLE_SLOTS plus __weakref__, all plain writable
 * object slots (h->slots_known; else it stays 0). */
static void
find_handle_slots(ucxx_state *st, LoopHookObject *h)
{
    PyObject *slots = PyObject_GetAttrString(st->Handle, "__slots__");
    PyObject *dict = PyObject_GetAttrString(st->Handle, "__dict__");
    PyObject *weakref = PyUnicode_FromString("__weakref__");
    int ok = slots != NULL && dict != NULL && weakref != NULL &&
             PyTuple_Check(slots) && PyTuple_GET_SIZE(slots) == 8 &&
             PySequence_Contains(slots, weakref) == 1;

    for (int i = 0; ok && i < 7; i++) {
        PyObject *name = PyUnicode_FromString(HANDLE_SLOTS[i]);
        PyObject *d = NULL;

        ok = name != NULL && PySequence_Contains(slots, name) == 1 &&
             (d = PyObject_GetItem(dict, name)) != NULL &&
             Py_IS_TYPE(d, &PyMemberDescr_Type);
        if (ok) {
            PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;

            ok = m->type == T_OBJECT_EX && !(m->flags & READONLY);
            h->slot_offset[i] = m->offset;
        }
        Py_XDECREF(d);
        Py_XDECREF(name);
    }
    Py_XDECREF(slots);
    Py_XDECREF(dict);
    Py_XDECREF(weakref);
    PyErr_Clear();
    h->slots_known = ok;
}

/* The C _run_once and its helpers exist on Python 3.11 only. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
/* ---- _run_once ------------------------------------------------------------
 *
 * BaseEventLoop._run_once (Python 3.11) in C, outside debug mode: select
 * with timeout 0 if callbacks are ready or the loop is stopping, else until
 * the first timer is due (or without limit), hand the events to
 * _process_events (the hook), move the timers that are due to the ready
 * queue, then run the callbacks that were ready at that point.  An
 * iteration that starts in debug mode, or with cancelled timers to drop
 * (the first timer cancelled, or the clean-up of many), runs the loop's own
 * method.  An EpollSelector is polled directly (what its select() does);
 * other selectors through their select(). */

#define EV_READ 1   /* selectors.EVENT_READ */
#define EV_WRITE 2  /* selectors.EVENT_WRITE */

/* A slot of a Handle (or of a subclass's instance; slots_known): its
 * value (new reference), what the member descriptor's get returns. */
static PyObject *
slot_get(LoopHookObject *h, PyObject *handle, int i)
{
    PyObject *v = *(PyObject **)((char *)handle + h->slot_offset[i]);

    if (v == NULL) {
        PyErr_Format(PyExc_AttributeError, "'%.100s' object has no "
                     "attribute '%s'", Py_TYPE(handle)->tp_name,
                     HANDLE_SLOTS[i]);
        return NULL;
    }
    return Py_NewRef(v);
}

/* handle._cancelled is true: 1, 0, or -1 with an error set. */
static int
handle_cancelled(LoopHookObject *h, ucxx_state *st, PyObject *handle)
{
    PyObject *v = h->slots_known &&
        PyObject_TypeCheck(handle, (PyTypeObject *)st->Handle) ?
        slot_get(h, handle, H_CANCELLED) :
        PyObject_GetAttrString(handle, "_cancelled");
    int rc = v == NULL ? -1 : PyObject_IsTrue(v);

    Py_XDECREF(v);
    return rc;
}

/* Handle._run's `except BaseException` branch: tell the loop's exception
 * handler about exc. */
static int
report_callback_error(LoopHookObject *h, PyObject *handle, PyObject *cb,
                      PyObject *cbargs, PyObject *exc)
{
    PyObject *fh, *src = NULL, *ctx = NULL, *tb = NULL, *loop = NULL;
    PyObject *res = NULL;
    int rc = -1;

    fh = PyImport_ImportModule("asyncio.format_helpers");
    if (fh == NULL) {
        return -1;
    }
    src = PyObject_CallMethod(fh, "_format_callback_source", "OO", cb,
                              cbargs);
    if (src == NULL) {
        goto done;
    }
    ctx = Py_BuildValue("{s:N,s:O,s:O}", "message",
                        PyUnicode_FromFormat("Exception in callback %S", src),
                        "exception", exc, "handle", handle);
    tb = slot_get(h, handle, H_TB);
    loop = slot_get(h, handle, H_LOOP);
    if (ctx == NULL || tb == NULL || loop == NULL) {
        goto done;
    }
    switch (PyObject_IsTrue(tb)) {
    case 1:
        if (PyDict_SetItemString(ctx, "source_traceback", tb) < 0) {
            goto done;
        }
        break;
    case -1:
        goto done;
    }
    res = PyObject_CallMethod(loop, "call_exception_handler", "O", ctx);
    rc = res == NULL ? -1 : 0;
done:
    Py_XDECREF(res);
    Py_XDECREF(loop);
    Py_XDECREF(tb);
    Py_XDECREF(ctx);
    Py_XDECREF(src);
    Py_DECREF(fh);
    return rc;
}

/* handle._run(); inline for asyncio.Handle itself.  -1: an exception to
 * propagate (SystemExit, KeyboardInterrupt, or the handler's own). */
static int
run_handle(LoopHookObject *h, ucxx_state *st, PyObject *handle)
{
    PyObject *cb = NULL, *cbargs = NULL, *ctx = NULL, *res, *exc;
    int rc = -1;

    if (!Py_IS_TYPE(handle, (PyTypeObject *)st->Handle) || !h->slots_known) {
        goto own;
    }
    cb = slot_get(h, handle, H_CALLBACK);
    cbargs = cb == NULL ? NULL : slot_get(h, handle, H_ARGS);
    ctx = cbargs == NULL ? NULL : slot_get(h, handle, H_CONTEXT);
    if (ctx == NULL) {
        goto done;
    }
    if (!PyTuple_CheckExact(cbargs)) { /* unusual: its own _run */
        goto own;
    }
    if (PyContext_Enter(ctx) < 0) {
        res = NULL;
    } else {
        /* what Context.run does */
        res = PyObject_Call(cb, cbargs, NULL);
        if (PyContext_Exit(ctx) < 0) {
            Py_CLEAR(res);
        }
    }
    if (res != NULL) {
        Py_DECREF(res);
        rc = 0;
        goto done;
    }
    exc = PyErr_GetRaisedException_compat();
    if (PyErr_GivenExceptionMatches(exc, PyExc_SystemExit) ||
        PyErr_GivenExceptionMatches(exc, PyExc_KeyboardInterrupt)) {
        PyErr_SetRaisedException_compat(exc);
        goto done;
    }
    rc = report_callback_error(h, handle, cb, cbargs, exc);
    Py_DECREF(exc);
    goto done;
own:
    res = PyObject_CallMethodNoArgs(handle, st->s_run);
    rc = res == NULL ? -1 : 0;
    Py_XDECREF(res);
done:
    Py_XDECREF(cb);
    Py_XDECREF(cbargs);
    Py_XDECREF(ctx);
    return rc;
}

/* selector.select(timeout) (None, 0 or seconds): the event list, or NULL
 * with an exception. */
static PyObject *
hook_select(LoopHookObject *h, ucxx_state *st, PyObject *loop,
            PyObject *timeout)
{
    PyObject *sel, *dict, *fd_to_key = NULL, *ep = NULL, *polled = NULL;
    PyObject *ready = NULL;
    Py_ssize_t i, n;

    sel = PyObject_GetAttr(loop, st->s_selector);
    if (sel == NULL) {
        return NULL;
    }
    if (h->epoll_selector == NULL ||
        !Py_IS_TYPE(sel, (PyTypeObject *)h->epoll_selector)) {
        goto generic;
    }
    dict = PyObject_GenericGetDict(sel, NULL);
    if (dict == NULL) {
        goto error;
    }
    n = PyDict_Contains(dict, st->s_select); /* patched on the instance */
    Py_DECREF(dict);
    if (n != 0) {
        if (n < 0) {
            goto error;
        }
        goto generic;
    }
    fd_to_key = PyObject_GetAttr(sel, st->s_fd_to_key);
    ep = fd_to_key == NULL ? NULL : PyObject_GetAttr(sel, st->s_selector);
    if (ep == NULL) {
        goto error;
    }
    if (!PyDict_Check(fd_to_key)) {
        Py_CLEAR(fd_to_key);
        Py_CLEAR(ep);
        goto generic;
    }
    {
        /* EpollSelector.select's timeout: -1 for None, 0 for <= 0, else
         * rounded up to the millisecond */
        double t = timeout == Py_None ? -1.0 : PyFloat_AsDouble(timeout);
        PyObject *args[3] = {
            ep,
            t == -1.0 && PyErr_Occurred() ? NULL :
            timeout == Py_None ? PyLong_FromLong(-1) :
            t <= 0 ? PyLong_FromLong(0) :
            PyFloat_FromDouble(ceil(t * 1e3) * 1e-3),
            PyLong_FromSsize_t(PyDict_GET_SIZE(fd_to_key) > 1 ?
                               PyDict_GET_SIZE(fd_to_key) : 1)};

        polled = args[1] == NULL || args[2] == NULL ? NULL :
            PyObject_VectorcallMethod(st->s_poll, args,
                                      3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                      NULL);
        Py_XDECREF(args[1]);
        Py_XDECREF(args[2]);
    }
    if (polled == NULL) {
        if (PyErr_ExceptionMatches(PyExc_InterruptedError)) {
            PyErr_Clear();
            ready = PyList_New(0);
        }
        goto done;
    }
    if (!PyList_Check(polled)) {
        PyErr_SetString(PyExc_TypeError, "epoll.poll() returned a non-list");
        goto done;
    }
    ready = PyList_New(0);
    for (i = 0; ready != NULL && i < PyList_GET_SIZE(polled); i++) {
        PyObject *item = PyList_GET_ITEM(polled, i), *key, *kev, *pair;
        long ev, events = 0, want;

        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "epoll.poll(): bad event");
            Py_CLEAR(ready);
            break;
        }
        ev = PyLong_AsLong(PyTuple_GET_ITEM(item, 1));
        if (ev == -1 && PyErr_Occurred()) {
            Py_CLEAR(ready);
            break;
        }
        if (ev & ~EPOLLIN) {
            events |= EV_WRITE;
        }
        if (ev & ~EPOLLOUT) {
            events |= EV_READ;
        }
        key = PyDict_GetItemWithError(fd_to_key, PyTuple_GET_ITEM(item, 0));
        if (key == NULL) {
            if (PyErr_Occurred()) {
                Py_CLEAR(ready);
            }
            continue;
        }
        /* key.events: SelectorKey(fileobj, fd, events, data) */
        if (PyTuple_Check(key) && PyTuple_GET_SIZE(key) == 4) {
            want = PyLong_AsLong(PyTuple_GET_ITEM(key, 2));
        } else {
            kev = PyObject_GetAttrString(key, "events");
            want = kev == NULL ? -1 : PyLong_AsLong(kev);
            Py_XDECREF(kev);
        }
        if (want == -1 && PyErr_Occurred()) {
            Py_CLEAR(ready);
            break;
        }
        kev = PyLong_FromLong(events & want);
        pair = kev == NULL ? NULL : PyTuple_Pack(2, key, kev);
        Py_XDECREF(kev);
        if (pair == NULL || PyList_Append(ready, pair) < 0) {
            Py_XDECREF(pair);
            Py_CLEAR(ready);
            break;
        }
        Py_DECREF(pair);
    }
    goto done;
generic:
    ready = PyObject_CallMethodOneArg(sel, st->s_select, timeout);
    goto done;
error:
    ready = NULL;
done:
    Py_XDECREF(polled);
    Py_XDECREF(ep);
    Py_XDECREF(fd_to_key);
    Py_DECREF(sel);
    return ready;
}

/* The "later" step of _run_once: timers that are due go to the ready
 * queue. */
static int
move_due_timers(LoopHookObject *h, PyObject *loop, PyObject *scheduled)
{
    PyObject *now, *res, *end;
    int rc = -1;

    now = PyObject_CallNoArgs(h->monotonic);
    res = now == NULL ? NULL : PyObject_GetAttrString(loop, "_clock_resolution");
    end = res == NULL ? NULL : PyNumber_Add(now, res);
    Py_XDECREF(now);
    Py_XDECREF(res);
    if (end == NULL) {
        return -1;
    }
    while (PyList_GET_SIZE(scheduled) > 0) {
        PyObject *first = PyList_GET_ITEM(scheduled, 0), *when, *handle;
        int due;

        when = PyObject_GetAttrString(first, "_when");
        due = when == NULL ? -1 : PyObject_RichCompareBool(when, end, Py_LT);
        Py_XDECREF(when);
        if (due <= 0) {
            rc = due;
            goto done;
        }
        handle = PyObject_CallOneArg(h->heappop, scheduled);
        if (handle == NULL ||
            PyObject_SetAttrString(handle, "_scheduled", Py_False) < 0) {
            Py_XDECREF(handle);
            goto done;
        }
        res = PyObject_CallOneArg(h->ready_append, handle);
        Py_DECREF(handle);
        if (res == NULL) {
            goto done;
        }
        Py_DECREF(res);
    }
    rc = 0;
done:
    Py_DECREF(end);
    return rc;
}

/* Whether _run_once's first step (dropping cancelled timers) has nothing
 * to do: fewer than min_timers timers or not enough of them cancelled (the
 * clean-up), and the first one live.  0: it has (the loop's own method
 * does it); -1: error set. */
static int
timers_simple(LoopHookObject *h, ucxx_state *st, PyObject *loop,
              PyObject *scheduled)
{
    Py_ssize_t n = PyList_GET_SIZE(scheduled);
    PyObject *v;
    int rc;

    if (n == 0) {
        return 1;
    }
    if (n > h->min_timers) {
        double count;

        v = PyObject_GetAttrString(loop, "_timer_cancelled_count");
        count = v == NULL ? -1.0 : PyFloat_AsDouble(v);
        Py_XDECREF(v);
        if (count == -1.0 && PyErr_Occurred()) {
            return -1;
        }
        if (count / (double)n > h->cancelled_fraction) {
            return 0;
        }
    }
    rc = handle_cancelled(h, st, PyList_GET_ITEM(scheduled, 0));
    return rc < 0 ? -1 : !rc;
}

/* min(max(0, first._when - loop.time()), MAXIMUM_SELECT_TIMEOUT), as
 * _run_once computes it (new reference). */
static PyObject *
select_timeout(LoopHookObject *h, PyObject *scheduled)
{
    PyObject *when, *now, *t, *zero = NULL;
    int gt;

    when = PyObject_GetAttrString(PyList_GET_ITEM(scheduled, 0), "_when");
    now = when == NULL ? NULL : PyObject_CallNoArgs(h->monotonic);
    t = now == NULL ? NULL : PyNumber_Subtract(when, now);
    Py_XDECREF(when);
    Py_XDECREF(now);
    if (t == NULL || (zero = PyLong_FromLong(0)) == NULL) {
        Py_XDECREF(t);
        return NULL;
    }
    gt = PyObject_RichCompareBool(t, zero, Py_GT); /* max(0, t) */
    if (gt <= 0) {
        Py_SETREF(t, zero);
        zero = NULL;
        if (gt < 0) {
            Py_CLEAR(t);
        }
    }
    Py_XDECREF(zero);
    if (t != NULL) {
        gt = PyObject_RichCompareBool(h->max_timeout, t, Py_LT); /* min() */
        if (gt != 0) {
            Py_SETREF(t, gt > 0 ? Py_NewRef(h->max_timeout) : NULL);
        }
    }
    return t;
}

/* loop._run_once() */
static PyObject *
hook_run_once(PyObject *self, PyObject *unused)
{
    LoopHookObject *h = (LoopHookObject *)self;
    ucxx_state *st = ucxx_state_of(self);
    PyObject *loop = h->loop, *scheduled, *timeout, *events, *res = NULL, *v;
    Py_ssize_t ntodo, i;
    int busy;

    if (h->orig_run_once == NULL) { /* only after tp_clear */
        PyErr_SetString(PyExc_RuntimeError, "event loop hook cleared");
        return NULL;
    }
    scheduled = PyObject_GetAttr(loop, st->s_scheduled);
    if (scheduled == NULL) {
        return NULL;
    }
    Py_INCREF(self); /* a callback may remove the hook */
    Py_INCREF(loop);
    if (!PyList_CheckExact(scheduled) || !attr_is_false(loop, st->s_debug)) {
        goto own;
    }
    switch (timers_simple(h, st, loop, scheduled)) {
    case 0:
        goto own;
    case -1:
        goto done;
    }
    busy = PyObject_Size(h->ready) > 0;
    if (!busy) {
        v = PyObject_GetAttr(loop, st->s_stopping);
        busy = v == NULL ? -1 : PyObject_IsTrue(v);
        Py_XDECREF(v);
        if (busy < 0) {
            goto done;
        }
    }
    timeout = busy ? PyLong_FromLong(0) :
        PyList_GET_SIZE(scheduled) > 0 ? select_timeout(h, scheduled) :
        Py_NewRef(Py_None);
    if (timeout == NULL) {
        goto done;
    }
    events = hook_select(h, st, loop, timeout);
    Py_DECREF(timeout);
    if (events == NULL) {
        goto done;
    }
    v = PyObject_CallMethodOneArg(loop, st->s_process_events, events);
    Py_DECREF(events);
    if (v == NULL) {
        goto done;
    }
    Py_DECREF(v);
    /* (only the loop's own _run_once replaces the list) */
    if (PyList_GET_SIZE(scheduled) > 0 &&
        move_due_timers(h, loop, scheduled) < 0) {
        goto done;
    }
    /* Run what is ready now; what those callbacks schedule waits. */
    ntodo = PyObject_Size(h->ready);
    for (i = 0; i < ntodo; i++) {
        PyObject *handle = PyObject_CallNoArgs(h->ready_popleft);
        int cancelled;

        if (handle == NULL) {
            goto done;
        }
        cancelled = handle_cancelled(h, st, handle);
        if (cancelled == 0 && run_handle(h, st, handle) < 0) {
            cancelled = -1;
        }
        Py_DECREF(handle);
        if (cancelled < 0) {
            goto done;
        }
    }
    if (ntodo >= 0) {
        res = Py_NewRef(Py_None);
    }
    goto done;
own:
    res = PyObject_CallNoArgs(h->orig_run_once);
done:
    Py_DECREF(scheduled);
    Py_DECREF(loop);
    Py_DECREF(self);
    return res;
}

static PyMethodDef hook_run_once_def = {
    "_run_once", (PyCFunction)hook_run_once, METH_NOARGS,
    "_run_once()\n--\n\n"
    "BaseEventLoop._run_once in C outside debug mode (installed by ucxx's\n"
    "loop hook).",
};
#endif

/* Drop what our _run_once holds. */
static void
clear_run_once(LoopHookObject *h)
{
    Py_CLEAR(h->run_once);
    Py_CLEAR(h->orig_run_once);
    Py_CLEAR(h->ready);
    Py_CLEAR(h->ready_popleft);
    Py_CLEAR(h->epoll_selector);
    Py_CLEAR(h->heappop);
    Py_CLEAR(h->monotonic);
    Py_CLEAR(h->max_timeout);
}

/* Drop what our call_soon (and _run_once, which needs it) holds. */
static void
clear_call_soon(LoopHookObject *h)
{
    clear_run_once(h);
    Py_CLEAR(h->loop);
    Py_CLEAR(h->ready_append);
    Py_CLEAR(h->orig_call_soon);
    Py_CLEAR(h->call_soon);
    Py_CLEAR(h->get_debug);
    h->slots_known = 0;
}

/* Whether type(loop).<name> is BaseEventLoop.<name> (errors: no). */
static int
keeps_base(ucxx_state *st, PyObject *loop, PyObject *name)
{
    PyObject *mine = PyObject_GetAttr((PyObject *)Py_TYPE(loop), name);
    PyObject *base = PyObject_GetAttr(st->BaseEventLoop, name);
    int same = mine != NULL && mine == base;

    Py_XDECREF(mine);
    Py_XDECREF(base);
    PyErr_Clear();
    return same;
}

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
/* A module attribute (new reference), or NULL (error set). */
static PyObject *
module_attr(const char *module, const char *name)
{
    PyObject *m = PyImport_ImportModule(module), *v;

    if (m == NULL) {
        return NULL;
    }
    v = PyObject_GetAttrString(m, name);
    Py_DECREF(m);
    return v;
}
#endif

/* Put our _run_once on the loop, after our call_soon: on Python 3.11,
 * whose _run_once it follows, when the loop runs BaseEventLoop._run_once,
 * its class keeps BaseEventLoop.time (time.monotonic) and its ready queue
 * is a deque. */
static void
install_run_once(ucxx_state *st, LoopHookObject *h, PyObject *loop)
{
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
    PyObject *deque, *base;
    int ok;

    /* loop._run_once must be BaseEventLoop's, bound to the loop (not a
     * subclass's, nor one already patched onto the instance) */
    h->orig_run_once = PyObject_GetAttr(loop, st->s_run_once);
    base = PyObject_GetAttr(st->BaseEventLoop, st->s_run_once);
    ok = h->orig_run_once != NULL && base != NULL &&
         PyMethod_Check(h->orig_run_once) &&
         PyMethod_GET_FUNCTION(h->orig_run_once) == base &&
         PyMethod_GET_SELF(h->orig_run_once) == loop;
    Py_XDECREF(base);
    if (!ok) {
        PyErr_Clear();
        clear_run_once(h);
        return;
    }
    deque = module_attr("collections", "deque");
    h->ready = PyObject_GetAttrString(loop, "_ready");
    ok = deque != NULL && h->ready != NULL && Py_IS_TYPE(h->ready,
                                                         (PyTypeObject *)deque);
    Py_XDECREF(deque);
    ok = ok && keeps_base(st, loop, st->s_time);
    if (ok) {
        PyObject *n = module_attr("asyncio.base_events",
                                  "_MIN_SCHEDULED_TIMER_HANDLES");
        PyObject *f = n == NULL ? NULL :
            module_attr("asyncio.base_events",
                        "_MIN_CANCELLED_TIMER_HANDLES_FRACTION");

        h->min_timers = n == NULL ? -1 : PyLong_AsSsize_t(n);
        h->cancelled_fraction = f == NULL ? -1.0 : PyFloat_AsDouble(f);
        Py_XDECREF(n);
        Py_XDECREF(f);
        h->max_timeout = module_attr("asyncio.base_events",
                                     "MAXIMUM_SELECT_TIMEOUT");
        h->monotonic = module_attr("time", "monotonic");
        ok = !PyErr_Occurred() && h->max_timeout != NULL &&
             h->monotonic != NULL;
    }
    if (ok) {
        h->ready_popleft = PyObject_GetAttrString(h->ready, "popleft");
        h->heappop = module_attr("heapq", "heappop");
        h->epoll_selector = module_attr("selectors", "EpollSelector");
        PyErr_Clear(); /* no epoll: every selector goes through select() */
        h->run_once = PyCMethod_New(&hook_run_once_def, (PyObject *)h, NULL,
                                    NULL);
        ok = h->ready_popleft != NULL && h->heappop != NULL &&
             h->orig_run_once != NULL && h->run_once != NULL &&
             PyObject_SetAttr(loop, st->s_run_once, h->run_once) == 0;
    }
    if (!ok) {
        PyErr_Clear();
        clear_run_once(h);
    }
#endif
}

/* Put our call_soon on the loop when its class keeps BaseEventLoop's
 * call_soon and _call_soon (a subclass may do more there). */
static void
install_call_soon(ucxx_state *st, LoopHookObject *h, PyObject *loop)
{
    PyObject *ready, *name = PyUnicode_InternFromString("_call_soon");
    int same = name != NULL && keeps_base(st, loop, st->s_call_soon) &&
               keeps_base(st, loop, name);

    Py_XDECREF(name);
    if (!same) {
        PyErr_Clear();
        return;
    }
    ready = PyObject_GetAttrString(loop, "_ready");
    if (ready == NULL) {
        PyErr_Clear();
        return;
    }
    h->ready_append = PyObject_GetAttrString(ready, "append");
    Py_DECREF(ready);
    h->orig_call_soon = PyObject_GetAttr(loop, st->s_call_soon);
    h->call_soon = PyCMethod_New(&hook_call_soon_def, (PyObject *)h, NULL,
                                 NULL);
    if (h->ready_append == NULL || h->orig_call_soon == NULL ||
        h->call_soon == NULL ||
        PyObject_SetAttr(loop, st->s_call_soon, h->call_soon) < 0) {
        PyErr_Clear();
        clear_call_soon(h);
        return;
    }
    h->loop = Py_NewRef(loop);
    find_handle_slots(st, h);
    if (keeps_base(st, loop, st->s_get_debug)) {
        h->get_debug = PyCMethod_New(&hook_get_debug_def, (PyObject *)h,
                                     NULL, NULL);
        if (h->get_debug == NULL ||
            PyObject_SetAttr(loop, st->s_get_debug, h->get_debug) < 0) {
            PyErr_Clear();
            Py_CLEAR(h->get_debug);
        }
    }
    install_run_once(st, h, loop);
}

/* Take our method `mine` off the loop's `name` (if it is still there).
 * What it holds stays until the hook goes, so that a reference taken while
 * it was installed (`cs = loop.call_soon`) keeps working. */
static void
remove_method(PyObject *loop, PyObject *name, PyObject *mine)
{
    PyObject *dict, *cur;

    if (mine == NULL) {
        return;
    }
    dict = PyObject_GenericGetDict(loop, NULL);
    if (dict != NULL) {
        cur = PyDict_GetItemWithError(dict, name);
        if (cur == mine && PyDict_DelItem(dict, name) < 0) {
            PyErr_Clear();
        }
        Py_DECREF(dict);
    }
    PyErr_Clear();
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
 * not a stdlib selector loop or UCXX_LOOP_HOOK=0 is set (the worker then
 * relies on its reader). */
PyObject *
ucxx_loophook_add(PyObject *loop, WorkerObject *w)
{
    ucxx_state *st = ucxx_state_of((PyObject *)w);
    const char *env = getenv("UCXX_LOOP_HOOK");
    LoopHookObject *h;
    PyObject *orig;

    if ((env != NULL && strcmp(env, "0") == 0) ||
        PyObject_IsInstance(loop, st->BaseSelectorEventLoop) != 1) {
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
        h->loop = h->ready_append = h->orig_call_soon = h->call_soon = NULL;
        h->get_debug = NULL;
        h->slots_known = 0;
        h->run_once = h->orig_run_once = h->ready = h->ready_popleft = NULL;
        h->epoll_selector = h->heappop = h->monotonic = NULL;
        h->max_timeout = NULL;
        PyObject_GC_Track(h);
        if (h->workers == NULL ||
            PyObject_SetAttr(loop, st->s_process_events, (PyObject *)h) < 0) {
            Py_DECREF(h);
            PyErr_Clear();
            return NULL;
        }
        install_call_soon(st, h, loop);
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
    remove_method(loop, st->s_run_once, h->run_once);
    remove_method(loop, st->s_call_soon, h->call_soon);
    remove_method(loop, st->s_get_debug, h->get_debug);
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
    Py_VISIT(h->loop);
    Py_VISIT(h->ready_append);
    Py_VISIT(h->orig_call_soon);
    Py_VISIT(h->call_soon);
    Py_VISIT(h->get_debug);
    Py_VISIT(h->run_once);
    Py_VISIT(h->orig_run_once);
    Py_VISIT(h->ready);
    Py_VISIT(h->ready_popleft);
    Py_VISIT(h->epoll_selector);
    Py_VISIT(h->heappop);
    Py_VISIT(h->monotonic);
    Py_VISIT(h->max_timeout);
    return 0;
}

static int
LoopHook_clear(LoopHookObject *h)
{
    Py_CLEAR(h->orig);
    Py_CLEAR(h->workers);
    clear_call_soon(h);
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
