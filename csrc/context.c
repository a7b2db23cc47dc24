/*
 * context.c - Context wraps ucp_context_h (ucp_init).  Owns the context and
 * its config dict; close() or dealloc releases it (workers keep a strong
 * reference, so it outlives them; dealloc of an open one warns).  Also
 * get_config() without a context.
 */
#include "ucxx.h"
#include <stdio.h>

/* Parse "UCX_NAME=value" lines of ucp_config_print into a dict. */
PyObject *
ucxx_config_to_dict(const ucp_config_t *config)
{
    char *text = NULL, *line, *save = NULL;
    size_t size = 0;
    FILE *f = open_memstream(&text, &size);
    PyObject *d;

    if (f == NULL) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    ucp_config_print(config, f, NULL, UCS_CONFIG_PRINT_CONFIG);
    fclose(f);
    d = PyDict_New();
    if (d == NULL) {
        free(text);
        return NULL;
    }
    for (line = strtok_r(text, "\n", &save); line != NULL;
         line = strtok_r(NULL, "\n", &save)) {
        char *eq = strchr(line, '=');
        PyObject *v;
        int rc;

        if (strncmp(line, "UCX_", 4) != 0 || eq == NULL) {
            continue;
        }
        *eq = '\0';
        v = PyUnicode_DecodeUTF8(eq + 1, strlen(eq + 1), "replace");
        if (v == NULL) {
            goto error;
        }
        rc = PyDict_SetItemString(d, line + 4, v);
        Py_DECREF(v);
        if (rc < 0) {
            goto error;
        }
    }
    free(text);
    return d;

error:
    free(text);
    Py_DECREF(d);
    return NULL;
}

/* Apply {NAME: value} (no UCX_ prefix) to config; a name or value UCX
 * refuses raises UCXInvalidOptionError (a UCXConfigError and a
 * UCXInvalidParamError) naming the option. */
int
ucxx_config_apply(ucxx_state *st, ucp_config_t *config, PyObject *opts,
                  int env_takes_precedence)
{
    PyObject *key, *value;
    Py_ssize_t pos = 0;

    if (opts == NULL || opts == Py_None) {
        return 0;
    }
    if (!PyDict_Check(opts)) {
        return ucxx_type_error("options must be a dict, not '%U'", opts);
    }
    while (PyDict_Next(opts, &pos, &key, &value)) {
        const char *k, *v;
        PyObject *vs;
        ucs_status_t status;
        char env[256];

        if (!PyUnicode_Check(key)) {
            PyErr_Format(PyExc_TypeError, "option names must be str, not %R",
                         key);
            return -1;
        }
        k = PyUnicode_AsUTF8AndSize(key, NULL);
        if (k == NULL) {
            return -1;
        }
        if (strncmp(k, "UCX_", 4) == 0) {
            k += 4;
        }
        snprintf(env, sizeof(env), "UCX_%s", k);
        if (env_takes_precedence && getenv(env) != NULL) {
            continue;
        }
        vs = PyObject_Str(value);
        if (vs == NULL) {
            return -1;
        }
        v = PyUnicode_AsUTF8AndSize(vs, NULL);
        if (v == NULL) {
            Py_DECREF(vs);
            return -1;
        }
        status = ucp_config_modify(config, k, v);
        if (status != UCS_OK) {
            if (status == UCS_ERR_NO_ELEM) {
                ucxx_raise(st, UCXX_EXC_INVALID_OPTION,
                           "unknown UCX option %R", key);
            } else {
                ucxx_raise(st, UCXX_EXC_INVALID_OPTION,
                           "invalid value %R for UCX option %R: %s", vs, key,
                           ucs_status_string(status));
            }
            Py_DECREF(vs);
            return -1;
        }
        Py_DECREF(vs);
    }
    return 0;
}

static ucp_config_t *
config_read(ucxx_state *st, PyObject *opts, int env_takes_precedence)
{
    ucp_config_t *config;
    ucs_status_t status = ucp_config_read(NULL, NULL, &config);

    if (status != UCS_OK) {
        ucxx_raise_status(st, status, "ucp_config_read");
        return NULL;
    }
    if (ucxx_config_apply(st, config, opts, env_takes_precedence) < 0) {
        ucp_config_release(config);
        return NULL;
    }
    return config;
}

PyObject *
ucxx_get_config(PyObject *module, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"options", NULL};
    ucxx_state *st = PyModule_GetState(module);
    PyObject *opts = Py_None, *d;
    ucp_config_t *config;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:get_config", kwlist,
                                     &opts)) {
        return NULL;
    }
    config = config_read(st, opts, 0);
    if (config == NULL) {
        return NULL;
    }
    d = ucxx_config_to_dict(config);
    ucp_config_release(config);
    return d;
}

/* Whether UCX's tcp transport will prefer IPv6 (TCP_AF_PRIO), from the
 * options or the environment, with the same precedence as the config. */
static int
af_prio_inet6_first(PyObject *opts, int env_first)
{
    const char *env = getenv("UCX_TCP_AF_PRIO");
    const char *v = NULL;
    PyObject *o = NULL;

    if (opts != NULL && PyDict_Check(opts)) {
        o = PyDict_GetItemString(opts, "TCP_AF_PRIO");
        if (o == NULL) {
            o = PyDict_GetItemString(opts, "UCX_TCP_AF_PRIO");
        }
    }
    if (o != NULL && PyUnicode_Check(o) && !(env_first && env != NULL)) {
        v = PyUnicode_AsUTF8AndSize(o, NULL);
    } else {
        v = env;
    }
    PyErr_Clear();
    return v != NULL && strncmp(v, "inet6", 5) == 0;
}

static PyObject *
Context_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"options", "features", "env_takes_precedence",
                             NULL};
    ucxx_state *st = ucxx_state_from_type(type);
    PyObject *opts = Py_None;
    unsigned long long features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP |
                                  UCP_FEATURE_STREAM | UCP_FEATURE_AM;
    int env_first = 0;
    ucp_config_t *config;
    ucp_params_t params = {0};
    ucs_status_t status;
    ContextObject *self;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "|OKp:Context", kwlist, &opts,
                                     &features, &env_first)) {
        return NULL;
    }
    self = (ContextObject *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
    if (self == NULL) {
        return NULL;
    }
    config = config_read(st, opts, env_first);
    if (config == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->config = ucxx_config_to_dict(config);
    if (self->config == NULL) {
        ucp_config_release(config);
        Py_DECREF(self);
        return NULL;
    }
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    params.features = features;
    params.name = "ucxx";
    status = ucp_init(&params, config, &self->handle);
    ucp_config_release(config);
    if (status != UCS_OK) {
        self->handle = NULL;
        Py_DECREF(self);
        return ucxx_raise_status(st, status, "ucp_init");
    }
    self->features = features;
    self->fork_gen = ucxx_fork_generation;
    self->ipv6 = af_prio_inet6_first(opts, env_first);
    return (PyObject *)self;
}

static void
context_close_now(ContextObject *self)
{
    if (self->handle != NULL) {
        if (!UCXX_FORKED(self)) {
            ucp_cleanup(self->handle);
        }
        self->handle = NULL;
    }
}

PyDoc_STRVAR(Context_close_doc,
"close($self, /)\n--\n\n"
"Release the UCX context (idempotent). Workers keep it alive until they\n"
"are closed.");

static PyObject *
Context_close(ContextObject *self, PyObject *unused)
{
    if (self->nworkers > 0 && !UCXX_FORKED(self)) {
        return ucxx_raise(ucxx_state_of((PyObject *)self), UCXX_EXC_BASE,
                          "Context has %zd open worker(s); close them first",
                          self->nworkers);
    }
    context_close_now(self);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Context_info_doc,
"info($self, /)\n--\n\nucp_context_print_info as a string.");

static PyObject *
Context_info(ContextObject *self, PyObject *unused)
{
    char *text = NULL;
    size_t size = 0;
    FILE *f;
    PyObject *s;

    if (self->handle == NULL) {
        return ucxx_raise(ucxx_state_of((PyObject *)self), UCXX_EXC_CLOSE,
                          "Context is closed");
    }
    f = open_memstream(&text, &size);
    if (f == NULL) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    ucp_context_print_info(self->handle, f);
    fclose(f);
    s = PyUnicode_DecodeUTF8(text, size, "replace");
    free(text);
    return s;
}

static PyObject *
Context_get_config(ContextObject *self, void *closure)
{
    return PyDict_Copy(self->config);
}

static PyObject *
Context_get_closed(ContextObject *self, void *closure)
{
    return PyBool_FromLong(self->handle == NULL);
}

static PyObject *
Context_get_handle(ContextObject *self, void *closure)
{
    return PyLong_FromVoidPtr(self->handle);
}

static PyObject *
Context_get_features(ContextObject *self, void *closure)
{
    return PyLong_FromUnsignedLongLong(self->features);
}

static int
Context_traverse(ContextObject *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE((PyObject *)self));
    Py_VISIT(self->config);
    return 0;
}

static int
Context_clear(ContextObject *self)
{
    Py_CLEAR(self->config);
    return 0;
}

/* An open context warns (ResourceWarning) as an open worker does; dealloc
 * releases it. */
static void
Context_finalize(ContextObject *self)
{
    PyObject *exc;

    if (self->handle == NULL) {
        return;
    }
    exc = PyErr_GetRaisedException_compat();
    if (PyErr_ResourceWarning((PyObject *)self, 1, "unclosed %R", self) < 0) {
        PyErr_WriteUnraisable((PyObject *)self);
    }
    if (exc != NULL) {
        PyErr_SetRaisedException_compat(exc);
    }
}

static void
Context_dealloc(ContextObject *self)
{
    PyTypeObject *tp = Py_TYPE((PyObject *)self);

    if (ucxx_finalize_from_dealloc((PyObject *)self, &self->finalized) < 0) {
        return;
    }
    PyObject_GC_UnTrack(self);
    if (self->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)self);
    }
    context_close_now(self);
    Context_clear(self);
    ((freefunc)PyType_GetSlot(tp, Py_tp_free))(self);
    Py_DECREF(tp);
}

static PyMethodDef Context_methods[] = {
    {"close", (PyCFunction)Context_close, METH_NOARGS, Context_close_doc},
    {"info", (PyCFunction)Context_info, METH_NOARGS, Context_info_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Context_getset[] = {
    {"config", (getter)Context_get_config, NULL, "Effective UCX config.", NULL},
    {"closed", (getter)Context_get_closed, NULL, "True once closed.", NULL},
    {"handle", (getter)Context_get_handle, NULL, "ucp_context_h as int.", NULL},
    {"features", (getter)Context_get_features, NULL, "Feature bits.", NULL},
    {NULL},
};

static PyMemberDef Context_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(ContextObject, weakreflist),
     READONLY},
    {NULL},
};

PyDoc_STRVAR(Context_doc,
"Context(options=None, features=DEFAULT_FEATURES, env_takes_precedence=False)\n"
"--\n\n"
"A UCX application context (ucp_init). options: {NAME: value} without\n"
"the UCX_ prefix; unknown names raise UCXConfigError.");

static PyType_Slot Context_slots[] = {
    {Py_tp_doc, (void *)Context_doc},
    {Py_tp_new, Context_new},
    {Py_tp_dealloc, Context_dealloc},
    {Py_tp_finalize, Context_finalize},
    {Py_tp_traverse, Context_traverse},
    {Py_tp_clear, Context_clear},
    {Py_tp_methods, Context_methods},
    {Py_tp_getset, Context_getset},
    {Py_tp_members, Context_members},
    {0, NULL},
};

PyType_Spec ucxx_context_spec = {
    .name = "ucxx._ucxx.Context",
    .basicsize = sizeof(ContextObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = Context_slots,
};
