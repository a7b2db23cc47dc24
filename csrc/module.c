/*
 * module.c - the module ucxx._ucxx: multi-phase init, module state, the
 * heap types, constants, get_ucx_version() and get_config().
 * Owns the module state; nothing here touches CUDA or creates a context.
 */
#include "ucxx.h"

volatile unsigned long ucxx_fork_generation;

static void
atfork_child(void)
{
    ucxx_fork_generation++;
}

PyObject *
ucxx_module_from_type(PyTypeObject *tp)
{
    /* A Python subclass of one of our types (the public ucxx.Endpoint)
     * has no module of its own: its C base has, the one heap type in the
     * chain whose base (object) is not a heap type.  Found by walking up
     * rather than by PyType_GetModuleByDef, stable only from 3.13, or by
     * PyType_GetModule, which raises on the subclass. */
    PyTypeObject *base;

    if (PyType_GetFlags(tp) & Py_TPFLAGS_BASETYPE) {
        while ((base = (PyTypeObject *)PyType_GetSlot(tp, Py_tp_base)) !=
                   NULL &&
               (PyType_GetFlags(base) & Py_TPFLAGS_HEAPTYPE)) {
            tp = base;
        }
    }
    return PyType_GetModule(tp);
}

ucxx_state *
ucxx_state_from_type(PyTypeObject *tp)
{
    PyObject *mod = ucxx_module_from_type(tp);

    return mod != NULL ? (ucxx_state *)PyModule_GetState(mod) : NULL;
}

/* PyObject_CallFinalizerFromDealloc, which the limited API lacks: run the
 * type's tp_finalize once, the object resurrected meanwhile.  A Python
 * subclass's dealloc has run it already (PyObject_GC_IsFinalized); our own
 * flag stands for the GC's mark, so that a resurrected object (a warning
 * filter keeping the ResourceWarning's source) is not finalized twice.
 * -1: the finalizer resurrected it, dealloc must stop. */
int
ucxx_finalize_from_dealloc(PyObject *self, int *finalized)
{
    destructor fin;
    Py_ssize_t refcnt;

    if (*finalized || PyObject_GC_IsFinalized(self)) {
        return 0;
    }
    *finalized = 1;
    fin = (destructor)PyType_GetSlot(Py_TYPE(self), Py_tp_finalize);
    if (fin == NULL) {
        return 0;
    }
    Py_SET_REFCNT(self, 1);
    fin(self);
    refcnt = Py_REFCNT(self) - 1;
    Py_SET_REFCNT(self, refcnt);
    return refcnt > 0 ? -1 : 0;
}

ucxx_state *
ucxx_state_of(PyObject *obj)
{
    return ucxx_state_from_type(Py_TYPE(obj));
}

/* throw(typ[, val[, tb]]) of the coroutine protocol, as generators take
 * it: sets the exception to raise and returns NULL. */
PyObject *
ucxx_throw(PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *typ, *val = NULL, *tb = NULL, *exc;

    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "throw() takes 1 to 3 arguments");
        return NULL;
    }
    typ = args[0];
    if (nargs > 1 && args[1] != Py_None) {
        val = args[1];
    }
    if (nargs > 2 && args[2] != Py_None) {
        tb = args[2];
        if (!PyTraceBack_Check(tb)) {
            PyErr_SetString(PyExc_TypeError,
                            "throw() third argument must be a traceback "
                            "object");
            return NULL;
        }
    }
    if (PyExceptionInstance_Check(typ)) {
        if (val != NULL) {
            PyErr_SetString(PyExc_TypeError,
                            "instance exception may not have a separate "
                            "value");
            return NULL;
        }
        PyErr_SetObject((PyObject *)Py_TYPE(typ), typ);
    } else if (PyExceptionClass_Check(typ)) {
        PyErr_SetObject(typ, val);
    } else {
        ucxx_type_error("exceptions must be classes or instances deriving "
                        "from BaseException, not %U", typ);
        return NULL;
    }
    if (tb != NULL) {
        exc = PyErr_GetRaisedException_compat();
        PyException_SetTraceback(exc, tb);
        PyErr_SetRaisedException_compat(exc);
    }
    return NULL;
}

PyDoc_STRVAR(get_ucx_version_doc,
"get_ucx_version($module, /)\n--\n\n"
"Version (major, minor, release) of the UCX library loaded at run time.");

static PyObject *
get_ucx_version(PyObject *module, PyObject *unused)
{
    unsigned major, minor, release;

    ucp_get_version(&major, &minor, &release);
    return Py_BuildValue("(III)", major, minor, release);
}

PyDoc_STRVAR(get_config_doc,
"get_config($module, /, options=None)\n--\n\n"
"UCX configuration {NAME: value} (no UCX_ prefix) after applying options.\n"
"Creates no context.");

PyDoc_STRVAR(status_exception_doc,
"_status_exception($module, status, /)\n--\n\n"
"The exception instance a UCX error status (a negative ucs_status_t)\n"
"becomes: the one mapping of csrc/status.c.");

/* The timer callback of a slice yield (engine.c): the awaiting task may
 * have been cancelled meanwhile (asyncio.run cancelling every task on
 * exit), and set_result on its cancelled future would raise in the loop. */
static PyObject *
slice_wake(PyObject *module, PyObject *fut)
{
    ucxx_state *st = PyModule_GetState(module);
    PyObject *done = PyObject_CallMethodObjArgs(fut, st->s_done, NULL);
    int is_done;

    if (done == NULL) {
        return NULL;
    }
    is_done = PyObject_IsTrue(done);
    Py_DECREF(done);
    if (is_done < 0) {
        return NULL;
    }
    if (is_done) {
        Py_RETURN_NONE;
    }
    return PyObject_CallMethodObjArgs(fut, st->s_set_result, Py_None, NULL);
}

static PyMethodDef module_methods[] = {
    {"get_ucx_version", get_ucx_version, METH_NOARGS, get_ucx_version_doc},
    {"get_config", (PyCFunction)(void (*)(void))ucxx_get_config,
     METH_VARARGS | METH_KEYWORDS, get_config_doc},
    {"_status_exception", ucxx_status_exception, METH_O,
     status_exception_doc},
    {"_slice_wake", slice_wake, METH_O,
     "_slice_wake($module, fut, /)\n--\n\n"
     "Resolve a slice yield's future unless it is done (cancelled)."},
    {NULL, NULL, 0, NULL},
};

static int
add_type(PyObject *m, PyType_Spec *spec, PyTypeObject **slot)
{
    *slot = (PyTypeObject *)PyType_FromModuleAndSpec(m, spec, NULL);
    if (*slot == NULL) {
        return -1;
    }
    return PyModule_AddType(m, *slot);
}

static int
intern(PyObject **slot, const char *s)
{
    *slot = PyUnicode_InternFromString(s);
    return *slot == NULL ? -1 : 0;
}

static int
module_exec(PyObject *m)
{
    ucxx_state *st = PyModule_GetState(m);
    PyObject *asyncio = NULL, *abc = NULL, *coro = NULL, *res = NULL;
    static int atfork_registered;

    if (!atfork_registered) {
        pthread_atfork(NULL, NULL, atfork_child);
        atfork_registered = 1;
    }
    if (ucxx_status_init(m, st) < 0) {
        return -1;
    }
    if (add_type(m, &ucxx_context_spec, &st->ContextType) < 0 ||
        add_type(m, &ucxx_worker_spec, &st->WorkerType) < 0 ||
        add_type(m, &ucxx_endpoint_spec, &st->EndpointType) < 0 ||
        add_type(m, &ucxx_listener_spec, &st->ListenerType) < 0 ||
        add_type(m, &ucxx_request_spec, &st->RequestType) < 0 ||
        add_type(m, &ucxx_progress_spec, &st->ProgressType) < 0) {
        return -1;
    }
    if (intern(&st->s_create_future, "create_future") < 0 ||
        intern(&st->s_create_task, "create_task") < 0 ||
        intern(&st->s_set_result, "set_result") < 0 ||
        intern(&st->s_set_exception, "set_exception") < 0 ||
        intern(&st->s_call_soon, "call_soon") < 0 ||
        intern(&st->s_call_later, "call_later") < 0 ||
        intern(&st->s_is_closed, "is_closed") < 0 ||
        intern(&st->s_done, "done") < 0 ||
        intern(&st->s_blocking, "_asyncio_future_blocking") < 0) {
        return -1;
    }

    asyncio = PyImport_ImportModule("asyncio");
    if (asyncio == NULL) {
        goto error;
    }
    st->get_running_loop = PyObject_GetAttrString(asyncio, "get_running_loop");
    st->CancelledError = PyObject_GetAttrString(asyncio, "CancelledError");
    st->InvalidStateError = PyObject_GetAttrString(asyncio,
                                                   "InvalidStateError");
    st->BaseEventLoop = PyObject_GetAttrString(asyncio, "BaseEventLoop");
    st->Future = PyObject_GetAttrString(asyncio, "Future");
    st->slice_wake = PyObject_GetAttrString(m, "_slice_wake");
    st->empty_tuple = PyTuple_New(0);
    st->zero = PyLong_FromLong(0);
    if (st->get_running_loop == NULL || st->CancelledError == NULL ||
        st->InvalidStateError == NULL ||
        st->BaseEventLoop == NULL || st->Future == NULL ||
        st->empty_tuple == NULL || st->zero == NULL || st->slice_wake == NULL) {
        goto error;
    }

    /* asyncio accepts the C progress coroutine as a coroutine. */
    abc = PyImport_ImportModule("collections.abc");
    if (abc == NULL) {
        goto error;
    }
    coro = PyObject_GetAttrString(abc, "Coroutine");
    if (coro == NULL) {
        goto error;
    }
    res = PyObject_CallMethod(coro, "register", "O", st->ProgressType);
    if (res == NULL) {
        goto error;
    }

    if (PyModule_AddObject(m, "UCX_BUILD_VERSION",
                           Py_BuildValue("(iii)", UCP_API_MAJOR, UCP_API_MINOR,
                                         0)) < 0 ||
        PyModule_AddIntConstant(m, "FEATURE_TAG", UCP_FEATURE_TAG) < 0 ||
        PyModule_AddIntConstant(m, "FEATURE_RMA", UCP_FEATURE_RMA) < 0 ||
        PyModule_AddIntConstant(m, "FEATURE_AMO32", UCP_FEATURE_AMO32) < 0 ||
        PyModule_AddIntConstant(m, "FEATURE_AMO64", UCP_FEATURE_AMO64) < 0 ||
        PyModule_AddIntConstant(m, "FEATURE_WAKEUP", UCP_FEATURE_WAKEUP) < 0 ||
        PyModule_AddIntConstant(m, "FEATURE_STREAM", UCP_FEATURE_STREAM) < 0 ||
        PyModule_AddIntConstant(m, "FEATURE_AM", UCP_FEATURE_AM) < 0 ||
        PyModule_AddIntConstant(m, "DEFAULT_FEATURES",
                                UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP |
                                UCP_FEATURE_STREAM | UCP_FEATURE_AM) < 0 ||
        PyModule_AddIntConstant(m, "MEMORY_TYPE_HOST",
                                UCS_MEMORY_TYPE_HOST) < 0 ||
        PyModule_AddIntConstant(m, "MEMORY_TYPE_CUDA",
                                UCS_MEMORY_TYPE_CUDA) < 0 ||
        PyModule_AddIntConstant(m, "MEMORY_TYPE_UNKNOWN",
                                UCS_MEMORY_TYPE_UNKNOWN) < 0) {
        goto error;
    }
    Py_DECREF(res);
    Py_DECREF(coro);
    Py_DECREF(abc);
    Py_DECREF(asyncio);
    return 0;

error:
    Py_XDECREF(res);
    Py_XDECREF(coro);
    Py_XDECREF(abc);
    Py_XDECREF(asyncio);
    return -1;
}

static int
module_traverse(PyObject *m, visitproc visit, void *arg)
{
    ucxx_state *st = PyModule_GetState(m);

    Py_VISIT(st->ContextType);
    Py_VISIT(st->WorkerType);
    Py_VISIT(st->EndpointType);
    Py_VISIT(st->ListenerType);
    Py_VISIT(st->RequestType);
    Py_VISIT(st->ProgressType);
    for (int i = 0; i < UCXX_EXC_COUNT; i++) {
        Py_VISIT(st->exc[i]);
    }
    Py_VISIT(st->get_running_loop);
    Py_VISIT(st->slice_wake);
    Py_VISIT(st->CancelledError);
    Py_VISIT(st->InvalidStateError);
    Py_VISIT(st->BaseEventLoop);
    Py_VISIT(st->Future);
    Py_VISIT(st->empty_tuple);
    return 0;
}

static int
module_clear(PyObject *m)
{
    ucxx_state *st = PyModule_GetState(m);

    ucxx_request_freelist_clear(st);
    Py_CLEAR(st->ContextType);
    Py_CLEAR(st->WorkerType);
    Py_CLEAR(st->EndpointType);
    Py_CLEAR(st->ListenerType);
    Py_CLEAR(st->RequestType);
    Py_CLEAR(st->ProgressType);
    for (int i = 0; i < UCXX_EXC_COUNT; i++) {
        Py_CLEAR(st->exc[i]);
    }
    Py_CLEAR(st->get_running_loop);
    Py_CLEAR(st->slice_wake);
    Py_CLEAR(st->CancelledError);
    Py_CLEAR(st->InvalidStateError);
    Py_CLEAR(st->BaseEventLoop);
    Py_CLEAR(st->Future);
    Py_CLEAR(st->empty_tuple);
    Py_CLEAR(st->s_create_future);
    Py_CLEAR(st->s_create_task);
    Py_CLEAR(st->s_set_result);
    Py_CLEAR(st->s_set_exception);
    Py_CLEAR(st->s_call_soon);
    Py_CLEAR(st->s_call_later);
    Py_CLEAR(st->zero);
    Py_CLEAR(st->s_is_closed);
    Py_CLEAR(st->s_done);
    Py_CLEAR(st->s_blocking);
    return 0;
}

static void
module_free(void *m)
{
    module_clear((PyObject *)m);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc,
"UCX workers, endpoints, listeners and tagged transfers for asyncio.");

PyModuleDef ucxx_module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "ucxx._ucxx",
    .m_doc = module_doc,
    .m_size = sizeof(ucxx_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC
PyInit__ucxx(void)
{
    return PyModuleDef_Init(&ucxx_module_def);
}
