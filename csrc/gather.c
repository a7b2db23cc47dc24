/*
 * gather.c - gather_send / gather_recv: a list of buffers moved as few
 * tagged messages as their sizes and memory types allow ("runs", below).
 * The Request owns the buffers, the runs (its ops) and the IOV entries UCX
 * reads while it holds them; ucxx_request_dispatch releases the buffers,
 * Request_dealloc frees the arrays.
 */
#include "ucxx.h"

/*
 * Runs.  Consecutive host frames smaller than UCXX_GATHER_ALONE travel as
 * ONE tagged message with an IOV datatype (one wire write, one match, one
 * completion), at most UCXX_GATHER_RUN_BYTES and UCXX_GATHER_RUN_FRAMES per
 * message; a run of one frame is a plain contiguous message.  Host frames
 * of UCXX_GATHER_ALONE bytes or more, and device frames, are messages of
 * their own: one IOV cannot mix memory types, and for large frames UCX's
 * contiguous protocols (zero-copy) beat its IOV ones (docs/ENGINE.md has
 * the measurements).  The split depends on (size, memory type) alone, so
 * a receiver holding buffers of the sender's sizes and memory types posts
 * run i against message i; it is part of the wire format
 * (docs/PROTOCOL.md).
 */
static Py_ssize_t
gather_plan(const ucxx_buf *bufs, Py_ssize_t n, Py_ssize_t nalone,
            ucxx_op *ops)
{
    ucxx_op *run = NULL;
    Py_ssize_t k = 0;

    for (Py_ssize_t i = 0; i < n; i++) {
        const ucxx_buf *b = &bufs[i];
        int alone = i < nalone || b->mem_type != UCS_MEMORY_TYPE_HOST ||
                    b->len >= UCXX_GATHER_ALONE;

        if (alone || run == NULL || run->nframes == UCXX_GATHER_RUN_FRAMES ||
            run->expected + b->len > UCXX_GATHER_RUN_BYTES) {
            run = &ops[k++];
            run->first = i;
            run->nframes = 0;
            run->expected = 0;
        }
        run->nframes++;
        run->expected += b->len;
        if (alone) {
            run = NULL;
        }
    }
    return k;
}

/* The outcome of one run of a gather receive: a message whose length is
 * not the run's is a mismatch (the run's index is kept for the error
 * message).  After the first failure the runs UCX still holds can only
 * land in the wrong place: the request is queued so that dispatch (after
 * progress returns; never cancel from inside a UCX callback) cancels
 * them. */
static ucs_status_t
gather_recv_outcome(ucxx_op *op, ucs_status_t status, size_t length)
{
    RequestObject *r = op->req;

    if (status == UCS_OK && length != op->expected) {
        status = UCS_ERR_MESSAGE_TRUNCATED;
        op->got = length;
    } else if (status == UCS_ERR_MESSAGE_TRUNCATED) {
        op->got = length > op->expected ? length : SIZE_MAX;
    }
    if (status != UCS_ERR_CANCELED) {
        r->nconsumed++;
    }
    if (status != UCS_OK && r->first_error == UCS_OK) {
        if (status == UCS_ERR_MESSAGE_TRUNCATED) {
            r->bad_op = op - r->ops;
        }
        if (!r->posting && r->npending > 1) {
            ucxx_worker_queue_done(r->worker, r);
        }
    }
    return status;
}

static void
gather_recv_cb(void *request, ucs_status_t status,
               const ucp_tag_recv_info_t *info, void *user_data)
{
    ucxx_op *op = user_data;

    ucp_request_free(request);
    status = gather_recv_outcome(op, status,
                                 status == UCS_OK ||
                                 status == UCS_ERR_MESSAGE_TRUNCATED ?
                                 info->length : 0);
    ucxx_request_op_complete(op, status);
}

/* A send run of several frames is sent packed if it is small enough: its
 * frames copied into one contiguous buffer.  Over tcp UCX sends an IOV
 * message with its multi-fragment protocol, a contiguous one of the same
 * size in one fragment; the receiver's IOV receive takes either (a tagged
 * message is bytes; the datatype is each side's own). */
#define UCXX_GATHER_PACK_MAX 65536

static int
run_packed(const ucxx_op *op)
{
    return op->nframes > 1 && op->expected <= UCXX_GATHER_PACK_MAX;
}

static int
gather_pack(RequestObject *r)
{
    size_t total = 0, off = 0;

    for (Py_ssize_t j = 0; j < r->nops; j++) {
        if (run_packed(&r->ops[j])) {
            total += r->ops[j].expected;
        }
    }
    if (total == 0) {
        return 0;
    }
    r->pack = PyMem_Malloc(total);
    if (r->pack == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t j = 0; j < r->nops; j++) {
        ucxx_op *op = &r->ops[j];

        if (!run_packed(op)) {
            continue;
        }
        for (Py_ssize_t i = op->first; i < op->first + op->nframes; i++) {
            memcpy(r->pack + off, r->bufs[i].ptr, r->bufs[i].len);
            off += r->bufs[i].len;
        }
    }
    return 0;
}

/* Buffers, runs and IOV entries of a gather of the buffers of hseq (the
 * header messages, or NULL) then seq; bad input raises before anything is
 * posted. */
static int
gather_prepare(ucxx_state *st, RequestObject *r, PyObject *hseq,
               PyObject *seq, int recv)
{
    Py_ssize_t nh = hseq != NULL ? ucxx_fast_size(hseq) : 0;
    Py_ssize_t n = nh + ucxx_fast_size(seq), iovs = 0;

    if (n > 1) {
        r->ops = PyMem_Calloc((size_t)n, sizeof(ucxx_op));
        r->bufs = PyMem_Calloc((size_t)n, sizeof(ucxx_buf));
        if (r->ops == NULL || r->bufs == NULL) {
            PyErr_NoMemory();
            return -1;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *obj = i < nh ? ucxx_fast_item(hseq, i)
                               : ucxx_fast_item(seq, i - nh);

        if (ucxx_buf_get(st, obj, recv, &r->bufs[i]) < 0) {
            return -1;
        }
        r->nbufs = i + 1;
    }
    r->nops = gather_plan(r->bufs, n, nh, r->ops);
    for (Py_ssize_t j = 0; j < r->nops; j++) {
        r->ops[j].req = r;
        r->ops[j].ucp_req = NULL;
        r->ops[j].got = 0;
        if (r->ops[j].nframes > 1) {
            iovs += r->ops[j].nframes;
        }
    }
    if (!recv && gather_pack(r) < 0) {
        return -1;
    }
    if (iovs == 0) {
        return 0;
    }
    /* Indexed like bufs: entries of frames that travel alone stay unused. */
    r->iov = PyMem_Malloc((size_t)n * sizeof(ucp_dt_iov_t));
    if (r->iov == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        r->iov[i].buffer = r->bufs[i].ptr;
        r->iov[i].length = r->bufs[i].len;
    }
    return 0;
}

PyObject *
ucxx_gather(EndpointObject *ep, PyObject *bufs, PyObject *header,
            ucp_tag_t tag, int recv)
{
    WorkerObject *w = ep->worker;
    ucxx_state *st = ucxx_state_of((PyObject *)ep);
    PyObject *seq, *hseq = NULL;
    RequestObject *r;
    ucp_request_param_t param;
    ucp_tag_recv_info_t info;
    size_t packed = 0;

    if (ep->poisoned) {
        return ucxx_raise(st, UCXX_EXC_BASE,
                          "a failed or partly received gather left this "
                          "endpoint's ordered stream unusable for gathers; "
                          "close it");
    }
    seq = PySequence_Fast(bufs, "buffers must be a sequence of buffers");
    if (seq == NULL) {
        return NULL;
    }
    if (header != NULL) {
        hseq = PySequence_Fast(header, "header must be a sequence of buffers");
        if (hseq == NULL) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    r = ucxx_request_new(w, ep, recv ? UCXX_REQ_GATHER_RECV
                                     : UCXX_REQ_GATHER_SEND, 0);
    if (r == NULL || gather_prepare(st, r, hseq, seq, recv) < 0) {
        Py_DECREF(seq);
        Py_XDECREF(hseq);
        Py_XDECREF((PyObject *)r);
        return NULL;
    }
    Py_DECREF(seq);
    Py_XDECREF(hseq);

    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                         UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_MEMORY_TYPE |
                         UCP_OP_ATTR_FIELD_DATATYPE;
    if (recv) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
        param.cb.recv = gather_recv_cb;
        param.recv_info.tag_info = &info;
    } else {
        param.cb.send = ucxx_send_cb;
    }
    ucxx_lock(w);
    for (Py_ssize_t j = 0; j < r->nops; j++) {
        ucxx_op *op = &r->ops[j];
        ucxx_buf *b = &r->bufs[op->first];
        ucs_status_ptr_t sp;
        void *buf;
        size_t count;

        if (op->nframes == 1) {
            param.datatype = ucp_dt_make_contig(1);
            buf = b->ptr;
            count = b->len;
        } else if (!recv && run_packed(op)) {
            param.datatype = ucp_dt_make_contig(1);
            buf = r->pack + packed;
            count = op->expected;
            packed += op->expected;
        } else {
            param.datatype = ucp_dt_make_iov();
            buf = &r->iov[op->first];
            count = (size_t)op->nframes;
        }
        param.memory_type = b->mem_type;
        param.user_data = op;
        if (recv) {
            sp = ucp_tag_recv_nbx(w->handle, buf, count, tag,
                                  UCXX_TAG_MASK_FULL, &param);
            if (sp == NULL) {
                ucs_status_t s = gather_recv_outcome(op, UCS_OK, info.length);

                if (s != UCS_OK && r->first_error == UCS_OK) {
                    r->first_error = s;
                }
            } else if (UCS_PTR_IS_ERR(sp)) {
                gather_recv_outcome(op, UCS_PTR_STATUS(sp), 0);
            }
        } else {
            sp = ucp_tag_send_nbx(ep->handle, buf, count, tag, &param);
        }
        ucxx_request_track(r, op, sp);
        if (r->first_error != UCS_OK) {
            break; /* first error wins; nothing more is posted */
        }
    }
    ucxx_worker_touched(w);
    if (recv && r->first_error != UCS_OK) {
        /* Earlier runs UCX still holds would complete a failed gather. */
        ucxx_request_cancel_ucx(r, UCS_ERR_CANCELED);
    }
    if (recv) {
        ucxx_request_fail_if_dead(r, ep);
    }
    ucxx_request_finish_posting(r);
    ucxx_worker_dispatch(w);
    ucxx_unlock(w);
    return (PyObject *)r;
}

/* The gather r settles with `status`.  A failed receive that took some
 * of its messages off the stream but not all (cancelled midway, or a run
 * that failed while later runs had not matched yet) leaves the stream
 * between two messages of one gather: later gathers on the endpoint are
 * refused ("poisoned").  One that took all of them (a size mismatch) or
 * none (cancelled before anything matched) leaves it where a whole number
 * of gathers would.  A failed send may have delivered any part of it. */
void
ucxx_gather_settled(RequestObject *r, ucs_status_t status)
{
    if (status == UCS_OK || r->endpoint == NULL) {
        return;
    }
    if (r->kind == UCXX_REQ_GATHER_RECV &&
        (r->nconsumed == 0 || r->nconsumed == r->nops)) {
        return;
    }
    r->endpoint->poisoned = 1;
}

/* The exception of a gather receive whose run r->bad_op met a message of
 * another length. */
PyObject *
ucxx_gather_raise_mismatch(ucxx_state *st, RequestObject *r)
{
    ucxx_op *op = &r->ops[r->bad_op];
    Py_ssize_t last = op->first + op->nframes - 1;
    char frames[64];

    if (op->nframes == 1) {
        snprintf(frames, sizeof(frames), "frame %zd", op->first);
    } else {
        snprintf(frames, sizeof(frames), "frames %zd-%zd", op->first, last);
    }
    if (op->got == SIZE_MAX) {
        return ucxx_raise(st, UCXX_EXC_TRUNCATED,
                          "gather_recv: the message for %s is longer than "
                          "their %zu bytes (message truncated)", frames,
                          op->expected);
    }
    if (op->got > op->expected) {
        return ucxx_raise(st, UCXX_EXC_TRUNCATED,
                          "gather_recv: the message for %s is %zu bytes, "
                          "longer than their %zu bytes (message truncated)",
                          frames, op->got, op->expected);
    }
    return ucxx_raise(st, UCXX_EXC_TRUNCATED,
                      "gather_recv: the message for %s is %zu bytes, "
                      "shorter than their %zu bytes", frames, op->got,
                      op->expected);
}

/* Endpoint.gather_runs(buffers): the runs a gather of `buffers` posts, as
 * (first frame, frame count, bytes, is IOV) tuples.  Both sides of a
 * gather compute the same list from (size, memory type). */
PyObject *
ucxx_gather_runs(ucxx_state *st, PyObject *bufs)
{
    PyObject *seq, *out = NULL;
    ucxx_buf *b = NULL;
    ucxx_op *ops = NULL;
    Py_ssize_t n, k, got = 0;

    seq = PySequence_Fast(bufs, "buffers must be a sequence of buffers");
    if (seq == NULL) {
        return NULL;
    }
    n = ucxx_fast_size(seq);
    b = PyMem_Calloc((size_t)(n ? n : 1), sizeof(ucxx_buf));
    ops = PyMem_Calloc((size_t)(n ? n : 1), sizeof(ucxx_op));
    if (b == NULL || ops == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (; got < n; got++) {
        if (ucxx_buf_get(st, ucxx_fast_item(seq, got), 0,
                         &b[got]) < 0) {
            goto out;
        }
    }
    k = gather_plan(b, n, 0, ops);
    out = PyList_New(k);
    if (out == NULL) {
        goto out;
    }
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *t = Py_BuildValue("(nnKO)", ops[j].first, ops[j].nframes,
                                    (unsigned long long)ops[j].expected,
                                    ops[j].nframes > 1 ? Py_True : Py_False);

        if (t == NULL) {
            Py_CLEAR(out);
            goto out;
        }
        PyList_SetItem(out, j, t);
    }
out:
    for (Py_ssize_t i = 0; i < got; i++) {
        ucxx_buf_release(&b[i]);
    }
    PyMem_Free(b);
    PyMem_Free(ops);
    Py_DECREF(seq);
    return out;
}
