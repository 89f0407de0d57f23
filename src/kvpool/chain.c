/* kvpool.chain, native: the native backend's block keys (chain.py beside it is the reference).

A block's key is SHA-256(previous key || the block's encoded tokens). Per block, the Python code
pays for a slice, a concatenation, a hash object and a digest object; a prompt of a few thousand
tokens has a few hundred blocks. Here one call encodes a prompt, or hashes a run of blocks, or
walks the tree's key index, with one stack buffer and no object but the results. SHA-256 is
OpenSSL's (the library hashlib uses), so the keys are the same bytes on both backends. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <openssl/sha.h>
#include <string.h>

#define KEY_BYTES 32
#define MAX_TOKEN 0x80000000L

/* Write `value` as 4 little-endian bytes at p; 0, or -1 when it is no token (< 0 or >= 2**31). */
static int put_token(unsigned char *p, long value, int overflow) {
    if (overflow || value < 0 || value >= MAX_TOKEN) {
        return -1;
    }
    p[0] = (unsigned char)value;
    p[1] = (unsigned char)(value >> 8);
    p[2] = (unsigned char)(value >> 16);
    p[3] = (unsigned char)(value >> 24);
    return 0;
}

/* encode_ints of a sequence holding something other than exact ints: on a snapshot (a tuple
   holding its items), as `__index__` may run any code, the list's own changes included. A
   TypeError (not an integer) is None, as in the reference; any other error propagates. */
static PyObject *encode_ints_slow(PyObject *tokens) {
    PyObject *snapshot = PySequence_Tuple(tokens);
    if (snapshot == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(snapshot);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) {
        Py_DECREF(snapshot);
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++, p += 4) {
        PyObject *token = PyTuple_GET_ITEM(snapshot, i);
        int overflow = 0;
        long value = PyBool_Check(token) ? -1 : PyLong_AsLongAndOverflow(token, &overflow);
        if (value == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_TypeError)) {
                Py_DECREF(snapshot);
                Py_DECREF(out);
                return NULL;
            }
            PyErr_Clear(); /* not an integer: the caller's general path says which token */
        }
        if (put_token(p, value, overflow) < 0) {
            Py_DECREF(snapshot);
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
    }
    Py_DECREF(snapshot);
    return out;
}

/* encode_ints(tokens) -> bytes | None: 4-byte little-endian ints, or None unless `tokens` is a
   list or tuple of integers (int, or any type with __index__, but not bool) in [0, 2**31).
   Exact ints (the usual case) are read in place: no Python code runs while the list is read. */
static PyObject *encode_ints(PyObject *self, PyObject *tokens) {
    (void)self;
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens)) {
        Py_RETURN_NONE;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    PyObject **items = PySequence_Fast_ITEMS(tokens);
    PyObject *out = PyBytes_FromStringAndSize(NULL, 4 * n);
    if (out == NULL) {
        return NULL;
    }
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++, p += 4) {
        PyObject *token = items[i];
        if (!PyLong_CheckExact(token)) {
            Py_DECREF(out);
            return encode_ints_slow(tokens);
        }
        int overflow = 0;
        long value = PyLong_AsLongAndOverflow(token, &overflow);
        if (put_token(p, value, overflow) < 0) {
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
    }
    return out;
}

/* Parse (key: bytes of 32, data: bytes, block_bytes: int > 0), checking that data holds whole
   blocks: the key is copied into `key` (the chain's running key), the blocks' start goes to
   *blocks and their count to *count. */
static int parse_run(PyObject *const *args, Py_ssize_t nargs, const char *name, Py_ssize_t want,
                     unsigned char key[KEY_BYTES], const unsigned char **blocks,
                     Py_ssize_t *block_bytes, Py_ssize_t *count) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
        return -1;
    }
    if (!PyBytes_CheckExact(args[0]) || PyBytes_GET_SIZE(args[0]) != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "%s: key must be %d bytes", name, KEY_BYTES);
        return -1;
    }
    if (!PyBytes_CheckExact(args[1])) {
        PyErr_Format(PyExc_TypeError, "%s: data must be bytes", name);
        return -1;
    }
    *block_bytes = PyLong_AsSsize_t(args[2]);
    if (*block_bytes == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (*block_bytes <= 0 || PyBytes_GET_SIZE(args[1]) % *block_bytes != 0) {
        PyErr_Format(PyExc_ValueError, "%s: data must hold whole blocks of block_bytes > 0",
                     name);
        return -1;
    }
    memcpy(key, PyBytes_AS_STRING(args[0]), KEY_BYTES);
    *blocks = (const unsigned char *)PyBytes_AS_STRING(args[1]);
    *count = PyBytes_GET_SIZE(args[1]) / *block_bytes;
    return 0;
}

/* The next key: SHA-256(key || block), written over key. */
static void next_key(unsigned char key[KEY_BYTES], const unsigned char *block, size_t size) {
    SHA256_CTX ctx;
    SHA256_Init(&ctx);
    SHA256_Update(&ctx, key, KEY_BYTES);
    SHA256_Update(&ctx, block, size);
    SHA256_Final(key, &ctx);
}

/* chain_blocks(key, data, block_bytes) -> (keys, datas): the chained keys of data's blocks
   and the blocks themselves (each a bytes object). */
static PyObject *chain_blocks(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned char key[KEY_BYTES];
    const unsigned char *block;
    Py_ssize_t block_bytes, count;
    if (parse_run(args, nargs, "chain_blocks", 3, key, &block, &block_bytes, &count) < 0) {
        return NULL;
    }
    PyObject *keys = PyList_New(count), *datas = PyList_New(count);
    if (keys == NULL || datas == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++, block += block_bytes) {
        next_key(key, block, (size_t)block_bytes);
        PyObject *k = PyBytes_FromStringAndSize((const char *)key, KEY_BYTES);
        if (k == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(keys, i, k);
        PyObject *d = count == 1 ? Py_NewRef(args[1])
                                 : PyBytes_FromStringAndSize((const char *)block, block_bytes);
        if (d == NULL) {
            goto fail;
        }
        PyList_SET_ITEM(datas, i, d);
    }
    PyObject *result = PyTuple_Pack(2, keys, datas);
    Py_DECREF(keys);
    Py_DECREF(datas);
    return result;
fail:
    Py_XDECREF(keys);
    Py_XDECREF(datas);
    return NULL;
}

/* walk_index(key, data, block_bytes, index) -> list: the values `index` (a dict: key -> block)
   holds for the chained keys of data's blocks, from the first on, up to the first key it lacks. */
static PyObject *walk_index(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    unsigned char key[KEY_BYTES];
    const unsigned char *block;
    Py_ssize_t block_bytes, count;
    if (parse_run(args, nargs, "walk_index", 4, key, &block, &block_bytes, &count) < 0) {
        return NULL;
    }
    PyObject *index = args[3];
    if (!PyDict_CheckExact(index)) {
        PyErr_SetString(PyExc_TypeError, "walk_index: index must be a dict");
        return NULL;
    }
    PyObject *found = PyList_New(0);
    if (found == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++, block += block_bytes) {
        next_key(key, block, (size_t)block_bytes);
        PyObject *k = PyBytes_FromStringAndSize((const char *)key, KEY_BYTES);
        if (k == NULL) {
            Py_DECREF(found);
            return NULL;
        }
        PyObject *value = PyDict_GetItemWithError(index, k); /* borrowed */
        Py_DECREF(k);
        if (value == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(found);
                return NULL;
            }
            break;
        }
        if (PyList_Append(found, value) < 0) {
            Py_DECREF(found);
            return NULL;
        }
    }
    return found;
}

static PyMethodDef methods[] = {
    {"encode_ints", encode_ints, METH_O, NULL},
    {"chain_blocks", (PyCFunction)(void (*)(void))chain_blocks, METH_FASTCALL, NULL},
    {"walk_index", (PyCFunction)(void (*)(void))walk_index, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvpool.chain", NULL, -1, methods};

PyMODINIT_FUNC PyInit_chain(void) { return PyModule_Create(&module); }
