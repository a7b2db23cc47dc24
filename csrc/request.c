/*
 * request.c - Request, the awaitable of one transfer (or one gather).
 * Owns its buffers (Py_buffer or device owner) and, while UCX holds any of
 * its operations, a reference to itself; both are released when the last
 * operation completes (ucxx_request_dispatch).  UCX frees its own request
 * handles in the completion callbacks below.
 */
#include "ucxx.h"

RequestObject *
ucxx_request_new(WorkerObject *w, EndpointObject *ep, int kind,
                 Py_ssize_t nops)
{
    ucxx_state *st = w->st;
    RequestObject *r;

    r = st->req_free;
    if (r != NULL) {
        st->req_free = r->next_done;
        st->nreq_free--;
        PyObject_Init((PyObject *)r, st->RequestType);
    } else {
        r = PyObject_GC_New(RequestObject, st->RequestType);
        if (r == NULL) {
            return NULL;
        }
    }
    r->worker = (WorkerObject *)Py_NewRef((PyObject *)w);
    r->endpoint = (EndpointObject *)Py_XNewRef((PyObject *)ep);
    r->kind = kind;
    r->status = UCS_INPROGRESS;
    r->first_error = UCS_OK;
    r->fail_status = UCS_OK;
    r->npending = 0;
    r->nops = nops;
    r->posting = 1;
    r->length = 0;
    r->queued = 0;
    r->self_ref = 0;
    r->abandoned = 0;
    r->op1.req = r;
    r->op1.ucp_req = NULL;
    r->op1.expected = 0;
    r->op1.got = 0;
    r->op1.first = 0;
    r->op1.nframes = 1;
    r->ops = &r->op1;
    r->buf1.view.obj = NULL;
    r->buf1.owner = NULL;
    r->bufs = &r->buf1;
    r->nbufs = 0;
    r->iov = NULL;
    r->pack = NULL;
    r->bad_op = -1;
    r->nconsumed = 0;
    r->result = NULL;
    r->future = NULL;
    r->wait_start = 0.0;
    r->slice_yielded = 0;
    r->large = 0;
    r->busy_yield_at = 0.0;
    r->next_done = NULL;
    ucxx_list_init(&r->wlink);
    ucxx_list_init(&r->elink);
    PyObject_GC_Track(r);
    return r;
}

static void
record_error(RequestObject *r, ucs_status_t status)
{
    if (status != UCS_OK && r->first_error == UCS_OK) {
        r->first_error = status;
    }
}

/* One operation completed inside UCX (no GIL needed: C fields only). */
void
ucxx_request_op_complete(ucxx_op *op, ucs_status_t status)
{
    RequestObject *r = op->req;

    op->ucp_req = NULL;
    record_error(r, status);
    if (--r->npending == 0 && !r->posting) {
        ucxx_worker_queue_done(r->worker, r);
    }
}

void
ucxx_send_cb(void *request, ucs_status_t status, void *user_data)
{
    ucp_request_free(request);
    ucxx_request_op_complete((ucxx_op *)user_data, status);
}

void
ucxx_recv_cb(void *request, ucs_status_t status,
             const ucp_tag_recv_info_t *info, void *user_data)
{
    ucxx_op *op = user_data;
    RequestObject *r = op->req;

    ucp_request_free(request);
    if (status == UCS_OK) {
        r->length = info->length;
    }
    ucxx_request_op_complete(op, status);
}

void
ucxx_stream_recv_cb(void *request, ucs_status_t status, size_t length,
                    void *user_data)
{
    ucxx_op *op = user_data;

    ucp_request_free(request);
    if (status == UCS_OK) {
        op->req->length = length;
    }
    ucxx_request_op_complete(op, status);
}

/*
 * Account for the return value of one *_nbx call: NULL is an immediate
 * completion, an error pointer fails the request, anything else is a UCX
 * request we now wait for (and hold ourselves alive for).
 */
int
ucxx_request_track(RequestObject *r, ucxx_op *op, ucs_status_ptr_t sp)
{
    if (sp == NULL) {
        return 0;
    }
    if (UCS_PTR_IS_ERR(sp)) {
        record_error(r, UCS_PTR_STATUS(sp));
        return -1;
    }
    op->ucp_req = sp;
    r->npending++;
    if (!r->self_ref) {
        size_t nbytes = 0;

        Py_INCREF((PyObject *)r);
        r->self_ref = 1;
        ucxx_list_add_tail(&r->worker->pending, &r->wlink);
        for (Py_ssize_t i = 0; i < r->nbufs; i++) {
            nbytes += r->bufs[i].len;
        }
        if (nbytes >= UCXX_FOLLOW_MIN && !r->large) {
            r->large = 1;
            r->worker->large_pending++;
        }
    }
    return 0;
}

/* Off worker->pending (idempotent). */
static void
request_unlink(RequestObject *r)
{
    ucxx_list_del(&r->wlink);
    if (r->large) {
        r->large = 0;
        r->worker->large_pending--;
        r->worker->follow_since = 0.0;      /* engine.c: follow_allowed */
        r->worker->follow_stopped = 0;
    }
}

/* All operations are posted: if none is pending, complete right away. */
void
ucxx_request_finish_posting(RequestObject *r)
{
    r->posting = 0;
    if (r->npending == 0) {
        ucxx_request_dispatch(r);
    }
}

/* Complete a request UCX does not hold (AM waiters) at the next dispatch. */
void
ucxx_request_complete_now(RequestObject *r, ucs_status_t status)
{
    record_error(r, status);
    if (r->npending == 0 && !r->queued && r->status == UCS_INPROGRESS) {
        if (!r->self_ref) {
            Py_INCREF((PyObject *)r);
            r->self_ref = 1;
        }
        ucxx_worker_queue_done(r->worker, r);
    }
}

/* Ask UCX to cancel what it still holds; report `report` instead of
 * UCS_ERR_CANCELED (e.g. the peer's error). Sends cannot be recalled. */
void
ucxx_request_cancel_ucx(RequestObject *r, ucs_status_t report)
{
    WorkerObject *w = r->worker;

    if (r->status != UCS_INPROGRESS) {
        return;
    }
    if (report != UCS_ERR_CANCELED && r->fail_status == UCS_OK) {
        r->fail_status = report;
    }
    if (r->kind == UCXX_REQ_AM_RECV) {
        ucxx_list_del(&r->elink);
        ucxx_request_complete_now(r, report);
        return;
    }
    if (w->handle == NULL) {
        return;
    }
    ucxx_lock(w);
    for (Py_ssize_t i = 0; i < r->nops; i++) {
        if (r->ops[i].ucp_req != NULL) {
            ucp_request_cancel(w->handle, r->ops[i].ucp_req);
        }
    }
    ucxx_worker_touched(w);
    ucxx_unlock(w);
}

PyObject *
ucxx_request_result(RequestObject *r)
{
    ucxx_state *st;
    ucs_status_t status = r->status;

    if (status == UCS_OK) {
        switch (r->kind) {
        case UCXX_REQ_RECV:
        case UCXX_REQ_STREAM_RECV:
            return PyLong_FromSize_t(r->length);
        case UCXX_REQ_AM_RECV:
            return Py_NewRef(r->result ? r->result : Py_None);
        default:
            Py_RETURN_NONE;
        }
    }
    if (r->kind == UCXX_REQ_AM_RECV && r->result != NULL &&
        PyExceptionInstance_Check(r->result)) {
        PyErr_SetRaisedException_compat(Py_NewRef(r->result));
        return NULL;
    }
    st = ucxx_state_of((PyObject *)r);
    if (r->kind == UCXX_REQ_GATHER_RECV &&
        status == UCS_ERR_MESSAGE_TRUNCATED && r->bad_op >= 0) {
        return ucxx_gather_raise_mismatch(st, r);
    }
    if (status == UCS_INPROGRESS) {
        PyErr_SetString(st->InvalidStateError, "request is not done");
        return NULL;
    }
    return ucxx_raise_status(st, status, NULL);
}

static void
request_release(RequestObject *r)
{
    for (Py_ssize_t i = 0; i < r->nbufs; i++) {
        ucxx_buf_release(&r->bufs[i]);
    }
    r->nbufs = 0;
}

/* Settle the status and resolve the future (which only schedules
 * callbacks). */
static void
request_settle(RequestObject *r, ucs_status_t status)
{
    PyObject *fut = r->future, *res;

    r->status = status;
    if (r->kind == UCXX_REQ_GATHER_RECV || r->kind == UCXX_REQ_GATHER_SEND) {
        ucxx_gather_settled(r, status);
    }
    if (fut != NULL) {
        ucxx_state *st = ucxx_state_of((PyObject *)r);
        PyObject *val;

        /* It slept: a task is woken, and the spin policy learns how long
         * the wait was. */
        r->worker->wakeups++;
        if (r->wait_start != 0.0 && r->worker->spin_auto) {
            ucxx_spin_feedback(r);
        }
        val = ucxx_request_result(r);

        if (val != NULL) {
            res = ucxx_call_method1(fut, st->s_set_result, val);
            Py_DECREF(val);
        } else {
            PyObject *exc = PyErr_GetRaisedException_compat();
            res = ucxx_call_method1(fut, st->s_set_exception, exc);
            Py_DECREF(exc);
        }
        if (res == NULL) {
            /* Only a cancelled future refuses a result: nothing to tell. */
            if (PyErr_ExceptionMatches(st->InvalidStateError)) {
                PyErr_Clear();
            } else {
                PyErr_WriteUnraisable((PyObject *)r);
            }
        }
        Py_XDECREF(res);
    }
}

static void
request_drop_self(RequestObject *r)
{
    if (r->self_ref) {
        r->self_ref = 0;
        Py_DECREF(r);
    }
}

/* Last operation done: release buffers, settle the status, resolve the
 * future, drop the self reference.  For an abandoned request (already
 * settled) only the release is left. */
void
ucxx_request_dispatch(RequestObject *r)
{
    ucs_status_t status = r->first_error;

    if (r->status != UCS_INPROGRESS) {
        if (r->abandoned && r->npending == 0) {
            r->abandoned = 0;
            request_release(r);
            request_unlink(r);
            request_drop_self(r);
        }
        return;
    }
    if (r->npending > 0) {
        /* Queued early by a gather receive whose run failed: the runs UCX
         * still holds can only land in the wrong place, cancel them (their
         * completions queue r again). */
        ucxx_request_cancel_ucx(r, UCS_ERR_CANCELED);
        return;
    }
    if (r->kind == UCXX_REQ_CLOSE) {
        status = UCS_OK; /* the endpoint is gone either way */
        if (r->endpoint != NULL) {
            ucxx_endpoint_flushed(r->endpoint);
        }
    }
    if (r->kind == UCXX_REQ_AM_DATA && r->endpoint != NULL) {
        /* A rendezvous active message arrived: hand it to am_recv. */
        PyObject *obj = status == UCS_OK ? Py_NewRef(r->result) :
            ucxx_status_exc(ucxx_state_of((PyObject *)r), status, NULL);
        if (obj != NULL) {
            ucxx_am_push(r->endpoint, obj);
            Py_DECREF(obj);
        } else {
            PyErr_WriteUnraisable((PyObject *)r);
        }
    }
    request_release(r);
    if (status == UCS_ERR_CANCELED && r->fail_status != UCS_OK) {
        status = r->fail_status;
    }
    request_unlink(r);
    request_settle(r, status);
    request_drop_self(r);
}

/* The endpoint of receive r is dead: fail r for Python now, whatever UCX
 * does with the operations it still holds after the cancel (a rendezvous
 * receive matched to a message of a peer that died may never complete,
 * nor be cancelled).  Its buffers, its place on worker->pending and its
 * self reference stay until UCX completes those operations, at the latest
 * when the worker closes.  Call it once every operation of r is posted. */
static void
request_abandon(RequestObject *r, ucs_status_t status)
{
    if (r->status != UCS_INPROGRESS || r->npending == 0) {
        return;
    }
    r->abandoned = 1;
    request_settle(r, status);
}

/* r's endpoint is closed or failed: cancel what UCX holds of r, reporting
 * `report`.  After a peer error (anything but UCS_ERR_CANCELED, which is
 * our own close or the peer's clean one: both flush first) UCX may never
 * finish what it still holds, so r is abandoned too. */
void
ucxx_request_cancel_for_endpoint(RequestObject *r, ucs_status_t report)
{
    ucxx_request_cancel_ucx(r, report);
    if (report != UCS_ERR_CANCELED) {
        request_abandon(r, report);
    }
}

/* ---- posting single operations ---------------------------------------- */

static void
param_init(ucp_request_param_t *p, RequestObject *r, ucxx_op *op,
           ucs_memory_type_t mem_type)
{
    p->op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                      UCP_OP_ATTR_FIELD_MEMORY_TYPE;
    p->user_data = op;
    p->memory_type = mem_type;
}

/* A one-operation Request holding `buf` (acquired before anything is
 * posted, so bad input raises first). */
RequestObject *
ucxx_request_with_buffer(WorkerObject *w, EndpointObject *ep, int kind,
                         PyObject *buf, int writable)
{
    RequestObject *r = ucxx_request_new(w, ep, kind, 1);

    if (r == NULL) {
        return NULL;
    }
    if (ucxx_buf_get(w->st, buf, writable,
                     &r->buf1) < 0) {
        Py_DECREF(r);
        return NULL;
    }
    r->nbufs = 1;
    r->op1.expected = r->buf1.len;
    return r;
}

/* A receive on a failed (or peer-closed) endpoint that did not match a
 * message that had already arrived can never complete: fail it now. */
void
ucxx_request_fail_if_dead(RequestObject *r, EndpointObject *ep)
{
    if (ep != NULL && (ep->error != UCS_OK || ep->peer_closed) &&
        r->npending) {
        ucxx_request_cancel_for_endpoint(
            r, ep->error != UCS_OK ? ep->error : UCS_ERR_CANCELED);
    }
}

/* A tagged receive into buf: of the next message matching tag/mask, or of
 * `msg` (a message a probe took from UCX's queue) when it is not NULL.
 * NULL (nothing posted) only if buf is refused. */
static PyObject *
post_tag_recv(WorkerObject *w, EndpointObject *ep, PyObject *buf,
              ucp_tag_t tag, ucp_tag_t mask, ucp_tag_message_h msg)
{
    ucp_request_param_t param;
    ucp_tag_recv_info_t info;
    ucs_status_ptr_t sp;
    RequestObject *r = ucxx_request_with_buffer(w, ep, UCXX_REQ_RECV, buf, 1);

    if (r == NULL) {
        return NULL;
    }
    param_init(&param, r, &r->op1, r->buf1.mem_type);
    param.op_attr_mask |= UCP_OP_ATTR_FIELD_RECV_INFO;
    param.cb.recv = ucxx_recv_cb;
    param.recv_info.tag_info = &info;
    ucxx_lock(w);
    sp = msg != NULL ?
        ucp_tag_msg_recv_nbx(w->handle, r->buf1.ptr, r->buf1.len, msg, &param) :
        ucp_tag_recv_nbx(w->handle, r->buf1.ptr, r->buf1.len, tag, mask, &param);
    ucxx_worker_touched(w);
    if (sp == NULL) {
        r->length = info.length;
    }
    ucxx_request_track(r, &r->op1, sp);
    ucxx_request_fail_if_dead(r, ep);
    ucxx_request_finish_posting(r);
    ucxx_worker_dispatch(w);
    ucxx_unlock(w);
    return (PyObject *)r;
}

PyObject *
ucxx_request_post_recv(WorkerObject *w, EndpointObject *ep, PyObject *buf,
                       ucp_tag_t tag, ucp_tag_t mask)
{
    return post_tag_recv(w, ep, buf, tag, mask, NULL);
}

PyObject *
ucxx_request_post_msg_recv(WorkerObject *w, PyObject *buf,
                           ucp_tag_message_h msg)
{
    return post_tag_recv(w, NULL, buf, 0, 0, msg);
}

PyObject *
ucxx_request_post_send(EndpointObject *ep, PyObject *buf, ucp_tag_t tag)
{
    WorkerObject *w = ep->worker;
    ucp_request_param_t param;
    ucs_status_ptr_t sp;
    RequestObject *r = ucxx_request_with_buffer(w, ep, UCXX_REQ_SEND, buf, 0);

    if (r == NULL) {
        return NULL;
    }
    param_init(&param, r, &r->op1, r->buf1.mem_type);
    param.cb.send = ucxx_send_cb;
    ucxx_lock(w);
    sp = ucp_tag_send_nbx(ep->handle, r->buf1.ptr, r->buf1.len, tag, &param);
    ucxx_worker_touched(w);
    ucxx_request_track(r, &r->op1, sp);
    ucxx_request_finish_posting(r);
    ucxx_unlock(w);
    return (PyObject *)r;
}

PyObject *
ucxx_request_post_stream(EndpointObject *ep, PyObject *buf, int recv)
{
    WorkerObject *w = ep->worker;
    ucp_request_param_t param;
    ucs_status_ptr_t sp;
    size_t length = 0;
    RequestObject *r = ucxx_request_with_buffer(
        w, ep, recv ? UCXX_REQ_STREAM_RECV : UCXX_REQ_SEND, buf, recv);

    if (r == NULL) {
        return NULL;
    }
    param_init(&param, r, &r->op1, r->buf1.mem_type);
    ucxx_lock(w);
    if (recv) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_STREAM_RECV_FLAG_WAITALL;
        param.cb.recv_stream = ucxx_stream_recv_cb;
        sp = ucp_stream_recv_nbx(ep->handle, r->buf1.ptr, r->buf1.len, &length,
                                 &param);
        if (sp == NULL) {
            r->length = length;
        }
    } else {
        param.cb.send = ucxx_send_cb;
        sp = ucp_stream_send_nbx(ep->handle, r->buf1.ptr, r->buf1.len, &param);
    }
    ucxx_worker_touched(w);
    ucxx_request_track(r, &r->op1, sp);
    ucxx_request_finish_posting(r);
    ucxx_unlock(w);
    return (PyObject *)r;
}

/* ---- awaiting ---------------------------------------------------------- */

/*
 * The first await of a pending request: spin (engine.c), then suspend on a
 * future, leaving the worker armed so that the loop's poll sees the next
 * event (the progress invariant).  A request that is done returns at once,
 * unless the time slice is spent: then the task gives the loop one turn
 * first (a bare yield, as asyncio.sleep(0)).  On a busy loop a pending
 * request neither spins on an auto budget nor suspends: it polls once per
 * loop iteration (engine.c, ucxx_busy_step).
 */
static PySendResult
Request_am_send(RequestObject *r, PyObject *arg, PyObject **presult)
{
    ucxx_state *st;
    WorkerObject *w = r->worker;
    PyObject *loop;

    if (r->future != NULL) {
        if (r->status != UCS_INPROGRESS) {
            ucxx_worker_resumed(w);     /* resumed by the loop */
            goto done;
        }
        goto suspend;
    }
    if (r->busy_yield_at != 0.0) {
        switch (ucxx_busy_step(r, 1)) {
        case UCXX_SPIN_DONE:
            goto done;
        case UCXX_SPIN_YIELD:
            goto busy_yield;
        }
        goto sleep;
    }
    if (r->status != UCS_INPROGRESS) {
        if (!r->slice_yielded && ucxx_slice_spent(w)) {
            goto yield;
        }
        goto done;
    }
    if (r->large && !UCXX_THREADED(w) && !w->loop_busy) {
        switch (ucxx_follow(r)) {
        case UCXX_SPIN_DONE:
            goto done;
        case UCXX_SPIN_YIELD:
            goto yield;
        }
    }
    if (w->spin_us > 0 && !(w->loop_busy && w->spin_auto)) {
        switch (ucxx_spin(r)) {
        case UCXX_SPIN_DONE:
            goto done;
        case UCXX_SPIN_YIELD:
            goto yield;
        }
    }

sleep:
    st = ucxx_state_of((PyObject *)r);
    loop = PyObject_CallNoArgs(st->get_running_loop);
    if (loop == NULL) {
        *presult = NULL;
        return PYGEN_ERROR;
    }
    if (loop != w->loop && ucxx_worker_attach(w, loop) < 0) {
        Py_DECREF(loop);
        *presult = NULL;
        return PYGEN_ERROR;
    }
    Py_DECREF(loop);
    if (w->loop_busy) {
        switch (ucxx_busy_step(r, 0)) {
        case UCXX_SPIN_DONE:
            goto done;
        case UCXX_SPIN_YIELD:
            goto busy_yield;
        }
    }
    if (w->mode == UCXX_MODE_BLOCKING && !w->armed && w->handle != NULL) {
        if (ucxx_worker_service(w, 0) < 0) {
            *presult = NULL;
            return PYGEN_ERROR;
        }
        if (r->status != UCS_INPROGRESS) {
            goto done;
        }
    }
    if (w->spin_auto) {
        r->sleep_calls = ucxx_state_of((PyObject *)r)->ucx_calls;
        if (r->wait_start == 0.0) {
            r->wait_start = ucxx_now_us();
        }
    }
    r->future = ucxx_worker_new_future(w, ucxx_state_of((PyObject *)r));
    if (r->future == NULL) {
        *presult = NULL;
        return PYGEN_ERROR;
    }
    w->slice_start = 0.0;

suspend:
    st = ucxx_state_of((PyObject *)r);
    if (PyObject_SetAttr(r->future, st->s_blocking, Py_True) < 0) {
        *presult = NULL;
        return PYGEN_ERROR;
    }
    *presult = Py_NewRef(r->future);
    return PYGEN_NEXT;

busy_yield:
    /* The loop is busy: poll again in its next iteration (a bare yield),
     * rather than wait for the fd reader, whose wake-ups run one
     * iteration after it. */
    r->busy_yield_at = ucxx_now_us();
    *presult = Py_NewRef(Py_None);
    return PYGEN_NEXT;

yield:
    r->slice_yielded = 1;
    *presult = ucxx_slice_yield(w);
    return *presult != NULL ? PYGEN_NEXT : PYGEN_ERROR;

done:
    *presult = ucxx_request_result(r);
    return *presult != NULL ? PYGEN_RETURN : PYGEN_ERROR;
}

static PyObject *
Request_iternext(RequestObject *r)
{
    PyObject *res;

    switch (Request_am_send(r, Py_None, &res)) {
    case PYGEN_NEXT:
        return res;
    case PYGEN_RETURN:
        PyGen_SetStopIterationValue_compat(res);
        Py_DECREF(res);
        return NULL;
    default:
        return NULL;
    }
}

PyDoc_STRVAR(Request_send_doc, "send($self, value, /)\n--\n\n"
             "Coroutine protocol: resume the await.");

static PyObject *
Request_send(RequestObject *r, PyObject *arg)
{
    return Request_iternext(r);
}

PyDoc_STRVAR(Request_throw_doc,
"throw($self, typ, val=None, tb=None, /)\n--\n\n"
"Coroutine protocol: the awaiting task was cancelled (or an exception was\n"
"thrown in). A pending receive is cancelled in UCX; a send keeps running\n"
"and keeps its buffer until UCX completes it.");

static PyObject *
Request_throw(RequestObject *r, PyObject *const *args, Py_ssize_t nargs)
{
    if (r->status == UCS_INPROGRESS && r->kind != UCXX_REQ_SEND &&
        r->kind != UCXX_REQ_GATHER_SEND && r->kind != UCXX_REQ_AM_SEND &&
        r->kind != UCXX_REQ_CLOSE) {
        ucxx_lock(r->worker);
        ucxx_request_cancel_ucx(r, UCS_ERR_CANCELED);
        ucxx_worker_dispatch(r->worker);
        ucxx_unlock(r->worker);
    }
    return ucxx_throw(args, nargs);
}

PyDoc_STRVAR(Request_close_doc,
"close($self, /)\n--\n\nCoroutine protocol: nothing to release (the\n"
"transfer itself continues; use cancel() to stop a receive).");

static PyObject *
Request_close(RequestObject *r, PyObject *unused)
{
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Request_done_doc, "done($self, /)\n--\n\nTrue once completed.");

static PyObject *
Request_done(RequestObject *r, PyObject *unused)
{
    return PyBool_FromLong(r->status != UCS_INPROGRESS);
}

PyDoc_STRVAR(Request_result_doc,
"result($self, /)\n--\n\nThe result, or raise the request's error.");

static PyObject *
Request_result(RequestObject *r, PyObject *unused)
{
    return ucxx_request_result(r);
}

PyDoc_STRVAR(Request_cancel_doc,
"cancel($self, /)\n--\n\n"
"Cancel a pending receive in UCX; it then fails with UCXCanceledError.\n"
"Returns False for sends and completed requests.");

static PyObject *
Request_cancel(RequestObject *r, PyObject *unused)
{
    if (r->status != UCS_INPROGRESS || r->kind == UCXX_REQ_SEND ||
        r->kind == UCXX_REQ_GATHER_SEND || r->kind == UCXX_REQ_AM_SEND ||
        r->kind == UCXX_REQ_CLOSE) {
        Py_RETURN_FALSE;
    }
    ucxx_lock(r->worker);
    ucxx_request_cancel_ucx(r, UCS_ERR_CANCELED);
    ucxx_worker_dispatch(r->worker);
    ucxx_unlock(r->worker);
    Py_RETURN_TRUE;
}

static PyObject *
Request_get_status(RequestObject *r, void *closure)
{
    return PyLong_FromLong(r->status);
}

static PyObject *
Request_await(RequestObject *r)
{
    return Py_NewRef((PyObject *)r);
}

static PyObject *
Request_repr(RequestObject *r)
{
    static const char *kinds[] = {"send", "recv", "stream_recv",
                                  "gather_send", "gather_recv", "close",
                                  "am_send", "am_recv", "am_data"};

    return PyUnicode_FromFormat("<ucxx.Request %s %s>", kinds[r->kind],
                                r->status == UCS_INPROGRESS ? "pending" :
                                ucs_status_string(r->status));
}

static int
Request_traverse(RequestObject *r, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE((PyObject *)r));
    Py_VISIT(r->worker);
    Py_VISIT(r->endpoint);
    Py_VISIT(r->result);
    Py_VISIT(r->future);
    for (Py_ssize_t i = 0; i < r->nbufs; i++) {
        Py_VISIT(r->bufs[i].view.obj);
        Py_VISIT(r->bufs[i].owner);
    }
    return 0;
}

static int
Request_clear(RequestObject *r)
{
    /* While UCX holds an operation we hold ourselves: never cleared then. */
    Py_CLEAR(r->result);
    Py_CLEAR(r->future);
    return 0;
}

static void
Request_dealloc(RequestObject *r)
{
    PyTypeObject *tp = Py_TYPE((PyObject *)r);
    PyObject *mod;
    ucxx_state *st;

    PyObject_GC_UnTrack(r);
    for (Py_ssize_t i = 0; i < r->nbufs; i++) {
        ucxx_buf_release(&r->bufs[i]);
    }
    if (r->bufs != &r->buf1) {
        PyMem_Free(r->bufs);
    }
    if (r->ops != &r->op1) {
        PyMem_Free(r->ops);
    }
    PyMem_Free(r->iov);
    PyMem_Free(r->pack);
    request_unlink(r);
    ucxx_list_del(&r->elink);
    /* The free list is the module's: reached through the worker, which
     * holds the module (no type lookup per message, and none at
     * interpreter shutdown, where the type may have lost its module). */
    mod = Py_NewRef(r->worker->module);
    st = PyModule_GetState(mod);
    Request_clear(r);
    Py_CLEAR(r->endpoint);
    Py_CLEAR(r->worker);
    if (st != NULL && tp == st->RequestType &&
        st->nreq_free < UCXX_REQ_FREELIST) {
        r->next_done = st->req_free;
        st->req_free = r;
        st->nreq_free++;
    } else {
        PyObject_GC_Del(r);
    }
    Py_DECREF(tp);
    Py_DECREF(mod);     /* last: the module's teardown empties the free list */
}

/* Module teardown: free the Requests kept for reuse. */
void
ucxx_request_freelist_clear(ucxx_state *st)
{
    while (st->req_free != NULL) {
        RequestObject *r = st->req_free;

        st->req_free = r->next_done;
        PyObject_GC_Del(r);
    }
    st->nreq_free = 0;
}

static PyMethodDef Request_methods[] = {
    {"send", (PyCFunction)Request_send, METH_O, Request_send_doc},
    {"throw", (PyCFunction)(void (*)(void))Request_throw, METH_FASTCALL,
     Request_throw_doc},
    {"close", (PyCFunction)Request_close, METH_NOARGS, Request_close_doc},
    {"done", (PyCFunction)Request_done, METH_NOARGS, Request_done_doc},
    {"result", (PyCFunction)Request_result, METH_NOARGS, Request_result_doc},
    {"cancel", (PyCFunction)Request_cancel, METH_NOARGS, Request_cancel_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Request_getset[] = {
    {"status", (getter)Request_get_status, NULL,
     "UCS status: 0 OK, 1 in progress, negative error.", NULL},
    {NULL},
};

PyDoc_STRVAR(Request_doc,
"The awaitable of one transfer. await returns the result (bytes received\n"
"for receives, None for sends) or raises the typed UCXError.");

static PyType_Slot Request_slots[] = {
    {Py_tp_doc, (void *)Request_doc},
    {Py_tp_dealloc, Request_dealloc},
    {Py_tp_traverse, Request_traverse},
    {Py_tp_clear, Request_clear},
    {Py_tp_iter, PyObject_SelfIter},
    {Py_tp_iternext, Request_iternext},
    {Py_tp_methods, Request_methods},
    {Py_tp_getset, Request_getset},
    {Py_tp_repr, Request_repr},
    {Py_am_await, Request_await},
    {Py_am_send, Request_am_send},
    {0, NULL},
};

PyType_Spec ucxx_request_spec = {
    .name = "ucxx._ucxx.Request",
    .basicsize = sizeof(RequestObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC |
             Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = Request_slots,
};
