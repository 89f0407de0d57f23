/* kvpool.ghosts, native: the hazard policy's ghost table (ghosts.py beside it is the reference).

Keys (32-byte bytes: block keys) -> values (C int64) in insertion order, as the reference's
OrderedDict keeps them. The entries sit in a ring of arrays in the order they came, each key
copied in (no Python object is kept: a dropped block's key is freed with the block, so the
table's memory is its arrays alone); a removed one leaves a hole (value -1) that the oldest end
skips when it gets there. An open-addressing index maps a key to its entry: linear probing from
the top bits of a hash of the key's own bytes (no process's hash seed: the same table in every
run), at most half full, each slot holding the entry's place and those 31 bits (a probe past
another key reads nothing else), and no tombstones (a removal shifts the keys probed past it
back: Knuth's algorithm R). So in a steady state (as many puts as removals) nothing is ever
rebuilt: the ring only grows, twice as large, when it is full and more than half of it is live,
and is compacted in place of growing when it is full of holes; `GhostTable(expected)` makes room
for `expected` entries at its first put (a table never written costs nothing; after that the
arrays' pages come from the system as they are first written: a zeroed index is empty). The
hash only places keys in the index: what a call returns, and the order, never depend on it. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#define EMPTY 0 /* (a zeroed index is empty: made with calloc, its pages come as they are used) */
#define HOLE (-1)
#define MIN_CAPACITY 8
#define MAX_CAPACITY 0x80000000UL /* (an index slot holds 32 bits of a place) */
#define KEY_BYTES 32
#define LOW32 ((int64_t)0xffffffff)
/* How many keys ahead the batch calls ask for their index slots: in a table of a million
   entries nearly every probe misses the caches, and a batch's misses then overlap. */
#define PREFETCH_AHEAD 8

typedef struct {
    PyObject_HEAD
    unsigned char *keys; /* a ring in insertion order, KEY_BYTES a place */
    int64_t *values;     /* HOLE: the place's entry was removed */
    size_t ring;         /* capacity - 1 (a power of two, <= MAX_CAPACITY) */
    size_t head; /* the oldest entry's place (from there on, `span` places, holes included) */
    size_t span;
    Py_ssize_t live;
    int64_t *index; /* mask + 1 slots: EMPTY, or slot_of(place, hash) (never 0) */
    size_t mask;
    size_t room; /* the capacity to make at the first put (from `expected`), 0 once made */
} GhostTable;

/* A hash of a key's bytes (a block key is already uniform: this only mixes its four words,
   so that keys alike in some words still spread). */
static inline uint64_t hash_of(const unsigned char *key) {
    uint64_t w[4];
    memcpy(w, key, KEY_BYTES);
    uint64_t h = w[0];
    for (int k = 1; k < 4; k++) {
        h = (h ^ (h >> 31) ^ w[k]) * 0x9E3779B97F4A7C15ULL;
    }
    return h ^ (h >> 29);
}

/* The hash's top 31 bits: where the key's probe starts, and what its index slot keeps. */
static inline uint64_t tag_of(uint64_t h) { return h >> 33; }

/* An index slot: the tag, and the place plus one (so that no slot is EMPTY). */
static inline int64_t slot_of(size_t e, uint64_t h) {
    return (int64_t)(tag_of(h) << 32 | (uint64_t)(e + 1));
}

static inline size_t place_of(int64_t slot) { return (size_t)(slot & LOW32) - 1; }

static inline unsigned char *key_at(GhostTable *t, size_t place) {
    return t->keys + place * KEY_BYTES;
}

/* The bytes of a key argument, or NULL with TypeError / ValueError. */
static const unsigned char *check_key(PyObject *key) {
    if (!PyBytes_CheckExact(key)) {
        PyErr_Format(PyExc_TypeError, "key must be bytes, not %s", Py_TYPE(key)->tp_name);
        return NULL;
    }
    if (PyBytes_GET_SIZE(key) != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError, "key must be %d bytes, got %zd", KEY_BYTES,
                     PyBytes_GET_SIZE(key));
        return NULL;
    }
    return (const unsigned char *)PyBytes_AS_STRING(key);
}

/* The entry place of `key` (hash h), or -1; *where: its index slot. */
static Py_ssize_t find(GhostTable *t, const unsigned char *key, uint64_t h, size_t *where) {
    int64_t tag = (int64_t)(tag_of(h) << 32);
    for (size_t i = tag_of(h) & t->mask;; i = (i + 1) & t->mask) {
        int64_t slot = t->index[i];
        if (slot == EMPTY) {
            return -1;
        }
        if ((slot & ~LOW32) == tag &&
            memcmp(key_at(t, place_of(slot)), key, KEY_BYTES) == 0) {
            *where = i;
            return (Py_ssize_t)place_of(slot);
        }
    }
}

/* Index `place` (of a key with hash h, known to be absent). */
static void index_add(int64_t *index, size_t mask, size_t place, uint64_t h) {
    size_t i = tag_of(h) & mask;
    while (index[i] != EMPTY) {
        i = (i + 1) & mask;
    }
    index[i] = slot_of(place, h);
}

/* Empty index slot i, moving back the slots after it that probed past it. */
static void index_remove(GhostTable *t, size_t i) {
    size_t mask = t->mask;
    for (size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
        int64_t slot = t->index[j];
        if (slot == EMPTY) {
            break;
        }
        size_t home = (size_t)(slot >> 32) & mask;
        /* It stays unless its probe started at or before i (cyclically: home not in (i, j]). */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            t->index[i] = slot;
            i = j;
        }
    }
    t->index[i] = EMPTY;
}

/* Ask the system for 2 MiB pages under a large array (where it has them: transparent huge
   pages): one fault and one TLB entry per 2 MiB of a table read at random places. */
static void advise_huge(void *memory, size_t bytes) {
#ifdef MADV_HUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t start = ((uintptr_t)memory + huge - 1) & ~(huge - 1);
    uintptr_t end = ((uintptr_t)memory + bytes) & ~(huge - 1);
    if (end > start) {
        (void)madvise((void *)start, end - start, MADV_HUGEPAGE);
    }
#else
    (void)memory;
    (void)bytes;
#endif
}

/* Move the live entries, in order, to the start of a ring of `capacity` places (a power of
   two, > live) and index them afresh; on failure (no memory) the table is as it was. */
static int rebuild(GhostTable *t, size_t capacity) {
    if (capacity > MAX_CAPACITY) {
        PyErr_NoMemory();
        return -1;
    }
    size_t slots = 2 * capacity;
    unsigned char *keys = PyMem_Malloc(KEY_BYTES * capacity);
    int64_t *values = PyMem_Malloc(sizeof(int64_t) * capacity);
    int64_t *index = PyMem_Calloc(slots, sizeof(int64_t));
    if (keys == NULL || values == NULL || index == NULL) {
        PyMem_Free(keys);
        PyMem_Free(values);
        PyMem_Free(index);
        PyErr_NoMemory();
        return -1;
    }
    advise_huge(keys, KEY_BYTES * capacity);
    advise_huge(values, sizeof(int64_t) * capacity);
    advise_huge(index, sizeof(int64_t) * slots);
    size_t n = 0;
    for (size_t k = 0; k < t->span; k++) {
        size_t e = (t->head + k) & t->ring;
        if (t->values[e] != HOLE) {
            memcpy(keys + n * KEY_BYTES, key_at(t, e), KEY_BYTES);
            values[n] = t->values[e];
            index_add(index, slots - 1, n, hash_of(key_at(t, e)));
            n++;
        }
    }
    PyMem_Free(t->keys);
    PyMem_Free(t->values);
    PyMem_Free(t->index);
    t->keys = keys;
    t->values = values;
    t->index = index;
    t->mask = slots - 1;
    t->ring = capacity - 1;
    t->head = 0;
    t->span = n;
    return 0;
}

/* Remove the entry at `place` (index slot i); the caller has read what it needs. The oldest
   end moves past the holes it reaches. */
static void remove_entry(GhostTable *t, size_t place, size_t i) {
    index_remove(t, i);
    t->values[place] = HOLE;
    t->live--;
    while (t->span && t->values[t->head] == HOLE) {
        t->head = (t->head + 1) & t->ring;
        t->span--;
    }
}

static PyObject *ghosts_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"expected", NULL};
    PyObject *expected = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O:GhostTable", names, &expected)) {
        return NULL;
    }
    long long room = 0;
    if (expected != NULL) {
        int overflow = 0;
        room = PyLong_CheckExact(expected) ? PyLong_AsLongLongAndOverflow(expected, &overflow)
                                           : -1;
        if (room == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (overflow || room < 0 || (unsigned long long)room > MAX_CAPACITY / 2) {
            PyObject *repr = PyObject_Repr(expected);
            if (repr != NULL) {
                PyErr_Format(PyExc_ValueError, "expected must be an int in [0, %lu], got %U",
                             MAX_CAPACITY / 2, repr);
                Py_DECREF(repr);
            }
            return NULL;
        }
    }
    /* Twice `expected`: the size a ring holding that many live entries grows to (it grows
       when it is full and more than half of it is live; holes fill it). */
    size_t capacity = MIN_CAPACITY;
    while (capacity < 2 * (size_t)room) {
        capacity *= 2;
    }
    GhostTable *t = (GhostTable *)type->tp_alloc(type, 0);
    if (t == NULL) {
        return NULL;
    }
    if (rebuild(t, MIN_CAPACITY) < 0) {
        Py_DECREF(t);
        return NULL;
    }
    t->room = capacity > MIN_CAPACITY ? capacity : 0;
    return (PyObject *)t;
}

static void ghosts_dealloc(GhostTable *t) {
    PyMem_Free(t->keys);
    PyMem_Free(t->values);
    PyMem_Free(t->index);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static Py_ssize_t ghosts_len(GhostTable *t) { return t->live; }

/* Ask for the index slot where the probe for hash h starts (a hint: changes nothing). */
static inline void prefetch_slot(GhostTable *t, uint64_t h) {
    __builtin_prefetch(&t->index[tag_of(h) & t->mask]);
}

/* `key`'s value (hash h), or -1; removed with `take`. */
static int64_t lookup_one(GhostTable *t, const unsigned char *key, uint64_t h, int take) {
    size_t i;
    Py_ssize_t e = find(t, key, h, &i);
    if (e < 0) {
        return -1;
    }
    int64_t value = t->values[e];
    if (take) {
        remove_entry(t, (size_t)e, i);
    }
    return value;
}

static PyObject *lookup(GhostTable *t, PyObject *key, int take) {
    const unsigned char *bytes = check_key(key);
    if (bytes == NULL) {
        return NULL;
    }
    return PyLong_FromLongLong(lookup_one(t, bytes, hash_of(bytes), take));
}

static PyObject *ghosts_get(GhostTable *t, PyObject *key) { return lookup(t, key, 0); }

static PyObject *ghosts_take(GhostTable *t, PyObject *key) { return lookup(t, key, 1); }

/* Set `key`'s value (hash h, value checked); -1 with an exception when the table cannot
   grow (nothing changed). */
static int put_one(GhostTable *t, const unsigned char *key, uint64_t h, int64_t value) {
    size_t i;
    Py_ssize_t e = find(t, key, h, &i);
    if (e >= 0) { /* (its place stays) */
        t->values[e] = value;
        return 0;
    }
    if (t->room) { /* the first put: the room asked for (a table never written costs nothing) */
        size_t room = t->room;
        if (room > t->ring + 1 && rebuild(t, room) < 0) {
            return -1;
        }
        t->room = 0;
    }
    size_t capacity = t->ring + 1;
    if (t->span == capacity && /* full: grow if more than half of it is live, else compact */
        rebuild(t, 2 * (size_t)t->live >= capacity ? 2 * capacity : capacity) < 0) {
        return -1;
    }
    size_t place = (t->head + t->span++) & t->ring;
    memcpy(key_at(t, place), key, KEY_BYTES);
    t->values[place] = value;
    index_add(t->index, t->mask, place, h);
    t->live++;
    return 0;
}

/* A value argument as an int64 in [0, INT64_MAX], or -1 with ValueError. */
static int64_t check_value(PyObject *arg) {
    int overflow = 0;
    long long value = PyLong_CheckExact(arg) ? PyLong_AsLongLongAndOverflow(arg, &overflow) : -1;
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow || value < 0) {
        PyObject *repr = PyObject_Repr(arg);
        if (repr != NULL) {
            PyErr_Format(PyExc_ValueError, "value must be an int in [0, %lld], got %U",
                         (long long)INT64_MAX, repr);
            Py_DECREF(repr);
        }
        return -1;
    }
    return (int64_t)value;
}

/* The hashes of a list of keys, all checked first (NULL with an exception: nothing done). */
static uint64_t *hashes_of(PyObject *keys) {
    if (!PyList_CheckExact(keys)) {
        PyErr_Format(PyExc_TypeError, "keys must be a list, not %s", Py_TYPE(keys)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    uint64_t *hashes = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (hashes == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        const unsigned char *key = check_key(PyList_GET_ITEM(keys, k));
        if (key == NULL) {
            PyMem_Free(hashes);
            return NULL;
        }
        hashes[k] = hash_of(key);
    }
    return hashes;
}

static inline const unsigned char *bytes_at(PyObject *keys, Py_ssize_t k) {
    return (const unsigned char *)PyBytes_AS_STRING(PyList_GET_ITEM(keys, k));
}

/* take() of each key, in order; the index slots are asked for ahead. Only a MemoryError while
   making the result's ints (after the takes) leaves keys taken with their values lost. */
static PyObject *ghosts_take_many(GhostTable *t, PyObject *keys) {
    uint64_t *hashes = hashes_of(keys);
    if (hashes == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *values = PyList_New(n);
    if (values == NULL) {
        PyMem_Free(hashes);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n && k < PREFETCH_AHEAD; k++) {
        prefetch_slot(t, hashes[k]);
    }
    int64_t *taken = (int64_t *)hashes; /* (each hash is read before its value is written) */
    for (Py_ssize_t k = 0; k < n; k++) {
        if (k + PREFETCH_AHEAD < n) {
            prefetch_slot(t, hashes[k + PREFETCH_AHEAD]);
        }
        taken[k] = lookup_one(t, bytes_at(keys, k), hashes[k], 1);
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = PyLong_FromLongLong(taken[k]);
        if (item == NULL) {
            Py_DECREF(values);
            PyMem_Free(hashes);
            return NULL;
        }
        PyList_SET_ITEM(values, k, item);
    }
    PyMem_Free(hashes);
    return values;
}

/* put() of each (key, value), in order, every argument checked first; the index slots are asked
   for ahead. Only a MemoryError (the table cannot grow) stops it part way: the pairs before it
   are put. */
static PyObject *ghosts_put_many(GhostTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put_many(keys, values) takes 2 arguments");
        return NULL;
    }
    PyObject *keys = args[0], *values = args[1];
    if (!PyList_CheckExact(values)) {
        PyErr_Format(PyExc_TypeError, "values must be a list, not %s", Py_TYPE(values)->tp_name);
        return NULL;
    }
    if (PyList_CheckExact(keys) && PyList_GET_SIZE(keys) != PyList_GET_SIZE(values)) {
        PyErr_Format(PyExc_ValueError, "keys and values must be as long: %zd keys, %zd values",
                     PyList_GET_SIZE(keys), PyList_GET_SIZE(values));
        return NULL;
    }
    uint64_t *hashes = hashes_of(keys);
    if (hashes == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    int64_t *checked = PyMem_Malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    if (checked == NULL) {
        PyMem_Free(hashes);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        if ((checked[k] = check_value(PyList_GET_ITEM(values, k))) < 0) {
            PyMem_Free(checked);
            PyMem_Free(hashes);
            return NULL;
        }
    }
    int failed = 0;
    for (Py_ssize_t k = 0; k < n && k < PREFETCH_AHEAD; k++) {
        prefetch_slot(t, hashes[k]);
    }
    for (Py_ssize_t k = 0; k < n && !failed; k++) {
        if (k + PREFETCH_AHEAD < n) {
            prefetch_slot(t, hashes[k + PREFETCH_AHEAD]);
        }
        failed = put_one(t, bytes_at(keys, k), hashes[k], checked[k]) < 0;
    }
    PyMem_Free(checked);
    PyMem_Free(hashes);
    if (failed) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *ghosts_put(GhostTable *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "put(key, value) takes 2 arguments");
        return NULL;
    }
    const unsigned char *key = check_key(args[0]);
    if (key == NULL) {
        return NULL;
    }
    int64_t value = check_value(args[1]);
    if (value < 0 || put_one(t, key, hash_of(key), value) < 0) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *ghosts_forget(GhostTable *t, PyObject *arg) {
    int overflow = 0;
    long long count = PyLong_CheckExact(arg) ? PyLong_AsLongLongAndOverflow(arg, &overflow) : -1;
    if (count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (overflow > 0) { /* (more than any table holds) */
        count = PY_SSIZE_T_MAX;
    }
    if (overflow < 0 || count < 0) {
        PyObject *repr = PyObject_Repr(arg);
        if (repr != NULL) {
            PyErr_Format(PyExc_ValueError, "count must be an int >= 0, got %U", repr);
            Py_DECREF(repr);
        }
        return NULL;
    }
    if (count > t->live) {
        count = t->live;
    }
    PyObject *values = PyList_New((Py_ssize_t)count);
    if (values == NULL) {
        return NULL;
    }
    for (Py_ssize_t n = 0; n < count; n++) {
        size_t e = t->head; /* (live: the oldest end never rests on a hole) */
        if (PREFETCH_AHEAD < t->span) { /* (a place written before: live, or a hole's old key) */
            prefetch_slot(t, hash_of(key_at(t, (e + PREFETCH_AHEAD) & t->ring)));
        }
        PyObject *value = PyLong_FromLongLong(t->values[e]);
        if (value == NULL) { /* (the entries forgotten so far stay forgotten: return them) */
            PyObject *done = PyList_GetSlice(values, 0, n);
            Py_DECREF(values);
            return done;
        }
        PyList_SET_ITEM(values, n, value);
        uint64_t h = hash_of(key_at(t, e));
        size_t i = tag_of(h) & t->mask;
        while (t->index[i] != slot_of(e, h)) {
            i = (i + 1) & t->mask;
        }
        remove_entry(t, e, i);
    }
    return values;
}

static PyObject *ghosts_items(GhostTable *t, PyObject *Py_UNUSED(ignored)) {
    PyObject *items = PyList_New(0);
    if (items == NULL) {
        return NULL;
    }
    for (size_t k = 0; k < t->span; k++) {
        size_t e = (t->head + k) & t->ring;
        if (t->values[e] == HOLE) {
            continue;
        }
        PyObject *item = Py_BuildValue("(y#L)", (const char *)key_at(t, e),
                                       (Py_ssize_t)KEY_BYTES, (long long)t->values[e]);
        if (item == NULL || PyList_Append(items, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(items);
            return NULL;
        }
        Py_DECREF(item);
    }
    return items;
}

static PyMethodDef ghosts_methods[] = {
    {"get", (PyCFunction)ghosts_get, METH_O, NULL},
    {"take", (PyCFunction)ghosts_take, METH_O, NULL},
    {"put", (PyCFunction)(void (*)(void))ghosts_put, METH_FASTCALL, NULL},
    {"take_many", (PyCFunction)ghosts_take_many, METH_O, NULL},
    {"put_many", (PyCFunction)(void (*)(void))ghosts_put_many, METH_FASTCALL, NULL},
    {"forget", (PyCFunction)ghosts_forget, METH_O, NULL},
    {"items", (PyCFunction)ghosts_items, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods ghosts_sequence = {.sq_length = (lenfunc)ghosts_len};

static PyTypeObject GhostTableType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvpool.ghosts.GhostTable",
    .tp_basicsize = sizeof(GhostTable),
    .tp_dealloc = (destructor)ghosts_dealloc,
    .tp_as_sequence = &ghosts_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Keys (32-byte bytes) -> values (ints in [0, 2**63)), in insertion order; room for\n"
               "`expected` entries is made up front.",
    .tp_methods = ghosts_methods,
    .tp_new = ghosts_new,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvpool.ghosts", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_ghosts(void) {
    if (PyType_Ready(&GhostTableType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "MAX_VALUE", INT64_MAX) < 0 ||
        PyModule_AddIntConstant(m, "KEY_BYTES", KEY_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "MAX_EXPECTED", MAX_CAPACITY / 2) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&GhostTableType);
    if (PyModule_AddObject(m, "GhostTable", (PyObject *)&GhostTableType) < 0) {
        Py_DECREF(&GhostTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
