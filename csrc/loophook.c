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
 * errors.  It is removed with the hook.
 */
#include "ucxx.h"

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
    /* strong: asyncio.Handle's slot descriptors, in HANDLE_SLOTS order,
     * when its __slots__ are the ones its __init__ below sets (else NULL:
     * Handles are made by calling the class) */
    PyObject *handle_slot[7];
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

    if (h->handle_slot[0] == NULL) {
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
        PyObject *d = h->handle_slot[i];

        if (Py_TYPE(d)->tp_descr_set(d, handle, values[i]) < 0) {
            Py_DECREF(ctx);
            Py_DECREF(handle);
            return NULL;
        }
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

/* h->handle_slot[]: asyncio.Handle's member descriptors, if its __slots__
 * are exactly HANDLE_SLOTS plus __weakref__ (else all NULL). */
static void
find_handle_slots(ucxx_state *st, LoopHookObject *h)
{
    PyObject *slots = PyObject_GetAttrString(st->Handle, "__slots__");
    PyObject *dict = PyObject_GetAttrString(st->Handle, "__dict__");
    PyObject *weakref = PyUnicode_FromString("__weakref__");
    int ok = slots != NULL && dict != NULL && weakref != NULL &&
             PyTuple_Check(slots) && PyTuple_GET_SIZE(slots) == 8 &&
             PySequence_Contains(slots, weakref) == 1;

    for (int i = 0; i < 7; i++) {
        PyObject *name = ok ? PyUnicode_FromString(HANDLE_SLOTS[i]) : NULL;

        ok = name != NULL && PySequence_Contains(slots, name) == 1;
        h->handle_slot[i] = ok ? PyObject_GetItem(dict, name) : NULL;
        ok = ok && h->handle_slot[i] != NULL &&
             Py_IS_TYPE(h->handle_slot[i], &PyMemberDescr_Type);
        Py_XDECREF(name);
    }
    Py_XDECREF(slots);
    Py_XDECREF(dict);
    Py_XDECREF(weakref);
    PyErr_Clear();
    if (!ok) {
        for (int i = 0; i < 7; i++) {
            Py_CLEAR(h->handle_slot[i]);
        }
    }
}

/* Drop what our call_soon holds. */
static void
clear_call_soon(LoopHookObject *h)
{
    Py_CLEAR(h->loop);
    Py_CLEAR(h->ready_append);
    Py_CLEAR(h->orig_call_soon);
    Py_CLEAR(h->call_soon);
    for (int i = 0; i < 7; i++) {
        Py_CLEAR(h->handle_slot[i]);
    }
}

/* Put our call_soon on the loop when its class keeps BaseEventLoop's
 * call_soon and _call_soon (a subclass may do more there). */
static void
install_call_soon(ucxx_state *st, LoopHookObject *h, PyObject *loop)
{
    static const char *names[] = {"call_soon", "_call_soon"};
    PyObject *ready;

    for (size_t i = 0; i < 2; i++) {
        PyObject *mine = PyObject_GetAttrString((PyObject *)Py_TYPE(loop),
                                                names[i]);
        PyObject *base = PyObject_GetAttrString(st->BaseEventLoop, names[i]);
        int same = mine != NULL && mine == base;

        Py_XDECREF(mine);
        Py_XDECREF(base);
        if (!same) {
            PyErr_Clear();
            return;
        }
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
}

/* Take our call_soon off the loop (if it is still there).  What it holds
 * stays until the hook goes, so that a reference taken while it was
 * installed (`cs = loop.call_soon`) keeps working. */
static void
remove_call_soon(ucxx_state *st, LoopHookObject *h, PyObject *loop)
{
    PyObject *dict, *cur;

    if (h->call_soon == NULL) {
        return;
    }
    dict = PyObject_GenericGetDict(loop, NULL);
    if (dict != NULL) {
        cur = PyDict_GetItemWithError(dict, st->s_call_soon);
        if (cur == h->call_soon && PyDict_DelItem(dict, st->s_call_soon) < 0) {
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
        h->loop = h->ready_append = h->orig_call_soon = h->call_soon = NULL;
        memset(h->handle_slot, 0, sizeof(h->handle_slot));
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
    remove_call_soon(st, h, loop);
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
    for (int i = 0; i < 7; i++) {
        Py_VISIT(h->handle_slot[i]);
    }
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
