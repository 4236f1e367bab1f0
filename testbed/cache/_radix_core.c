/* The replay's hot loops in C (testbed/cache/native.py says which, and holds their Python twins).
 *
 * Each function does exactly what its Python twin in native.py (or the method it stands for)
 * does to the tree's nodes, reading and writing `TreeNode`'s slots at their offsets, which `bind`
 * finds once from the class. Only `TreeNode`s are taken: any other object where a node is
 * expected raises TypeError. Token runs are bytes of 4-byte tokens, children keyed by the first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <string.h>

#define TOKEN 4 /* bytes a token (token_runs.TOKEN_BYTES; native.py checks) */

/* TreeNode's slots, in the order of its __slots__ (bind checks that they are these) */
enum { ID, PARENT, CHILDREN, KB, SLOTS, LOCK_REF, LAST_ACCESS, ACCESS_COUNT, CREATED, START,
       PRIORITY, CATEGORY, OFFER, ALIVE, TIER, HITS, HISTORY, NUM_SLOTS };
static const char *slot_names[NUM_SLOTS] = {
    "id", "parent", "children", "kb", "slots", "lock_ref", "last_access", "access_count",
    "created", "start", "priority", "category", "offer", "alive", "tier", "hits", "history"};
static Py_ssize_t off[NUM_SLOTS];
static PyTypeObject *node_type = NULL;
static PyObject *no_children = NULL; /* tree_node.NO_CHILDREN, every leaf's */

static PyObject *heappush, *heappop, *zero, *one;
static PyObject *s_heap, *s_num_nodes, *s_evictable, *s_pool, *s_free, *s_rebuild, *s_priority,
    *s_category;

#define GET(o, i) (*(PyObject **)((char *)(o) + off[i]))

static void put(PyObject *o, int i, PyObject *v) { /* steals v */
    PyObject *old = GET(o, i);
    GET(o, i) = v;
    Py_XDECREF(old);
}

/* a TreeNode with every slot set (a deleted one would read as NULL below) and bytes for tokens */
static int is_node(PyObject *o) {
    if (node_type == NULL || Py_TYPE(o) != node_type) return 0;
    for (int i = 0; i < NUM_SLOTS; i++)
        if (GET(o, i) == NULL) return 0;
    return PyBytes_CheckExact(GET(o, KB));
}

static int not_node(void) {
    PyErr_SetString(PyExc_TypeError, "_radix_core: expected a TreeNode with every field set and "
                                     "bytes in kb (bind the class first)");
    return -1;
}

/* bind(TreeNode, NO_CHILDREN): find the slots' offsets */
static PyObject *bind(PyObject *self, PyObject *args) {
    PyObject *t, *empty;
    if (!PyArg_ParseTuple(args, "O!O", &PyType_Type, &t, &empty)) return NULL;
    PyTypeObject *tp = (PyTypeObject *)t;
    PyObject *names = PyDict_GetItemString(tp->tp_dict, "__slots__");
    if (names == NULL || !PyTuple_Check(names) || PyTuple_GET_SIZE(names) != NUM_SLOTS) {
        PyErr_Format(PyExc_TypeError, "bind: %s's __slots__ are not the %d this module knows",
                     tp->tp_name, NUM_SLOTS);
        return NULL;
    }
    Py_ssize_t found[NUM_SLOTS]; /* (a class refused leaves the bound one as it was) */
    for (int i = 0; i < NUM_SLOTS; i++) {
        PyObject *d = PyDict_GetItemString(tp->tp_dict, slot_names[i]);
        if (d == NULL || Py_TYPE(d) != &PyMemberDescr_Type ||
            ((PyMemberDescrObject *)d)->d_member->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_TypeError, "bind: %s.%s is not a slot", tp->tp_name, slot_names[i]);
            return NULL;
        }
        found[i] = ((PyMemberDescrObject *)d)->d_member->offset;
    }
    memcpy(off, found, sizeof off);
    Py_XSETREF(node_type, (PyTypeObject *)Py_NewRef(t));
    Py_XSETREF(no_children, Py_NewRef(empty));
    Py_RETURN_NONE;
}

/* a child's key: the bytes of the token at byte ``at`` of ``kb`` (new ref) */
static PyObject *token_key(PyObject *kb, Py_ssize_t at) {
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(kb) + at, TOKEN);
}

/* match(root, kb, end) -> (path, at, stop): native.match_py */
static PyObject *match(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "match(root, kb: bytes, end)");
        return NULL;
    }
    PyObject *node = args[0], *kb = args[1], *stop = Py_None;
    Py_ssize_t end = PyLong_AsSsize_t(args[2]), at = 0;
    if (end == -1 && PyErr_Occurred()) return NULL;
    if (!is_node(node)) return not_node(), NULL;
    const char *buf = PyBytes_AS_STRING(kb);
    if (end > PyBytes_GET_SIZE(kb)) end = PyBytes_GET_SIZE(kb);
    PyObject *path = PyList_New(0);
    if (!path) return NULL;
    while (at + TOKEN <= end) {
        PyObject *kids = GET(node, CHILDREN);
        if (!PyDict_CheckExact(kids)) break; /* NO_CHILDREN: a leaf */
        PyObject *key = token_key(kb, at);
        if (!key) goto fail;
        PyObject *child = PyDict_GetItemWithError(kids, key); /* borrowed */
        Py_DECREF(key);
        if (child == NULL) {
            if (PyErr_Occurred()) goto fail;
            break;
        }
        if (!is_node(child)) { not_node(); goto fail; }
        PyObject *edge = GET(child, KB);
        Py_ssize_t len = PyBytes_GET_SIZE(edge);
        if (at + len > end || memcmp(buf + at, PyBytes_AS_STRING(edge), len) != 0) {
            stop = child;
            break;
        }
        if (PyList_Append(path, child)) goto fail;
        at += len;
        node = child;
    }
    return Py_BuildValue("(NnO)", path, at, stop);
fail:
    Py_DECREF(path);
    return NULL;
}

static int increment(PyObject *o, int i) {
    PyObject *v = PyNumber_Add(GET(o, i), one);
    if (!v) return -1;
    put(o, i, v);
    return 0;
}

static int lower_priority(PyObject *x, PyObject *urgent) {
    if (urgent == Py_None) return 0;
    int lt = PyObject_RichCompareBool(urgent, GET(x, PRIORITY), Py_LT);
    if (lt > 0) put(x, PRIORITY, Py_NewRef(urgent));
    return lt < 0 ? -1 : 0;
}

static int set_tick(PyObject *x, long long tick) {
    PyObject *t = PyLong_FromLongLong(tick);
    if (!t) return -1;
    put(x, LAST_ACCESS, t);
    return 0;
}

/* touch(root, path, last, tick, urgent) -> tick: native.touch_py */
static PyObject *touch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5 || !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "touch(root, path: list, last: list, tick, urgent)");
        return NULL;
    }
    PyObject *root = args[0], *path = args[1], *last = args[2], *urgent = args[4];
    long long tick = PyLong_AsLongLong(args[3]);
    if (tick == -1 && PyErr_Occurred()) return NULL;
    if (!is_node(root)) return not_node(), NULL;
    if (set_tick(root, tick) || lower_priority(root, urgent)) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(path); i++) {
        PyObject *x = PyList_GET_ITEM(path, i);
        if (!is_node(x)) return not_node(), NULL;
        if (set_tick(x, ++tick) || increment(x, ACCESS_COUNT) || increment(x, HITS) ||
            lower_priority(x, urgent))
            return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(last); i++) {
        PyObject *x = PyList_GET_ITEM(last, i);
        if (!is_node(x)) return not_node(), NULL;
        if (set_tick(x, ++tick)) return NULL;
    }
    return PyLong_FromLongLong(tick);
}

/* TreeNode(id, parent, kb, slots, clock, start, requester) as its __init__ makes it (new ref) */
static PyObject *make_node(PyObject *id, PyObject *parent, PyObject *kb, PyObject *slots,
                           PyObject *clock, PyObject *start, PyObject *requester) {
    if (node_type == NULL) return not_node(), NULL;
    if (!PyBytes_CheckExact(kb)) {
        PyErr_SetString(PyExc_TypeError, "a node's kb must be bytes");
        return NULL;
    }
    PyObject *priority = zero, *category = Py_None;
    int given = requester == Py_None ? 0 : PyObject_IsTrue(requester); /* `if requester` */
    if (given < 0) return NULL;
    if (given) {
        priority = PyObject_GetAttr(requester, s_priority);
        category = priority ? PyObject_GetAttr(requester, s_category) : NULL;
        if (!category) { Py_XDECREF(priority); return NULL; }
    } else {
        Py_INCREF(priority);
        Py_INCREF(category);
    }
    PyObject *o = node_type->tp_alloc(node_type, 0);
    if (!o) { Py_DECREF(priority); Py_DECREF(category); return NULL; }
    GET(o, ID) = Py_NewRef(id);
    GET(o, PARENT) = Py_NewRef(parent);
    GET(o, CHILDREN) = Py_NewRef(no_children);
    GET(o, KB) = Py_NewRef(kb);
    GET(o, SLOTS) = Py_NewRef(slots);
    GET(o, LOCK_REF) = Py_NewRef(zero);
    GET(o, LAST_ACCESS) = Py_NewRef(clock);
    GET(o, ACCESS_COUNT) = Py_NewRef(one);
    GET(o, HITS) = Py_NewRef(zero);
    GET(o, HISTORY) = Py_NewRef(zero);
    GET(o, CREATED) = Py_NewRef(clock);
    GET(o, START) = Py_NewRef(start);
    GET(o, PRIORITY) = priority;
    GET(o, CATEGORY) = category;
    GET(o, OFFER) = Py_NewRef(zero);
    GET(o, ALIVE) = Py_NewRef(Py_True);
    GET(o, TIER) = Py_NewRef(Py_None);
    return o;
}

/* cut_leaf(ids, node, kb, at, cut, head_slots, leaf_slots, head_tick, leaf_tick, requester,
   prompt_priority) -> [head, leaf]: native.cut_leaf_py */
static PyObject *cut_leaf(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 11 || !PyBytes_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "cut_leaf(ids, node, kb: bytes, at, cut, head_slots, "
                                         "leaf_slots, head_tick, leaf_tick, requester, prompt_priority)");
        return NULL;
    }
    PyObject *ids = args[0], *node = args[1], *kb = args[2], *requester = args[9];
    Py_ssize_t at = PyLong_AsSsize_t(args[3]), cut = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (!is_node(node)) return not_node(), NULL;
    if (at < 0 || at % TOKEN || cut % TOKEN || cut <= at || cut + TOKEN > PyBytes_GET_SIZE(kb)) {
        PyErr_SetString(PyExc_ValueError, "cut_leaf: at < cut < len(kb), in whole tokens");
        return NULL;
    }
    PyObject *leaf = NULL, *head = NULL, *list = NULL, *kids = NULL, *key = NULL;
    PyObject *leaf_id = PyIter_Next(ids), *head_id = leaf_id ? PyIter_Next(ids) : NULL;
    PyObject *tail = PyBytes_FromStringAndSize(PyBytes_AS_STRING(kb) + cut, PyBytes_GET_SIZE(kb) - cut);
    PyObject *front = PyBytes_FromStringAndSize(PyBytes_AS_STRING(kb) + at, cut - at);
    PyObject *leaf_start = PyLong_FromSsize_t(cut / TOKEN), *head_start = PyLong_FromSsize_t(at / TOKEN);
    if (!head_id || !tail || !front || !leaf_start || !head_start) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "cut_leaf: the ids ran out");
        goto done;
    }
    leaf = make_node(leaf_id, Py_None, tail, args[6], args[8], leaf_start, requester);
    head = leaf ? make_node(head_id, node, front, args[5], args[7], head_start, requester) : NULL;
    if (!head) goto done;
    put(leaf, PARENT, Py_NewRef(head));
    put(leaf, HITS, Py_NewRef(one));
    put(head, HITS, Py_NewRef(one));
    if (lower_priority(head, args[10])) goto done;
    kids = PyDict_New();
    key = kids ? token_key(kb, cut) : NULL;
    if (!key || PyDict_SetItem(kids, key, leaf)) goto done;
    put(head, CHILDREN, Py_NewRef(kids));
    Py_SETREF(key, token_key(kb, at));
    if (!key) goto done;
    if (!PyDict_CheckExact(GET(node, CHILDREN))) { /* its first child: a dict of its own */
        PyObject *own = PyDict_New();
        if (!own) goto done;
        put(node, CHILDREN, own);
    }
    if (PyDict_SetItem(GET(node, CHILDREN), key, head)) goto done;
    list = PyList_New(2);
    if (list) {
        PyList_SET_ITEM(list, 0, Py_NewRef(head));
        PyList_SET_ITEM(list, 1, Py_NewRef(leaf));
    }
done:
    Py_XDECREF(leaf_id); Py_XDECREF(head_id); Py_XDECREF(tail); Py_XDECREF(front);
    Py_XDECREF(leaf_start); Py_XDECREF(head_start); Py_XDECREF(leaf); Py_XDECREF(head);
    Py_XDECREF(kids); Py_XDECREF(key);
    return list;
}

static int has_children(PyObject *node) {
    PyObject *kids = GET(node, CHILDREN);
    if (PyDict_CheckExact(kids)) return PyDict_GET_SIZE(kids) != 0;
    return PyObject_IsTrue(kids);
}

static Py_ssize_t attr_ssize(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return n;
}

static int set_attr_ssize(PyObject *o, PyObject *name, Py_ssize_t n) {
    PyObject *v = PyLong_FromSsize_t(n);
    if (!v) return -1;
    int r = PyObject_SetAttr(o, name, v);
    Py_DECREF(v);
    return r;
}

/* LeafEviction.offer's entry under LRU: an unlocked leaf (not the root) pushed onto ``heap``
   keyed by its last access, its offer counted; 1 if pushed, 0 if no candidate, -1 on error */
static int push_offer(PyObject *heap, PyObject *root, PyObject *node) {
    if (!is_node(node)) return not_node();
    int kids = has_children(node);
    if (kids) return kids < 0 ? -1 : 0;
    int locked = PyObject_IsTrue(GET(node, LOCK_REF));
    if (locked) return locked < 0 ? -1 : 0;
    if (node == root) return 0;
    if (increment(node, OFFER)) return -1;
    PyObject *entry = PyTuple_Pack(4, GET(node, LAST_ACCESS), GET(node, ID), GET(node, OFFER), node);
    if (!entry) return -1;
    PyObject *r = PyObject_CallFunctionObjArgs(heappush, heap, entry, NULL);
    Py_DECREF(entry);
    if (!r) return -1;
    Py_DECREF(r);
    return 1;
}

/* whether the heap holds so many stale entries that LeafEviction drops them (its _rebuild_heap) */
static int too_long(PyObject *heap, Py_ssize_t nodes) {
    return PyList_GET_SIZE(heap) > 4 * nodes + 1024;
}

static PyObject *the_heap(PyObject *ev) {
    PyObject *heap = PyObject_GetAttr(ev, s_heap);
    if (heap && !PyList_CheckExact(heap)) {
        Py_DECREF(heap);
        PyErr_SetString(PyExc_TypeError, "LeafEviction._heap is not a list");
        return NULL;
    }
    return heap;
}

static int rebuild(PyObject *ev) {
    PyObject *r = PyObject_CallMethodNoArgs(ev, s_rebuild);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* offer_lru(eviction, tree, root, node): LeafEviction.offer under LRU */
static PyObject *offer_lru(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "offer_lru(eviction, tree, root, node)");
        return NULL;
    }
    PyObject *heap = the_heap(args[0]);
    if (!heap) return NULL;
    int pushed = push_offer(heap, args[2], args[3]);
    int full = 0;
    if (pushed == 1) {
        Py_ssize_t nodes = attr_ssize(args[1], s_num_nodes);
        if (nodes == -1 && PyErr_Occurred()) pushed = -1;
        else full = too_long(heap, nodes);
    }
    Py_DECREF(heap);
    if (pushed < 0 || (full && rebuild(args[0]))) return NULL;
    Py_RETURN_NONE;
}

/* evict_lru(eviction, tree, root, num_tokens) -> freed: LeafEviction.evict under LRU, whole
   leaves, no hooks, each unlinked as RadixTree.unlink_leaf does (the caller makes sure that is
   the tree's); the tree's counts are kept here and written back before a rebuild and at the end */
static PyObject *evict_lru(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "evict_lru(eviction, tree, root, num_tokens)");
        return NULL;
    }
    PyObject *ev = args[0], *tree = args[1], *root = args[2];
    Py_ssize_t want = PyLong_AsSsize_t(args[3]), freed = 0;
    if (want == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t nodes = attr_ssize(tree, s_num_nodes);
    Py_ssize_t evictable = nodes == -1 && PyErr_Occurred() ? -1 : attr_ssize(tree, s_evictable);
    if (evictable == -1 && PyErr_Occurred()) return NULL;
    PyObject *pool = PyObject_GetAttr(tree, s_pool);
    PyObject *give_back = pool ? PyObject_GetAttr(pool, s_free) : NULL;
    Py_XDECREF(pool);
    PyObject *heap = give_back ? the_heap(ev) : NULL;
    if (!heap) { Py_XDECREF(give_back); return NULL; }
    int failed = 0;
    while (freed < want && PyList_GET_SIZE(heap) > 0) {
        PyObject *entry = PyObject_CallOneArg(heappop, heap);
        if (!entry) { failed = 1; break; }
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 4) {
            Py_DECREF(entry);
            PyErr_SetString(PyExc_TypeError, "evict_lru: a heap entry is not (key, id, offer, node)");
            failed = 1;
            break;
        }
        PyObject *node = Py_NewRef(PyTuple_GET_ITEM(entry, 3));
        int current = is_node(node) ?
            PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, 2), GET(node, OFFER), Py_EQ) : not_node();
        Py_DECREF(entry);
        int alive = current > 0 ? PyObject_IsTrue(GET(node, ALIVE)) : current;
        int kids = alive > 0 ? has_children(node) : 0;
        int locked = alive > 0 && !kids ? PyObject_IsTrue(GET(node, LOCK_REF)) : 0;
        if (current < 0 || alive < 0 || kids < 0 || locked < 0) { Py_DECREF(node); failed = 1; break; }
        if (!current || !alive || kids || locked) { Py_DECREF(node); continue; } /* stale */
        /* RadixTree.unlink_leaf */
        PyObject *parent = Py_NewRef(GET(node, PARENT)), *slots = GET(node, SLOTS);
        Py_ssize_t size = is_node(parent) && PyBytes_GET_SIZE(GET(node, KB)) >= TOKEN ?
            PyObject_Length(slots) : not_node();
        PyObject *key = size < 0 ? NULL : token_key(GET(node, KB), 0);
        int r = key ? PyObject_DelItem(GET(parent, CHILDREN), key) : -1;
        Py_XDECREF(key);
        if (r == 0) {
            put(node, ALIVE, Py_NewRef(Py_False));
            nodes -= 1;
            evictable -= size;
            PyObject *done = PyObject_CallOneArg(give_back, slots);
            Py_XDECREF(done);
            r = done ? 0 : -1;
        }
        Py_DECREF(node);
        if (r == 0) {
            freed += size;
            r = push_offer(heap, root, parent); /* a parent left childless competes now */
        }
        Py_DECREF(parent);
        if (r < 0) { failed = 1; break; }
        if (r == 1 && too_long(heap, nodes)) {
            if (set_attr_ssize(tree, s_num_nodes, nodes) ||
                set_attr_ssize(tree, s_evictable, evictable) || rebuild(ev)) { failed = 1; break; }
            Py_SETREF(heap, the_heap(ev));
            if (!heap) { failed = 1; break; }
        }
    }
    Py_XDECREF(heap);
    Py_DECREF(give_back);
    /* the tree's counts as far as the eviction went, whatever stopped it (an error kept aside) */
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    int written = set_attr_ssize(tree, s_num_nodes, nodes) == 0 &&
                  set_attr_ssize(tree, s_evictable, evictable) == 0;
    if (failed) {
        if (!written) PyErr_Clear();
        PyErr_Restore(type, value, trace);
        return NULL;
    }
    return written ? PyLong_FromSsize_t(freed) : NULL;
}

static PyMethodDef methods[] = {
    {"bind", bind, METH_VARARGS, "bind(TreeNode, NO_CHILDREN): learn the node class's slots"},
    {"match", (PyCFunction)(void (*)(void))match, METH_FASTCALL, "native.match_py"},
    {"touch", (PyCFunction)(void (*)(void))touch, METH_FASTCALL, "native.touch_py"},
    {"cut_leaf", (PyCFunction)(void (*)(void))cut_leaf, METH_FASTCALL, "native.cut_leaf_py"},
    {"offer_lru", (PyCFunction)(void (*)(void))offer_lru, METH_FASTCALL, "LeafEviction.offer, LRU"},
    {"evict_lru", (PyCFunction)(void (*)(void))evict_lru, METH_FASTCALL, "LeafEviction.evict, LRU"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_radix_core",
                                    "The replay's hot loops (testbed/cache/native.py).", -1, methods};

static PyObject *intern(const char *s) { return PyUnicode_InternFromString(s); }

PyMODINIT_FUNC PyInit__radix_core(void) {
    PyObject *heapq = PyImport_ImportModule("_heapq");
    if (!heapq) return NULL;
    heappush = PyObject_GetAttrString(heapq, "heappush");
    heappop = PyObject_GetAttrString(heapq, "heappop");
    Py_DECREF(heapq);
    zero = PyLong_FromLong(0);
    one = PyLong_FromLong(1);
    s_heap = intern("_heap");
    s_num_nodes = intern("num_nodes");
    s_evictable = intern("_evictable");
    s_pool = intern("pool");
    s_free = intern("free");
    s_rebuild = intern("_rebuild_heap");
    s_priority = intern("priority");
    s_category = intern("category");
    if (!heappush || !heappop || !zero || !one || !s_heap || !s_num_nodes || !s_evictable ||
        !s_pool || !s_free || !s_rebuild || !s_priority || !s_category)
        return NULL;
    return PyModule_Create(&module);
}
