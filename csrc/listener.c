/*
 * listener.c - Listener wraps ucp_listener_h.  Owns the listener handle,
 * the user callback and connection requests not yet accepted; close(),
 * worker close or dealloc destroys it (queued requests are rejected).
 * Connection requests are queued by the UCX callback and turned into
 * Endpoints after progress returns; the callback runs from the loop.
 */
#include "ucxx.h"
#include <arpa/inet.h>
#include <netinet/in.h>

static void
conn_cb(ucp_conn_request_h conn_request, void *arg)
{
    ListenerObject *l = arg;

    /* Inside ucp_worker_progress: queue only (no Python, no GIL). */
    if (l->nconns == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 8;
        ucp_conn_request_h *c = realloc(l->conns, cap * sizeof(*c));
        if (c == NULL) {
            ucp_listener_reject(l->handle, conn_request);
            return;
        }
        l->conns = c;
        l->cap = cap;
    }
    l->conns[l->nconns++] = conn_request;
    if (!l->conn_queued) {
        l->conn_queued = 1;
        ucxx_list_add_tail(&l->worker->conn_ready, &l->clink);
    }
}

void
ucxx_listener_deliver(ListenerObject *l)
{
    size_t n = l->nconns;
    ucp_conn_request_h *conns = l->conns;

    l->conns = NULL;
    l->nconns = l->cap = 0;
    for (size_t i = 0; i < n; i++) {
        ucp_ep_params_t params = {0};
        EndpointObject *ep;

        if (l->handle == NULL) {
            continue;
        }
        params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST;
        params.conn_request = conns[i];
        ep = ucxx_endpoint_new(l->worker, &params, l->error_handling);
        if (ep == NULL || ucxx_call_soon(l->worker, l->callback,
                                         (PyObject *)ep) < 0) {
            PyErr_WriteUnraisable((PyObject *)l);
        }
        Py_XDECREF((PyObject *)ep);
    }
    free(conns);
}

void
ucxx_listener_close_now(ListenerObject *l)
{
    ucxx_lock(l->worker);
    ucxx_list_del(&l->wlink);
    ucxx_list_del(&l->clink);
    l->conn_queued = 0;
    if (l->handle != NULL) {
        for (size_t i = 0; i < l->nconns; i++) {
            ucp_listener_reject(l->handle, l->conns[i]);
        }
        ucp_listener_destroy(l->handle);
        l->handle = NULL;
        if (l->worker->handle != NULL) {
            ucxx_worker_touched(l->worker);
        }
    }
    free(l->conns);
    l->conns = NULL;
    l->nconns = l->cap = 0;
    ucxx_unlock(l->worker);
}

PyObject *
ucxx_listener_create(WorkerObject *w, PyObject *cb, int port,
                     const char *host, int error_handling)
{
    ucxx_state *st = w->st;
    PyTypeObject *tp = st->ListenerType;
    ucp_listener_params_t params = {0};
    ucp_listener_attr_t attr = {0};
    struct sockaddr_storage ss = {0};
    socklen_t sslen;
    ucs_status_t status;
    ListenerObject *l;

    if (host == NULL || *host == '\0') {
        host = "0.0.0.0";
    }
    if (inet_pton(AF_INET, host,
                  &((struct sockaddr_in *)&ss)->sin_addr) == 1) {
        ((struct sockaddr_in *)&ss)->sin_family = AF_INET;
        ((struct sockaddr_in *)&ss)->sin_port = htons(port);
        sslen = sizeof(struct sockaddr_in);
    } else if (inet_pton(AF_INET6, host,
                         &((struct sockaddr_in6 *)&ss)->sin6_addr) == 1) {
        ((struct sockaddr_in6 *)&ss)->sin6_family = AF_INET6;
        ((struct sockaddr_in6 *)&ss)->sin6_port = htons(port);
        sslen = sizeof(struct sockaddr_in6);
    } else {
        PyErr_Format(PyExc_ValueError, "invalid listen address '%s' "
                     "(an IPv4 or IPv6 literal is expected)", host);
        return NULL;
    }
    if (ucxx_check_family(w, ss.ss_family, host) < 0) {
        return NULL;
    }
    l = (ListenerObject *)((allocfunc)PyType_GetSlot(tp, Py_tp_alloc))(tp, 0);
    if (l == NULL) {
        return NULL;
    }
    ucxx_list_init(&l->wlink);
    ucxx_list_init(&l->clink);
    l->worker = (WorkerObject *)Py_NewRef((PyObject *)w);
    l->callback = Py_NewRef(cb);
    l->error_handling = error_handling;
    params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                        UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    params.sockaddr.addr = (struct sockaddr *)&ss;
    params.sockaddr.addrlen = sslen;
    params.conn_handler.cb = conn_cb;
    params.conn_handler.arg = l;
    ucxx_lock(w);
    status = ucp_listener_create(w->handle, &params, &l->handle);
    ucxx_worker_touched(w);
    ucxx_unlock(w);
    if (status != UCS_OK) {
        l->handle = NULL;
        Py_DECREF(l);
        PyErr_Format(st->exc[status == UCS_ERR_BUSY ? UCXX_EXC_BUSY
                                                    : UCXX_EXC_BASE],
                     "cannot listen on %s:%d: %s", host, port,
                     ucs_status_string(status));
        return NULL;
    }
    attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    ucxx_lock(w);
    status = ucp_listener_query(l->handle, &attr);
    ucxx_unlock(w);
    if (status != UCS_OK) {
        ucxx_listener_close_now(l);
        Py_DECREF(l);
        return ucxx_raise_status(st, status, "ucp_listener_query");
    }
    if (attr.sockaddr.ss_family == AF_INET) {
        struct sockaddr_in *sin = (struct sockaddr_in *)&attr.sockaddr;
        l->port = ntohs(sin->sin_port);
        inet_ntop(AF_INET, &sin->sin_addr, l->ip, sizeof(l->ip));
    } else {
        struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)&attr.sockaddr;
        l->port = ntohs(sin6->sin6_port);
        inet_ntop(AF_INET6, &sin6->sin6_addr, l->ip, sizeof(l->ip));
    }
    ucxx_lock(w);
    ucxx_list_add_tail(&w->listeners, &l->wlink);
    ucxx_unlock(w);
    return (PyObject *)l;
}

PyDoc_STRVAR(Listener_close_doc,
"close($self, /)\n--\n\nStop listening (idempotent).");

static PyObject *
Listener_close(ListenerObject *l, PyObject *unused)
{
    ucxx_listener_close_now(l);
    Py_RETURN_NONE;
}

static PyObject *
Listener_get_port(ListenerObject *l, void *c)
{
    return PyLong_FromLong(l->port);
}

static PyObject *
Listener_get_ip(ListenerObject *l, void *c)
{
    return PyUnicode_FromString(l->ip);
}

static PyObject *
Listener_get_closed(ListenerObject *l, void *c)
{
    return PyBool_FromLong(l->handle == NULL);
}

static PyObject *
Listener_get_worker(ListenerObject *l, void *c)
{
    return Py_NewRef((PyObject *)l->worker);
}

static int
Listener_traverse(ListenerObject *l, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE((PyObject *)l));
    Py_VISIT(l->worker);
    Py_VISIT(l->callback);
    return 0;
}

static int
Listener_clear(ListenerObject *l)
{
    Py_CLEAR(l->callback);
    return 0;
}

static void
Listener_dealloc(ListenerObject *l)
{
    PyTypeObject *tp = Py_TYPE((PyObject *)l);

    PyObject_GC_UnTrack(l);
    if (l->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)l);
    }
    /* A listener stops when collected (documented; no warning). */
    if (l->worker != NULL) {
        ucxx_listener_close_now(l);
    }
    Listener_clear(l);
    Py_CLEAR(l->worker);
    ((freefunc)PyType_GetSlot(tp, Py_tp_free))(l);
    Py_DECREF(tp);
}

static PyObject *
Listener_repr(ListenerObject *l)
{
    return PyUnicode_FromFormat("<ucxx.Listener %s:%d%s>", l->ip, l->port,
                                l->handle == NULL ? " closed" : "");
}

static PyMethodDef Listener_methods[] = {
    {"close", (PyCFunction)Listener_close, METH_NOARGS, Listener_close_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Listener_getset[] = {
    {"port", (getter)Listener_get_port, NULL, "Listening port.", NULL},
    {"ip", (getter)Listener_get_ip, NULL, "Listening address.", NULL},
    {"closed", (getter)Listener_get_closed, NULL, "True once closed.", NULL},
    {"worker", (getter)Listener_get_worker, NULL, "The Worker.", NULL},
    {NULL},
};

static PyMemberDef Listener_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(ListenerObject, weakreflist),
     READONLY},
    {NULL},
};

PyDoc_STRVAR(Listener_doc,
"A UCX listener. Created by Worker.listen, never directly.");

static PyType_Slot Listener_slots[] = {
    {Py_tp_doc, (void *)Listener_doc},
    {Py_tp_dealloc, Listener_dealloc},
    {Py_tp_traverse, Listener_traverse},
    {Py_tp_clear, Listener_clear},
    {Py_tp_methods, Listener_methods},
    {Py_tp_getset, Listener_getset},
    {Py_tp_members, Listener_members},
    {Py_tp_repr, Listener_repr},
    {0, NULL},
};

PyType_Spec ucxx_listener_spec = {
    .name = "ucxx._ucxx.Listener",
    .basicsize = sizeof(ListenerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Listener_slots,
};
