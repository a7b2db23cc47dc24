/*
 * address.c - checks a packed UCX worker address before UCX reads it.
 * Owns nothing: it reads the caller's buffer (Worker.ep_from_address);
 * nothing to close.
 */
#include "ucxx.h"

/*
 * The part of a packed worker address that comes before its device list
 * (UCX 1.22, src/ucp/wireup/address.c):
 *
 *   v1: [ version (low 4 bits) | flags (high 4 bits) ]
 *   v2: [ version (low 4 bits) | release (high 4 bits) ] [ flags ]
 *   then uuid (8 bytes, flag 0x2), client id (8 bytes, flag 0x4), worker
 *   name (length byte + bytes, flag 0x1), then the devices or a single
 *   UCP_NULL_RESOURCE byte: at least one byte.
 *
 * UCX asserts (aborts the process) on a version other than v1 (0) and v2
 * (1), and reads the fixed fields without knowing the buffer's length:
 * both are checked here.  The device list is left to UCX.  Returns the
 * reason the address is refused, or NULL.
 */
#define UCXX_ADDR_VERSION_MASK  0x0f
#define UCXX_ADDR_VERSION_V1    0
#define UCXX_ADDR_VERSION_V2    1
#define UCXX_ADDR_FLAG_NAME     0x1
#define UCXX_ADDR_FLAG_UUID     0x2
#define UCXX_ADDR_FLAG_CLIENT   0x4

static const char *
header_error(const uint8_t *a, Py_ssize_t len, Py_ssize_t *need)
{
    unsigned version = a[0] & UCXX_ADDR_VERSION_MASK, flags;
    Py_ssize_t off;

    *need = 0;
    if (version == UCXX_ADDR_VERSION_V1) {
        flags = a[0] >> 4;
        off = 1;
    } else if (version == UCXX_ADDR_VERSION_V2) {
        if (len < 2) {
            *need = 2;
            return "too short for its header";
        }
        flags = a[1];
        off = 2;
    } else {
        return "unsupported address version";
    }
    off += (flags & UCXX_ADDR_FLAG_UUID) ? 8 : 0;
    off += (flags & UCXX_ADDR_FLAG_CLIENT) ? 8 : 0;
    if (flags & UCXX_ADDR_FLAG_NAME) {
        if (len <= off) {
            *need = off + 1;
            return "too short for its header";
        }
        off += 1 + a[off];
    }
    if (len < off + 1) {        /* + the first device (or NULL resource) */
        *need = off + 1;
        return "too short for its header";
    }
    return NULL;
}

/* 0 if UCX can read `a`; -1 with UCXInvalidParamError (or UCXConfigError
 * for a buffer too short to be any address) set otherwise. */
int
ucxx_address_check(ucxx_state *st, const uint8_t *a, Py_ssize_t len)
{
    const char *why;
    Py_ssize_t need;

    if (len < 8) {
        ucxx_raise(st, UCXX_EXC_CONFIG,
                   "invalid UCX worker address (%zd bytes)", len);
        return -1;
    }
    why = header_error(a, len, &need);
    if (why == NULL) {
        return 0;
    }
    if (need == 0) {
        ucxx_raise(st, UCXX_EXC_INVALID_PARAM,
                   "invalid UCX worker address: %s %u (first byte 0x%02x; "
                   "UCX reads versions %d (v1) and %d (v2))",
                   why, a[0] & UCXX_ADDR_VERSION_MASK, (unsigned)a[0],
                   UCXX_ADDR_VERSION_V1, UCXX_ADDR_VERSION_V2);
    } else {
        ucxx_raise(st, UCXX_EXC_INVALID_PARAM,
                   "invalid UCX worker address: %s (%zd bytes, its header "
                   "needs at least %zd)", why, len, need);
    }
    return -1;
}
