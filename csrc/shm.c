/*
 * shm.c - UCX's shared-memory receive FIFOs mapped in this process: the
 * watch over this process's own after a peer error, and the peer an
 * endpoint from a worker address attached.  Owns the worker's watch timer
 * and its table of stuck slots (fields of WorkerObject); worker close
 * cancels the timer.  The FIFOs are UCX's.
 *
 * A shared-memory sender reserves a slot of the receiver's FIFO (moves the
 * FIFO head), writes the message, then flips the slot's owner bit.  A
 * sender killed between the two leaves a slot the receiver waits on for
 * good: every message behind it, from every other sender, is stuck.  After
 * a peer error the worker looks at its FIFOs for a while; a slot reserved
 * but unwritten for UCXX_SHM_STUCK_US is written as an empty message with
 * an active-message id UCP has no handler for (UCT drops it), and the
 * FIFO moves on.  A FIFO's control block also names its owner: the peer
 * FIFO that ucp_ep_create attaches names the process an endpoint from a
 * worker address talks to (its pidfd is then watched, liveness.py).  The
 * layout is UCX's (uct/sm/mm/base/mm_iface.h), unchanged from UCX 1.17 to
 * 1.22; other versions, and FIFOs of another geometry than UCX's default,
 * are left alone.  docs/RELIABILITY.md, "A dead sender's FIFO slot".
 */
#include "ucxx.h"

#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

/* UCX's defaults: MM_FIFO_SIZE, MM_FIFO_ELEM_SIZE, the control block
 * (uct_mm_fifo_ctl_t: head, signal socket address, padding to two cache
 * lines, tail, pid; aligned to a cache line). */
#define FIFO_SIZE 256u
#define FIFO_ELEM_SIZE 128u
#define FIFO_CTL_SIZE 192u
#define FIFO_OFF_TAIL 128u
#define FIFO_OFF_PID 136u
#define FIFO_HEAD_ARMED (1ULL << 63)
#define ELEM_FLAG_OWNER 1u
#define ELEM_FLAG_INLINE 2u
/* An active-message id below UCT_AM_ID_MAX that UCP leaves unhandled. */
#define ELEM_AM_ID_NONE 0u
/* How long a slot must stay reserved and unwritten, how often the FIFOs
 * are looked at, for how long after the last peer error. */
#define UCXX_SHM_STUCK_US 1000000.0
#define UCXX_SHM_PERIOD_S 0.25
#define UCXX_SHM_WATCH_US 10000000.0

static size_t
fifo_map_size(void)
{
    long page = sysconf(_SC_PAGESIZE);
    size_t n = FIFO_CTL_SIZE + FIFO_SIZE * FIFO_ELEM_SIZE + 63;

    return (n + (size_t)page - 1) / (size_t)page * (size_t)page;
}

/* Slot i's first byte (its flags; am_id and length follow). */
static uintptr_t
fifo_elem(uintptr_t fifo, uint64_t i)
{
    return fifo + FIFO_CTL_SIZE + (i % FIFO_SIZE) * FIFO_ELEM_SIZE;
}

/* The owner bit of slot i once written in its lap. */
static unsigned
lap_bit(uint64_t i)
{
    return (unsigned)((i / FIFO_SIZE) & 1);
}

/* What of a FIFO is looked at: the control block and every slot's flags.
 * Memory is read (and written) with process_vm_readv/writev on this
 * process: a mapping that goes away meanwhile (another worker's thread
 * detaching a peer) is an error, not a crash. */
typedef struct {
    unsigned char ctl[FIFO_CTL_SIZE];
    uint8_t flags[FIFO_SIZE];
} fifo_view;

static int
mem_io(int write, uintptr_t addr, void *buf, size_t len)
{
    struct iovec local = {buf, len}, remote = {(void *)addr, len};
    ssize_t n = write ? process_vm_writev(getpid(), &local, 1, &remote, 1, 0)
                      : process_vm_readv(getpid(), &local, 1, &remote, 1, 0);

    return n == (ssize_t)len ? 0 : -1;
}

static int
fifo_read(uintptr_t fifo, fifo_view *v)
{
    struct iovec local[2], remote[1 + FIFO_SIZE];
    ssize_t want = FIFO_CTL_SIZE + FIFO_SIZE;

    local[0].iov_base = v->ctl;
    local[0].iov_len = FIFO_CTL_SIZE;
    local[1].iov_base = v->flags;
    local[1].iov_len = FIFO_SIZE;
    remote[0].iov_base = (void *)fifo;
    remote[0].iov_len = FIFO_CTL_SIZE;
    for (unsigned i = 0; i < FIFO_SIZE; i++) {
        remote[1 + i].iov_base = (void *)fifo_elem(fifo, i);
        remote[1 + i].iov_len = 1;
    }
    return process_vm_readv(getpid(), local, 2, remote, 1 + FIFO_SIZE, 0) ==
                   want ? 0 : -1;
}

static uint64_t
view_u64(const fifo_view *v, size_t off)
{
    uint64_t x;

    memcpy(&x, v->ctl + off, sizeof(x));
    return x;
}

static uint64_t
view_head(const fifo_view *v)
{
    return view_u64(v, 0) & ~FIFO_HEAD_ARMED;
}

static pid_t
view_pid(const fifo_view *v)
{
    pid_t pid;

    memcpy(&pid, v->ctl + FIFO_OFF_PID, sizeof(pid));
    return pid;
}

/* v is a receive FIFO with the default geometry, this process's (mine) or
 * a peer's: its control block names us (or another process), a unix
 * socket, a head no more than a FIFO ahead of the tail, and every slot's
 * flags are UCX's. */
static int
view_is_fifo(const fifo_view *v, int mine)
{
    uint64_t h = view_head(v), t = view_u64(v, FIFO_OFF_TAIL);
    pid_t pid = view_pid(v);
    socklen_t alen;
    sa_family_t fam;

    memcpy(&alen, v->ctl + 8, sizeof(alen));
    memcpy(&fam, v->ctl + 12, sizeof(fam));
    if ((mine ? pid != getpid() : (pid <= 0 || pid == getpid())) ||
        fam != AF_UNIX || alen > sizeof(struct sockaddr_un) || t > h ||
        h - t > FIFO_SIZE) {
        return 0;
    }
    for (unsigned i = 0; i < FIFO_SIZE; i++) {
        if (v->flags[i] & ~(ELEM_FLAG_OWNER | ELEM_FLAG_INLINE)) {
            return 0;
        }
    }
    return 1;
}

/* The first slot below the head that is reserved but not written, or
 * UINT64_MAX. */
static uint64_t
view_first_unwritten(const fifo_view *v)
{
    uint64_t h = view_head(v);
    uint64_t i = h > FIFO_SIZE ? h - FIFO_SIZE : 0;

    for (; i < h; i++) {
        if ((v->flags[i % FIFO_SIZE] & ELEM_FLAG_OWNER) != lap_bit(i)) {
            return i;
        }
    }
    return UINT64_MAX;
}

/* The receive FIFOs mapped in this process (mapping starts into out,
 * their owners' pids into pids), its own (mine) or its peers', at most
 * max; -1 if /proc/self/maps cannot be read.  UCX maps them from /dev/shm
 * (ucx_shm_posix_*) or System V segments (/SYSV*); a FIFO attached twice
 * (an endpoint to ourselves) is listed twice, which is harmless. */
static int
fifo_find(uintptr_t *out, pid_t *pids, int max, int mine)
{
    FILE *f = fopen("/proc/self/maps", "re");
    char line[512], path[256];
    unsigned long lo, hi;
    size_t want = fifo_map_size();
    fifo_view v;
    int n = 0;

    if (f == NULL) {
        return -1;
    }
    while (n < max && fgets(line, sizeof(line), f) != NULL) {
        path[0] = '\0';
        if (sscanf(line, "%lx-%lx %*4s %*x %*x:%*x %*u %255s", &lo, &hi,
                   path) != 3 ||
            (strncmp(path, "/dev/shm/ucx_shm_posix_", 23) != 0 &&
             strncmp(path, "/SYSV", 5) != 0) ||
            hi - lo != want || fifo_read(lo, &v) < 0 ||
            !view_is_fifo(&v, mine)) {
            continue;
        }
        out[n] = lo;
        if (pids != NULL) {
            pids[n] = view_pid(&v);
        }
        n++;
    }
    fclose(f);
    return n;
}

/* Write slot i of fifo as an empty message UCX drops, after checking once
 * more that it is still unwritten: am_id and length first, then the
 * flags with the owner bit of its lap. */
static int
fifo_skip(uintptr_t fifo, uint64_t i)
{
    uintptr_t e = fifo_elem(fifo, i);
    uint8_t flags, rest[3] = {ELEM_AM_ID_NONE, 0, 0};

    if (mem_io(0, e, &flags, 1) < 0 ||
        (flags & ELEM_FLAG_OWNER) == lap_bit(i) ||
        mem_io(1, e + 1, rest, sizeof(rest)) < 0) {
        return 0;
    }
    __atomic_thread_fence(__ATOMIC_RELEASE);
    flags = (uint8_t)(ELEM_FLAG_INLINE | lap_bit(i));
    return mem_io(1, e, &flags, 1) == 0;
}

static void
log_skip(uint64_t i, double stuck_us)
{
    PyObject *logging = PyImport_ImportModule("logging");
    PyObject *logger, *res = NULL;

    if (logging == NULL) {
        PyErr_Clear();
        return;
    }
    logger = PyObject_CallMethod(logging, "getLogger", "s", "ucx");
    if (logger != NULL) {
        res = PyObject_CallMethod(
            logger, "warning", "sKd",
            "shared-memory receive FIFO: slot %d was reserved by a sender "
            "that never wrote it (a peer died) and blocked the FIFO for "
            "%.1f s; it is skipped",
            (unsigned long long)i, stuck_us / 1e6);
    }
    if (res == NULL) {
        PyErr_Clear();
    }
    Py_XDECREF(res);
    Py_XDECREF(logger);
    Py_DECREF(logging);
}

/* Consume the skipped slots and the messages behind them.  UCX's log is at
 * "error" meanwhile: its warning of an unknown active message (with a
 * backtrace) says no more than log_skip.  Then the worker is woken as a
 * UCX call on an armed worker wakes it (the rest of the drain, the arm). */
static void
drain_quietly(WorkerObject *w)
{
    char level[32];
    int quiet = ucs_global_opts_get_value("LOG_LEVEL", level,
                                          sizeof(level)) == UCS_OK;

    if (quiet) {
        ucs_global_opts_set_value("LOG_LEVEL", "error");
    }
    ucxx_worker_drain(w, UCXX_DRAIN_BUDGET);
    if (quiet) {
        ucs_global_opts_set_value("LOG_LEVEL", level);
    }
    w->armed = 1;
    ucxx_worker_touched(w);
}

/* The UCX this module is running with lays its FIFOs out as above. */
static int
layout_known(void)
{
    unsigned major, minor, release;

    ucp_get_version(&major, &minor, &release);
    return major == 1 && minor >= 17 && minor <= 22;
}

/* One look at the FIFOs (lock held): note the slots reserved and
 * unwritten, skip those stuck for UCXX_SHM_STUCK_US.  The number of slots
 * still stuck; -1 if the process has no FIFO to watch (no shared memory,
 * another layout) or its maps cannot be read. */
static int
watch_once(WorkerObject *w)
{
    uintptr_t fifos[UCXX_SHM_FIFOS_MAX];
    int n = fifo_find(fifos, NULL, UCXX_SHM_FIFOS_MAX, 1), nstuck = 0;
    int skipped = 0;
    fifo_view v;
    double now = ucxx_now_us();

    if (n <= 0) {
        w->shm_nstuck = 0;
        return -1;
    }
    for (int k = 0; k < n; k++) {
        uint64_t i;
        double since = now;

        if (fifo_read(fifos[k], &v) < 0 ||
            (i = view_first_unwritten(&v)) == UINT64_MAX) {
            continue;
        }
        for (int s = 0; s < w->shm_nstuck; s++) {
            if (w->shm_stuck[s].fifo == fifos[k] &&
                w->shm_stuck[s].index == i) {
                since = w->shm_stuck[s].since;
            }
        }
        if (now - since >= UCXX_SHM_STUCK_US && fifo_skip(fifos[k], i)) {
            w->shm_skipped++;
            skipped = 1;
            log_skip(i, now - since);
            continue;
        }
        w->shm_stuck[nstuck].fifo = fifos[k];
        w->shm_stuck[nstuck].index = i;
        w->shm_stuck[nstuck].since = since;
        nstuck++;
    }
    w->shm_nstuck = nstuck;
    if (skipped) {
        drain_quietly(w);
    }
    return nstuck;
}

static int
watch_schedule(WorkerObject *w)
{
    ucxx_state *st = w->st;
    PyObject *cb, *delay;

    if (w->shm_timer != NULL || w->loop == NULL) {
        return 0;
    }
    cb = PyObject_GetAttrString((PyObject *)w, "_shm_watch");
    delay = PyFloat_FromDouble(UCXX_SHM_PERIOD_S);
    if (cb != NULL && delay != NULL) {
        w->shm_timer = PyObject_CallMethodObjArgs(w->loop, st->s_call_later,
                                                  delay, cb, NULL);
    }
    Py_XDECREF(cb);
    Py_XDECREF(delay);
    return w->shm_timer == NULL ? -1 : 0;
}

/* A peer of w failed (dispatch, lock held): watch the FIFOs for a while. */
void
ucxx_shm_peer_failed(WorkerObject *w)
{
    if (!layout_known()) {
        return;
    }
    w->shm_watch_until = ucxx_now_us() + UCXX_SHM_WATCH_US;
    if (watch_schedule(w) < 0) {
        PyErr_Clear();      /* the loop is closed: nothing to watch for */
    }
}

/* Worker._shm_watch: the timer's callback. */
PyObject *
ucxx_shm_watch(WorkerObject *w, PyObject *unused)
{
    int nstuck;

    Py_CLEAR(w->shm_timer);
    if (w->handle == NULL || UCXX_FORKED(w)) {
        Py_RETURN_NONE;
    }
    ucxx_lock(w);
    nstuck = watch_once(w);
    ucxx_unlock(w);
    if (nstuck >= 0 && (nstuck > 0 || ucxx_now_us() < w->shm_watch_until) &&
        watch_schedule(w) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Worker close: the watch ends. */
void
ucxx_shm_watch_stop(WorkerObject *w)
{
    PyObject *timer = w->shm_timer;

    w->shm_timer = NULL;
    w->shm_nstuck = 0;
    if (timer != NULL) {
        PyObject *res = PyObject_CallMethod(timer, "cancel", NULL);

        if (res == NULL) {
            PyErr_Clear();
        }
        Py_XDECREF(res);
        Py_DECREF(timer);
    }
}

/* The peers' FIFOs this process has attached, into before (at most max);
 * -1 where the layout is not known or the maps cannot be read. */
int
ucxx_shm_peer_fifos(uintptr_t *before, int max)
{
    return layout_known() ? fifo_find(before, NULL, max, 0) : -1;
}

/* After ucp_ep_create: the pid of the one peer whose FIFO was attached
 * since ucxx_shm_peer_fifos gave before[0..n) (the endpoint talks shared
 * memory to it), or 0 if none, several, or n says the snapshot failed. */
pid_t
ucxx_shm_new_peer(const uintptr_t *before, int n, int max)
{
    uintptr_t after[UCXX_SHM_PEERS_MAX];
    pid_t pids[UCXX_SHM_PEERS_MAX], found = 0;
    int m;

    if (n < 0 || n >= max) {
        return 0;
    }
    m = fifo_find(after, pids, UCXX_SHM_PEERS_MAX, 0);
    for (int i = 0; i < m; i++) {
        int old = 0;

        for (int k = 0; k < n; k++) {
            old |= before[k] == after[i];
        }
        if (old) {
            continue;
        }
        if (found != 0 && found != pids[i]) {
            return 0;
        }
        found = pids[i];
    }
    return found;
}
