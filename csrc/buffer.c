/*
 * buffer.c - turns a Python object into (pointer, length, memory type):
 * the buffer protocol for host memory, __cuda_array_interface__ for device
 * memory.  Owns nothing beyond the ucxx_buf it fills; the caller releases
 * it with ucxx_buf_release() exactly once.
 */
#include "ucxx.h"
#include <dlfcn.h>

/* cuStreamSynchronize from the CUDA driver, loaded on first use only (the
 * package never touches CUDA at import). */
typedef int (*cu_stream_sync_t)(void *stream);

static int
cuda_stream_sync(PyObject *stream_obj)
{
    static cu_stream_sync_t sync_fn; /* process-wide: the driver is too */
    void *stream;
    int rc;

    if (stream_obj == NULL || stream_obj == Py_None) {
        return 0;
    }
    stream = PyLong_AsVoidPtr(stream_obj);
    if (stream == NULL && PyErr_Occurred()) {
        return -1;
    }
    if (stream == NULL) {
        PyErr_SetString(PyExc_ValueError,
                        "__cuda_array_interface__: stream 0 is disallowed "
                        "(use 1 for the legacy default stream)");
        return -1;
    }
    if (sync_fn == NULL) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);

        if (lib != NULL) {
            sync_fn = (cu_stream_sync_t)dlsym(lib, "cuStreamSynchronize");
        }
        if (sync_fn == NULL) {
            PyErr_SetString(PyExc_RuntimeError,
                            "__cuda_array_interface__ names a stream but the "
                            "CUDA driver (libcuda.so.1) cannot be loaded");
            return -1;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    rc = sync_fn(stream);
    Py_END_ALLOW_THREADS
    if (rc != 0) {
        PyErr_Format(PyExc_RuntimeError, "cuStreamSynchronize failed (%d)",
                     rc);
        return -1;
    }
    return 0;
}

/* Item size from a typestr such as "<f8", "|u1". */
static int
typestr_itemsize(PyObject *typestr, Py_ssize_t *itemsize)
{
    const char *s = PyUnicode_Check(typestr) ? PyUnicode_AsUTF8AndSize(typestr, NULL) : NULL;
    long n;
    char *end;

    if (s == NULL || strlen(s) < 3) {
        PyErr_SetString(PyExc_TypeError,
                        "__cuda_array_interface__: bad 'typestr'");
        return -1;
    }
    n = strtol(s + 2, &end, 10);
    if (*end != '\0' || n <= 0) {
        PyErr_Format(PyExc_TypeError,
                     "__cuda_array_interface__: bad 'typestr' %R", typestr);
        return -1;
    }
    *itemsize = n;
    return 0;
}

/* Parse __cuda_array_interface__ (v2/v3): data, shape, typestr, strides,
 * mask; synchronise the producer's stream when one is named. */
static int
cuda_buf_get(PyObject *obj, PyObject *cai, int writable, ucxx_buf *b)
{
    PyObject *data, *shape, *typestr, *strides, *mask, *ptr, *ro;
    Py_ssize_t itemsize, n, nbytes = 1, expect;
    int empty = 0, overflow = 0;

    if (!PyDict_Check(cai)) {
        PyErr_SetString(PyExc_TypeError,
                        "__cuda_array_interface__ must be a dict");
        return -1;
    }
    data = PyDict_GetItemString(cai, "data");
    shape = PyDict_GetItemString(cai, "shape");
    typestr = PyDict_GetItemString(cai, "typestr");
    if (data == NULL || shape == NULL || typestr == NULL ||
        !PyTuple_Check(data) || PyTuple_Size(data) != 2 ||
        !PyTuple_Check(shape)) {
        PyErr_SetString(PyExc_TypeError,
                        "__cuda_array_interface__ needs 'data' (ptr, readonly),"
                        " 'shape' (tuple) and 'typestr'");
        return -1;
    }
    mask = PyDict_GetItemString(cai, "mask");
    if (mask != NULL && mask != Py_None) {
        PyErr_SetString(PyExc_BufferError,
                        "masked CUDA arrays cannot be transferred");
        return -1;
    }
    if (typestr_itemsize(typestr, &itemsize) < 0) {
        return -1;
    }
    /* The size is shape[0] x ... x shape[n-1] x itemsize, checked: a
     * product that does not fit in Py_ssize_t would otherwise wrap (to 0 or
     * to any size) and be posted over an arbitrary pointer.  An empty array
     * (a zero in the shape) has no bytes, whatever its other extents. */
    n = PyTuple_Size(shape);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t d = PyLong_AsSsize_t(PyTuple_GetItem(shape, i));
        if (d < 0) {
            if (!PyErr_Occurred()) {
                PyErr_SetString(PyExc_ValueError, "negative CUDA shape");
            }
            return -1;
        }
        empty |= d == 0;
        overflow |= __builtin_mul_overflow(nbytes, d, &nbytes);
    }
    overflow |= __builtin_mul_overflow(nbytes, itemsize, &nbytes);
    if (empty) {
        nbytes = 0;
    } else if (overflow) {
        PyErr_Format(PyExc_OverflowError,
                     "__cuda_array_interface__: size of shape %R x itemsize "
                     "%zd overflows (more than %zd bytes)", shape, itemsize,
                     PY_SSIZE_T_MAX);
        return -1;
    }
    strides = PyDict_GetItemString(cai, "strides");
    if (strides != NULL && strides != Py_None) {
        if (!PyTuple_Check(strides) || PyTuple_Size(strides) != n) {
            PyErr_SetString(PyExc_TypeError,
                            "__cuda_array_interface__: bad 'strides'");
            return -1;
        }
        /* C-contiguous: stride[i] == itemsize * prod(shape[i+1:]) (an
         * empty array is contiguous whatever its strides; otherwise expect
         * stays <= nbytes and cannot overflow). */
        expect = itemsize;
        for (Py_ssize_t i = n - 1; i >= 0 && !empty; i--) {
            Py_ssize_t d = PyLong_AsSsize_t(PyTuple_GetItem(shape, i));
            Py_ssize_t s = PyLong_AsSsize_t(PyTuple_GetItem(strides, i));
            if (s == -1 && PyErr_Occurred()) {
                return -1;
            }
            if (d > 1 && s != expect) {
                PyErr_SetString(PyExc_BufferError,
                                "CUDA array is not C-contiguous");
                return -1;
            }
            expect *= d;
        }
    }
    ro = PyTuple_GetItem(data, 1);
    if (writable && PyObject_IsTrue(ro)) {
        PyErr_SetString(PyExc_BufferError,
                        "CUDA array is read-only; a receive needs a writable "
                        "buffer");
        return -1;
    }
    ptr = PyTuple_GetItem(data, 0);
    b->ptr = PyLong_AsVoidPtr(ptr);
    if (b->ptr == NULL && PyErr_Occurred()) {
        return -1;
    }
    if (b->ptr == NULL && nbytes > 0) {
        PyErr_SetString(PyExc_ValueError, "CUDA array has a NULL pointer");
        return -1;
    }
    if ((uintptr_t)b->ptr > UINTPTR_MAX - (size_t)nbytes) {
        PyErr_Format(PyExc_OverflowError,
                     "__cuda_array_interface__: %zd bytes at %p run past the "
                     "end of the address space", nbytes, b->ptr);
        return -1;
    }
    if (cuda_stream_sync(PyDict_GetItemString(cai, "stream")) < 0) {
        return -1;
    }
    b->len = (size_t)nbytes;
    b->mem_type = UCS_MEMORY_TYPE_CUDA;
    b->view.obj = NULL;
    b->owner = Py_NewRef(obj);
    return 0;
}

/* obj.__cuda_array_interface__ (a new reference), read once per buffer:
 * exporters such as cupy build the dict on every access.  NULL without an
 * error when obj has no such attribute. */
static PyObject *
cuda_interface_of(PyObject *obj)
{
    PyObject *cai = PyObject_GetAttrString(obj, "__cuda_array_interface__");

    if (cai == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
    }
    return cai;
}

/*
 * Fill b from obj.  Host objects must export a C-contiguous buffer
 * (writable for receives); device objects need __cuda_array_interface__.
 * On error b holds nothing and a TypeError/BufferError is set.
 */
int
ucxx_buf_get(ucxx_state *st, PyObject *obj, int writable, ucxx_buf *b)
{
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    PyObject *cai;
    int rc;

    b->owner = NULL;
    b->view.obj = NULL;
    if (PyObject_CheckBuffer(obj)) {
        PyObject *exc;

        if (PyObject_GetBuffer(obj, &b->view, flags) == 0) {
            b->ptr = b->view.buf;
            b->len = (size_t)b->view.len;
            b->mem_type = UCS_MEMORY_TYPE_HOST;
            return 0;
        }
        b->view.obj = NULL;
        /* Device arrays may define a __buffer__ that refuses (cupy on
         * Python >= 3.12): their CUDA interface is what counts then, and an
         * error raised while building it is the one reported. */
        exc = PyErr_GetRaisedException_compat();
        cai = cuda_interface_of(obj);
        if (cai == NULL && !PyErr_Occurred()) {
            /* Exporters disagree on the class (numpy: ValueError for
             * read-only or strided arrays): one BufferError for all. */
            if (!PyErr_GivenExceptionMatches(exc, PyExc_BufferError)) {
                PyObject *cause;

                PyErr_Format(PyExc_BufferError, "%s buffer required: %S",
                             writable ? "a writable C-contiguous"
                                      : "a C-contiguous", exc);
                cause = PyErr_GetRaisedException_compat();
                PyException_SetCause(cause, exc);
                PyErr_SetRaisedException_compat(cause);
            } else {
                PyErr_SetRaisedException_compat(exc);
            }
            return -1;
        }
        Py_DECREF(exc);
    } else {
        cai = cuda_interface_of(obj);
    }
    if (cai == NULL) {
        if (!PyErr_Occurred()) {
            ucxx_type_error("a bytes-like object or an object with "
                            "__cuda_array_interface__ is required, not '%U'",
                            obj);
        }
        return -1;
    }
    rc = cuda_buf_get(obj, cai, writable, b);
    Py_DECREF(cai);
    return rc;
}

void
ucxx_buf_release(ucxx_buf *b)
{
    if (b->view.obj != NULL) {
        PyBuffer_Release(&b->view);
    }
    Py_CLEAR(b->owner);
}

/* A tag: a Python int in [0, 2**64). */
int
ucxx_tag_from_obj(PyObject *obj, ucp_tag_t *tag)
{
    unsigned long long v;

    if (!PyLong_Check(obj)) {
        return ucxx_type_error("tag must be an int, not '%U'", obj);
    }
    v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "tag must be in [0, 2**64), got %R",
                     obj);
        return -1;
    }
    *tag = (ucp_tag_t)v;
    return 0;
}
