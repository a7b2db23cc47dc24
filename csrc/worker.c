/*
 * worker.c - Worker wraps ucp_worker_h (thread mode SINGLE; SERIALIZED in
 * the thread modes, whose progress thread and loop thread take the worker
 * lock around every UCX call).  Owns the worker handle and, while attached
 * (loop.c), the loop reference, the fd reader and the progress Task;
 * close() (or dealloc) cancels what is pending, closes endpoints and
 * listeners, detaches and destroys it.  How it is progressed: engine.c.
 */
#include "ucxx.h"
#include <netdb.h>
#include <unistd.h>

/* Entry-point check: open, and used from the loop's thread. */
int
ucxx_worker_check(WorkerObject *w)
{
    if (w->handle == NULL) {
        ucxx_raise(w->st, UCXX_EXC_CLOSE,
                   "Worker is closed");
        return -1;
    }
    if (UCXX_FORKED(w)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "ucxx objects cannot be used in a forked child "
                        "process: create a new context there (ucxx.reset() "
                        "then ucxx.init()), or use the 'spawn' start method");
        return -1;
    }
    if (w->loop != NULL && PyThread_get_thread_ident() != w->thread_id &&
        ucxx_loop_is_running(w->loop)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "ucxx objects must be used from the thread of the "
                        "running event loop driving their worker");
        return -1;
    }
    return 0;
}

/* UCX's tcp transport speaks one address family first (TCP_AF_PRIO,
 * default inet): a connection of the other family fails inside UCX, and
 * its error path has been seen to corrupt the heap.  Refuse it up front. */
int
ucxx_check_family(WorkerObject *w, int family, const char *host)
{
    if ((family == AF_INET6) != (w->context->ipv6 != 0)) {
        ucxx_raise(w->st, UCXX_EXC_CONFIG,
                   "address '%s' is IPv%c but UCX's tcp transport is set up "
                   "for IPv%c: set UCX_TCP_AF_PRIO=%s (or the option "
                   "TCP_AF_PRIO) to use it", host,
                   family == AF_INET6 ? '6' : '4',
                   w->context->ipv6 ? '6' : '4',
                   family == AF_INET6 ? "inet6,inet" : "inet,inet6");
        return -1;
    }
    return 0;
}

/* ---- construction ------------------------------------------------------- */

static int
parse_mode(PyObject *mode_obj, int *mode)
{
    const char *m;

    if (mode_obj == NULL || mode_obj == Py_None) {
        *mode = UCXX_MODE_BLOCKING;
        return 0;
    }
    m = PyUnicode_Check(mode_obj) ? PyUnicode_AsUTF8AndSize(mode_obj, NULL) : NULL;
    if (m != NULL && strcmp(m, "blocking") == 0) {
        *mode = UCXX_MODE_BLOCKING;
    } else if (m != NULL && strcmp(m, "polling") == 0) {
        *mode = UCXX_MODE_POLLING;
    } else if (m != NULL && strcmp(m, "thread") == 0) {
        *mode = UCXX_MODE_THREAD;
    } else if (m != NULL && strcmp(m, "thread-polling") == 0) {
        *mode = UCXX_MODE_THREAD_POLLING;
    } else {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError,
                     "unknown progress mode %R (expected 'blocking', "
                     "'polling', 'thread' or 'thread-polling')", mode_obj);
        return -1;
    }
    return 0;
}

/* spin_us: None (the mode's default), "auto" (adaptive, engine.c) or a
 * fixed number of microseconds (0: never spin).  Defaults: "auto" in the
 * blocking and thread modes; a fixed UCXX_POLL_SPIN_US in polling mode;
 * 0 in thread-polling mode, whose progress thread polls already (a
 * spinning loop thread would make two busy threads per process). */
static int
set_spin(WorkerObject *w, PyObject *v)
{
    double d;

    if (v == NULL || v == Py_None) {
        w->spin_auto = w->mode == UCXX_MODE_BLOCKING ||
                       w->mode == UCXX_MODE_THREAD;
        w->spin_us = w->mode == UCXX_MODE_POLLING ? UCXX_POLL_SPIN_US : 0.0;
        return 0;
    }
    if (PyUnicode_Check(v) && PyUnicode_CompareWithASCIIString(v, "auto") == 0) {
        w->spin_auto = 1;
        w->spin_us = 0.0;
        return 0;
    }
    d = PyFloat_AsDouble(v);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError,
                     "spin_us must be 'auto', None or a number of "
                     "microseconds, got %R", v);
        return -1;
    }
    if (!(d >= 0 && d <= 1e7)) {
        PyErr_Format(PyExc_ValueError, "spin_us must be in [0, 1e7], got %R",
                     v);
        return -1;
    }
    w->spin_auto = 0;
    w->spin_us = d;
    return 0;
}

static void worker_close_now(WorkerObject *w);

/* Undo a half-built worker (error set): it was never handed out, so it
 * closes without a ResourceWarning, and the self-cycle of rearm_cb goes. */
static PyObject *
worker_new_failed(WorkerObject *w)
{
    PyObject *exc = PyErr_GetRaisedException_compat();

    worker_close_now(w);
    Py_CLEAR(w->rearm_cb);
    Py_DECREF(w);
    PyErr_SetRaisedException_compat(exc);
    return NULL;
}

static PyObject *
Worker_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"context", "progress_mode", "spin_us", NULL};
    PyObject *mod = ucxx_module_from_type(type);
    ucxx_state *st;
    PyObject *ctx, *mode_obj = Py_None, *spin = Py_None;
    ucp_worker_params_t params = {0};
    ucs_status_t status;
    WorkerObject *w;
    int mode;

    if (mod == NULL) {
        return NULL;
    }
    st = PyModule_GetState(mod);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|OO:Worker", kwlist,
                                     st->ContextType, &ctx, &mode_obj,
                                     &spin)) {
        return NULL;
    }
    if (((ContextObject *)ctx)->handle == NULL) {
        return ucxx_raise(st, UCXX_EXC_CLOSE, "Context is closed");
    }
    if (parse_mode(mode_obj, &mode) < 0) {
        return NULL;
    }
    w = (WorkerObject *)((allocfunc)PyType_GetSlot(type, Py_tp_alloc))(type, 0);
    if (w == NULL) {
        return NULL;
    }
    w->module = Py_NewRef(mod);
    w->st = st;
    w->efd = -1;
    w->wake_fd = w->notify_fd = -1;
    w->mode = mode;
    {
        pthread_mutexattr_t attr;

        pthread_mutexattr_init(&attr);
        pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_RECURSIVE);
        pthread_mutex_init(&w->lock, &attr);
        pthread_mutexattr_destroy(&attr);
    }
    ucxx_list_init(&w->pending);
    ucxx_list_init(&w->endpoints);
    ucxx_list_init(&w->listeners);
    ucxx_list_init(&w->errored);
    ucxx_list_init(&w->conn_ready);
    ucxx_list_init(&w->am_ready);
    w->context = (ContextObject *)Py_NewRef(ctx);
    w->spin_hit_rate = 1.0;
    w->spin_backoff_len = UCXX_SPIN_BACKOFF;
    if (set_spin(w, spin) < 0) {
        return worker_new_failed(w);
    }
    w->rearm_cb = PyObject_GetAttrString((PyObject *)w, "_rearm");
    w->am_allocators = PyDict_New();
    if (w->rearm_cb == NULL || w->am_allocators == NULL) {
        return worker_new_failed(w);
    }
    if (!(w->context->features & UCP_FEATURE_WAKEUP) &&
        (mode == UCXX_MODE_BLOCKING || mode == UCXX_MODE_THREAD)) {
        PyErr_SetString(PyExc_ValueError,
                        "a progress mode that sleeps needs FEATURE_WAKEUP");
        return worker_new_failed(w);
    }
    params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    /* Thread modes serialise every UCX call with the worker's lock. */
    params.thread_mode = UCXX_THREADED(w) ? UCS_THREAD_MODE_SERIALIZED
                                          : UCS_THREAD_MODE_SINGLE;
    status = ucp_worker_create(w->context->handle, &params, &w->handle);
    if (status != UCS_OK) {
        w->handle = NULL;
        ucxx_raise_status(st, status, "ucp_worker_create");
        return worker_new_failed(w);
    }
    w->context->nworkers++;
    w->fork_gen = ucxx_fork_generation;
    if (w->context->features & UCP_FEATURE_WAKEUP) {
        status = ucp_worker_get_efd(w->handle, &w->efd);
        if (status != UCS_OK) {
            ucxx_raise_status(st, status, "ucp_worker_get_efd");
            return worker_new_failed(w);
        }
    }
    if ((w->context->features & UCP_FEATURE_AM) && ucxx_am_setup(w) < 0) {
        return worker_new_failed(w);
    }
    return (PyObject *)w;
}

/* ---- close -------------------------------------------------------------- */

static void
forget_forked(WorkerObject *w)
{
    while (!ucxx_list_empty(&w->listeners)) {
        ListenerObject *l = UCXX_CONTAINER(w->listeners.next, ListenerObject,
                                           wlink);
        l->handle = NULL;
        l->nconns = 0;
        ucxx_list_del(&l->wlink);
    }
    while (!ucxx_list_empty(&w->endpoints)) {
        EndpointObject *ep = UCXX_CONTAINER(w->endpoints.next, EndpointObject,
                                            wlink);
        ep->handle = NULL;
        ep->closed = 1;
        ucxx_list_del(&ep->wlink);
    }
    /* Requests the parent posted stay referenced forever: never dispatched
     * here, their buffers are the parent's business. */
    ucxx_list_init(&w->pending);
    w->done_head = w->done_tail = NULL;
    w->thread_running = 0;
    w->handle = NULL;
    w->efd = -1;
    Py_CLEAR(w->loop);
    Py_CLEAR(w->future_kw);
    Py_CLEAR(w->task);
    Py_CLEAR(w->coro);
    Py_CLEAR(w->waiter);
    w->context->nworkers--;
}

/* Messages that arrived but were never received (say, a CLOSE the peer
 * sent after this side stopped reading) make ucp_worker_destroy warn once
 * each ("unexpected tag-receive descriptor ... was not matched"): receive
 * the small ones into scratch memory and drop them, oldest first, up to
 * the first one larger than UCXX_DROP_MAX.  Those are eager messages whose
 * data is already here unless UCX_RNDV_THRESH was set below that size; a
 * rendezvous one would need its sender, which may be gone, so the wait is
 * bounded and then cancelled, and a scratch buffer UCX may still write
 * into is kept in `late` and freed by the caller after ucp_worker_destroy.
 * Larger messages are left to UCX (and its warning). */
#define UCXX_DROP_LATE 16
#define UCXX_DROP_MAX 4096

static int
drop_unexpected(WorkerObject *w, void **late)
{
    ucp_request_param_t param = {.op_attr_mask = 0};
    ucp_tag_recv_info_t info;
    ucp_tag_message_h msg;
    int nlate = 0, rounds;
    void *req, *buf;

    if (!(w->context->features & UCP_FEATURE_TAG)) {
        return 0;
    }
    while (nlate < UCXX_DROP_LATE &&
           ucp_tag_probe_nb(w->handle, 0, 0, 0, &info) != NULL &&
           info.length <= UCXX_DROP_MAX &&
           (msg = ucp_tag_probe_nb(w->handle, 0, 0, 1, &info)) != NULL) {
        buf = malloc(info.length > 0 ? info.length : 1);
        if (buf == NULL) {
            break; /* UCX releases the message with the worker */
        }
        req = ucp_tag_msg_recv_nbx(w->handle, buf, info.length, msg, &param);
        if (req == NULL || UCS_PTR_IS_ERR(req)) {
            free(buf);
            continue;
        }
        for (rounds = 0; rounds < 1000 &&
             ucp_request_check_status(req) == UCS_INPROGRESS; rounds++) {
            ucp_worker_progress(w->handle);
        }
        if (ucp_request_check_status(req) == UCS_INPROGRESS) {
            ucp_request_cancel(w->handle, req);
            ucp_worker_progress(w->handle);
        }
        if (ucp_request_check_status(req) == UCS_INPROGRESS) {
            late[nlate++] = buf;
        } else {
            free(buf);
        }
        ucp_request_free(req);
    }
    return nlate;
}

static void
worker_close_now(WorkerObject *w)
{
    void *late[UCXX_DROP_LATE];
    int nlate;
    ucxx_link *it;
    int rounds;

    if (w->handle == NULL) {
        return;
    }
    if (UCXX_FORKED(w)) {
        /* Inherited from the parent: forget the handles, touch nothing. */
        forget_forked(w);
        return;
    }
    ucxx_worker_stop_thread(w);
    ucxx_shm_watch_stop(w);
    /* No progress thread from here on; the lock is still taken, as the
     * functions called below expect it (and assert it). */
    ucxx_lock(w);
    /* Listeners first (no new endpoints), then endpoints (their sends fail
     * with UCX errors), then whatever is still pending. */
    while (!ucxx_list_empty(&w->listeners)) {
        ListenerObject *l = UCXX_CONTAINER(w->listeners.next, ListenerObject,
                                           wlink);
        ucxx_listener_close_now(l);
    }
    while (!ucxx_list_empty(&w->endpoints)) {
        EndpointObject *ep = UCXX_CONTAINER(w->endpoints.next, EndpointObject,
                                            wlink);
        ucxx_endpoint_abort_now(ep, UCS_ERR_CANCELED);
    }
    for (it = w->pending.next; it != &w->pending; it = it->next) {
        RequestObject *r = UCXX_CONTAINER(it, RequestObject, wlink);
        for (Py_ssize_t i = 0; i < r->nops; i++) {
            if (r->ops[i].ucp_req != NULL) {
                ucp_request_cancel(w->handle, r->ops[i].ucp_req);
            }
        }
    }
    for (rounds = 0; rounds < 1000 && !ucxx_list_empty(&w->pending);
         rounds++) {
        ucp_worker_progress(w->handle);
        ucxx_worker_dispatch(w);
    }
    /* Whatever UCX still holds dies with the worker: complete it here. */
    while (!ucxx_list_empty(&w->pending)) {
        RequestObject *r = UCXX_CONTAINER(w->pending.next, RequestObject,
                                          wlink);
        for (Py_ssize_t i = 0; i < r->nops; i++) {
            if (r->ops[i].ucp_req != NULL) {
                r->ops[i].ucp_req = NULL;
                r->npending--;
            }
        }
        if (r->first_error == UCS_OK) {
            r->first_error = UCS_ERR_CANCELED;
        }
        ucxx_request_dispatch(r);
    }
    nlate = drop_unexpected(w, late);
    ucxx_worker_dispatch(w);
    ucxx_unlock(w);
    ucxx_worker_detach(w);
    ucp_worker_destroy(w->handle);
    while (nlate > 0) {
        free(late[--nlate]);
    }
    w->handle = NULL;
    w->efd = -1;
    w->context->nworkers--;
}

PyDoc_STRVAR(Worker_close_doc,
"close($self, /)\n--\n\n"
"Close listeners and endpoints, fail pending requests with\n"
"UCXCanceledError, remove the reader, end the progress task and destroy\n"
"the worker. Idempotent.");

static PyObject *
Worker_close(WorkerObject *w, PyObject *unused)
{
    worker_close_now(w);
    Py_RETURN_NONE;
}

/* ---- methods ------------------------------------------------------------ */

PyDoc_STRVAR(Worker_progress_doc,
"progress($self, /)\n--\n\n"
"One ucp_worker_progress (GIL released in thread modes), then deliver its\n"
"completions.\n"
"Returns the UCX count.");

static PyObject *
Worker_progress(WorkerObject *w, PyObject *unused)
{
    unsigned n;

    if (ucxx_worker_check(w) < 0) {
        return NULL;
    }
    ucxx_lock(w);
    ucxx_worker_touched(w);
    if (UCXX_THREADED(w)) {
        Py_BEGIN_ALLOW_THREADS
        n = ucp_worker_progress(w->handle);
        Py_END_ALLOW_THREADS
    } else {
        n = ucp_worker_progress(w->handle); /* the GIL is the worker lock */
    }
    ucxx_worker_dispatch(w);
    ucxx_unlock(w);
    return PyLong_FromUnsignedLong(n);
}

PyDoc_STRVAR(Worker_arm_doc,
"arm($self, /)\n--\n\n"
"ucp_worker_arm: True if armed, False if busy (progress again).");

static PyObject *
Worker_arm(WorkerObject *w, PyObject *unused)
{
    ucs_status_t status;

    if (ucxx_worker_check(w) < 0) {
        return NULL;
    }
    ucxx_lock(w);
    status = ucp_worker_arm(w->handle);
    ucxx_unlock(w);
    if (status == UCS_ERR_BUSY) {
        Py_RETURN_FALSE;
    }
    if (status != UCS_OK) {
        return ucxx_raise_status(w->st, status,
                                 "ucp_worker_arm");
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(Worker_signal_doc,
"signal($self, /)\n--\n\nucp_worker_signal: wake a thread waiting on efd.");

static PyObject *
Worker_signal(WorkerObject *w, PyObject *unused)
{
    ucs_status_t status;

    if (w->handle == NULL) {
        return ucxx_raise(w->st, UCXX_EXC_CLOSE,
                          "Worker is closed");
    }
    status = ucp_worker_signal(w->handle);
    if (status != UCS_OK) {
        return ucxx_raise_status(w->st, status,
                                 "ucp_worker_signal");
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Worker_info_doc,
"info($self, /)\n--\n\nucp_worker_print_info as a string.");

static PyObject *
Worker_info(WorkerObject *w, PyObject *unused)
{
    char *text = NULL;
    size_t size = 0;
    FILE *f;
    PyObject *s;

    if (ucxx_worker_check(w) < 0) {
        return NULL;
    }
    f = open_memstream(&text, &size);
    if (f == NULL) {
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    ucxx_lock(w);
    ucp_worker_print_info(w->handle, f);
    ucxx_unlock(w);
    fclose(f);
    s = PyUnicode_DecodeUTF8(text, size, "replace");
    free(text);
    return s;
}

PyDoc_STRVAR(Worker_start_doc,
"start($self, loop, /)\n--\n\n"
"Attach to loop: register the event-fd reader (blocking mode) and start\n"
"the progress coroutine in a Task. Idempotent per loop; returns the Task.");

static PyObject *
Worker_start(WorkerObject *w, PyObject *loop)
{
    if (w->handle == NULL) {
        return ucxx_raise(w->st, UCXX_EXC_CLOSE,
                          "Worker is closed");
    }
    if (ucxx_worker_attach(w, loop) < 0) {
        return NULL;
    }
    return Py_NewRef(w->task);
}

PyDoc_STRVAR(Worker_stop_doc,
"stop($self, /)\n--\n\nDetach from the current loop.");

static PyObject *
Worker_stop(WorkerObject *w, PyObject *unused)
{
    ucxx_worker_detach(w);
    Py_RETURN_NONE;
}

static int
parse_buf_tag_mask(PyObject *const *args, Py_ssize_t nargs, const char *name,
                   ucp_tag_t *tag, ucp_tag_t *mask)
{
    if (nargs < 2 || nargs > 3) {
        PyErr_Format(PyExc_TypeError, "%s() takes 2 or 3 arguments (%zd given)",
                     name, nargs);
        return -1;
    }
    if (ucxx_tag_from_obj(args[1], tag) < 0) {
        return -1;
    }
    *mask = UCXX_TAG_MASK_FULL;
    if (nargs == 3 && ucxx_tag_from_obj(args[2], mask) < 0) {
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(Worker_tag_recv_doc,
"tag_recv($self, buf, tag, mask=0xFFFFFFFFFFFFFFFF, /)\n--\n\n"
"Receive into a writable C-contiguous buffer from any endpoint.");

static PyObject *
Worker_tag_recv(WorkerObject *w, PyObject *const *args, Py_ssize_t nargs)
{
    ucp_tag_t tag, mask;

    if (ucxx_worker_check(w) < 0 ||
        parse_buf_tag_mask(args, nargs, "tag_recv", &tag, &mask) < 0) {
        return NULL;
    }
    return ucxx_request_post_recv(w, NULL, args[0], tag, mask);
}

/* A message removed from UCX's queue by tag_probe(remove=True): a capsule
 * whose context is the worker's handle until the message is received. */
#define UCXX_MSG_CAPSULE "ucxx._ucxx.tag_message"

PyDoc_STRVAR(Worker_tag_probe_doc,
"tag_probe($self, tag, mask=0xFFFFFFFFFFFFFFFF, remove=False, /)\n--\n\n"
"ucp_tag_probe_nb: None if no message matching tag/mask has arrived,\n"
"else (sender_tag, length, handle). With remove the message leaves UCX's\n"
"queue and handle is what tag_recv_with_handle() receives it with\n"
"(otherwise None). Does not progress the worker.");

static PyObject *
Worker_tag_probe(WorkerObject *w, PyObject *const *args, Py_ssize_t nargs)
{
    ucp_tag_t tag, mask = UCXX_TAG_MASK_FULL;
    ucp_tag_recv_info_t info;
    ucp_tag_message_h msg;
    PyObject *handle;
    int remove = 0;

    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError,
                        "tag_probe(tag, mask=..., remove=False)");
        return NULL;
    }
    if (ucxx_worker_check(w) < 0 || ucxx_tag_from_obj(args[0], &tag) < 0 ||
        (nargs > 1 && ucxx_tag_from_obj(args[1], &mask) < 0) ||
        (nargs > 2 && (remove = PyObject_IsTrue(args[2])) < 0)) {
        return NULL;
    }
    ucxx_lock(w);
    msg = ucp_tag_probe_nb(w->handle, tag, mask, remove, &info);
    ucxx_worker_touched(w);
    ucxx_unlock(w);
    if (msg == NULL) {
        Py_RETURN_NONE;
    }
    if (!remove) {
        handle = Py_NewRef(Py_None);
    } else if ((handle = PyCapsule_New(msg, UCXX_MSG_CAPSULE, NULL)) == NULL ||
               PyCapsule_SetContext(handle, w->handle) < 0) {
        /* The message stays in UCX until the worker is destroyed. */
        Py_XDECREF(handle);
        return NULL;
    }
    return Py_BuildValue("KnN", (unsigned long long)info.sender_tag,
                         (Py_ssize_t)info.length, handle);
}

PyDoc_STRVAR(Worker_tag_recv_with_handle_doc,
"tag_recv_with_handle($self, buf, handle, /)\n--\n\n"
"ucp_tag_msg_recv_nbx: receive the message a tag_probe(remove=True) of\n"
"this worker took from UCX's queue into buf. Each handle once.");

static PyObject *
Worker_tag_recv_with_handle(WorkerObject *w, PyObject *const *args,
                            Py_ssize_t nargs)
{
    ucp_tag_message_h msg;
    PyObject *r;

    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "tag_recv_with_handle(buf, handle)");
        return NULL;
    }
    if (ucxx_worker_check(w) < 0) {
        return NULL;
    }
    if (!PyCapsule_IsValid(args[1], UCXX_MSG_CAPSULE)) {
        PyErr_SetString(PyExc_TypeError, "handle must come from "
                        "Worker.tag_probe(..., remove=True)");
        return NULL;
    }
    if (PyCapsule_GetContext(args[1]) != (void *)w->handle) {
        PyErr_SetString(PyExc_ValueError, "the message of this handle was "
                        "already received, or belongs to another worker");
        return NULL;
    }
    msg = PyCapsule_GetPointer(args[1], UCXX_MSG_CAPSULE);
    r = ucxx_request_post_msg_recv(w, args[0], msg);
    if (r != NULL && PyCapsule_SetContext(args[1], NULL) < 0) {
        Py_CLEAR(r);
    }
    return r;
}

PyDoc_STRVAR(Worker_ep_from_address_doc,
"ep_from_address($self, address, error_handling=True)\n--\n\n"
"Endpoint to the worker whose UCX address is given (no handshake).\n"
"UCXInvalidParamError if the address's header is not one UCX reads.");

static PyObject *
Worker_ep_from_address(WorkerObject *w, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"address", "error_handling", NULL};
    Py_buffer addr;
    int eh = 1, npeers;
    ucp_ep_params_t params = {0};
    EndpointObject *ep;
    uintptr_t peers[UCXX_SHM_PEERS_MAX];

    if (!PyArg_ParseTupleAndKeywords(args, kw, "y*|p:ep_from_address", kwlist,
                                     &addr, &eh)) {
        return NULL;
    }
    if (ucxx_worker_check(w) < 0 ||
        ucxx_address_check(w->st, addr.buf,
                           addr.len) < 0) {
        PyBuffer_Release(&addr);
        return NULL;
    }
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS;
    params.address = addr.buf;
    /* No handshake names the peer: the shared-memory FIFO UCX attaches
     * for the endpoint does (its pid, for the pidfd watch).  The lock keeps
     * the progress thread from attaching another meanwhile. */
    ucxx_lock(w);
    npeers = eh ? ucxx_shm_peer_fifos(peers, UCXX_SHM_PEERS_MAX) : -1;
    ep = ucxx_endpoint_new(w, &params, eh);
    if (ep != NULL && ep->error_handling) {
        ep->shm_peer_pid = ucxx_shm_new_peer(peers, npeers,
                                             UCXX_SHM_PEERS_MAX);
    }
    ucxx_unlock(w);
    PyBuffer_Release(&addr);
    return (PyObject *)ep;
}

PyDoc_STRVAR(Worker_ep_from_sockaddr_doc,
"ep_from_sockaddr($self, host, port, error_handling=True)\n--\n\n"
"Client endpoint to a listener at host:port (no handshake at this level).");

static PyObject *
Worker_ep_from_sockaddr(WorkerObject *w, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"host", "port", "error_handling", NULL};
    const char *host;
    int port, eh = 1, rc;
    ucp_ep_params_t params = {0};
    struct addrinfo hints = {0}, *res = NULL;
    char portstr[16];
    PyObject *ep;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "si|p:ep_from_sockaddr", kwlist,
                                     &host, &port, &eh)) {
        return NULL;
    }
    if (ucxx_worker_check(w) < 0) {
        return NULL;
    }
    if (port <= 0 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "port must be in 1..65535, got %d",
                     port);
        return NULL;
    }
    snprintf(portstr, sizeof(portstr), "%d", port);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    Py_BEGIN_ALLOW_THREADS
    rc = getaddrinfo(host, portstr, &hints, &res);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_Format(PyExc_ValueError, "cannot resolve address '%s': %s",
                     host, gai_strerror(rc));
        return NULL;
    }
    if (ucxx_check_family(w, res->ai_family, host) < 0) {
        freeaddrinfo(res);
        return NULL;
    }
    params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR;
    params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    params.sockaddr.addr = res->ai_addr;
    params.sockaddr.addrlen = res->ai_addrlen;
    ep = (PyObject *)ucxx_endpoint_new(w, &params, eh);
    freeaddrinfo(res);
    return ep;
}

PyDoc_STRVAR(Worker_listen_doc,
"listen($self, callback, port=0, host=None, error_handling=True)\n--\n\n"
"ucp_listener_create; callback(endpoint) is called from the event loop for\n"
"each accepted connection.");

static PyObject *
Worker_listen(WorkerObject *w, PyObject *args, PyObject *kw)
{
    static char *kwlist[] = {"callback", "port", "host", "error_handling",
                             NULL};
    PyObject *cb;
    int port = 0, eh = 1;
    const char *host = NULL;

    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|izp:listen", kwlist, &cb,
                                     &port, &host, &eh)) {
        return NULL;
    }
    if (ucxx_worker_check(w) < 0) {
        return NULL;
    }
    if (!PyCallable_Check(cb)) {
        PyErr_SetString(PyExc_TypeError, "callback must be callable");
        return NULL;
    }
    if (port < 0 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "port must be in 0..65535, got %d",
                     port);
        return NULL;
    }
    return ucxx_listener_create(w, cb, port, host, eh);
}

PyDoc_STRVAR(Worker_register_am_allocator_doc,
"register_am_allocator($self, memory_type, allocator, /)\n--\n\n"
"allocator(nbytes) -> writable buffer, used by am_recv for messages of\n"
"that memory type (MEMORY_TYPE_HOST, MEMORY_TYPE_CUDA, or another UCS\n"
"memory type); ValueError for any other int.");

static PyObject *
Worker_register_am_allocator(WorkerObject *w, PyObject *const *args,
                             Py_ssize_t nargs)
{
    PyObject *key;
    long mt;
    int rc;

    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError,
                        "register_am_allocator() takes 2 arguments");
        return NULL;
    }
    if (!PyLong_Check(args[0]) || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "register_am_allocator(memory_type: int, "
                        "allocator: callable)");
        return NULL;
    }
    /* One of UCX's memory types (ucs_memory_type_t: 0 ..
     * UCS_MEMORY_TYPE_LAST - 1); anything else would be stored and never
     * used.  Stored under an exact int, the key am_recv looks up. */
    mt = PyLong_AsLong(args[0]);
    if (mt == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return NULL;
        }
        PyErr_Clear();
    }
    if (mt < 0 || mt >= UCS_MEMORY_TYPE_LAST) {
        PyErr_Format(PyExc_ValueError,
                     "unknown memory type %R: expected a UCS memory type in "
                     "[0, %d) (MEMORY_TYPE_HOST = %d, MEMORY_TYPE_CUDA = %d)",
                     args[0], (int)UCS_MEMORY_TYPE_LAST,
                     (int)UCS_MEMORY_TYPE_HOST, (int)UCS_MEMORY_TYPE_CUDA);
        return NULL;
    }
    key = PyLong_FromLong(mt);
    if (key == NULL) {
        return NULL;
    }
    rc = PyDict_SetItem(w->am_allocators, key, args[1]);
    Py_DECREF(key);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* The spin policy's two inputs, for its tests: a sleeping request that
 * completed block_us after its await began (busy: other UCX calls were
 * made meanwhile), and an auto spin that expired with nothing. */
static PyObject *
Worker_spin_adapt(WorkerObject *w, PyObject *args)
{
    double block;
    int busy = 0;

    if (!PyArg_ParseTuple(args, "d|p:_spin_adapt", &block, &busy)) {
        return NULL;
    }
    ucxx_spin_adapt(w, block, busy);
    Py_RETURN_NONE;
}

static PyObject *
Worker_spin_missed(WorkerObject *w, PyObject *unused)
{
    ucxx_spin_missed(w);
    Py_RETURN_NONE;
}

/* ---- getters ------------------------------------------------------------ */

static PyObject *
Worker_get_efd(WorkerObject *w, void *closure)
{
    return PyLong_FromLong(w->efd);
}

static PyObject *
Worker_get_address(WorkerObject *w, void *closure)
{
    ucp_address_t *addr;
    size_t len;
    ucs_status_t status;
    PyObject *b;

    if (ucxx_worker_check(w) < 0) {
        return NULL;
    }
    ucxx_lock(w);
    status = ucp_worker_get_address(w->handle, &addr, &len);
    ucxx_unlock(w);
    if (status != UCS_OK) {
        return ucxx_raise_status(w->st, status,
                                 "ucp_worker_get_address");
    }
    b = PyBytes_FromStringAndSize((const char *)addr, (Py_ssize_t)len);
    ucxx_lock(w);
    ucp_worker_release_address(w->handle, addr);
    ucxx_unlock(w);
    return b;
}

static PyObject *
Worker_get_closed(WorkerObject *w, void *closure)
{
    return PyBool_FromLong(w->handle == NULL);
}

static PyObject *
Worker_get_handle(WorkerObject *w, void *closure)
{
    return PyLong_FromVoidPtr(w->handle);
}

static PyObject *
Worker_get_context(WorkerObject *w, void *closure)
{
    return Py_NewRef((PyObject *)w->context);
}

static const char *const mode_names[] = {"blocking", "polling", "thread",
                                         "thread-polling"};

static PyObject *
Worker_get_mode(WorkerObject *w, void *closure)
{
    return PyUnicode_FromString(mode_names[w->mode]);
}

static PyObject *
Worker_get_spin(WorkerObject *w, void *closure)
{
    return PyFloat_FromDouble(w->spin_us);
}

static int
Worker_set_spin(WorkerObject *w, PyObject *v, void *closure)
{
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete spin_us");
        return -1;
    }
    return set_spin(w, v);
}

static PyObject *
Worker_get_spin_auto(WorkerObject *w, void *closure)
{
    return PyBool_FromLong(w->spin_auto);
}

static PyObject *
Worker_get_spin_stats(WorkerObject *w, void *closure)
{
    return Py_BuildValue("{sksksksksksksk}", "hits", w->spin_hits,
                         "grows", w->spin_grows, "shrinks", w->spin_shrinks,
                         "slice_yields", w->slice_yields,
                         "busy_polls", w->busy_polls, "follows", w->follows,
                         "follow_stops", w->follow_stops);
}

static PyObject *
Worker_get_shm_slots_skipped(WorkerObject *w, void *closure)
{
    return PyLong_FromUnsignedLong(w->shm_skipped);
}

static PyObject *
Worker_get_loop(WorkerObject *w, void *closure)
{
    return Py_NewRef(w->loop ? w->loop : Py_None);
}

static PyObject *
Worker_get_task(WorkerObject *w, void *closure)
{
    return Py_NewRef(w->task ? w->task : Py_None);
}

static PyObject *
Worker_get_armed(WorkerObject *w, void *closure)
{
    return PyBool_FromLong(w->armed);
}

static PyObject *
Worker_get_npending(WorkerObject *w, void *closure)
{
    Py_ssize_t n = 0;

    for (ucxx_link *it = w->pending.next; it != &w->pending; it = it->next) {
        n++;
    }
    return PyLong_FromSsize_t(n);
}

/* ---- GC ----------------------------------------------------------------- */

static int
Worker_traverse(WorkerObject *w, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE((PyObject *)w));
    Py_VISIT(w->context);
    Py_VISIT(w->module);
    Py_VISIT(w->loop);
    Py_VISIT(w->future_kw);
    Py_VISIT(w->task);
    Py_VISIT(w->coro);
    Py_VISIT(w->waiter);
    Py_VISIT(w->rearm_cb);
    Py_VISIT(w->shm_timer);
    Py_VISIT(w->am_allocators);
    return 0;
}

static int
Worker_clear(WorkerObject *w)
{
    Py_CLEAR(w->task);
    Py_CLEAR(w->coro);
    Py_CLEAR(w->waiter);
    Py_CLEAR(w->loop);
    Py_CLEAR(w->future_kw);
    Py_CLEAR(w->rearm_cb);
    Py_CLEAR(w->am_allocators);
    Py_CLEAR(w->shm_timer);
    return 0;
}

static void
Worker_finalize(WorkerObject *w)
{
    PyObject *exc;

    if (w->handle == NULL) {
        return;
    }
    exc = PyErr_GetRaisedException_compat();
    if (PyErr_ResourceWarning((PyObject *)w, 1, "unclosed %R", w) < 0) {
        PyErr_WriteUnraisable((PyObject *)w);
    }
    worker_close_now(w);
    if (exc != NULL) {
        PyErr_SetRaisedException_compat(exc);
    }
}

static void
Worker_dealloc(WorkerObject *w)
{
    PyTypeObject *tp = Py_TYPE((PyObject *)w);
    PyObject *module;

    if (ucxx_finalize_from_dealloc((PyObject *)w, &w->finalized) < 0) {
        return;
    }
    PyObject_GC_UnTrack(w);
    if (w->weakreflist != NULL) {
        PyObject_ClearWeakRefs((PyObject *)w);
    }
    worker_close_now(w);
    Worker_clear(w);
    Py_CLEAR(w->context);
    pthread_mutex_destroy(&w->lock);
    module = w->module;
    ((freefunc)PyType_GetSlot(tp, Py_tp_free))(w);
    Py_DECREF(tp);
    Py_XDECREF(module);
}

static PyObject *
Worker_repr(WorkerObject *w)
{
    return PyUnicode_FromFormat("<ucxx.Worker %s%s>", mode_names[w->mode],
                                w->handle == NULL ? " closed" : "");
}

static PyMethodDef Worker_methods[] = {
    {"close", (PyCFunction)Worker_close, METH_NOARGS, Worker_close_doc},
    {"progress", (PyCFunction)Worker_progress, METH_NOARGS,
     Worker_progress_doc},
    {"arm", (PyCFunction)Worker_arm, METH_NOARGS, Worker_arm_doc},
    {"signal", (PyCFunction)Worker_signal, METH_NOARGS, Worker_signal_doc},
    {"info", (PyCFunction)Worker_info, METH_NOARGS, Worker_info_doc},
    {"start", (PyCFunction)Worker_start, METH_O, Worker_start_doc},
    {"stop", (PyCFunction)Worker_stop, METH_NOARGS, Worker_stop_doc},
    {"tag_recv", (PyCFunction)(void (*)(void))Worker_tag_recv, METH_FASTCALL,
     Worker_tag_recv_doc},
    {"tag_probe", (PyCFunction)(void (*)(void))Worker_tag_probe, METH_FASTCALL,
     Worker_tag_probe_doc},
    {"tag_recv_with_handle",
     (PyCFunction)(void (*)(void))Worker_tag_recv_with_handle, METH_FASTCALL,
     Worker_tag_recv_with_handle_doc},
    {"ep_from_address", (PyCFunction)(void (*)(void))Worker_ep_from_address,
     METH_VARARGS | METH_KEYWORDS, Worker_ep_from_address_doc},
    {"ep_from_sockaddr", (PyCFunction)(void (*)(void))Worker_ep_from_sockaddr,
     METH_VARARGS | METH_KEYWORDS, Worker_ep_from_sockaddr_doc},
    {"listen", (PyCFunction)(void (*)(void))Worker_listen,
     METH_VARARGS | METH_KEYWORDS, Worker_listen_doc},
    {"register_am_allocator",
     (PyCFunction)(void (*)(void))Worker_register_am_allocator, METH_FASTCALL,
     Worker_register_am_allocator_doc},
    {"_on_efd", (PyCFunction)ucxx_worker_on_efd, METH_NOARGS,
     "_on_efd($self, /)\n--\n\nEvent-fd reader: drain, then re-arm."},
    {"_spin_adapt", (PyCFunction)Worker_spin_adapt, METH_VARARGS,
     "_spin_adapt($self, block_us, busy=False, /)\n--\n\n"
     "Feed the auto spin policy a sleeping request's completion (tests)."},
    {"_spin_missed", (PyCFunction)Worker_spin_missed, METH_NOARGS,
     "_spin_missed($self, /)\n--\n\n"
     "Feed the auto spin policy an expired spin (tests)."},
    {"_rearm", (PyCFunction)ucxx_worker_rearm, METH_NOARGS,
     "_rearm($self, /)\n--\n\nScheduled after a UCX call on an armed "
     "worker."},
    {"_shm_watch", (PyCFunction)ucxx_shm_watch, METH_NOARGS,
     "_shm_watch($self, /)\n--\n\nThe shared-memory FIFO watch's timer "
     "(after a peer error)."},
    {"_on_notify", (PyCFunction)ucxx_worker_on_notify, METH_NOARGS,
     "_on_notify($self, /)\n--\n\nThread modes: deliver what the progress "
     "thread\nqueued (one wakeup per batch)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Worker_getset[] = {
    {"efd", (getter)Worker_get_efd, NULL, "The worker's event fd.", NULL},
    {"address", (getter)Worker_get_address, NULL, "UCX worker address.", NULL},
    {"closed", (getter)Worker_get_closed, NULL, "True once closed.", NULL},
    {"handle", (getter)Worker_get_handle, NULL, "ucp_worker_h as int.", NULL},
    {"context", (getter)Worker_get_context, NULL, "The Context.", NULL},
    {"progress_mode", (getter)Worker_get_mode, NULL,
     "blocking, polling, thread or thread-polling.", NULL},
    {"spin_us", (getter)Worker_get_spin, (setter)Worker_set_spin,
     "Await spin budget in microseconds (the adaptive budget now, when\n"
     "spin_auto); set a number, or 'auto'.", NULL},
    {"spin_auto", (getter)Worker_get_spin_auto, NULL,
     "True if the spin budget adapts to the traffic.", NULL},
    {"spin_stats", (getter)Worker_get_spin_stats, NULL,
     "Counters of the spin policy: awaits completed by a spin, budget\n"
     "grows and shrinks, time-slice yields.", NULL},
    {"shm_slots_skipped", (getter)Worker_get_shm_slots_skipped, NULL,
     "Slots of this process's shared-memory receive FIFOs that a dead\n"
     "sender reserved and never wrote, skipped so the FIFO moves on.", NULL},
    {"loop", (getter)Worker_get_loop, NULL, "Attached event loop.", NULL},
    {"task", (getter)Worker_get_task, NULL, "The progress Task.", NULL},
    {"armed", (getter)Worker_get_armed, NULL, "Armed for the event fd.", NULL},
    {"npending", (getter)Worker_get_npending, NULL,
     "Requests UCX still holds.", NULL},
    {NULL},
};

static PyMemberDef Worker_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(WorkerObject, weakreflist),
     READONLY},
    {NULL},
};

PyDoc_STRVAR(Worker_doc,
"Worker(context, progress_mode='blocking', spin_us=None)\n--\n\n"
"A UCX worker driven from one asyncio loop.");

static PyType_Slot Worker_slots[] = {
    {Py_tp_doc, (void *)Worker_doc},
    {Py_tp_new, Worker_new},
    {Py_tp_dealloc, Worker_dealloc},
    {Py_tp_finalize, Worker_finalize},
    {Py_tp_traverse, Worker_traverse},
    {Py_tp_clear, Worker_clear},
    {Py_tp_methods, Worker_methods},
    {Py_tp_getset, Worker_getset},
    {Py_tp_members, Worker_members},
    {Py_tp_repr, Worker_repr},
    {0, NULL},
};

PyType_Spec ucxx_worker_spec = {
    .name = "ucxx._ucxx.Worker",
    .basicsize = sizeof(WorkerObject),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE,
    .slots = Worker_slots,
};
