/*
 * ucxx.h - private header of the C extension ucxx._ucxx.
 *
 * Every struct says, field by field, who owns what.  "strong" is a
 * Python reference this object holds and releases in clear/dealloc;
 * "borrowed" is a pointer kept valid by someone else (named); "native" is
 * a UCX handle this object releases in close()/dealloc.
 *
 * Threading: everything runs on the thread of the event loop the worker is
 * attached to, with the GIL held.  UCX callbacks (completions, peer errors,
 * connection requests, active messages) only record facts in C fields and
 * queue the object on the worker; ucxx_worker_dispatch() turns them into
 * Python effects once ucp_worker_progress() has returned.
 */
#ifndef UCXX_H
#define UCXX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <assert.h>
#include <pthread.h>
/* UCX's UCS_MASK macro trips -Wsign-compare in its own header. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wsign-compare"
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>
#pragma GCC diagnostic pop

#define UCXX_TAG_MASK_FULL ((ucp_tag_t)-1)

/* The extension is built against the limited API of 3.11 (one abi3
 * wheel for 3.11 on).  What that API lacks, written with what it has:
 * vectorcall entry points (stable only from 3.12), the one-argument call
 * shortcuts, the GET/SET macros (their functions check the type; measured
 * in docs/DECISIONS.md), Py_SETREF. */
#ifndef Py_SETREF
#define Py_SETREF(dst, src)                                                    \
    do {                                                                       \
        PyObject **_ucxx_p = (PyObject **)&(dst);                              \
        PyObject *_ucxx_old = *_ucxx_p;                                        \
        *_ucxx_p = (PyObject *)(src);                                          \
        Py_DECREF(_ucxx_old);                                                  \
    } while (0)
#endif
#ifndef Py_XSETREF
#define Py_XSETREF(dst, src)                                                   \
    do {                                                                       \
        PyObject **_ucxx_p = (PyObject **)&(dst);                              \
        PyObject *_ucxx_old = *_ucxx_p;                                        \
        *_ucxx_p = (PyObject *)(src);                                          \
        Py_XDECREF(_ucxx_old);                                                 \
    } while (0)
#endif

static inline PyObject *
ucxx_call1(PyObject *f, PyObject *arg)
{
    return PyObject_CallFunctionObjArgs(f, arg, NULL);
}

static inline PyObject *
ucxx_call_method0(PyObject *obj, PyObject *name)
{
    return PyObject_CallMethodObjArgs(obj, name, NULL);
}

static inline PyObject *
ucxx_call_method1(PyObject *obj, PyObject *name, PyObject *arg)
{
    return PyObject_CallMethodObjArgs(obj, name, arg, NULL);
}

/* PySequence_Fast_GET_* of a list or tuple (PySequence_Fast's result). */
static inline Py_ssize_t
ucxx_fast_size(PyObject *seq)
{
    return PyList_Check(seq) ? PyList_Size(seq) : PyTuple_Size(seq);
}

static inline PyObject *
ucxx_fast_item(PyObject *seq, Py_ssize_t i)
{
    return PyList_Check(seq) ? PyList_GetItem(seq, i)
                             : PyTuple_GetItem(seq, i);
}

/* Raise TypeError(fmt) with the name of obj's type for fmt's one %U (the
 * limited API has no tp_name, and 3.11's PyErr_Format no %T).  -1. */
static inline int
ucxx_type_error(const char *fmt, PyObject *obj)
{
    PyObject *name = PyType_GetName(Py_TYPE(obj));

    if (name != NULL) {
        PyErr_Format(PyExc_TypeError, fmt, name);
        Py_DECREF(name);
    }
    return -1;
}

/* Python 3.11 has no PyErr_{Get,Set}RaisedException. */
static inline PyObject *
PyErr_GetRaisedException_compat(void)
{
    PyObject *t, *v, *tb;

    PyErr_Fetch(&t, &v, &tb);
    if (t == NULL) {
        return NULL;
    }
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb != NULL) {
        PyException_SetTraceback(v, tb);
    }
    Py_XDECREF(t);
    Py_XDECREF(tb);
    return v;
}

static inline void
PyErr_SetRaisedException_compat(PyObject *exc)
{
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc,
                  PyException_GetTraceback(exc));
}

/* Raise StopIteration(value), as a generator's return does (Python 3.13
 * has no public _PyGen_SetStopIterationValue). 0 or -1 (error set). */
static inline int
PyGen_SetStopIterationValue_compat(PyObject *value)
{
    PyObject *e = ucxx_call1(PyExc_StopIteration, value);

    if (e == NULL) {
        return -1;
    }
    PyErr_SetObject(PyExc_StopIteration, e);
    Py_DECREF(e);
    return 0;
}

/* Exception classes, indexed; the table lives in status.c. */
enum {
    UCXX_EXC_BASE = 0,
    UCXX_EXC_CANCELED,
    UCXX_EXC_CLOSE,
    UCXX_EXC_CONFIG,
    UCXX_EXC_CONNECTION_RESET,
    UCXX_EXC_TRUNCATED,
    UCXX_EXC_NOT_CONNECTED,
    UCXX_EXC_UNREACHABLE,
    UCXX_EXC_TIMED_OUT,
    UCXX_EXC_NO_MEMORY,
    UCXX_EXC_NO_RESOURCE,
    UCXX_EXC_INVALID_PARAM,
    UCXX_EXC_BUSY,
    UCXX_EXC_UNSUPPORTED,
    UCXX_EXC_REJECTED,
    UCXX_EXC_NO_DEVICE,
    UCXX_EXC_EP_TIMEOUT,
    UCXX_EXC_BUFFER_TOO_SMALL,
    UCXX_EXC_ALREADY_EXISTS,
    UCXX_EXC_EXCEEDS_LIMIT,
    UCXX_EXC_FIRST_EP_FAILURE,
    UCXX_EXC_FIRST_LINK_FAILURE,
    UCXX_EXC_IO,
    UCXX_EXC_INVALID_ADDR,
    UCXX_EXC_LAST_EP_FAILURE,
    UCXX_EXC_LAST_LINK_FAILURE,
    UCXX_EXC_NO_ELEM,
    UCXX_EXC_NO_MESSAGE,
    UCXX_EXC_NO_PROGRESS,
    UCXX_EXC_NOT_IMPLEMENTED,
    UCXX_EXC_OUT_OF_RANGE,
    UCXX_EXC_SHMEM_SEGMENT,      /* also a UCXConnectionResetError */
    UCXX_EXC_SOME_CONNECTS_FAILED,
    UCXX_EXC_INVALID_OPTION,     /* UCXConfigError and UCXInvalidParamError */
    UCXX_EXC_COUNT
};

typedef struct {
    PyTypeObject *ContextType;
    PyTypeObject *WorkerType;
    PyTypeObject *EndpointType;
    PyTypeObject *ListenerType;
    PyTypeObject *RequestType;
    PyTypeObject *ProgressType;
    PyObject *exc[UCXX_EXC_COUNT];     /* strong: exception classes */
    PyObject *get_running_loop;        /* strong: asyncio.get_running_loop */
    PyObject *slice_wake;              /* strong: this module's _slice_wake */
    PyObject *CancelledError;          /* strong: asyncio.CancelledError */
    PyObject *InvalidStateError;       /* strong: asyncio.InvalidStateError */
    PyObject *BaseEventLoop;           /* strong: asyncio.BaseEventLoop */
    PyObject *Future;                  /* strong: asyncio.Future */
    PyObject *empty_tuple;             /* strong: () */
    /* interned method / attribute names */
    PyObject *s_create_future;
    PyObject *s_create_task;
    PyObject *s_set_result;
    PyObject *s_set_exception;
    PyObject *s_call_soon;
    PyObject *s_call_later;
    PyObject *zero;                    /* strong: 0 */
    PyObject *s_is_closed;
    PyObject *s_done;
    PyObject *s_blocking;              /* "_asyncio_future_blocking" */
    /* Dead Requests kept for reuse (linked through next_done): a transfer
     * that completes inside its call costs no allocation. */
    struct RequestObject *req_free;
    int nreq_free;
    /* UCX calls made by entry points of any worker (ucxx_worker_touched):
     * the spin policy's sign that this thread was busy with its own
     * traffic while a request slept. */
    unsigned long ucx_calls;
} ucxx_state;

/* Requests kept on the free list; none in sanitizer builds, where a
 * reused object would hide a use after free. */
#if defined(__SANITIZE_ADDRESS__)
#define UCXX_REQ_FREELIST 0
#else
#define UCXX_REQ_FREELIST 16
#endif

typedef struct WorkerObject WorkerObject;
typedef struct EndpointObject EndpointObject;
typedef struct RequestObject RequestObject;

/* Intrusive doubly linked list (ring with a sentinel head). */
typedef struct ucxx_link {
    struct ucxx_link *prev, *next;
} ucxx_link;

static inline void ucxx_list_init(ucxx_link *h) { h->prev = h->next = h; }
static inline int ucxx_list_empty(const ucxx_link *h) { return h->next == h; }
static inline void ucxx_list_add_tail(ucxx_link *h, ucxx_link *n)
{
    n->prev = h->prev;
    n->next = h;
    h->prev->next = n;
    h->prev = n;
}
static inline void ucxx_list_del(ucxx_link *n)
{
    n->prev->next = n->next;
    n->next->prev = n->prev;
    n->prev = n->next = n;
}
#define UCXX_CONTAINER(ptr, type, field) \
    ((type *)((char *)(ptr) - offsetof(type, field)))

/* A buffer handed to UCX: host (Py_buffer) or device (CUDA interface). */
typedef struct {
    void *ptr;                   /* borrowed from the exporter */
    size_t len;
    ucs_memory_type_t mem_type;
    Py_buffer view;              /* host: released by ucxx_buf_release */
    PyObject *owner;             /* device: strong, the exporting object */
} ucxx_buf;

/* Context: wraps ucp_context_h.  Owns the context; closed by close() or
 * dealloc once no worker uses it (workers hold a strong reference). */
typedef struct {
    PyObject_HEAD
    ucp_context_h handle;        /* native, NULL once closed */
    PyObject *config;            /* strong: dict of the effective config */
    uint64_t features;
    Py_ssize_t nworkers;         /* open workers created on this context */
    unsigned long fork_gen;      /* ucxx_fork_generation at creation */
    int ipv6;                    /* TCP_AF_PRIO puts inet6 first */
    PyObject *weakreflist;
    int finalized;               /* tp_finalize has run (the GC's own mark
                                    is not in the limited API) */
} ContextObject;

enum {
    UCXX_MODE_BLOCKING = 0,
    UCXX_MODE_POLLING = 1,
    UCXX_MODE_THREAD = 2,           /* progress thread sleeping on the fd */
    UCXX_MODE_THREAD_POLLING = 3    /* progress thread polling */
};
#define UCXX_THREADED(w) ((w)->mode >= UCXX_MODE_THREAD)

/* Shared-memory receive FIFOs of one process a worker watches, and peers'
 * FIFOs looked at when an endpoint is made from a worker address (shm.c). */
#define UCXX_SHM_FIFOS_MAX 16
#define UCXX_SHM_PEERS_MAX 256

/* Worker: wraps ucp_worker_h and drives it from one event loop at a time. */
struct WorkerObject {
    PyObject_HEAD
    ucp_worker_h handle;         /* native, NULL once closed */
    ContextObject *context;      /* strong */
    PyObject *module;            /* strong, to the end of dealloc: keeps st */
    ucxx_state *st;              /* borrowed from module: its state, found
                                    once (the limited API's lookup walks
                                    the subclass chain) */
    int efd;                     /* owned by UCX; -1 without WAKEUP */
    int mode;                    /* UCXX_MODE_* */
    int armed;                   /* ucp_worker_arm succeeded, no UCX call since */
    int rearm_scheduled;         /* a rearm callback is in loop's ready queue */
    /* Busy loop (engine.c, "busy yield"): the loop runs other work between
     * its polls, so a pending await polls once per loop iteration */
    int loop_busy;               /* the last resume came long after its
                                    completion was dispatched, or after
                                    its yield */
    double dispatched_at;        /* when an fd reader or the polling
                                    progress task last dispatched */
    int dispatching;             /* re-entrancy guard for dispatch */
    int peer_errors_ok;          /* an endpoint with error handling worked */
    int no_peer_errors;          /* transports cannot detect peer failure */
    /* Spin policy and time slice (engine.c) */
    int spin_auto;               /* spin_us adapts to the traffic */
    double spin_us;              /* await spin budget (fixed, or adaptive) */
    double slice_start;          /* ucxx_now_us() when the current run of
                                    inline awaits began; 0: the loop has
                                    had a turn since */
    unsigned inline_count;       /* immediate completions since the last
                                    clock reading (ucxx_slice_spent) */
    unsigned long wakeups;       /* futures resolved and callbacks queued
                                    by dispatch: a spin ends when it grows */
    int spin_progressed;         /* thread mode: the loop thread's spin
                                    called ucp_worker_progress */
    double spin_hit_rate;        /* auto: moving average of spins that
                                    caught their completion */
    unsigned spin_backoff;       /* auto: sleeps left before it may grow */
    unsigned spin_backoff_len;   /* auto: the next back-off's length */
    unsigned long spin_hits, spin_grows, spin_shrinks, slice_yields;
    unsigned long busy_polls;    /* busy-yield polls (the loop was busy) */
    Py_ssize_t large_pending;    /* requests of UCXX_FOLLOW_MIN bytes or
                                    more that UCX holds (RequestObject.large) */
    unsigned long follows;       /* progress runs kept going for them */
    double follow_since;         /* ucxx_now_us() of the first follow since
                                    a large request last settled; 0: none */
    int follow_stopped;          /* UCXX_FOLLOW_MAX_US passed: not followed
                                    until a large request settles */
    unsigned long follow_stops;  /* times that happened */
    unsigned long thread_id;     /* loop thread, valid while loop != NULL */
    unsigned long fork_gen;      /* ucxx_fork_generation at creation */
    PyObject *loop;              /* strong: attached event loop or NULL */
    PyObject *task;              /* strong: the progress Task on loop */
    PyObject *coro;              /* strong: the ProgressCoroutine */
    PyObject *waiter;            /* strong: future the coroutine waits on */
    PyObject *rearm_cb;          /* strong: bound method _rearm (cycle via self,
                                    broken in clear) */
    PyObject *future_kw;         /* strong: {"loop": loop} while
                                    direct_future */
    int direct_future;           /* the loop's create_future is
                                    BaseEventLoop's: futures are made as
                                    asyncio.Future(loop=loop) directly */
    ucxx_link pending;           /* RequestObject.wlink: requests UCX holds */
    ucxx_link endpoints;         /* EndpointObject.wlink: borrowed, open eps */
    ucxx_link listeners;         /* ListenerObject.wlink: borrowed */
    RequestObject *done_head;    /* completed, awaiting dispatch (borrowed:
                                    each holds its own self reference) */
    RequestObject *done_tail;
    ucxx_link errored;           /* EndpointObject.elink: peer errors to report */
    /* The shared-memory FIFO watch after a peer error (shm.c) */
    PyObject *shm_timer;         /* strong: its pending TimerHandle or NULL */
    double shm_watch_until;      /* ucxx_now_us() it runs until */
    int shm_nstuck;              /* slots seen reserved and unwritten */
    struct {
        uintptr_t fifo;          /* the FIFO's mapping in this process */
        uint64_t index;          /* the slot's position (head counter) */
        double since;            /* ucxx_now_us() first seen so */
    } shm_stuck[UCXX_SHM_FIFOS_MAX];
    unsigned long shm_skipped;   /* stuck slots written off */
    ucxx_link conn_ready;        /* ListenerObject.clink: conn requests queued */
    /* Thread modes: the progress thread calls UCX with `lock` held; so does
     * every entry point (always, so that the rule cannot be forgotten).
     * The lock is recursive: entry points nest. The thread never takes the
     * GIL, so holding the GIL while waiting for `lock` cannot deadlock. */
    pthread_mutex_t lock;
#ifndef NDEBUG
    pthread_t lock_owner;        /* under lock: who holds it (asserts) */
    int lock_depth;              /* under lock: recursion depth */
#endif
    pthread_t thread;
    int thread_running;
    int thread_stop;             /* under lock */
    int wake_fd;                 /* eventfd: loop thread -> progress thread */
    int notify_fd;               /* eventfd: progress thread -> loop */
    int notified;                /* under lock: notify_fd written, not read */
    PyObject *am_allocators;     /* strong: dict mem_type -> callable */
    int am_registered;           /* AM handler installed */
    ucxx_link am_ready;          /* EndpointObject.alink: AM data to deliver */
    PyObject *weakreflist;
    int finalized;               /* tp_finalize has run (the GC's own mark
                                    is not in the limited API) */
};

/* One UCX operation inside a Request (a Request has 1; a gather has one
 * per run of frames, see gather.c). */
typedef struct {
    RequestObject *req;          /* borrowed: the owning request */
    void *ucp_req;               /* native while pending; freed in callback */
    size_t expected;             /* buffer length (receives); a gather run:
                                    the bytes of its frames */
    size_t got;                  /* gather receive: length of the message
                                    that did not match (SIZE_MAX: longer,
                                    by an unknown amount) */
    Py_ssize_t first;            /* gather: first frame (index in bufs) */
    Py_ssize_t nframes;          /* gather: frames in this run */
} ucxx_op;

/* Gather runs (gather.c): host frames below UCXX_GATHER_ALONE bytes are
 * packed into IOV messages of at most UCXX_GATHER_RUN_BYTES bytes and
 * UCXX_GATHER_RUN_FRAMES frames.  Part of the wire format: both sides must
 * agree (docs/PROTOCOL.md). */
#ifndef UCXX_GATHER_ALONE
#define UCXX_GATHER_ALONE (256 * 1024)
#endif
#ifndef UCXX_GATHER_RUN_BYTES
#define UCXX_GATHER_RUN_BYTES (1024 * 1024)
#endif
#ifndef UCXX_GATHER_RUN_FRAMES
#define UCXX_GATHER_RUN_FRAMES 1024
#endif

enum {
    UCXX_REQ_SEND = 0,
    UCXX_REQ_RECV,
    UCXX_REQ_STREAM_RECV,
    UCXX_REQ_GATHER_SEND,
    UCXX_REQ_GATHER_RECV,
    UCXX_REQ_CLOSE,
    UCXX_REQ_AM_SEND,
    UCXX_REQ_AM_RECV,
    UCXX_REQ_AM_DATA
};

/* Request: the awaitable of one transfer or one gather. */
struct RequestObject {
    PyObject_HEAD
    WorkerObject *worker;        /* strong */
    EndpointObject *endpoint;    /* strong, or NULL (worker-level recv) */
    int kind;                    /* UCXX_REQ_* */
    ucs_status_t status;         /* UCS_INPROGRESS until dispatched */
    ucs_status_t first_error;    /* first failing sub-op, UCS_OK if none */
    ucs_status_t fail_status;    /* reported instead of CANCELED (peer error) */
    Py_ssize_t npending;         /* ops UCX still holds */
    Py_ssize_t nops;
    int posting;                 /* ops still being posted: do not queue */
    size_t length;               /* bytes received (single receive) */
    int queued;                  /* on worker's done list */
    int self_ref;                /* holds a reference to itself for UCX */
    int abandoned;               /* failed for Python while UCX still holds
                                    operations: buffers, wlink and self_ref
                                    go when UCX lets go of them */
    ucxx_op op1;                 /* inline op for the common case */
    ucxx_op *ops;                /* op1 or PyMem array (gathers) */
    ucxx_buf buf1;
    ucxx_buf *bufs;              /* buf1 or PyMem array (gathers) */
    Py_ssize_t nbufs;            /* buffers to release on completion */
    ucp_dt_iov_t *iov;           /* PyMem, gathers with an IOV run (UCX
                                    reads it until the run completes), or
                                    NULL; freed in dealloc */
    char *pack;                  /* PyMem, gather sends: the frames of the
                                    runs sent packed, or NULL; freed in
                                    dealloc (UCX reads it until done) */
    Py_ssize_t bad_op;           /* gather receive: the run whose message
                                    length did not match, or -1 */
    Py_ssize_t nconsumed;        /* gather receive: runs that took a message
                                    off the stream (not cancelled) */
    PyObject *result;            /* strong: am_recv result object */
    PyObject *future;            /* strong: asyncio future, on first await */
    double wait_start;           /* ucxx_now_us() when its await began to
                                    wait (spin, then sleep); 0: not yet */
    unsigned long sleep_calls;   /* ucxx_state.ucx_calls then */
    int slice_yielded;           /* gave the loop its turn (time slice) */
    int large;                   /* counted in worker->large_pending */
    double busy_yield_at;        /* ucxx_now_us() when its await yielded
                                    to a busy loop; 0: it did not */
    RequestObject *next_done;    /* worker done list */
    ucxx_link wlink;             /* worker->pending while UCX holds it */
    ucxx_link elink;             /* endpoint->am_waiters (AM_RECV) */
};

/* Endpoint: wraps ucp_ep_h. Closed by close()/abort()/worker close/dealloc. */
struct EndpointObject {
    PyObject_HEAD
    ucp_ep_h handle;             /* native, NULL once closed or failed */
    WorkerObject *worker;        /* strong */
    ucp_tag_t send_tag;
    ucp_tag_t recv_tag;
    int error_handling;
    int closed;                  /* close()/abort() was called */
    int err_queued;              /* on worker->errored */
    ucs_status_t error;          /* peer error status, UCS_OK if none */
    int close_cb_done;           /* close callback already scheduled */
    int poisoned;                /* a gather failed/cancelled mid-stream */
    int peer_closed;             /* the peer said it closed (_close_by_peer) */
    pid_t shm_peer_pid;          /* from a worker address: the process whose
                                    shared-memory FIFO it attached; 0 */
    int closing;                 /* this side began a graceful close */
    PyObject *close_cb;          /* strong */
    PyObject *close_req;         /* strong: the Request of a graceful close */
    uint64_t uid;
    ucxx_link wlink;             /* worker->endpoints */
    ucxx_link elink;             /* worker->errored */
    ucxx_link alink;             /* worker->am_ready */
    ucxx_link am_waiters;        /* RequestObject.elink: pending am_recv */
    PyObject *am_queue;          /* strong: list of received AM objects */
    PyObject *state;             /* strong: the asyncio layer's state of a
                                    public Endpoint (_state), or NULL */
    PyObject *dict;              /* strong: instance __dict__ (created on
                                    first attribute set), or NULL */
    uint64_t nrecv;              /* receives posted by recv()/am_recv() */
    void *am_raw;                /* malloc'd list of raw AM messages (am.c) */
    void *am_raw_tail;
    PyObject *weakreflist;
    int finalized;               /* tp_finalize has run (the GC's own mark
                                    is not in the limited API) */
};

/* Listener: wraps ucp_listener_h. */
typedef struct {
    PyObject_HEAD
    ucp_listener_h handle;       /* native, NULL once closed */
    WorkerObject *worker;        /* strong */
    PyObject *callback;          /* strong */
    int error_handling;
    int port;
    char ip[64];
    ucp_conn_request_h *conns;   /* malloc'd (no GIL in UCX callbacks): queued
                                    conn requests, rejected on close */
    size_t nconns, cap;
    int conn_queued;             /* on worker->conn_ready */
    ucxx_link wlink;             /* worker->listeners */
    ucxx_link clink;             /* worker->conn_ready */
    PyObject *weakreflist;
} ListenerObject;

/* module.c */
/* Bumped in the child after fork(): UCX handles inherited from the parent
 * must not be used (or destroyed) there.  Process-wide by nature. */
extern volatile unsigned long ucxx_fork_generation;
ucxx_state *ucxx_state_of(PyObject *obj);
ucxx_state *ucxx_state_from_type(PyTypeObject *tp);
PyObject *ucxx_module_from_type(PyTypeObject *tp);
int ucxx_finalize_from_dealloc(PyObject *self, int *finalized);
PyObject *ucxx_throw(PyObject *const *args, Py_ssize_t nargs);
extern PyModuleDef ucxx_module_def;

/* A handle inherited through fork(): drop it, never call UCX on it. */
#define UCXX_FORKED(obj) ((obj)->fork_gen != ucxx_fork_generation)

/* status.c: the one place a ucs_status_t becomes a Python exception */
PyObject *ucxx_status_exc(ucxx_state *st, ucs_status_t status,
                          const char *what);
PyObject *ucxx_raise_status(ucxx_state *st, ucs_status_t status,
                            const char *what);
PyObject *ucxx_raise(ucxx_state *st, int exc, const char *fmt, ...);
int ucxx_status_init(PyObject *module, ucxx_state *st);
PyObject *ucxx_status_exception(PyObject *module, PyObject *arg);

/* buffer.c */
int ucxx_buf_get(ucxx_state *st, PyObject *obj, int writable, ucxx_buf *b);
void ucxx_buf_release(ucxx_buf *b);
int ucxx_tag_from_obj(PyObject *obj, ucp_tag_t *tag);

/* context.c */
extern PyType_Spec ucxx_context_spec;
PyObject *ucxx_get_config(PyObject *module, PyObject *args, PyObject *kw);
int ucxx_config_apply(ucxx_state *st, ucp_config_t *config, PyObject *opts,
                      int env_takes_precedence);
PyObject *ucxx_config_to_dict(const ucp_config_t *config);

/* worker.c */
extern PyType_Spec ucxx_worker_spec;
int ucxx_worker_check(WorkerObject *w);
int ucxx_check_family(WorkerObject *w, int family, const char *host);

/* address.c */
int ucxx_address_check(ucxx_state *st, const uint8_t *a, Py_ssize_t len);

/* engine.c: the progress engine */
/* Progress calls one drain (or one progress-thread round) makes before it
 * lets the loop (or the loop thread) have a turn. */
#define UCXX_DRAIN_BUDGET 1024
/* Spin policy (docs/ENGINE.md, "Spin"): the auto budget lies in
 * {0} U [UCXX_SPIN_GROW_US, UCXX_SPIN_CAP_US]; polling mode's default is a
 * fixed UCXX_POLL_SPIN_US.  While awaits complete inline the loop gets a
 * turn every UCXX_SLICE_US, checked every UCXX_SLICE_CHECK immediate
 * completions. */
#define UCXX_SPIN_GROW_US 10.0
#define UCXX_SPIN_CAP_US 200.0
#define UCXX_SPIN_BACKOFF 32
#define UCXX_SPIN_BACKOFF_MAX 1024
/* Eight progress calls take a few microseconds; longer means the spinning
 * thread lost its CPU. */
#define UCXX_SPIN_GAP_US 30.0
#define UCXX_POLL_SPIN_US 100.0
#define UCXX_SLICE_US 200.0
#define UCXX_SLICE_CHECK 32
/* A loop iteration that ran other work this long is a busy loop's: the
 * worker is polled once per iteration instead of waiting for its fd. */
#define UCXX_BUSY_GAP_US 100.0
/* A transfer of UCXX_FOLLOW_MIN bytes or more takes many progress calls
 * (fragments, FIFO slots freed by the peer): while one is in flight the
 * worker is progressed until it completes, goes UCXX_FOLLOW_IDLE_US
 * without an event, or the time slice is spent, instead of sleeping on
 * the fd between pieces. */
#define UCXX_FOLLOW_MIN (64 * 1024)
#define UCXX_FOLLOW_IDLE_US 500.0
/* ... and for at most this long without a large request settling (a
 * 64 MiB transfer within a host takes 10-30 ms here). */
#define UCXX_FOLLOW_MAX_US 200000.0
enum { UCXX_SPIN_DONE, UCXX_SPIN_SLEEP, UCXX_SPIN_YIELD };
/* shm.c: after a peer error, slots of this process's shared-memory
 * receive FIFOs that a dead sender reserved and never wrote are skipped. */
void ucxx_shm_peer_failed(WorkerObject *w);
PyObject *ucxx_shm_watch(WorkerObject *w, PyObject *unused);
void ucxx_shm_watch_stop(WorkerObject *w);
/* The pid of the shared-memory peer an endpoint from a worker address
 * attached: snapshot the peers' FIFOs, create, compare. */
int ucxx_shm_peer_fifos(uintptr_t *before, int max);
pid_t ucxx_shm_new_peer(const uintptr_t *before, int n, int max);
void ucxx_worker_touched(WorkerObject *w);
int ucxx_worker_dispatch(WorkerObject *w);
unsigned ucxx_worker_drain(WorkerObject *w, unsigned budget);
int ucxx_worker_arm(WorkerObject *w, int drained);
int ucxx_worker_service(WorkerObject *w, int drained);
void ucxx_worker_queue_done(WorkerObject *w, RequestObject *r);
PyObject *ucxx_worker_on_efd(WorkerObject *w, PyObject *unused);
PyObject *ucxx_worker_on_notify(WorkerObject *w, PyObject *unused);
PyObject *ucxx_worker_rearm(WorkerObject *w, PyObject *unused);
void ucxx_worker_resumed(WorkerObject *w);
int ucxx_busy_step(RequestObject *r, int resumed);
double ucxx_now_us(void);
int ucxx_spin(RequestObject *r);
int ucxx_follow(RequestObject *r);
int ucxx_slice_spent(WorkerObject *w);
PyObject *ucxx_slice_yield(WorkerObject *w);
void ucxx_spin_feedback(RequestObject *r);
void ucxx_spin_adapt(WorkerObject *w, double block_us, int busy);
void ucxx_spin_missed(WorkerObject *w);

/* loop.c: attachment to an event loop */
int ucxx_worker_attach(WorkerObject *w, PyObject *loop);
void ucxx_worker_detach(WorkerObject *w);
void ucxx_worker_stop_thread(WorkerObject *w);
int ucxx_loop_is_running(PyObject *loop);
PyObject *ucxx_worker_new_future(WorkerObject *w, ucxx_state *st);
int ucxx_call_soon(WorkerObject *w, PyObject *cb, PyObject *arg);

/* The worker lock serialises the loop thread and the progress thread, so
 * only thread modes take it; in the other modes the GIL is the lock (no
 * entry point releases it around a UCX call there).  Debug builds (the
 * sanitizer job) record the holder for UCXX_ASSERT_LOCKED. */
#ifndef NDEBUG
#define UCXX_LOCK_ACQUIRED(w) ((w)->lock_owner = pthread_self(), \
                               (w)->lock_depth++)
#define UCXX_LOCK_RELEASING(w) ((w)->lock_depth--)
#define UCXX_ASSERT_LOCKED(w) \
    assert(!UCXX_THREADED(w) || ((w)->lock_depth > 0 && \
           pthread_equal((w)->lock_owner, pthread_self())))
#else
#define UCXX_LOCK_ACQUIRED(w) ((void)0)
#define UCXX_LOCK_RELEASING(w) ((void)0)
#define UCXX_ASSERT_LOCKED(w) ((void)0)
#endif

static inline void
ucxx_lock(WorkerObject *w)
{
    if (UCXX_THREADED(w)) {
        pthread_mutex_lock(&w->lock);
        UCXX_LOCK_ACQUIRED(w);
    }
}

static inline void
ucxx_unlock(WorkerObject *w)
{
    if (UCXX_THREADED(w)) {
        UCXX_LOCK_RELEASING(w);
        pthread_mutex_unlock(&w->lock);
    }
}

/* thread.c */
int ucxx_thread_start(WorkerObject *w);
void ucxx_thread_stop(WorkerObject *w);
void ucxx_thread_wake(WorkerObject *w);

/* progress.c */
extern PyType_Spec ucxx_progress_spec;
PyObject *ucxx_progress_new(WorkerObject *w, PyObject *loop);

/* request.c */
extern PyType_Spec ucxx_request_spec;
void ucxx_request_freelist_clear(ucxx_state *st);
RequestObject *ucxx_request_new(WorkerObject *w, EndpointObject *ep,
                                int kind, Py_ssize_t nops);
RequestObject *ucxx_request_with_buffer(WorkerObject *w, EndpointObject *ep,
                                        int kind, PyObject *buf,
                                        int writable);
void ucxx_request_fail_if_dead(RequestObject *r, EndpointObject *ep);
void ucxx_request_cancel_for_endpoint(RequestObject *r, ucs_status_t report);
int ucxx_request_track(RequestObject *r, ucxx_op *op, ucs_status_ptr_t sp);
void ucxx_request_op_complete(ucxx_op *op, ucs_status_t status);
void ucxx_request_finish_posting(RequestObject *r);
void ucxx_request_dispatch(RequestObject *r);
void ucxx_request_complete_now(RequestObject *r, ucs_status_t status);
void ucxx_request_cancel_ucx(RequestObject *r, ucs_status_t report);
PyObject *ucxx_request_post_recv(WorkerObject *w, EndpointObject *ep,
                                 PyObject *buf, ucp_tag_t tag, ucp_tag_t mask);
PyObject *ucxx_request_post_msg_recv(WorkerObject *w, PyObject *buf,
                                     ucp_tag_message_h msg);
PyObject *ucxx_request_post_send(EndpointObject *ep, PyObject *buf,
                                 ucp_tag_t tag);
PyObject *ucxx_request_post_stream(EndpointObject *ep, PyObject *buf,
                                   int recv);
PyObject *ucxx_request_result(RequestObject *r);
void ucxx_send_cb(void *request, ucs_status_t status, void *user_data);
void ucxx_recv_cb(void *request, ucs_status_t status,
                  const ucp_tag_recv_info_t *info, void *user_data);
void ucxx_stream_recv_cb(void *request, ucs_status_t status, size_t length,
                         void *user_data);

/* endpoint.c */
extern PyType_Spec ucxx_endpoint_spec;
EndpointObject *ucxx_endpoint_new(WorkerObject *w, ucp_ep_params_t *params,
                                  int error_handling);
void ucxx_endpoint_report_error(EndpointObject *ep);
void ucxx_endpoint_abort_now(EndpointObject *ep, ucs_status_t report);
void ucxx_endpoint_flushed(EndpointObject *ep);

/* gather.c */
PyObject *ucxx_gather(EndpointObject *ep, PyObject *bufs, PyObject *header,
                      ucp_tag_t tag, int recv);
void ucxx_gather_settled(RequestObject *r, ucs_status_t status);
PyObject *ucxx_gather_raise_mismatch(ucxx_state *st, RequestObject *r);
PyObject *ucxx_gather_runs(ucxx_state *st, PyObject *bufs);

/* am.c */
int ucxx_am_setup(WorkerObject *w);
void ucxx_am_deliver(EndpointObject *ep);
void ucxx_am_discard(EndpointObject *ep);
void ucxx_am_push(EndpointObject *ep, PyObject *obj);
PyObject *ucxx_am_send(EndpointObject *ep, PyObject *buf);
PyObject *ucxx_am_recv(EndpointObject *ep);

/* listener.c */
extern PyType_Spec ucxx_listener_spec;
PyObject *ucxx_listener_create(WorkerObject *w, PyObject *cb, int port,
                               const char *host, int error_handling);
void ucxx_listener_deliver(ListenerObject *l);
void ucxx_listener_close_now(ListenerObject *l);

#endif /* UCXX_H */
