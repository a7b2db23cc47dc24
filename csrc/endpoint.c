/*
 * endpoint.c - Endpoint wraps ucp_ep_h (peer error handling on by default).
 * Owns the endpoint handle and its close callback; close() (graceful,
 * awaitable), abort() (force), worker close or dealloc releases it.
 * Receives posted through an endpoint are tracked by it: they fail with
 * UCXCanceledError when it closes and with the peer's error when it dies.
 */
#include "ucxx.h"

#include <inttypes.h>

static uint64_t
mix64(uint64_t x)
{
    /* splitmix64 finaliser: user tags spread over the 64-bit space */
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static void
ep_err_cb(void *arg, ucp_ep_h uep, ucs_status_t status)
{
    EndpointObject *ep = arg;

    /* Inside ucp_worker_progress: record only (no Python). */
    if (ep->error == UCS_OK) {
        ep->error = status;
    }
    if (!ep->err_queued) {
        ep->err_queued = 1;
        ucxx_list_add_tail(&ep->worker->errored, &ep->elink);
    }
}

/* ucp_ep_create; an attempt that may fail for want of peer-failure support
 * runs with UCX logging at "fatal", so the fallback prints nothing. */
static ucs_status_t
ep_create_quiet(WorkerObject *w, ucp_ep_params_t *params, ucp_ep_h *ep,
                int quiet)
{
    char level[32];
    ucs_status_t status;

    if (!quiet || w->peer_errors_ok ||
        ucs_global_opts_get_value("LOG_LEVEL", level, sizeof(level)) !=
            UCS_OK) {
        return ucp_ep_create(w->handle, params, ep);
    }
    ucs_global_opts_set_value("LOG_LEVEL", "fatal");
    status = ucp_ep_create(w->handle, params, ep);
    ucs_global_opts_set_value("LOG_LEVEL", level);
    if (status == UCS_OK) {
        w->peer_errors_ok = 1;
    }
    return status;
}

/* Error handling PEER with our handler, or NONE with no handler at all
 * (UCX must never call back into an endpoint object it was not told of). */
static void
set_err_mode(ucp_ep_params_t *params, EndpointObject *ep)
{
    if (ep->error_handling) {
        params->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
        params->err_mode = UCP_ERR_HANDLING_MODE_PEER;
        params->err_handler.cb = ep_err_cb;
        params->err_handler.arg = ep;
    } else {
        params->field_mask &= ~(uint64_t)UCP_EP_PARAM_FIELD_ERR_HANDLER;
        params->err_mode = UCP_ERR_HANDLING_MODE_NONE;
    }
}

EndpointObject *
ucxx_endpoint_new(WorkerObject *w, ucp_ep_params_t *params,
                  int error_handling)
{
    ucxx_state *st = w->st;
    PyTypeObject *tp = st->EndpointType;
    EndpointObject *ep;
    ucs_status_t status;

    ep = (EndpointObject *)((allocfunc)PyType_GetSlot(tp, Py_tp_alloc))(tp, 0);
    if (ep == NULL) {
        return NULL;
    }
    ep->worker = (WorkerObject *)Py_NewRef((PyObject *)w);
    ucxx_list_init(&ep->wlink);
    ucxx_list_init(&ep->elink);
    ucxx_list_init(&ep->alink);
    ucxx_list_init(&ep->am_waiters);
    ep->am_queue = PyList_New(0);
    if (ep->am_queue == NULL) {
        Py_DECREF(ep);
        return NULL;
    }
    ep->error_handling = error_handling;
    params->field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                          UCP_EP_PARAM_FIELD_USER_DATA;
    params->user_data = ep;
    ucxx_lock(w);
    if (error_handling && w->no_peer_errors) {
        ep->error_handling = 0;
    }
    set_err_mode(params, ep);
    status = ep_create_quiet(w, params, &ep->handle, ep->error_handling);
    if (status == UCS_ERR_UNREACHABLE && ep->error_handling) {
        /* Transports without peer failure support (shared memory alone):
         * connect without error handling rather than not at all, and do
         * not ask again on this worker. */
        ep->error_handling = 0;
        set_err_mode(params, ep);
        status = ucp_ep_create(w->handle, params, &ep->handle);
        if (status == UCS_OK) {
            w->no_peer_errors = 1;
        }
    }
    ucxx_worker_touched(w);
    ucxx_unlock(w);
    if (status != UCS_OK) {
        ep->handle = NULL;
        ep->closed = 1;
        Py_DECREF(ep);
        return (EndpointObject *)ucxx_raise_status(st, status,
                                                   "ucp_ep_create");
    }
    ep->uid = (uint64_t)(uintptr_t)ep->handle;
    ucxx_lock(w);
    ucxx_list_add_tail(&w->endpoints, &ep->wlink);
    ucxx_unlock(w);
    return ep;
}

/* Cancel the receives this endpoint tracks, reporting `report`. */
static void
cancel_tracked(EndpointObject *ep, ucs_status_t report)
{
    WorkerObject *w = ep->worker;

    for (ucxx_link *it = w->pending.next; it != &w->pending; it = it->next) {
        RequestObject *r = UCXX_CONTAINER(it, RequestObject, wlink);

        if (r->endpoint == ep &&
            (r->kind == UCXX_REQ_RECV || r->kind == UCXX_REQ_STREAM_RECV ||
             r->kind == UCXX_REQ_GATHER_RECV)) {
            ucxx_request_cancel_for_endpoint(r, report);
        }
    }
    while (!ucxx_list_empty(&ep->am_waiters)) {
        RequestObject *r = UCXX_CONTAINER(ep->am_waiters.next, RequestObject,
                                          elink);
        ucxx_request_cancel_ucx(r, report);
    }
}

static void
run_close_callback(EndpointObject *ep)
{
    PyObject *cb = ep->close_cb;

    if (ep->close_cb_done) {
        return;
    }
    ep->close_cb_done = 1;
    if (cb == NULL) {
        return;
    }
    ep->close_cb = NULL;
    if (ucxx_call_soon(ep->worker, cb, NULL) < 0) {
        PyErr_WriteUnraisable(cb);
    }
    Py_DECREF(cb);
}

/*
 * Close the UCX endpoint; returns the close Request (already done if UCX
 * completed at once).  force: ucp_ep_close_nbx(FORCE) now.  Graceful: flush
 * (everything posted reaches the peer), then, when the flush completes, a
 * FORCE close (ucxx_endpoint_flushed), so that nothing posted on the
 * endpoint outlives it (a rendezvous the peer never fetched fails with
 * UCXCanceledError) and the transport resources go at once.  Close errors
 * are not reported: the endpoint is gone either way.
 */
static RequestObject *
ep_close_handle(EndpointObject *ep, int force)
{
    WorkerObject *w = ep->worker;
    ucp_request_param_t param;
    ucs_status_ptr_t sp;
    RequestObject *r = ucxx_request_new(w, ep, UCXX_REQ_CLOSE, 1);

    if (r == NULL) {
        return NULL;
    }
    if (ep->handle != NULL && w->handle != NULL) {
        param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                             UCP_OP_ATTR_FIELD_USER_DATA;
        param.cb.send = ucxx_send_cb;
        param.user_data = &r->op1;
        if (force) {
            /* FORCE is only defined with peer error handling on both
             * sides; without it the close flushes. */
            param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
            param.flags = ep->error_handling ? UCP_EP_CLOSE_FLAG_FORCE : 0;
            sp = ucp_ep_close_nbx(ep->handle, &param);
            ep->handle = NULL;
        } else {
            sp = ucp_ep_flush_nbx(ep->handle, &param);
        }
        ucxx_worker_touched(w);
        ucxx_request_track(r, &r->op1, sp);
    }
    r->first_error = UCS_OK;
    ucxx_request_finish_posting(r);
    return r;
}

/* The flush of a graceful close completed (dispatch, lock held). */
void
ucxx_endpoint_flushed(EndpointObject *ep)
{
    RequestObject *r;

    if (ep->handle == NULL) {
        return;
    }
    r = ep_close_handle(ep, 1);
    if (r == NULL) {
        PyErr_WriteUnraisable((PyObject *)ep);
    }
    Py_XDECREF((PyObject *)r);
}

/* Close now (force): pending receives fail with `report`. */
void
ucxx_endpoint_abort_now(EndpointObject *ep, ucs_status_t report)
{
    RequestObject *r;

    ucxx_lock(ep->worker);
    if (!ep->closed) {
        ep->closed = 1;
        cancel_tracked(ep, report);
    }
    ucxx_list_del(&ep->wlink);
    ucxx_list_del(&ep->elink);
    ucxx_list_del(&ep->alink);
    ucxx_am_discard(ep);
    if (ep->handle != NULL) {
        r = ep_close_handle(ep, 1);
        if (r == NULL) {
            PyErr_WriteUnraisable((PyObject *)ep);
        }
        Py_XDECREF((PyObject *)r);
    }
    run_close_callback(ep);
    ucxx_unlock(ep->worker);
}

/* Dispatch of a peer error recorded by ep_err_cb (lock held). */
void
ucxx_endpoint_report_error(EndpointObject *ep)
{
    RequestObject *r;

    /* A failure during this side's graceful close (the peer closing in
     * answer) ends what the close would have cancelled. */
    cancel_tracked(ep, ep->closing ? UCS_ERR_CANCELED : ep->error);
    /* A dead shared-memory sender may have left a FIFO slot half-written. */
    ucxx_shm_peer_failed(ep->worker);
    if (ep->handle != NULL) {
        /* UCX requires a failed endpoint to be closed with FORCE. */
        r = ep_close_handle(ep, 1);
        if (r == NULL) {
            PyErr_WriteUnraisable((PyObject *)ep);
        }
        Py_XDECREF((PyObject *)r);
    }
    run_close_callback(ep);
}

/* ---- argument helpers --------------------------------------------------- */

static int
endpoint_check_send(EndpointObject *ep)
{
    ucxx_state *st = ep->worker->st;

    if (ucxx_worker_check(ep->worker) < 0) {
        return -1;
    }
    /* Closed by the caller first: whatever the peer did afterwards. */
    if (ep->closed && !ep->peer_closed) {
        ucxx_raise(st, UCXX_EXC_CLOSE, "Endpoint is closed");
        return -1;
    }
    if (ep->error != UCS_OK) {
        ucxx_raise_status(st, ep->error, "endpoint failed");
        return -1;
    }
    if (ep->closed || ep->handle == NULL) {
        ucxx_raise(st, UCXX_EXC_CLOSE, "Endpoint is closed");
        return -1;
    }
    return 0;
}

static int
endpoint_check_recv(EndpointObject *ep)
{
    if (ucxx_worker_check(ep->worker) < 0) {
        return -1;
    }
    /* A failed endpoint, or one the peer closed, may still receive what
     * had already arrived. */
    if (ep->closed && ep->error == UCS_OK && !ep->peer_closed) {
        ucxx_raise(ucxx_state_of((PyObject *)ep), UCXX_EXC_CLOSE,
                   "Endpoint is closed");
        return -1;
    }
    return 0;
}

/* A str or bytes tag (RAPIDS accepts names: tag="msg1"): FNV-1a of its
 * bytes (UTF-8), the same in every process, mixed with base. */
static int
mix_name_tag(PyObject *obj, ucp_tag_t base, ucp_tag_t *tag)
{
    const char *p;
    Py_ssize_t n;
    uint64_t h = 0xcbf29ce484222325ULL;

    if (PyUnicode_Check(obj)) {
        p = PyUnicode_AsUTF8AndSize(obj, &n);
        if (p == NULL) {
            return -1;
        }
    } else if (PyBytes_Check(obj)) {
        p = PyBytes_AsString(obj);
        n = PyBytes_Size(obj);
    } else {
        return ucxx_type_error("tag must be an int, str or bytes, not '%U'",
                               obj);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        h = (h ^ (uint8_t)p[i]) * 0x100000001b3ULL;
    }
    *tag = base ^ mix64(h ^ 0x6e616d65ULL);   /* "name": not an int's tag */
    return 0;
}

/* (buf, tag=None, force_tag=False) -> the tag to use (nbuf: the leading
 * positional arguments before tag, 0 or 1). */
static int
parse_msg_args(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
               const char *name, ucp_tag_t base, int nbuf, PyObject **first,
               ucp_tag_t *tag)
{
    PyObject *tag_obj = Py_None, *force_obj = Py_False;
    Py_ssize_t nkw = kwnames ? PyTuple_Size(kwnames) : 0;
    int force;

    if (nargs < nbuf || nargs > nbuf + 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes %d to %d positional "
                     "arguments (%zd given)", name, nbuf, nbuf + 2, nargs);
        return -1;
    }
    *first = nbuf > 0 ? args[0] : NULL;
    if (nargs > nbuf) {
        tag_obj = args[nbuf];
    }
    if (nargs > nbuf + 1) {
        force_obj = args[nbuf + 1];
    }
    for (Py_ssize_t i = 0; i < nkw; i++) {
        PyObject *k = PyTuple_GetItem(kwnames, i);
        if (PyUnicode_CompareWithASCIIString(k, "tag") == 0) {
            tag_obj = args[nargs + i];
        } else if (PyUnicode_CompareWithASCIIString(k, "force_tag") == 0) {
            force_obj = args[nargs + i];
        } else {
            PyErr_Format(PyExc_TypeError,
                         "%s() got an unexpected keyword argument %R", name, k);
            return -1;
        }
    }
    if (tag_obj == Py_None) {
        *tag = base;
        return 0;
    }
    force = PyObject_IsTrue(force_obj);
    if (force < 0) {
        return -1;
    }
    if (force) {
        return ucxx_tag_from_obj(tag_obj, tag);
    }
    if (!PyLong_Check(tag_obj)) {
        return mix_name_tag(tag_obj, base, tag);
    }
    {
        /* Any int: its low 64 bits (two's complement) mixed with base. */
        uint64_t v = (uint64_t)PyLong_AsUnsignedLongLongMask(tag_obj);
        if (v == (uint64_t)-1 && PyErr_Occurred()) {
            return -1;
        }
        *tag = base ^ mix64(v);
    }
    return 0;
}

PyDoc_STRVAR(Endpoint_recv_tag_for_doc,
"recv_tag_for($self, tag=None, force_tag=False)\n--\n\n"
"The UCX tag recv(buf, tag, force_tag) matches (what tag_probe needs).");

static PyObject *
Endpoint_recv_tag_for(EndpointObject *ep, PyObject *const *args,
                      Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *unused;
    ucp_tag_t tag;

    if (parse_msg_args(args, nargs, kwnames,
                       "recv_tag_for", ep->recv_tag, 0, &unused, &tag) < 0) {
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(tag);
}

/* ---- transfers ---------------------------------------------------------- */

PyDoc_STRVAR(Endpoint_send_doc,
"send($self, buf, tag=None, force_tag=False)\n--\n\n"
"Tagged send. tag None: send_tag; else tag mixed with send_tag unless\n"
"force_tag. Returns an awaitable Request.");

static PyObject *
Endpoint_send(EndpointObject *ep, PyObject *const *args, Py_ssize_t nargs,
              PyObject *kwnames)
{
    PyObject *buf;
    ucp_tag_t tag;

    if (parse_msg_args(args, nargs, kwnames, "send",
                       ep->send_tag, 1, &buf, &tag) < 0 ||
        endpoint_check_send(ep) < 0) {
        return NULL;
    }
    return ucxx_request_post_send(ep, buf, tag);
}

PyDoc_STRVAR(Endpoint_recv_doc,
"recv($self, buf, tag=None, force_tag=False)\n--\n\n"
"Tagged receive (full mask) on recv_tag, or the mixed/forced tag.\n"
"Await returns the number of bytes received.");

static PyObject *
Endpoint_recv(EndpointObject *ep, PyObject *const *args, Py_ssize_t nargs,
              PyObject *kwnames)
{
    PyObject *buf;
    ucp_tag_t tag;

    if (parse_msg_args(args, nargs, kwnames, "recv",
                       ep->recv_tag, 1, &buf, &tag) < 0 ||
        endpoint_check_recv(ep) < 0) {
        return NULL;
    }
    ep->nrecv++;
    return ucxx_request_post_recv(ep->worker, ep, buf, tag,
                                  UCXX_TAG_MASK_FULL);
}

PyDoc_STRVAR(Endpoint_tag_send_doc,
"tag_send($self, buf, tag, /)\n--\n\nTagged send with an explicit tag.");

static PyObject *
Endpoint_tag_send(EndpointObject *ep, PyObject *const *args, Py_ssize_t nargs)
{
    ucp_tag_t tag;

    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "tag_send(buf, tag)");
        return NULL;
    }
    if (ucxx_tag_from_obj(args[1], &tag) < 0 || endpoint_check_send(ep) < 0) {
        return NULL;
    }
    return ucxx_request_post_send(ep, args[0], tag);
}

PyDoc_STRVAR(Endpoint_tag_recv_doc,
"tag_recv($self, buf, tag, mask=0xFFFFFFFFFFFFFFFF, /)\n--\n\n"
"Tagged receive tracked by this endpoint.");

static PyObject *
Endpoint_tag_recv(EndpointObject *ep, PyObject *const *args, Py_ssize_t nargs)
{
    ucp_tag_t tag, mask = UCXX_TAG_MASK_FULL;

    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "tag_recv(buf, tag, mask=...)");
        return NULL;
    }
    if (ucxx_tag_from_obj(args[1], &tag) < 0 ||
        (nargs == 3 && ucxx_tag_from_obj(args[2], &mask) < 0) ||
        endpoint_check_recv(ep) < 0) {
        return NULL;
    }
    return ucxx_request_post_recv(ep->worker, ep, args[0], tag, mask);
}

PyDoc_STRVAR(Endpoint_stream_send_doc,
"stream_send($self, buf, /)\n--\n\nStream API send.");

static PyObject *
Endpoint_stream_send(EndpointObject *ep, PyObject *buf)
{
    if (endpoint_check_send(ep) < 0) {
        return NULL;
    }
    return ucxx_request_post_stream(ep, buf, 0);
}

PyDoc_STRVAR(Endpoint_stream_recv_doc,
"stream_recv($self, buf, /)\n--\n\nStream API receive of exactly len(buf)"
" bytes.");

static PyObject *
Endpoint_stream_recv(EndpointObject *ep, PyObject *buf)
{
    if (endpoint_check_send(ep) < 0) {
        return NULL;
    }
    return ucxx_request_post_stream(ep, buf, 1);
}

/* gather_send(buffers, tag=None, force_tag=False, header=None) and
 * gather_recv(buffers, tag=None, force_tag=False): `header` is taken out
 * of the keywords, the rest parsed as for send/recv. */
static PyObject *
gather(EndpointObject *ep, PyObject *const *args, Py_ssize_t nargs,
       PyObject *kwnames, int recv)
{
    PyObject *bufs, *header = NULL, *argv[8], *kw = NULL, *res = NULL;
    Py_ssize_t nkw, n = 0;
    ucp_tag_t tag;

    nkw = kwnames != NULL ? PyTuple_Size(kwnames) : 0;
    if (!recv && nkw > 0) {
        if (nargs + nkw > (Py_ssize_t)(sizeof(argv) / sizeof(argv[0]))) {
            PyErr_SetString(PyExc_TypeError,
                            "gather_send() takes at most 4 arguments");
            return NULL;
        }
        kw = PyList_New(0);
        if (kw == NULL) {
            return NULL;
        }
        for (n = 0; n < nargs; n++) {
            argv[n] = args[n];
        }
        for (Py_ssize_t i = 0; i < nkw; i++) {
            PyObject *k = PyTuple_GetItem(kwnames, i);

            if (PyUnicode_CompareWithASCIIString(k, "header") == 0) {
                header = args[nargs + i];
            } else if (PyList_Append(kw, k) < 0) {
                goto out;
            } else {
                argv[n++] = args[nargs + i];
            }
        }
        Py_SETREF(kw, PyList_AsTuple(kw));
        if (kw == NULL) {
            goto out;
        }
        args = argv;
        kwnames = PyTuple_Size(kw) > 0 ? kw : NULL;
        if (header == Py_None) {
            header = NULL;
        }
    }
    if (parse_msg_args(args, nargs, kwnames,
                       recv ? "gather_recv" : "gather_send",
                       recv ? ep->recv_tag : ep->send_tag, 1, &bufs,
                       &tag) < 0) {
        goto out;
    }
    if ((recv ? endpoint_check_recv(ep) : endpoint_check_send(ep)) < 0) {
        goto out;
    }
    res = ucxx_gather(ep, bufs, header, tag, recv);
out:
    Py_XDECREF(kw);
    return res;
}

PyDoc_STRVAR(Endpoint_gather_send_doc,
"gather_send($self, buffers, tag=None, force_tag=False, header=None)\n"
"--\n\n"
"Send the buffers as one operation: consecutive small host buffers go as\n"
"one IOV message, large and device buffers as messages of their own\n"
"(gather_runs), all posted in order in one call; one Request.  The\n"
"buffers of `header`, if given, are sent first, each as a message of its\n"
"own (received with recv), in the same call.");

static PyObject *
Endpoint_gather_send(EndpointObject *ep, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames)
{
    return gather(ep, args, nargs, kwnames, 0);
}

PyDoc_STRVAR(Endpoint_gather_recv_doc,
"gather_recv($self, buffers, tag=None, force_tag=False)\n--\n\n"
"Receive what gather_send sent from buffers of the same sizes and memory\n"
"types, scattered into these buffers; one Request.  A message whose length\n"
"is not that of its buffers raises UCXMessageTruncatedError naming both.");

static PyObject *
Endpoint_gather_recv(EndpointObject *ep, PyObject *const *args, Py_ssize_t nargs,
                     PyObject *kwnames)
{
    return gather(ep, args, nargs, kwnames, 1);
}

PyDoc_STRVAR(Endpoint_gather_runs_doc,
"gather_runs(buffers, /)\n--\n\n"
"The messages a gather of these buffers is made of, as (first frame,\n"
"frame count, bytes, is IOV) tuples: both sides derive them from the\n"
"sizes and memory types alone.");

static PyObject *
Endpoint_gather_runs(PyObject *cls, PyObject *bufs)
{
    ucxx_state *st = ucxx_state_from_type((PyTypeObject *)cls);

    if (st == NULL) {
        return NULL;
    }
    return ucxx_gather_runs(st, bufs);
}

PyDoc_STRVAR(Endpoint_am_send_doc,
"am_send($self, buf, /)\n--\n\nActive message send.");

static PyObject *
Endpoint_am_send(EndpointObject *ep, PyObject *buf)
{
    if (endpoint_check_send(ep) < 0) {
        return NULL;
    }
    return ucxx_am_send(ep, buf);
}

PyDoc_STRVAR(Endpoint_am_recv_doc,
"am_recv($self, /)\n--\n\nNext active message from this endpoint.");

static PyObject *
Endpoint_am_recv(EndpointObject *ep, PyObject *unused)
{
    if (endpoint_check_recv(ep) < 0) {
        return NULL;
    }
    ep->nrecv++;
    return ucxx_am_recv(ep);
}

PyDoc_STRVAR(Endpoint_am_probe_doc,
"am_probe($self, /)\n--\n\n"
"True if an active message from this endpoint waits for am_recv().");

static PyObject *
Endpoint_am_probe(EndpointObject *ep, PyObject *unused)
{
    return PyBool_FromLong(ep->am_raw != NULL ||
                           (ep->am_queue != NULL &&
                            PyList_Size(ep->am_queue) > 0));
}

/* ---- close -------------------------------------------------------------- */

PyDoc_STRVAR(Endpoint_close_doc,
"close($self, /)\n--\n\n"
"Graceful (flush) close; returns an awaitable. Pending receives fail with\n"
"UCXCanceledError. Idempotent.");

static PyObject *
Endpoint_close(EndpointObject *ep, PyObject *unused)
{
    RequestObject *r;

    if (ep->close_req != NULL) {
        return Py_NewRef(ep->close_req);
    }
    ucxx_lock(ep->worker);
    if (!ep->closed) {
        ep->closed = 1;
        cancel_tracked(ep, UCS_ERR_CANCELED);
    }
    ucxx_list_del(&ep->wlink);
    r = ep_close_handle(ep, 0);
    if (r != NULL) {
        ep->close_req = Py_NewRef((PyObject *)r);
        ucxx_am_discard(ep);
        run_close_callback(ep);
        if (ep->worker->handle != NULL) {
            ucxx_worker_dispatch(ep->worker);
        }
    }
    ucxx_unlock(ep->worker);
    return (PyObject *)r;
}

PyDoc_STRVAR(Endpoint_abort_doc,
"abort($self, /)\n--\n\nImmediate (force) close. Idempotent.");

static PyObject *
Endpoint_abort(EndpointObject *ep, PyObject *unused)
{
    ucxx_lock(ep->worker);
    ucxx_endpoint_abort_now(ep, UCS_ERR_CANCELED);
    if (ep->worker->handle != NULL) {
        ucxx_worker_dispatch(ep->worker);
    }
    ucxx_unlock(ep->worker);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Endpoint_close_by_peer_doc,
"_close_by_peer($self, /)\n--\n\n"
"The peer announced its close: abort, fail pending receives with\n"
"UCXCanceledError; later receives still match messages that had already\n"
"arrived, and fail at once otherwise.");

static PyObject *
Endpoint_close_by_peer(EndpointObject *ep, PyObject *unused)
{
    ep->peer_closed = 1;
    return Endpoint_abort(ep, NULL);
}

PyDoc_STRVAR(Endpoint_peer_exited_doc,
"_peer_exited($self, /)\n--\n\n"
"The peer process is known to have exited (its pidfd): the endpoint fails\n"
"as on a UCX peer error, with UCXConnectionResetError. Idempotent.");

static PyObject *
Endpoint_peer_exited(EndpointObject *ep, PyObject *unused)
{
    WorkerObject *w = ep->worker;

    ucxx_lock(w);
    if (!ep->closed && ep->handle != NULL && w->handle != NULL) {
        ep_err_cb(ep, ep->handle, UCS_ERR_CONNECTION_RESET);
        ucxx_worker_dispatch(w);
    }
    ucxx_unlock(w);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Endpoint_begin_close_doc,
"_begin_close($self, /)\n--\n\n"
"This side began a graceful close: should the endpoint fail before the\n"
"close ends (the peer closing in answer), pending requests fail with\n"
"UCXCanceledError, as the close would have failed them.");

static PyObject *
Endpoint_begin_close(EndpointObject *ep, PyObject *unused)
{
    ep->closing = 1;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Endpoint_set_close_callback_doc,
"set_close_callback($self, callback, /)\n--\n\n"
"callback() is called once, from the loop, when the endpoint closes or\n"
"fails. None removes it.");

static PyObject *
Endpoint_set_close_callback(EndpointObject *ep, PyObject *cb)
{
    if (cb != Py_None && !PyCallable_Check(cb)) {
        PyErr_SetString(PyExc_TypeError, "callback must be callable or None");
        return NULL;
    }
    Py_XSETREF(ep->close_cb, cb == Py_None ? NULL : Py_NewRef(cb));
    if (ep->close_cb_done && ep->close_cb != NULL) {
        /* Already closed: run it now (from the loop). */
        ep->close_cb_done = 0;
        run_close_callback(ep);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Endpoint_raise_on_error_doc,
"raise_on_error($self, /)\n--\n\n"
"Raise the peer error of this endpoint (its UCXError class), if any.");

static PyObject *
Endpoint_raise_on_error(EndpointObject *ep, PyObject *unused)
{
    if (ep->error != UCS_OK) {
        return ucxx_raise_status(ucxx_state_of((PyObject *)ep), ep->error,
                                 "endpoint failed");
    }
    Py_RETURN_NONE;
}

/* ---- getters ------------------------------------------------------------ */

static PyObject *
Endpoint_get_recv_count(EndpointObject *ep, void *closure)
{
    return PyLong_FromUnsignedLongLong(ep->nrecv);
}

static PyObject *
Endpoint_get_peer_closed(EndpointObject *ep, void *closure)
{
    return PyBool_FromLong(ep->peer_closed);
}

static PyObject *
Endpoint_get_alive(EndpointObject *ep, void *closure)
{
    return PyBool_FromLong(ep->handle != NULL && ep->error == UCS_OK &&
                           !ep->closed);
}

static PyObject *
Endpoint_get_closed(EndpointObject *ep, void *closure)
{
    return PyBool_FromLong(ep->closed || ep->handle == NULL);
}

static PyObject *
Endpoint_get_handle(EndpointObject *ep, void *closure)
{
    return PyLong_FromVoidPtr(ep->handle);
}

static PyObject *
Endpoint_get_uid(EndpointObject *ep, void *closure)
{
    return PyLong_FromUnsignedLongLong(ep->uid);
}

static PyObject *
Endpoint_get_worker(EndpointObject *ep, void *closure)
{
    return Py_NewRef((PyObject *)ep->worker);
}

static PyObject *
Endpoint_get_error_handling(EndpointObject *ep, void *closure)
{
    return PyBool_FromLong(ep->error_handling);
}

static PyObject *
Endpoint_get_error(EndpointObject *ep, void *closure)
{
    if (ep->error == UCS_OK) {
        Py_RETURN_NONE;
    }
    return ucxx_status_exc(ucxx_state_of((PyObject *)ep), ep->error, NULL);
}

static PyObject *
get_tag(ucp_tag_t t)
{
    return PyLong_FromUnsignedLongLong(t);
}

static int
set_tag(ucp_tag_t *slot, PyObject *v)
{
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete a tag");
        return -1;
    }
    return ucxx_tag_from_obj(v, slot);
}

static PyObject *
Endpoint_get_send_tag(EndpointObject *ep, void *c)
{
    return get_tag(ep->send_tag);
}

static int
Endpoint_set_send_tag(EndpointObject *ep, PyObject *v, void *c)
{
    return set_tag(&ep->send_tag, v);
}

static PyObject *
Endpoint_get_recv_tag(EndpointObject *ep, void *c)
{
    return get_tag(ep->recv_tag);
}

static int
Endpoint_set_recv_tag(EndpointObject *ep, PyObject *v, void *c)
{
    return set_tag(&ep->recv_tag, v);
}

/* ---- GC ----------------------------------------------------------------- */

static int
Endpoint_traverse(EndpointObject *ep, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE((PyObject *)ep));
    Py_VISIT(ep->worker);
    Py_VISIT(ep->close_cb);
    Py_VISIT(ep->close_req);
    Py_VISIT(ep->am_queue);
    Py_VISIT(ep->state);
    Py_VISIT(ep->dict);
    return 0;
}

static int
Endpoint_clear(EndpointObject *ep)
{
    Py_CLEAR(ep->close_cb);
    Py_CLEAR(ep->close_req);
    Py_CLEAR(ep->am_queue);
    Py_CLEAR(ep->state);
    Py_CLEAR(ep->dict);
    return 0;
}

static void
Endpoint_finalize(EndpointObject *ep)
{
    PyObject *exc;

    if (ep->handle == NULL || ep->worker == NULL ||
        ep->worker->handle == NULL) {
        return;
    }
    exc = PyErr_GetRaisedException_compat();
    if (PyErr_ResourceWarning((PyObject *)ep, 1, "unclosed %R", ep) < 0) {
        PyErr_WriteUnraisable((PyObject *)ep);
    }
    ucxx_endpoint_abort_now(ep, UCS_ERR_CANCELED);
    if (exc != NULL) {
        PyErr_SetRaisedException_compat(exc);
    }
}

static void
Endpoint_dealloc(EndpointObject *ep)
{
    PyTypeObject *tp = Py_TYPE((PyObject *)ep);

    if (ucxx_finalize_from_dealloc((PyObject *)ep, &ep->finalized) < 0) {
        return;
    }
    PyObject_GC_UnTrack(ep);
    if (ep->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)ep);
    }
    /* No UCX callback may reach us after this point. */
    if (ep->worker != NULL) {
        ucxx_lock(ep->worker);
        ucxx_list_del(&ep->wlink);
        ucxx_list_del(&ep->elink);
        ucxx_list_del(&ep->alink);
        ucxx_am_discard(ep);
        ucxx_unlock(ep->worker);
    }
    Endpoint_clear(ep);
    Py_CLEAR(ep->worker);
    ((freefunc)PyType_GetSlot(tp, Py_tp_free))(ep);
    Py_DECREF(tp);
}

static PyObject *
Endpoint_repr(EndpointObject *ep)
{
    char uid[24]; /* PyUnicode_FromFormat has no %llx before Python 3.12 */

    snprintf(uid, sizeof(uid), "%#llx", (unsigned long long)ep->uid);
    return PyUnicode_FromFormat("<ucxx.Endpoint uid=%s %s>", uid,
                                ep->error != UCS_OK ? "failed" :
                                ep->closed ? "closed" : "open");
}

#define FASTKW(f) (PyCFunction)(void (*)(void))(f), \
    METH_FASTCALL | METH_KEYWORDS

static PyMethodDef Endpoint_methods[] = {
    {"send", FASTKW(Endpoint_send), Endpoint_send_doc},
    {"recv", FASTKW(Endpoint_recv), Endpoint_recv_doc},
    {"tag_send", (PyCFunction)(void (*)(void))Endpoint_tag_send,
     METH_FASTCALL, Endpoint_tag_send_doc},
    {"tag_recv", (PyCFunction)(void (*)(void))Endpoint_tag_recv,
     METH_FASTCALL, Endpoint_tag_recv_doc},
    {"stream_send", (PyCFunction)Endpoint_stream_send, METH_O,
     Endpoint_stream_send_doc},
    {"stream_recv", (PyCFunction)Endpoint_stream_recv, METH_O,
     Endpoint_stream_recv_doc},
    {"gather_send", FASTKW(Endpoint_gather_send), Endpoint_gather_send_doc},
    {"gather_recv", FASTKW(Endpoint_gather_recv), Endpoint_gather_recv_doc},
    {"gather_runs", (PyCFunction)Endpoint_gather_runs, METH_O | METH_CLASS,
     Endpoint_gather_runs_doc},
    {"am_send", (PyCFunction)Endpoint_am_send, METH_O, Endpoint_am_send_doc},
    {"am_recv", (PyCFunction)Endpoint_am_recv, METH_NOARGS,
     Endpoint_am_recv_doc},
    {"close", (PyCFunction)Endpoint_close, METH_NOARGS, Endpoint_close_doc},
    {"abort", (PyCFunction)Endpoint_abort, METH_NOARGS, Endpoint_abort_doc},
    {"_peer_exited", (PyCFunction)Endpoint_peer_exited, METH_NOARGS,
     Endpoint_peer_exited_doc},
    {"_close_by_peer", (PyCFunction)Endpoint_close_by_peer, METH_NOARGS,
     Endpoint_close_by_peer_doc},
    {"_begin_close", (PyCFunction)Endpoint_begin_close, METH_NOARGS,
     Endpoint_begin_close_doc},
    {"set_close_callback", (PyCFunction)Endpoint_set_close_callback, METH_O,
     Endpoint_set_close_callback_doc},
    {"recv_tag_for", FASTKW(Endpoint_recv_tag_for), Endpoint_recv_tag_for_doc},
    {"am_probe", (PyCFunction)Endpoint_am_probe, METH_NOARGS,
     Endpoint_am_probe_doc},
    {"raise_on_error", (PyCFunction)Endpoint_raise_on_error, METH_NOARGS,
     Endpoint_raise_on_error_doc},
    {NULL, NULL, 0, NULL},
};

/* The transports UCX uses for this endpoint: one (transport, device) per
 * lane, in lane order (ucp_ep_query). */
static PyObject *
Endpoint_get_transports(EndpointObject *ep, void *closure)
{
    ucp_transport_entry_t entries[16];
    ucp_ep_attr_t attr;
    ucs_status_t status;
    PyObject *out;

    ucxx_lock(ep->worker);
    if (ep->handle == NULL || ep->worker->handle == NULL) {
        ucxx_unlock(ep->worker);
        return PyTuple_New(0);
    }
    attr.field_mask = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries = entries;
    attr.transports.num_entries = 16;
    attr.transports.entry_size = sizeof(entries[0]);
    status = ucp_ep_query(ep->handle, &attr);
    ucxx_unlock(ep->worker);
    if (status != UCS_OK) {
        return ucxx_raise_status(ep->worker->st, status, "ucp_ep_query");
    }
    out = PyTuple_New(attr.transports.num_entries);
    for (unsigned i = 0; out != NULL && i < attr.transports.num_entries; i++) {
        PyObject *pair = Py_BuildValue("(ss)", entries[i].transport_name,
                                       entries[i].device_name);
        if (pair == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SetItem(out, i, pair);
    }
    return out;
}

static PyObject *
Endpoint_get_shm_peer_pid(EndpointObject *ep, void *closure)
{
    return PyLong_FromLong((long)ep->shm_peer_pid);
}

static PyGetSetDef Endpoint_getset[] = {
    {"_shm_peer_pid", (getter)Endpoint_get_shm_peer_pid, NULL,
     "From a worker address: the pid of the process whose shared-memory\n"
     "FIFO UCX attached for this endpoint (its pidfd is watched); 0.",
     NULL},
    {"transports", (getter)Endpoint_get_transports, NULL,
     "((transport, device), ...) UCX uses, one per lane; () once closed.",
     NULL},
    {"alive", (getter)Endpoint_get_alive, NULL, "Open and not failed.", NULL},
    {"closed", (getter)Endpoint_get_closed, NULL, "Closed or failed.", NULL},
    {"handle", (getter)Endpoint_get_handle, NULL, "ucp_ep_h as int.", NULL},
    {"uid", (getter)Endpoint_get_uid, NULL, "Unique id.", NULL},
    {"worker", (getter)Endpoint_get_worker, NULL, "The Worker.", NULL},
    {"peer_closed", (getter)Endpoint_get_peer_closed, NULL,
     "The peer announced its close.", NULL},
    {"error_handling", (getter)Endpoint_get_error_handling, NULL,
     "Peer error handling in effect.", NULL},
    {"error", (getter)Endpoint_get_error, NULL,
     "The peer error as an exception instance, or None.", NULL},
    {"send_tag", (getter)Endpoint_get_send_tag, (setter)Endpoint_set_send_tag,
     "Tag of send() when tag is None.", NULL},
    {"recv_tag", (getter)Endpoint_get_recv_tag, (setter)Endpoint_set_recv_tag,
     "Tag of recv() when tag is None.", NULL},
    {"recv_count", (getter)Endpoint_get_recv_count, NULL,
     "Receives posted by recv() and am_recv().", NULL},
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyMemberDef Endpoint_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(EndpointObject, weakreflist),
     READONLY},
    /* Attributes an application sets on its endpoints (a plain Python
     * object in RAPIDS ucxx); the dict exists only once one is set, so
     * method lookups stay on the class's fast path. */
    {"__dictoffset__", T_PYSSIZET, offsetof(EndpointObject, dict), READONLY},
    {"_state", T_OBJECT, offsetof(EndpointObject, state), 0,
     "The asyncio layer's per-endpoint state (None at creation)."},
    {NULL},
};

PyDoc_STRVAR(Endpoint_doc,
"A UCX endpoint. Created by Worker.ep_from_address/ep_from_sockaddr or a\n"
"Listener, never directly. A Python subclass that adds no instance\n"
"layout (__slots__ = ()) may be assigned to __class__: the public\n"
"ucxx.Endpoint is such a subclass, so its transfer methods are these.");

static PyType_Slot Endpoint_slots[] = {
    {Py_tp_doc, (void *)Endpoint_doc},
    {Py_tp_dealloc, Endpoint_dealloc},
    {Py_tp_finalize, Endpoint_finalize},
    {Py_tp_traverse, Endpoint_traverse},
    {Py_tp_clear, Endpoint_clear},
    {Py_tp_methods, Endpoint_methods},
    {Py_tp_getset, Endpoint_getset},
    {Py_tp_members, Endpoint_members},
    {Py_tp_repr, Endpoint_repr},
    {0, NULL},
};

PyType_Spec ucxx_endpoint_spec = {
    .name = "ucxx._ucxx.Endpoint",
    .basicsize = sizeof(EndpointObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Endpoint_slots,
};
