/*
 * gather.c - gather_send / gather_recv: N tagged operations on one tag,
 * posted in order in one C call, completed through ONE Request.  The
 * Request owns every Py_buffer (acquired up front, released once when the
 * last operation completes).  UCX keeps per-(sender, tag) order, so frame
 * i lands in buffer i.
 */
#include "ucxx.h"

PyObject *
ucxx_gather(EndpointObject *ep, PyObject *bufs, ucp_tag_t tag, int recv)
{
    WorkerObject *w = ep->worker;
    ucxx_state *st = ucxx_state_of((PyObject *)ep);
    PyObject *seq;
    Py_ssize_t n, i;
    RequestObject *r;
    ucp_request_param_t param;
    ucp_tag_recv_info_t info;

    if (ep->poisoned) {
        return ucxx_raise(st, UCXX_EXC_BASE,
                          "a cancelled or failed gather left this endpoint's "
                          "ordered stream unusable; close it");
    }
    seq = PySequence_Fast(bufs, "buffers must be a sequence of buffers");
    if (seq == NULL) {
        return NULL;
    }
    n = PySequence_Fast_GET_SIZE(seq);
    r = ucxx_request_new(w, ep, recv ? UCXX_REQ_GATHER_RECV
                                     : UCXX_REQ_GATHER_SEND, n);
    if (r == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    if (n > 1) {
        r->ops = PyMem_Calloc((size_t)n, sizeof(ucxx_op));
        r->bufs = PyMem_Calloc((size_t)n, sizeof(ucxx_buf));
        if (r->ops == NULL || r->bufs == NULL) {
            Py_DECREF(seq);
            Py_DECREF(r);
            return PyErr_NoMemory();
        }
    }
    /* Every buffer first: bad input raises before anything is posted. */
    for (i = 0; i < n; i++) {
        if (ucxx_buf_get(st, PySequence_Fast_GET_ITEM(seq, i), recv,
                         &r->bufs[i]) < 0) {
            Py_DECREF(seq);
            Py_DECREF(r);
            return NULL;
        }
        r->nbufs = i + 1;
        r->ops[i].req = r;
        r->ops[i].ucp_req = NULL;
        r->ops[i].expected = r->bufs[i].len;
    }
    Py_DECREF(seq);

    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                         UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    if (recv) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
        param.cb.recv = ucxx_recv_cb;
        param.recv_info.tag_info = &info;
    } else {
        param.cb.send = ucxx_send_cb;
    }
    ucxx_lock(w);
    for (i = 0; i < n; i++) {
        ucs_status_ptr_t sp;

        param.user_data = &r->ops[i];
        param.memory_type = r->bufs[i].mem_type;
        if (recv) {
            sp = ucp_tag_recv_nbx(w->handle, r->bufs[i].ptr, r->bufs[i].len,
                                  tag, UCXX_TAG_MASK_FULL, &param);
            if (sp == NULL && info.length != r->bufs[i].len &&
                r->first_error == UCS_OK) {
                r->first_error = UCS_ERR_MESSAGE_TRUNCATED;
            }
        } else {
            sp = ucp_tag_send_nbx(ep->handle, r->bufs[i].ptr, r->bufs[i].len,
                                  tag, &param);
        }
        if (ucxx_request_track(r, &r->ops[i], sp) < 0 &&
            !(recv && UCS_PTR_STATUS(sp) == UCS_ERR_MESSAGE_TRUNCATED)) {
            break; /* first error wins; nothing more is posted */
        }
    }
    ucxx_worker_touched(w);
    /* A frame that did not fit was consumed all the same: the receives of
     * the frames behind it stay posted so the stream stays in step. Any
     * other error stops the gather. */
    if (recv && r->first_error != UCS_OK &&
        r->first_error != UCS_ERR_MESSAGE_TRUNCATED) {
        ucxx_request_cancel_ucx(r, r->first_error);
    }
    if (recv) {
        ucxx_request_fail_if_dead(r, ep);
    }
    ucxx_request_finish_posting(r);
    ucxx_worker_dispatch(w);
    ucxx_unlock(w);
    return (PyObject *)r;
}
