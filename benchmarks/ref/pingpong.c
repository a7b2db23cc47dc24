/*
 * Reference tagged ping-pong over UCX, in plain C.
 *
 * This is the yardstick the ucxx Python package is measured against: the
 * same transfer pattern (tagged send/recv of a fixed-size message, one
 * message in flight per direction) with nothing between the application and
 * ucp but a progress loop.
 *
 *   server:  pingpong -S [-s ADDR] [-p PORT] [-m MODE]
 *   client:  pingpong    [-s ADDR] [-p PORT] [-m MODE] [-n BYTES] [-i ITERS]
 *                        [-w WARMUP]
 *   both:    pingpong -f [options]        (forks: server child, client parent)
 *   more:    -a CPU[,CPU] pinning, -c payload check, -v diagnostics,
 *            -E no peer error handling, -T per-operation timeout; see -h
 *
 * The client tells the server the message size and the iteration counts in
 * a hello message, so the server needs no size options.  The client prints
 * exactly one line on stdout:
 *
 *   RESULT mode=M bytes=N iters=I latency_ns=L median_latency_ns=D
 *          bandwidth_Bps=B
 *
 * (on one line), where L is the mean half round trip, D the median of the
 * per-iteration half round trips and B = 2 * N * I / total seconds.
 *
 * Progress modes:
 *   blocking  ucp_worker_progress() until it returns 0, ucp_worker_arm(),
 *             UCS_ERR_BUSY -> progress again, otherwise poll() on the
 *             worker's event fd.
 *   polling   ucp_worker_progress() in a busy loop.
 */

#ifdef __linux__
#define _GNU_SOURCE /* sched_setaffinity() */
#else
#define _POSIX_C_SOURCE 200809L
#endif

#include <ucp/api/ucp.h>

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sched.h>
#include <sys/prctl.h>
#endif


#define PP_DEFAULT_PORT        13337
#define PP_DEFAULT_ADDR        "127.0.0.1"
#define PP_TAG_DATA            ((ucp_tag_t)0x5050494e47000001ull)
#define PP_TAG_HELLO           ((ucp_tag_t)0x5050494e47000002ull)
#define PP_TAG_ACK             ((ucp_tag_t)0x5050494e47000003ull)
#define PP_TAG_FIN             ((ucp_tag_t)0x5050494e47000004ull)
#define PP_TAG_MASK_FULL       ((ucp_tag_t)-1)
#define PP_MAGIC               0x75637878706f6e67ull /* "ucxxpong" */
#define PP_VERSION             1
#define PP_CONNECT_TIMEOUT_S   5.0
#define PP_CLOSE_TIMEOUT_S     5.0
#define PP_POLL_TIMEOUT_MS     100
#define PP_SPINS_PER_CHECK     4096
#define PP_MAX_BYTES           ((uint64_t)1 << 40)


typedef enum {
    PP_MODE_BLOCKING,
    PP_MODE_POLLING
} pp_mode_t;


typedef struct {
    int         server;      /* -S: act as the server */
    int         fork;        /* -f: fork a server, act as the client */
    const char *addr;        /* -s: listen / connect address */
    int         port;        /* -p: port, -1 if not given */
    uint64_t    nbytes;      /* -n: message size */
    uint64_t    iters;       /* -i: measured iterations */
    uint64_t    warmup;      /* -w: unmeasured iterations before */
    pp_mode_t   mode;        /* -m: progress mode */
    double      timeout_s;   /* -T: limit for any single wait */
    int         check;       /* -c: verify the echoed payload */
    int         verbose;     /* -v: diagnostics on stderr */
    int         no_err;      /* -E: no peer error handling */
    int         cpu[2];      /* -a: server / client CPU, -1 = not pinned */
} pp_opts_t;


/* Sent by the client right after connecting; answered with the same
 * struct on PP_TAG_ACK. */
typedef struct {
    uint64_t magic;
    uint64_t version;
    uint64_t nbytes;
    uint64_t iters;
    uint64_t warmup;
    uint64_t check;
} pp_hello_t;


typedef struct {
    ucp_context_h      context;
    ucp_worker_h       worker;
    ucp_listener_h     listener;
    ucp_ep_h           ep;
    int                efd;
    pp_mode_t          mode;
    double             timeout_s;
    int                verbose;
    int                no_err;       /* endpoints without error handling */
    ucs_status_t       ep_status;    /* set by the endpoint error callback */
    ucp_conn_request_h conn_request; /* set by the listener callback */
    int                conn_ready;   /* conn_request is valid */
} pp_ctx_t;


/* Completion record of one operation, filled by the callbacks. */
typedef struct {
    int          done;
    ucs_status_t status;
    size_t       length;
} pp_op_t;


static const char *pp_prog = "pingpong";


#if defined(__GNUC__)
static void pp_error(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
#endif

static void pp_error(const char *fmt, ...)
{
    va_list ap;

    fprintf(stderr, "%s[%ld]: ", pp_prog, (long)getpid());
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
}


static uint64_t pp_now_ns(void)
{
    struct timespec ts;

    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}


static void pp_sleep_ms(long ms)
{
    struct timespec ts;

    ts.tv_sec  = ms / 1000;
    ts.tv_nsec = (ms % 1000) * 1000000l;
    while ((nanosleep(&ts, &ts) != 0) && (errno == EINTR)) {
    }
}


static int pp_pin(int cpu)
{
#ifdef __linux__
    cpu_set_t set;

    if (cpu < 0) {
        return 0;
    }
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (sched_setaffinity(0, sizeof(set), &set) != 0) {
        pp_error("cannot pin to CPU %d: %s", cpu, strerror(errno));
        return -1;
    }
    return 0;
#else
    if (cpu < 0) {
        return 0;
    }
    pp_error("CPU pinning is not supported on this system");
    return -1;
#endif
}


/* ------------------------------------------------------------------------ */
/* Callbacks                                                                */
/* ------------------------------------------------------------------------ */

static void pp_send_cb(void *request, ucs_status_t status, void *user_data)
{
    pp_op_t *op = user_data;

    (void)request;
    op->status = status;
    op->done   = 1;
}


static void pp_recv_cb(void *request, ucs_status_t status,
                       const ucp_tag_recv_info_t *info, void *user_data)
{
    pp_op_t *op = user_data;

    (void)request;
    op->status = status;
    op->length = (status == UCS_OK) ? info->length : 0;
    op->done   = 1;
}


static void pp_ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    pp_ctx_t *ctx = arg;

    (void)ep;
    if (ctx->verbose) {
        pp_error("endpoint error: %s", ucs_status_string(status));
    }
    if (ctx->ep_status == UCS_OK) {
        ctx->ep_status = (status == UCS_OK) ? UCS_ERR_CONNECTION_RESET :
                                              status;
    }
}


static void pp_conn_cb(ucp_conn_request_h conn_request, void *arg)
{
    pp_ctx_t *ctx = arg;

    if (ctx->conn_request != NULL) {
        /* one client per run */
        ucp_listener_reject(ctx->listener, conn_request);
        return;
    }
    ctx->conn_request = conn_request;
    ctx->conn_ready   = 1;
}


/* ------------------------------------------------------------------------ */
/* Progress                                                                 */
/* ------------------------------------------------------------------------ */

/*
 * One step of the progress loop.  The caller re-checks its condition after
 * every step, so a step that made progress returns at once; a blocking step
 * that finds nothing to do arms the worker and sleeps on its event fd.
 * Sets *idle when it waited on the fd and the wait timed out.
 */
static ucs_status_t pp_progress(pp_ctx_t *ctx, int *idle)
{
    struct pollfd pfd;
    ucs_status_t  status;
    int           ret;

    *idle = 0;
    if (ucp_worker_progress(ctx->worker) != 0) {
        return UCS_OK;
    }

    if (ctx->mode == PP_MODE_POLLING) {
        return UCS_OK;
    }

    status = ucp_worker_arm(ctx->worker);
    if (status == UCS_ERR_BUSY) {
        return UCS_OK; /* events arrived meanwhile: progress again */
    }
    if (status != UCS_OK) {
        pp_error("ucp_worker_arm() failed: %s", ucs_status_string(status));
        return status;
    }

    pfd.fd      = ctx->efd;
    pfd.events  = POLLIN;
    pfd.revents = 0;
    do {
        ret = poll(&pfd, 1, PP_POLL_TIMEOUT_MS);
    } while ((ret < 0) && (errno == EINTR));
    if (ret < 0) {
        pp_error("poll() on the worker fd failed: %s", strerror(errno));
        return UCS_ERR_IO_ERROR;
    }

    *idle = (ret == 0);
    return UCS_OK;
}


/*
 * Progress until *flag becomes non-zero.  Gives up with UCS_ERR_TIMED_OUT
 * after timeout_s seconds, and with the endpoint's error if the endpoint
 * fails meanwhile and watch_ep is set.
 */
static ucs_status_t pp_wait_flag(pp_ctx_t *ctx, const int *flag,
                                 double timeout_s, int watch_ep)
{
    uint64_t     deadline = 0;
    unsigned     spins    = 0;
    ucs_status_t status;
    int          idle;

    while (!*flag) {
        if (watch_ep && (ctx->ep_status != UCS_OK)) {
            return ctx->ep_status;
        }

        status = pp_progress(ctx, &idle);
        if (status != UCS_OK) {
            return status;
        }

        if (!idle && (++spins < PP_SPINS_PER_CHECK)) {
            continue;
        }

        spins = 0;
        if (deadline == 0) {
            deadline = pp_now_ns() + (uint64_t)(timeout_s * 1e9);
        } else if (pp_now_ns() > deadline) {
            return UCS_ERR_TIMED_OUT;
        }
    }

    return UCS_OK;
}


/*
 * Wait for the operation returned by a ucp *_nbx call and release it.
 * A NULL request completed immediately (op was filled by the caller).
 * If the endpoint fails or the wait times out while the operation is
 * pending, the operation is cancelled and released (ucp then calls no more
 * callbacks for it) and the error returned.
 */
static ucs_status_t pp_wait(pp_ctx_t *ctx, ucs_status_ptr_t request,
                            pp_op_t *op, const char *what)
{
    ucs_status_t status;

    if (request == NULL) {
        return UCS_OK;
    }

    if (UCS_PTR_IS_ERR(request)) {
        status = UCS_PTR_STATUS(request);
        pp_error("%s failed: %s", what, ucs_status_string(status));
        return status;
    }

    status = pp_wait_flag(ctx, &op->done, ctx->timeout_s, 1);
    if (status != UCS_OK) {
        ucp_request_cancel(ctx->worker, request);
    } else {
        status = op->status;
    }

    ucp_request_free(request);

    if ((status != UCS_OK) && ctx->verbose) {
        pp_error("%s failed: %s", what, ucs_status_string(status));
    }
    return status;
}


static ucs_status_t pp_send(pp_ctx_t *ctx, const void *buffer, size_t length,
                            ucp_tag_t tag, const char *what)
{
    ucp_request_param_t param;
    ucs_status_ptr_t    request;
    pp_op_t             op;

    op.done   = 0;
    op.status = UCS_INPROGRESS;
    op.length = length;

    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                         UCP_OP_ATTR_FIELD_USER_DATA;
    param.cb.send      = pp_send_cb;
    param.user_data    = &op;

    request = ucp_tag_send_nbx(ctx->ep, buffer, length, tag, &param);
    return pp_wait(ctx, request, &op, what);
}


static ucs_status_t pp_recv(pp_ctx_t *ctx, void *buffer, size_t length,
                            ucp_tag_t tag, size_t *received, const char *what)
{
    ucp_request_param_t param;
    ucp_tag_recv_info_t info;
    ucs_status_ptr_t    request;
    ucs_status_t        status;
    pp_op_t             op;

    op.done   = 0;
    op.status = UCS_INPROGRESS;
    op.length = 0;

    param.op_attr_mask       = UCP_OP_ATTR_FIELD_CALLBACK |
                               UCP_OP_ATTR_FIELD_USER_DATA |
                               UCP_OP_ATTR_FIELD_RECV_INFO;
    param.cb.recv            = pp_recv_cb;
    param.user_data          = &op;
    param.recv_info.tag_info = &info;

    request = ucp_tag_recv_nbx(ctx->worker, buffer, length, tag,
                               PP_TAG_MASK_FULL, &param);
    if (request == NULL) {
        /* completed immediately: the callback is not called */
        op.length = info.length;
    }

    status = pp_wait(ctx, request, &op, what);
    if (status != UCS_OK) {
        return status;
    }

    *received = op.length;
    return UCS_OK;
}


/* ------------------------------------------------------------------------ */
/* Setup and teardown                                                       */
/* ------------------------------------------------------------------------ */

static ucs_status_t pp_ctx_init(pp_ctx_t *ctx, const pp_opts_t *opts)
{
    ucp_params_t        params;
    ucp_worker_params_t wparams;
    ucp_config_t       *config;
    ucs_status_t        status;

    memset(ctx, 0, sizeof(*ctx));
    ctx->efd       = -1;
    ctx->mode      = opts->mode;
    ctx->timeout_s = opts->timeout_s;
    ctx->verbose   = opts->verbose;
    ctx->no_err    = opts->no_err;
    ctx->ep_status = UCS_OK;

    status = ucp_config_read(NULL, NULL, &config);
    if (status != UCS_OK) {
        pp_error("ucp_config_read() failed: %s", ucs_status_string(status));
        return status;
    }

    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME;
    params.features   = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    params.name       = opts->server ? "pingpong-server" : "pingpong-client";

    status = ucp_init(&params, config, &ctx->context);
    ucp_config_release(config);
    if (status != UCS_OK) {
        pp_error("ucp_init() failed: %s", ucs_status_string(status));
        return status;
    }

    memset(&wparams, 0, sizeof(wparams));
    wparams.field_mask  = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;

    status = ucp_worker_create(ctx->context, &wparams, &ctx->worker);
    if (status != UCS_OK) {
        pp_error("ucp_worker_create() failed: %s",
                 ucs_status_string(status));
        goto err_cleanup_context;
    }

    status = ucp_worker_get_efd(ctx->worker, &ctx->efd);
    if (status != UCS_OK) {
        pp_error("ucp_worker_get_efd() failed: %s",
                 ucs_status_string(status));
        goto err_destroy_worker;
    }

    return UCS_OK;

err_destroy_worker:
    ucp_worker_destroy(ctx->worker);
    ctx->worker = NULL;
err_cleanup_context:
    ucp_cleanup(ctx->context);
    ctx->context = NULL;
    return status;
}


/* Close the endpoint: flush (delivering what was sent) unless force is set
 * or the endpoint already failed.  Errors of the close itself only mean
 * that the peer closed first. */
static void pp_ep_close(pp_ctx_t *ctx, int force)
{
    ucp_request_param_t param;
    ucs_status_ptr_t    request;
    ucs_status_t        status;
    pp_op_t             op;

    if (ctx->ep == NULL) {
        return;
    }

    op.done   = 0;
    op.status = UCS_INPROGRESS;

    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK |
                         UCP_OP_ATTR_FIELD_USER_DATA |
                         UCP_OP_ATTR_FIELD_FLAGS;
    param.cb.send      = pp_send_cb;
    param.user_data    = &op;
    param.flags        = (force || (ctx->ep_status != UCS_OK)) ?
                         UCP_EP_CLOSE_FLAG_FORCE : 0;

    request = ucp_ep_close_nbx(ctx->ep, &param);
    ctx->ep = NULL;
    if (request == NULL) {
        return;
    }
    if (UCS_PTR_IS_ERR(request)) {
        if (ctx->verbose) {
            pp_error("ucp_ep_close_nbx() failed: %s",
                     ucs_status_string(UCS_PTR_STATUS(request)));
        }
        return;
    }

    status = pp_wait_flag(ctx, &op.done, PP_CLOSE_TIMEOUT_S, 0);
    if (status != UCS_OK) {
        /* leave the request to ucp_worker_destroy() */
        pp_error("endpoint close did not complete: %s",
                 ucs_status_string(status));
        return;
    }
    if ((op.status != UCS_OK) && ctx->verbose) {
        pp_error("endpoint close: %s", ucs_status_string(op.status));
    }
    ucp_request_free(request);
}


/* Normal paths close the endpoint (flush) before; one still open here is
 * left over from an error and is closed by force. */
static void pp_ctx_cleanup(pp_ctx_t *ctx)
{
    pp_ep_close(ctx, 1);
    if (ctx->listener != NULL) {
        ucp_listener_destroy(ctx->listener);
        ctx->listener = NULL;
    }
    if (ctx->worker != NULL) {
        ucp_worker_destroy(ctx->worker);
        ctx->worker = NULL;
    }
    if (ctx->context != NULL) {
        ucp_cleanup(ctx->context);
        ctx->context = NULL;
    }
}


static int pp_resolve(const char *addr, int port, int passive,
                      struct sockaddr_storage *ss, socklen_t *sslen)
{
    struct addrinfo  hints;
    struct addrinfo *res;
    char             service[16];
    int              ret;

    memset(&hints, 0, sizeof(hints));
    hints.ai_family   = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags    = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
    snprintf(service, sizeof(service), "%d", port);

    ret = getaddrinfo(addr, service, &hints, &res);
    if (ret != 0) {
        pp_error("cannot resolve '%s': %s", addr, gai_strerror(ret));
        return -1;
    }

    memcpy(ss, res->ai_addr, res->ai_addrlen);
    *sslen = res->ai_addrlen;
    freeaddrinfo(res);
    return 0;
}


static int pp_sockaddr_port(const struct sockaddr_storage *ss)
{
    if (ss->ss_family == AF_INET) {
        return ntohs(((const struct sockaddr_in*)ss)->sin_port);
    } else if (ss->ss_family == AF_INET6) {
        return ntohs(((const struct sockaddr_in6*)ss)->sin6_port);
    }
    return -1;
}


static void pp_print_transports(pp_ctx_t *ctx, const char *who)
{
    ucp_transport_entry_t entries[16];
    ucp_ep_attr_t         attr;
    ucs_status_t          status;
    unsigned              i;

    memset(&attr, 0, sizeof(attr));
    attr.field_mask                 = UCP_EP_ATTR_FIELD_TRANSPORTS;
    attr.transports.entries         = entries;
    attr.transports.num_entries     = 16;
    attr.transports.entry_size      = sizeof(entries[0]);

    status = ucp_ep_query(ctx->ep, &attr);
    if (status != UCS_OK) {
        pp_error("%s: ucp_ep_query() failed: %s", who,
                 ucs_status_string(status));
        return;
    }

    fprintf(stderr, "%s[%ld]: %s transports:", pp_prog, (long)getpid(), who);
    for (i = 0; i < attr.transports.num_entries; ++i) {
        fprintf(stderr, " %s/%s", entries[i].transport_name,
                entries[i].device_name);
    }
    fputc('\n', stderr);
}


static ucs_status_t pp_ep_create(pp_ctx_t *ctx, ucp_ep_params_t *params)
{
    ucs_status_t status;

    params->field_mask      |= UCP_EP_PARAM_FIELD_ERR_HANDLER |
                               UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    params->err_mode         = ctx->no_err ? UCP_ERR_HANDLING_MODE_NONE :
                                             UCP_ERR_HANDLING_MODE_PEER;
    params->err_handler.cb   = pp_ep_err_cb;
    params->err_handler.arg  = ctx;

    ctx->ep_status = UCS_OK;
    status = ucp_ep_create(ctx->worker, params, &ctx->ep);
    if (status != UCS_OK) {
        ctx->ep = NULL;
        pp_error("ucp_ep_create() failed: %s", ucs_status_string(status));
    }
    return status;
}


static void *pp_alloc(size_t length, unsigned char fill)
{
    void *buffer;

    if (posix_memalign(&buffer, 4096, (length > 0) ? length : 1) != 0) {
        pp_error("cannot allocate %zu bytes", length);
        return NULL;
    }
    memset(buffer, fill, length);
    return buffer;
}


/* ------------------------------------------------------------------------ */
/* Server                                                                   */
/* ------------------------------------------------------------------------ */

static int pp_server(const pp_opts_t *opts, int ready_fd)
{
    ucp_listener_params_t lparams;
    ucp_listener_attr_t   lattr;
    ucp_ep_params_t       eparams;
    struct sockaddr_storage ss;
    socklen_t             sslen;
    pp_hello_t            hello;
    pp_ctx_t              ctx;
    ucs_status_t          status;
    unsigned char        *buffer = NULL;
    size_t                received;
    uint64_t              i, total;
    int                   port, ret = 1;

    if (pp_pin(opts->cpu[0]) != 0) {
        return 1;
    }

    port = (opts->port >= 0) ? opts->port :
           (opts->fork ? 0 : PP_DEFAULT_PORT);
    if (pp_resolve(opts->addr, port, 1, &ss, &sslen) != 0) {
        return 1;
    }

    status = pp_ctx_init(&ctx, opts);
    if (status != UCS_OK) {
        return 1;
    }

    memset(&lparams, 0, sizeof(lparams));
    lparams.field_mask         = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR |
                                 UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
    lparams.sockaddr.addr      = (const struct sockaddr*)&ss;
    lparams.sockaddr.addrlen   = sslen;
    lparams.conn_handler.cb    = pp_conn_cb;
    lparams.conn_handler.arg   = &ctx;

    status = ucp_listener_create(ctx.worker, &lparams, &ctx.listener);
    if (status != UCS_OK) {
        pp_error("ucp_listener_create(%s:%d) failed: %s", opts->addr, port,
                 ucs_status_string(status));
        goto cleanup;
    }

    lattr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
    status = ucp_listener_query(ctx.listener, &lattr);
    if (status != UCS_OK) {
        pp_error("ucp_listener_query() failed: %s",
                 ucs_status_string(status));
        goto cleanup;
    }
    port = pp_sockaddr_port(&lattr.sockaddr);

    if (opts->verbose) {
        pp_error("listening on %s:%d", opts->addr, port);
    }
    if (ready_fd >= 0) {
        if (write(ready_fd, &port, sizeof(port)) != sizeof(port)) {
            pp_error("cannot report the port: %s", strerror(errno));
            goto cleanup;
        }
        close(ready_fd);
        ready_fd = -1;
    }

    /* the client has PP_CONNECT_TIMEOUT_S to connect, but a server started
     * by hand may wait for a while */
    status = pp_wait_flag(&ctx, &ctx.conn_ready,
                          opts->fork ? 2 * PP_CONNECT_TIMEOUT_S : 1e9, 0);
    if (status != UCS_OK) {
        pp_error("no client connected: %s", ucs_status_string(status));
        goto cleanup;
    }

    memset(&eparams, 0, sizeof(eparams));
    eparams.field_mask   = UCP_EP_PARAM_FIELD_CONN_REQUEST;
    eparams.conn_request = ctx.conn_request;
    status = pp_ep_create(&ctx, &eparams);
    if (status != UCS_OK) {
        goto cleanup;
    }

    status = pp_recv(&ctx, &hello, sizeof(hello), PP_TAG_HELLO, &received,
                     "receive hello");
    if (status != UCS_OK) {
        pp_error("no hello from the client: %s", ucs_status_string(status));
        goto cleanup;
    }
    if ((received != sizeof(hello)) || (hello.magic != PP_MAGIC) ||
        (hello.version != PP_VERSION) || (hello.nbytes > PP_MAX_BYTES)) {
        pp_error("bad hello from the client");
        goto cleanup;
    }

    if (opts->verbose) {
        pp_print_transports(&ctx, "server");
    }

    buffer = pp_alloc(hello.nbytes, 0);
    if (buffer == NULL) {
        goto cleanup;
    }

    status = pp_send(&ctx, &hello, sizeof(hello), PP_TAG_ACK, "send ack");
    if (status != UCS_OK) {
        pp_error("cannot answer the hello: %s", ucs_status_string(status));
        goto cleanup;
    }

    /* echo: receive into the buffer, send the same buffer back */
    total = hello.warmup + hello.iters;
    for (i = 0; i < total; ++i) {
        status = pp_recv(&ctx, buffer, hello.nbytes, PP_TAG_DATA, &received,
                         "receive ping");
        if (status != UCS_OK) {
            pp_error("iteration %" PRIu64 ": receive: %s", i,
                     ucs_status_string(status));
            goto cleanup;
        }
        if (received != hello.nbytes) {
            pp_error("iteration %" PRIu64 ": received %zu bytes, expected %"
                     PRIu64, i, received, hello.nbytes);
            goto cleanup;
        }

        status = pp_send(&ctx, buffer, hello.nbytes, PP_TAG_DATA,
                         "send pong");
        if (status != UCS_OK) {
            pp_error("iteration %" PRIu64 ": send: %s", i,
                     ucs_status_string(status));
            goto cleanup;
        }
    }

    /* the client's FIN says it has everything: then both close */
    status = pp_recv(&ctx, &hello, sizeof(hello), PP_TAG_FIN, &received,
                     "receive fin");
    if (status != UCS_OK) {
        pp_error("no fin from the client: %s", ucs_status_string(status));
        goto cleanup;
    }

    pp_ep_close(&ctx, 0);
    ret = 0;

cleanup:
    if (ready_fd >= 0) {
        close(ready_fd);
    }
    pp_ctx_cleanup(&ctx);
    free(buffer);
    return ret;
}


/* ------------------------------------------------------------------------ */
/* Client                                                                   */
/* ------------------------------------------------------------------------ */

static ucs_status_t pp_client_connect(pp_ctx_t *ctx, const pp_opts_t *opts,
                                      int port)
{
    struct sockaddr_storage ss;
    socklen_t               sslen;
    ucp_ep_params_t         eparams;
    pp_hello_t              hello, ack;
    ucs_status_t            status;
    size_t                  received;
    uint64_t                deadline;
    int                     verbose = ctx->verbose;

    if (pp_resolve(opts->addr, port, 0, &ss, &sslen) != 0) {
        return UCS_ERR_INVALID_ADDR;
    }

    hello.magic   = PP_MAGIC;
    hello.version = PP_VERSION;
    hello.nbytes  = opts->nbytes;
    hello.iters   = opts->iters;
    hello.warmup  = opts->warmup;
    hello.check   = opts->check;

    /* failed attempts are expected while the server starts: keep quiet */
    ctx->verbose = 0;
    deadline     = pp_now_ns() + (uint64_t)(PP_CONNECT_TIMEOUT_S * 1e9);
    for (;;) {
        memset(&eparams, 0, sizeof(eparams));
        eparams.field_mask       = UCP_EP_PARAM_FIELD_FLAGS |
                                   UCP_EP_PARAM_FIELD_SOCK_ADDR;
        eparams.flags            = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
        eparams.sockaddr.addr    = (const struct sockaddr*)&ss;
        eparams.sockaddr.addrlen = sslen;

        status = pp_ep_create(ctx, &eparams);
        if (status != UCS_OK) {
            return status;
        }

        /* the connection is up once the server answered the hello */
        status = pp_send(ctx, &hello, sizeof(hello), PP_TAG_HELLO,
                         "send hello");
        if (status == UCS_OK) {
            status = pp_recv(ctx, &ack, sizeof(ack), PP_TAG_ACK, &received,
                             "receive ack");
        }
        if (status == UCS_OK) {
            ctx->verbose = verbose;
            if ((received != sizeof(ack)) ||
                (memcmp(&ack, &hello, sizeof(ack)) != 0)) {
                pp_error("bad answer to the hello");
                return UCS_ERR_INVALID_PARAM;
            }
            return UCS_OK;
        }

        pp_ep_close(ctx, 1);
        if ((status == UCS_ERR_TIMED_OUT) || (pp_now_ns() > deadline)) {
            ctx->verbose = verbose;
            pp_error("cannot connect to %s:%d: %s", opts->addr, port,
                     ucs_status_string(status));
            return status;
        }
        pp_sleep_ms(50);
    }
}


static int pp_cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t*)a;
    uint64_t y = *(const uint64_t*)b;

    return (x > y) - (x < y);
}


static int pp_client(const pp_opts_t *opts, int port)
{
    pp_ctx_t       ctx;
    ucs_status_t   status;
    unsigned char *sbuf    = NULL;
    unsigned char *rbuf    = NULL;
    uint64_t      *samples = NULL;
    uint64_t       i, total, t_start, t_prev, t_now, elapsed, mid;
    double         mean_ns, median_ns, bandwidth;
    size_t         n = opts->nbytes;
    size_t         received;
    int            ret = 1;

    if (pp_pin(opts->fork ? opts->cpu[1] : opts->cpu[0]) != 0) {
        return 1;
    }

    status = pp_ctx_init(&ctx, opts);
    if (status != UCS_OK) {
        return 1;
    }

    sbuf    = pp_alloc(n, 0xa5);
    rbuf    = pp_alloc(n, 0);
    samples = malloc(opts->iters * sizeof(*samples));
    if ((sbuf == NULL) || (rbuf == NULL) || (samples == NULL)) {
        pp_error("cannot allocate buffers");
        goto cleanup;
    }

    status = pp_client_connect(&ctx, opts, port);
    if (status != UCS_OK) {
        goto cleanup;
    }

    if (opts->verbose) {
        pp_print_transports(&ctx, "client");
    }

    total   = opts->warmup + opts->iters;
    t_start = t_prev = pp_now_ns();
    for (i = 0; i < total; ++i) {
        if (opts->check && (n > 0)) {
            sbuf[0]     = (unsigned char)i;
            sbuf[n - 1] = (unsigned char)(i >> 8);
        }

        status = pp_send(&ctx, sbuf, n, PP_TAG_DATA, "send ping");
        if (status != UCS_OK) {
            pp_error("iteration %" PRIu64 ": send: %s", i,
                     ucs_status_string(status));
            goto cleanup;
        }

        status = pp_recv(&ctx, rbuf, n, PP_TAG_DATA, &received,
                         "receive pong");
        if (status != UCS_OK) {
            pp_error("iteration %" PRIu64 ": receive: %s", i,
                     ucs_status_string(status));
            goto cleanup;
        }

        t_now = pp_now_ns();
        if (i >= opts->warmup) {
            samples[i - opts->warmup] = t_now - t_prev;
        } else {
            t_start = t_now; /* the measurement starts after the warmup */
        }
        t_prev = t_now;

        if (received != n) {
            pp_error("iteration %" PRIu64 ": received %zu bytes, expected "
                     "%zu", i, received, n);
            goto cleanup;
        }
        if (opts->check && (memcmp(sbuf, rbuf, n) != 0)) {
            pp_error("iteration %" PRIu64 ": echoed payload differs", i);
            goto cleanup;
        }
    }
    elapsed = t_prev - t_start;

    /* tell the server we are done; the flush close delivers it */
    status = pp_send(&ctx, NULL, 0, PP_TAG_FIN, "send fin");
    if (status != UCS_OK) {
        pp_error("cannot send fin: %s", ucs_status_string(status));
        goto cleanup;
    }
    pp_ep_close(&ctx, 0);

    qsort(samples, opts->iters, sizeof(*samples), pp_cmp_u64);
    mid = opts->iters / 2;
    if (opts->iters % 2) {
        median_ns = samples[mid] / 2.0;
    } else {
        median_ns = (samples[mid - 1] + samples[mid]) / 4.0;
    }
    mean_ns   = (double)elapsed / (double)opts->iters / 2.0;
    bandwidth = (elapsed > 0) ?
                2.0 * (double)n * (double)opts->iters / (elapsed / 1e9) : 0.0;

    printf("RESULT mode=%s bytes=%zu iters=%" PRIu64 " latency_ns=%.1f "
           "median_latency_ns=%.1f bandwidth_Bps=%.1f\n",
           (opts->mode == PP_MODE_BLOCKING) ? "blocking" : "polling", n,
           opts->iters, mean_ns, median_ns, bandwidth);
    fflush(stdout);
    ret = 0;

cleanup:
    pp_ctx_cleanup(&ctx);
    free(samples);
    free(rbuf);
    free(sbuf);
    return ret;
}


/* ------------------------------------------------------------------------ */
/* Fork mode: server in a child, client in the parent                       */
/* ------------------------------------------------------------------------ */

static volatile pid_t pp_child_pid = 0;


/* SIGTERM/SIGINT/SIGHUP in the fork parent: take the server down with us
 * and reap it (kill, waitpid and _exit are async-signal-safe). */
static void pp_parent_signal(int signo)
{
    pid_t pid = pp_child_pid;

    if (pid > 0) {
        kill(pid, SIGKILL);
        while ((waitpid(pid, NULL, 0) < 0) && (errno == EINTR)) {
        }
    }
    _exit(128 + signo);
}


static void pp_install_parent_handlers(void)
{
    struct sigaction sa;

    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = pp_parent_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
}


static int pp_wait_child(pid_t pid, int kill_it)
{
    int wstatus;

    if (kill_it) {
        kill(pid, SIGKILL);
    }
    while (waitpid(pid, &wstatus, 0) < 0) {
        if (errno != EINTR) {
            pp_error("waitpid() failed: %s", strerror(errno));
            pp_child_pid = 0;
            return 1;
        }
    }
    pp_child_pid = 0;
    if (WIFEXITED(wstatus)) {
        return WEXITSTATUS(wstatus);
    }
    if (WIFSIGNALED(wstatus) && !kill_it) {
        pp_error("server killed by signal %d", WTERMSIG(wstatus));
    }
    return 1;
}


static int pp_fork(pp_opts_t *opts)
{
    struct pollfd pfd;
    pid_t         pid, parent = getpid();
    ssize_t       nread;
    int           fds[2], port = -1, ret;

    /* fork before any UCX initialization, so each process has its own */
    if (pipe(fds) != 0) {
        pp_error("pipe() failed: %s", strerror(errno));
        return 1;
    }

    fflush(stdout);
    fflush(stderr);
    pid = fork();
    if (pid < 0) {
        pp_error("fork() failed: %s", strerror(errno));
        close(fds[0]);
        close(fds[1]);
        return 1;
    }

    if (pid == 0) {
#ifdef __linux__
        prctl(PR_SET_PDEATHSIG, SIGKILL);
#endif
        if (getppid() != parent) {
            _exit(1);
        }
        close(fds[0]);
        opts->server = 1;
        pp_prog      = "pingpong-server";
        fflush(stdout);
        _exit(pp_server(opts, fds[1]));
    }

    close(fds[1]);
    pp_prog      = "pingpong-client";
    pp_child_pid = pid;
    pp_install_parent_handlers();

    /* the server reports its port once it listens */
    pfd.fd      = fds[0];
    pfd.events  = POLLIN;
    pfd.revents = 0;
    do {
        ret = poll(&pfd, 1, (int)(PP_CONNECT_TIMEOUT_S * 1000));
    } while ((ret < 0) && (errno == EINTR));
    if (ret > 0) {
        nread = read(fds[0], &port, sizeof(port));
        if (nread != sizeof(port)) {
            port = -1;
        }
    }
    close(fds[0]);
    if (port < 0) {
        pp_error("the server did not start listening");
        pp_wait_child(pid, 1);
        return 1;
    }

    ret = pp_client(opts, port);
    if (ret != 0) {
        pp_wait_child(pid, 1);
        return ret;
    }

    ret = pp_wait_child(pid, 0);
    if (ret != 0) {
        pp_error("server exited with status %d", ret);
    }
    return ret;
}


/* ------------------------------------------------------------------------ */
/* Command line                                                             */
/* ------------------------------------------------------------------------ */

static void pp_usage(FILE *stream)
{
    fprintf(stream,
            "usage: %s [-S | -f] [-s ADDR] [-p PORT] [-m blocking|polling]\n"
            "                [-n BYTES] [-i ITERS] [-w WARMUP] [-T SECONDS]\n"
            "                [-a CPU[,CPU]] [-c] [-v] [-E]\n"
            "\n"
            "  -S          run the server (default: run the client)\n"
            "  -f          fork: server in a child process, client here\n"
            "  -s ADDR     listen / connect address (default %s)\n"
            "  -p PORT     port (default %d; with -f an ephemeral one)\n"
            "  -m MODE     progress mode: blocking (default) or polling\n"
            "  -n BYTES    message size, K/M/G suffixes allowed (default 1)\n"
            "  -i ITERS    measured iterations (default 1000)\n"
            "  -w WARMUP   iterations before the measurement (default 100)\n"
            "  -T SECONDS  give up when one operation waits longer "
            "(default 60)\n"
            "  -a S[,C]    pin to CPU S; with -f the server to S and the "
            "client to C\n"
            "  -c          verify the echoed payload every iteration\n"
            "  -v          diagnostics (port, transports) on stderr\n"
            "  -E          endpoints without peer error handling\n"
            "\n"
            "The client prints one line:\n"
            "  RESULT mode=M bytes=N iters=I latency_ns=L "
            "median_latency_ns=D bandwidth_Bps=B\n",
            "pingpong", PP_DEFAULT_ADDR, PP_DEFAULT_PORT);
}


static int pp_parse_u64(const char *arg, int suffixes, uint64_t *value)
{
    unsigned long long v;
    char              *end;

    if ((arg[0] == '\0') || (arg[0] == '-')) {
        return -1;
    }

    errno = 0;
    v     = strtoull(arg, &end, 10);
    if ((errno != 0) || (end == arg)) {
        return -1;
    }

    if (suffixes && (*end != '\0')) {
        switch (*end) {
        case 'k': case 'K': v <<= 10; break;
        case 'm': case 'M': v <<= 20; break;
        case 'g': case 'G': v <<= 30; break;
        default: return -1;
        }
        ++end;
        if ((*end == 'i') || (*end == 'I')) {
            ++end;
        }
        if ((*end == 'b') || (*end == 'B')) {
            ++end;
        }
    }

    if (*end != '\0') {
        return -1;
    }

    *value = v;
    return 0;
}


/* "N" or "N,M": the first CPU is the server's (or this process's), the
 * second the client's in fork mode; one CPU means both on it. */
static int pp_parse_cpus(const char *arg, int *cpu)
{
    const char *comma;
    char        first[32];
    uint64_t    v;

    comma = strchr(arg, ',');
    if (comma == NULL) {
        if ((pp_parse_u64(arg, 0, &v) != 0) || (v > 4095)) {
            return -1;
        }
        cpu[0] = cpu[1] = (int)v;
        return 0;
    }

    if ((size_t)(comma - arg) >= sizeof(first)) {
        return -1;
    }
    memcpy(first, arg, comma - arg);
    first[comma - arg] = '\0';
    if ((pp_parse_u64(first, 0, &v) != 0) || (v > 4095)) {
        return -1;
    }
    cpu[0] = (int)v;
    if ((pp_parse_u64(comma + 1, 0, &v) != 0) || (v > 4095)) {
        return -1;
    }
    cpu[1] = (int)v;
    return 0;
}


int main(int argc, char **argv)
{
    pp_opts_t opts;
    uint64_t  v;
    int       c;

    opts.server    = 0;
    opts.fork      = 0;
    opts.addr      = PP_DEFAULT_ADDR;
    opts.port      = -1;
    opts.nbytes    = 1;
    opts.iters     = 1000;
    opts.warmup    = 100;
    opts.mode      = PP_MODE_BLOCKING;
    opts.timeout_s = 60.0;
    opts.check     = 0;
    opts.verbose   = 0;
    opts.no_err    = 0;
    opts.cpu[0]    = -1;
    opts.cpu[1]    = -1;

    while ((c = getopt(argc, argv, "Sfs:p:m:n:i:w:T:a:cvEh")) != -1) {
        switch (c) {
        case 'S':
            opts.server = 1;
            break;
        case 'f':
            opts.fork = 1;
            break;
        case 's':
            opts.addr = optarg;
            break;
        case 'p':
            if ((pp_parse_u64(optarg, 0, &v) != 0) || (v > 65535)) {
                pp_error("invalid port '%s'", optarg);
                return 2;
            }
            opts.port = (int)v;
            break;
        case 'm':
            if (!strcmp(optarg, "blocking")) {
                opts.mode = PP_MODE_BLOCKING;
            } else if (!strcmp(optarg, "polling")) {
                opts.mode = PP_MODE_POLLING;
            } else {
                pp_error("invalid mode '%s' (blocking or polling)", optarg);
                return 2;
            }
            break;
        case 'n':
            if ((pp_parse_u64(optarg, 1, &v) != 0) || (v > PP_MAX_BYTES)) {
                pp_error("invalid size '%s'", optarg);
                return 2;
            }
            opts.nbytes = v;
            break;
        case 'i':
            if ((pp_parse_u64(optarg, 0, &v) != 0) || (v == 0)) {
                pp_error("invalid iteration count '%s'", optarg);
                return 2;
            }
            opts.iters = v;
            break;
        case 'w':
            if (pp_parse_u64(optarg, 0, &v) != 0) {
                pp_error("invalid warmup count '%s'", optarg);
                return 2;
            }
            opts.warmup = v;
            break;
        case 'T':
            opts.timeout_s = strtod(optarg, NULL);
            if (!(opts.timeout_s > 0)) {
                pp_error("invalid timeout '%s'", optarg);
                return 2;
            }
            break;
        case 'c':
            opts.check = 1;
            break;
        case 'v':
            opts.verbose = 1;
            break;
        case 'E':
            opts.no_err = 1;
            break;
        case 'a':
            if (pp_parse_cpus(optarg, opts.cpu) != 0) {
                pp_error("invalid CPU list '%s'", optarg);
                return 2;
            }
            break;
        case 'h':
            pp_usage(stdout);
            return 0;
        default:
            pp_usage(stderr);
            return 2;
        }
    }

    if (optind != argc) {
        pp_error("unexpected argument '%s'", argv[optind]);
        pp_usage(stderr);
        return 2;
    }
    if (opts.server && opts.fork) {
        pp_error("-S and -f are exclusive");
        return 2;
    }

    if (opts.fork) {
        return pp_fork(&opts);
    } else if (opts.server) {
        pp_prog = "pingpong-server";
        return pp_server(&opts, -1);
    } else {
        pp_prog = "pingpong-client";
        return pp_client(&opts,
                         (opts.port >= 0) ? opts.port : PP_DEFAULT_PORT);
    }
}
