/*
 * thread.c - the progress thread of the `thread` and `thread-polling` modes.
 * Owned by its Worker: started when the worker attaches to a loop, stopped
 * (and joined) when it detaches or closes.  The thread calls UCX with the
 * worker's lock held and never touches Python: UCX callbacks queue what
 * completed, and the thread writes notify_fd once per batch; the loop's
 * reader on notify_fd (Worker._on_notify) dispatches the batch.
 */
#include "ucxx.h"
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <unistd.h>

static void
fd_signal(int fd)
{
    uint64_t one = 1;
    ssize_t rc;

    do {
        rc = write(fd, &one, sizeof(one));
    } while (rc < 0 && errno == EINTR);
}

static void
fd_drain(int fd)
{
    uint64_t v;
    ssize_t rc;

    do {
        rc = read(fd, &v, sizeof(v));
    } while (rc < 0 && errno == EINTR);
}

/* Under lock: tell the loop once per batch that there is work. */
static void
notify_loop(WorkerObject *w)
{
    if (w->notified) {
        return;
    }
    if (w->done_head != NULL || !ucxx_list_empty(&w->errored) ||
        !ucxx_list_empty(&w->conn_ready) || !ucxx_list_empty(&w->am_ready)) {
        w->notified = 1;
        fd_signal(w->notify_fd);
    }
}

static void *
thread_main(void *arg)
{
    WorkerObject *w = arg;
    struct pollfd fds[2];
    ucs_status_t status;
    unsigned n;

    fds[0].fd = w->efd;
    fds[0].events = POLLIN;
    fds[1].fd = w->wake_fd;
    fds[1].events = POLLIN;
    for (;;) {
        ucxx_lock(w);
        w->armed = 0;
        if (w->thread_stop) {
            ucxx_unlock(w);
            break;
        }
        for (n = 0; n < UCXX_DRAIN_BUDGET; n++) {
            if (ucp_worker_progress(w->handle) == 0) {
                break;
            }
        }
        notify_loop(w);
        if (w->mode == UCXX_MODE_THREAD_POLLING || n == UCXX_DRAIN_BUDGET) {
            ucxx_unlock(w);
            sched_yield(); /* let the loop thread take the lock */
            continue;
        }
        status = ucp_worker_arm(w->handle);
        if (status == UCS_OK) {
            w->armed = 1;
        }
        ucxx_unlock(w);
        if (status == UCS_ERR_BUSY) {
            continue;
        }
        if (status != UCS_OK) {
            /* Cannot sleep on the fd: fall back to a gentle poll. */
            usleep(100);
            continue;
        }
        if (poll(fds, 2, -1) > 0 && (fds[1].revents & POLLIN)) {
            fd_drain(w->wake_fd);
        }
    }
    return NULL;
}

/* Under lock, after a UCX call from the loop thread on an armed worker. */
void
ucxx_thread_wake(WorkerObject *w)
{
    fd_signal(w->wake_fd);
}

int
ucxx_thread_start(WorkerObject *w)
{
    int rc;

    if (w->thread_running) {
        return 0;
    }
    w->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    w->notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (w->wake_fd < 0 || w->notify_fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto error;
    }
    w->thread_stop = 0;
    w->notified = 0;
    rc = pthread_create(&w->thread, NULL, thread_main, w);
    if (rc != 0) {
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        goto error;
    }
    w->thread_running = 1;
    return 0;

error:
    if (w->wake_fd >= 0) {
        close(w->wake_fd);
    }
    if (w->notify_fd >= 0) {
        close(w->notify_fd);
    }
    w->wake_fd = w->notify_fd = -1;
    return -1;
}

void
ucxx_thread_stop(WorkerObject *w)
{
    if (!w->thread_running) {
        return;
    }
    ucxx_lock(w);
    w->thread_stop = 1;
    fd_signal(w->wake_fd);
    ucxx_unlock(w);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(w->thread, NULL);
    Py_END_ALLOW_THREADS
    w->thread_running = 0;
    w->armed = 0;
    close(w->wake_fd);
    close(w->notify_fd);
    w->wake_fd = w->notify_fd = -1;
}
