/*
 * status.c - the one place a ucs_status_t becomes a Python exception.
 * Owns the exception classes (created in module exec, kept in state).
 */
#include "ucxx.h"

static const struct {
    const char *name;
    const char *doc;
} exc_table[UCXX_EXC_COUNT] = {
    [UCXX_EXC_BASE] = {"UCXError", "Base class of every UCX error."},
    [UCXX_EXC_CANCELED] = {"UCXCanceledError",
                           "The operation was canceled (local or peer close)."},
    [UCXX_EXC_CLOSE] = {"UCXCloseError", "The object is closed."},
    [UCXX_EXC_CONFIG] = {"UCXConfigError", "Invalid UCX configuration."},
    [UCXX_EXC_CONNECTION_RESET] = {"UCXConnectionResetError",
                                   "The peer went away."},
    [UCXX_EXC_TRUNCATED] = {"UCXMessageTruncatedError",
                            "The message does not fit the receive buffer."},
    [UCXX_EXC_NOT_CONNECTED] = {"UCXNotConnectedError", "Not connected."},
    [UCXX_EXC_UNREACHABLE] = {"UCXUnreachableError", "Destination unreachable."},
    [UCXX_EXC_TIMED_OUT] = {"UCXTimedOutError", "The operation timed out."},
    [UCXX_EXC_NO_MEMORY] = {"UCXNoMemoryError", "Out of memory."},
    [UCXX_EXC_NO_RESOURCE] = {"UCXNoResourceError", "No resources available."},
    [UCXX_EXC_INVALID_PARAM] = {"UCXInvalidParamError", "Invalid parameter."},
    [UCXX_EXC_BUSY] = {"UCXBusyError", "Device or resource busy."},
    [UCXX_EXC_UNSUPPORTED] = {"UCXUnsupportedError", "Unsupported operation."},
    [UCXX_EXC_REJECTED] = {"UCXRejectedError", "The request was rejected."},
    [UCXX_EXC_NO_DEVICE] = {"UCXNoDeviceError", "No such device."},
    [UCXX_EXC_EP_TIMEOUT] = {"UCXEndpointTimeoutError",
                             "The endpoint timed out (keepalive)."},
    [UCXX_EXC_BUFFER_TOO_SMALL] = {"UCXBufferTooSmallError",
                                   "Buffer too small."},
};

int
ucxx_status_init(PyObject *module, ucxx_state *st)
{
    char qualname[96];

    for (int i = 0; i < UCXX_EXC_COUNT; i++) {
        PyObject *base = i == UCXX_EXC_BASE ? PyExc_Exception
                                            : st->exc[UCXX_EXC_BASE];
        snprintf(qualname, sizeof(qualname), "ucxx._ucxx.%s",
                 exc_table[i].name);
        st->exc[i] = PyErr_NewExceptionWithDoc(qualname, exc_table[i].doc,
                                               base, NULL);
        if (st->exc[i] == NULL) {
            return -1;
        }
        if (PyModule_AddObjectRef(module, exc_table[i].name, st->exc[i]) < 0) {
            return -1;
        }
    }
    return 0;
}

static int
status_class(ucs_status_t status)
{
    switch (status) {
    case UCS_ERR_CANCELED:            return UCXX_EXC_CANCELED;
    case UCS_ERR_CONNECTION_RESET:    return UCXX_EXC_CONNECTION_RESET;
    /* A transfer to a shared-memory peer that died before the keepalive saw
     * it fails attaching the peer's (removed) segment: the peer is gone. */
    case UCS_ERR_SHMEM_SEGMENT:       return UCXX_EXC_CONNECTION_RESET;
    case UCS_ERR_MESSAGE_TRUNCATED:   return UCXX_EXC_TRUNCATED;
    case UCS_ERR_NOT_CONNECTED:       return UCXX_EXC_NOT_CONNECTED;
    case UCS_ERR_UNREACHABLE:         return UCXX_EXC_UNREACHABLE;
    case UCS_ERR_TIMED_OUT:           return UCXX_EXC_TIMED_OUT;
    case UCS_ERR_NO_MEMORY:           return UCXX_EXC_NO_MEMORY;
    case UCS_ERR_NO_RESOURCE:         return UCXX_EXC_NO_RESOURCE;
    case UCS_ERR_INVALID_PARAM:       return UCXX_EXC_INVALID_PARAM;
    case UCS_ERR_BUSY:                return UCXX_EXC_BUSY;
    case UCS_ERR_UNSUPPORTED:         return UCXX_EXC_UNSUPPORTED;
    case UCS_ERR_REJECTED:            return UCXX_EXC_REJECTED;
    case UCS_ERR_NO_DEVICE:           return UCXX_EXC_NO_DEVICE;
    case UCS_ERR_ENDPOINT_TIMEOUT:    return UCXX_EXC_EP_TIMEOUT;
    case UCS_ERR_BUFFER_TOO_SMALL:    return UCXX_EXC_BUFFER_TOO_SMALL;
    case UCS_ERR_NO_ELEM:
    case UCS_ERR_INVALID_ADDR:        return UCXX_EXC_CONFIG;
    default:                          return UCXX_EXC_BASE;
    }
}

/* New exception instance for status (no error set). */
PyObject *
ucxx_status_exc(ucxx_state *st, ucs_status_t status, const char *what)
{
    PyObject *cls = st->exc[status_class(status)];

    if (what != NULL) {
        return PyObject_CallFunction(cls, "s", what);
    }
    return PyObject_CallFunction(cls, "s", ucs_status_string(status));
}

PyObject *
ucxx_raise_status(ucxx_state *st, ucs_status_t status, const char *what)
{
    PyObject *cls = st->exc[status_class(status)];

    if (what != NULL) {
        PyErr_Format(cls, "%s: %s", what, ucs_status_string(status));
    } else {
        PyErr_SetString(cls, ucs_status_string(status));
    }
    return NULL;
}

PyObject *
ucxx_raise(ucxx_state *st, int exc, const char *fmt, ...)
{
    va_list ap;

    va_start(ap, fmt);
    PyErr_FormatV(st->exc[exc], fmt, ap);
    va_end(ap);
    return NULL;
}
