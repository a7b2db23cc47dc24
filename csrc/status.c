/*
 * status.c - the one place a ucs_status_t becomes a Python exception.
 * Owns the exception classes (created in module exec, kept in state).
 */
#include "ucxx.h"

/* name, doc, and the second base class (index, 0: none) of each class;
 * every class derives from UCXError (UCXError from Exception). */
static const struct {
    const char *name;
    const char *doc;
    int also;
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
    [UCXX_EXC_ALREADY_EXISTS] = {"UCXAlreadyExistsError",
                                 "Element already exists."},
    [UCXX_EXC_EXCEEDS_LIMIT] = {"UCXExceedsLimitError", "Limit exceeded."},
    [UCXX_EXC_FIRST_EP_FAILURE] = {"UCXFirstEndpointFailureError",
                                   "First endpoint failure."},
    [UCXX_EXC_FIRST_LINK_FAILURE] = {"UCXFirstLinkFailureError",
                                     "First link failure."},
    [UCXX_EXC_IO] = {"UCXIOError", "Input/output error."},
    [UCXX_EXC_INVALID_ADDR] = {"UCXInvalidAddrError", "Invalid address."},
    [UCXX_EXC_LAST_EP_FAILURE] = {"UCXLastEndpointFailureError",
                                  "Last endpoint failure."},
    [UCXX_EXC_LAST_LINK_FAILURE] = {"UCXLastLinkFailureError",
                                    "Last link failure."},
    [UCXX_EXC_NO_ELEM] = {"UCXNoElemError", "No such element."},
    [UCXX_EXC_NO_MESSAGE] = {"UCXNoMessageError", "No pending message."},
    [UCXX_EXC_NO_PROGRESS] = {"UCXNoProgressError", "No progress."},
    [UCXX_EXC_NOT_IMPLEMENTED] = {"UCXNotImplementedError",
                                  "Function not implemented."},
    [UCXX_EXC_OUT_OF_RANGE] = {"UCXOutOfRangeError", "Value out of range."},
    /* A transfer to a shared-memory peer that died before the keepalive saw
     * it fails attaching the peer's (removed) segment: the peer is gone. */
    [UCXX_EXC_SHMEM_SEGMENT] = {"UCXShmemSegmentError",
                                "Shared memory segment error: the peer is "
                                "gone.", UCXX_EXC_CONNECTION_RESET},
    [UCXX_EXC_SOME_CONNECTS_FAILED] = {"UCXSomeConnectsFailedError",
                                       "Some connections failed."},
    [UCXX_EXC_INVALID_OPTION] = {"UCXInvalidOptionError",
                                 "A UCX option UCX refused (an invalid "
                                 "parameter of the configuration).",
                                 UCXX_EXC_CONFIG},
};

int
ucxx_status_init(PyObject *module, ucxx_state *st)
{
    char qualname[96];
    PyObject *bases;

    for (int i = 0; i < UCXX_EXC_COUNT; i++) {
        if (i == UCXX_EXC_BASE) {
            bases = Py_NewRef(PyExc_Exception);
        } else if (i == UCXX_EXC_INVALID_OPTION) {
            bases = PyTuple_Pack(2, st->exc[UCXX_EXC_CONFIG],
                                 st->exc[UCXX_EXC_INVALID_PARAM]);
        } else if (exc_table[i].also) {
            bases = Py_NewRef(st->exc[exc_table[i].also]);
        } else {
            bases = Py_NewRef(st->exc[UCXX_EXC_BASE]);
        }
        if (bases == NULL) {
            return -1;
        }
        snprintf(qualname, sizeof(qualname), "ucxx._ucxx.%s",
                 exc_table[i].name);
        st->exc[i] = PyErr_NewExceptionWithDoc(qualname, exc_table[i].doc,
                                               bases, NULL);
        Py_DECREF(bases);
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
    case UCS_ERR_SHMEM_SEGMENT:       return UCXX_EXC_SHMEM_SEGMENT;
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
    case UCS_ERR_ALREADY_EXISTS:      return UCXX_EXC_ALREADY_EXISTS;
    case UCS_ERR_EXCEEDS_LIMIT:       return UCXX_EXC_EXCEEDS_LIMIT;
    case UCS_ERR_FIRST_ENDPOINT_FAILURE: return UCXX_EXC_FIRST_EP_FAILURE;
    case UCS_ERR_FIRST_LINK_FAILURE:  return UCXX_EXC_FIRST_LINK_FAILURE;
    case UCS_ERR_IO_ERROR:            return UCXX_EXC_IO;
    case UCS_ERR_INVALID_ADDR:        return UCXX_EXC_INVALID_ADDR;
    case UCS_ERR_LAST_ENDPOINT_FAILURE: return UCXX_EXC_LAST_EP_FAILURE;
    case UCS_ERR_LAST_LINK_FAILURE:   return UCXX_EXC_LAST_LINK_FAILURE;
    case UCS_ERR_NO_ELEM:             return UCXX_EXC_NO_ELEM;
    case UCS_ERR_NO_MESSAGE:          return UCXX_EXC_NO_MESSAGE;
    case UCS_ERR_NO_PROGRESS:         return UCXX_EXC_NO_PROGRESS;
    case UCS_ERR_NOT_IMPLEMENTED:     return UCXX_EXC_NOT_IMPLEMENTED;
    case UCS_ERR_OUT_OF_RANGE:        return UCXX_EXC_OUT_OF_RANGE;
    case UCS_ERR_SOME_CONNECTS_FAILED: return UCXX_EXC_SOME_CONNECTS_FAILED;
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

/* _status_exception(status): the exception a status becomes (tests and
 * docs/COMPAT.md's table are checked against this). */
PyObject *
ucxx_status_exception(PyObject *module, PyObject *arg)
{
    long status = PyLong_AsLong(arg);

    if (status == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (status >= 0 || status < UCS_ERR_LAST) {
        PyErr_Format(PyExc_ValueError, "%ld is not a UCX error status",
                     status);
        return NULL;
    }
    return ucxx_status_exc(PyModule_GetState(module), (ucs_status_t)status,
                           NULL);
}
