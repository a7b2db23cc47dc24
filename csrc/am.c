/*
 * am.c - active messages: am_send / am_recv on an Endpoint.  The worker
 * installs one AM handler; arriving messages are queued raw (C only) per
 * endpoint by the handler, then allocated through the allocator registered
 * for their memory type (host default: bytearray) and handed to a waiting
 * am_recv or kept in the endpoint's queue.  The endpoint owns queued raw
 * messages and releases them to UCX when it closes.
 */
#include "ucxx.h"

#define UCXX_AM_ID 0x75

enum { AM_COPY, AM_PERSISTENT, AM_RNDV };

typedef struct ucxx_am_msg {
    struct ucxx_am_msg *next;
    void *data;                  /* copy (malloc), UCX data, or rndv desc */
    size_t length;
    int kind;
    ucs_memory_type_t mem_type;
} ucxx_am_msg;

static EndpointObject *
find_endpoint(WorkerObject *w, ucp_ep_h uep)
{
    for (ucxx_link *it = w->endpoints.next; it != &w->endpoints;
         it = it->next) {
        EndpointObject *ep = UCXX_CONTAINER(it, EndpointObject, wlink);
        if (ep->handle == uep) {
            return ep;
        }
    }
    return NULL;
}

static ucs_status_t
am_recv_cb(void *arg, const void *header, size_t header_length, void *data,
           size_t length, const ucp_am_recv_param_t *param)
{
    WorkerObject *w = arg;
    EndpointObject *ep;
    ucxx_am_msg *m;

    /* Inside ucp_worker_progress: C only. */
    if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ||
        (ep = find_endpoint(w, param->reply_ep)) == NULL ||
        (m = malloc(sizeof(*m))) == NULL) {
        return UCS_OK; /* unknown sender: dropped */
    }
    m->next = NULL;
    m->length = length;
    m->mem_type = header_length >= 1 ? *(const uint8_t *)header
                                     : UCS_MEMORY_TYPE_HOST;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        m->kind = AM_RNDV;
        m->data = data;
    } else if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA) {
        m->kind = AM_PERSISTENT;
        m->data = data;
    } else {
        m->kind = AM_COPY;
        m->data = malloc(length ? length : 1);
        if (m->data == NULL) {
            free(m);
            return UCS_OK;
        }
        memcpy(m->data, data, length);
    }
    if (ep->am_raw_tail != NULL) {
        ((ucxx_am_msg *)ep->am_raw_tail)->next = m;
    } else {
        ep->am_raw = m;
    }
    ep->am_raw_tail = m;
    if (ucxx_list_empty(&ep->alink)) {
        ucxx_list_add_tail(&w->am_ready, &ep->alink);
    }
    return m->kind == AM_COPY ? UCS_OK : UCS_INPROGRESS;
}

int
ucxx_am_setup(WorkerObject *w)
{
    ucp_am_handler_param_t p = {0};
    ucs_status_t status;

    p.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID |
                   UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                   UCP_AM_HANDLER_PARAM_FIELD_CB |
                   UCP_AM_HANDLER_PARAM_FIELD_ARG;
    p.id = UCXX_AM_ID;
    p.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
    p.cb = am_recv_cb;
    p.arg = w;
    status = ucp_worker_set_am_recv_handler(w->handle, &p);
    if (status != UCS_OK) {
        ucxx_raise_status(w->st, status,
                          "ucp_worker_set_am_recv_handler");
        return -1;
    }
    w->am_registered = 1;
    return 0;
}

/* A received message (or the exception of a failed one) for am_recv. */
void
ucxx_am_push(EndpointObject *ep, PyObject *obj)
{
    if (!ucxx_list_empty(&ep->am_waiters)) {
        RequestObject *r = UCXX_CONTAINER(ep->am_waiters.next, RequestObject,
                                          elink);
        ucxx_list_del(&r->elink);
        if (PyExceptionInstance_Check(obj)) {
            r->result = Py_NewRef(obj);
            ucxx_request_complete_now(r, UCS_ERR_IO_ERROR);
        } else {
            r->result = Py_NewRef(obj);
            ucxx_request_complete_now(r, UCS_OK);
        }
        return;
    }
    if (ep->am_queue != NULL && PyList_Append(ep->am_queue, obj) < 0) {
        PyErr_WriteUnraisable((PyObject *)ep);
    }
}

static PyObject *
am_allocate(WorkerObject *w, ucxx_am_msg *m)
{
    PyObject *key = PyLong_FromLong(m->mem_type), *alloc;

    if (key == NULL) {
        return NULL;
    }
    alloc = PyDict_GetItemWithError(w->am_allocators, key);
    Py_DECREF(key);
    if (alloc != NULL) {
        return PyObject_CallFunction(alloc, "n", (Py_ssize_t)m->length);
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (m->mem_type != UCS_MEMORY_TYPE_HOST) {
        return ucxx_raise(w->st, UCXX_EXC_UNSUPPORTED,
                          "no allocator registered for memory type %d",
                          (int)m->mem_type);
    }
    return PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)m->length);
}

static void
am_release(WorkerObject *w, ucxx_am_msg *m)
{
    if (m->kind == AM_COPY) {
        free(m->data);
    } else if (w->handle != NULL) {
        ucp_am_data_release(w->handle, m->data);
    }
    free(m);
}

/* Post the rendezvous receive of m into obj. */
static int
am_fetch(EndpointObject *ep, ucxx_am_msg *m, PyObject *obj)
{
    WorkerObject *w = ep->worker;
    ucp_request_param_t param;
    ucs_status_ptr_t sp;
    RequestObject *r = ucxx_request_with_buffer(w, ep, UCXX_REQ_AM_DATA, obj,
                                                1);

    if (r == NULL) {
        return -1;
    }
    r->result = Py_NewRef(obj);
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                         UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    param.cb.recv_am = ucxx_stream_recv_cb;
    param.user_data = &r->op1;
    param.memory_type = r->buf1.mem_type;
    sp = ucp_am_recv_data_nbx(w->handle, m->data, r->buf1.ptr,
                              m->length < r->buf1.len ? m->length
                                                      : r->buf1.len,
                              &param);
    ucxx_worker_touched(w);
    ucxx_request_track(r, &r->op1, sp);
    ucxx_request_finish_posting(r);
    Py_DECREF(r);
    return 0;
}

void
ucxx_am_deliver(EndpointObject *ep)
{
    WorkerObject *w = ep->worker;
    ucxx_am_msg *m;

    while ((m = ep->am_raw) != NULL) {
        PyObject *obj;
        ucxx_buf b;

        ep->am_raw = m->next;
        if (ep->am_raw == NULL) {
            ep->am_raw_tail = NULL;
        }
        obj = am_allocate(w, m);
        if (obj != NULL && m->kind == AM_RNDV) {
            if (am_fetch(ep, m, obj) < 0) {
                Py_CLEAR(obj);
            } else {
                Py_DECREF(obj);
                free(m); /* UCX owns the descriptor now */
                continue;
            }
        } else if (obj != NULL) {
            if (ucxx_buf_get(ucxx_state_of((PyObject *)ep), obj, 1, &b) < 0) {
                Py_CLEAR(obj);
            } else if (b.len < m->length) {
                ucxx_buf_release(&b);
                Py_CLEAR(obj);
                ucxx_raise(ucxx_state_of((PyObject *)ep), UCXX_EXC_TRUNCATED,
                           "the AM allocator returned %zu bytes for a "
                           "%zu-byte message", b.len, m->length);
            } else {
                memcpy(b.ptr, m->data, m->length);
                ucxx_buf_release(&b);
            }
        }
        am_release(w, m);
        if (obj == NULL) {
            PyObject *exc = PyErr_GetRaisedException_compat();
            ucxx_am_push(ep, exc);
            Py_DECREF(exc);
        } else {
            ucxx_am_push(ep, obj);
            Py_DECREF(obj);
        }
    }
}

void
ucxx_am_discard(EndpointObject *ep)
{
    ucxx_am_msg *m;

    ucxx_lock(ep->worker);
    while ((m = ep->am_raw) != NULL) {
        ep->am_raw = m->next;
        am_release(ep->worker, m);
    }
    ep->am_raw_tail = NULL;
    ucxx_list_del(&ep->alink);
    ucxx_unlock(ep->worker);
}

PyObject *
ucxx_am_send(EndpointObject *ep, PyObject *buf)
{
    WorkerObject *w = ep->worker;
    ucp_request_param_t param;
    ucs_status_ptr_t sp;
    uint8_t hdr;
    RequestObject *r;

    if (!w->am_registered) {
        return ucxx_raise(ucxx_state_of((PyObject *)ep), UCXX_EXC_UNSUPPORTED,
                          "the context was created without FEATURE_AM");
    }
    r = ucxx_request_with_buffer(w, ep, UCXX_REQ_AM_SEND, buf, 0);
    if (r == NULL) {
        return NULL;
    }
    hdr = (uint8_t)r->buf1.mem_type;
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                         UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_MEMORY_TYPE |
                         UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send = ucxx_send_cb;
    param.user_data = &r->op1;
    param.memory_type = r->buf1.mem_type;
    /* Device data always goes by rendezvous so the receiver can place it
     * directly into device memory. */
    param.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER |
                  (r->buf1.mem_type == UCS_MEMORY_TYPE_HOST
                       ? 0 : UCP_AM_SEND_FLAG_RNDV);
    ucxx_lock(w);
    sp = ucp_am_send_nbx(ep->handle, UCXX_AM_ID, &hdr, sizeof(hdr),
                         r->buf1.ptr, r->buf1.len, &param);
    ucxx_worker_touched(w);
    ucxx_request_track(r, &r->op1, sp);
    ucxx_request_finish_posting(r);
    ucxx_unlock(w);
    return (PyObject *)r;
}

PyObject *
ucxx_am_recv(EndpointObject *ep)
{
    RequestObject *r = ucxx_request_new(ep->worker, ep, UCXX_REQ_AM_RECV, 0);

    if (r == NULL) {
        return NULL;
    }
    r->posting = 0;
    if (ep->am_queue != NULL && PyList_Size(ep->am_queue) > 0) {
        PyObject *obj = Py_NewRef(PyList_GetItem(ep->am_queue, 0));

        if (PySequence_DelItem(ep->am_queue, 0) < 0) {
            Py_DECREF(obj);
            Py_DECREF(r);
            return NULL;
        }
        r->result = obj;
        r->status = PyExceptionInstance_Check(obj) ? UCS_ERR_IO_ERROR : UCS_OK;
        return (PyObject *)r;
    }
    if (ep->error != UCS_OK || ep->closed) {
        r->status = ep->error != UCS_OK ? ep->error : UCS_ERR_CANCELED;
        return (PyObject *)r;
    }
    ucxx_list_add_tail(&ep->am_waiters, &r->elink);
    return (PyObject *)r;
}
