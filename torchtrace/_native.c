/* The compiled helpers of the hot path (torchtrace._native; optional: without them torchtrace takes its Python
   body, numpy's passes and ctypes.memmove, the same values, slower).

   float_stats: the statistics of a large CPU float tensor from one pass over its values (sum, sum of squares, min,
   max, non-zero count), written straight into its stats dict (no Python arithmetic, no tuple). numpy and torch
   take one pass each (five in all, several times as long as this memory-bound one; docs/statistics.md).
   Each of LANES accumulators adds every LANES-th value, so the compiler vectorises the loop without reordering any
   sum (no -ffast-math needed). A tensor's whole blocks are added 16 values a lane in its own type, each block's
   partial sums then into double accumulators (float32 adds vectorise twice as wide, see REDUCE_BLOCKS): one float32
   accumulator over a whole tensor drifts by parts per million over values far from zero, a block's partial sum by a
   few ulps, and the std's second pass corrects the mean it centres on (see CENTERED).
   On x86-64 Linux the loops are compiled for AVX-512, AVX2 and the baseline, picked at load time (target_clones).
   NaN and Inf are not handled here: they make the sum of squares non-finite, and the caller then takes its exact
   numpy / torch passes, which count them and propagate them as torch does.

   stat_rows: the statistics of each row of a forward's small tensors of one size, staged as rows of one array, as
   a table, in one call (numpy's vectorised passes and its column arithmetic take several times as long).

   copy: a small tensor's bytes into its staging row (a fraction of what a ctypes.memmove call costs).

   traced_call: a traced module's forward inside a traced forward, recorded without a Python frame (the hooks' hot
   path; the Python body in _hooks keeps every uncommon case).

   read_later: a CUDA forward's timing events read by a native thread that never takes the GIL, while the model's
   thread runs the next forward (POSIX threads; without it they are read where the forward is resolved). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX, READONLY: a slot's member descriptor */
#include <stdint.h>
#include <float.h>
#include <limits.h>
#include <math.h>
#include <string.h>
#if !defined(_WIN32)
#include <time.h> /* clock_gettime: time.perf_counter_ns's clock (Linux); nanosleep: the event reader's pause */
#include <pthread.h>
#include <stdlib.h>
#define EVENT_READS 1 /* read_later: a native thread reads a forward's events */
#endif

#define LANES 16
#define BLOCK_LANES 32
#define BLOCK 16

#if defined(__GNUC__) && defined(__x86_64__) && defined(__linux__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* out: sum, sum of squares (both added in double), min, max, non-zero count (NaN counts as non-zero, -0.0 does
   not) */
#define REDUCE(NAME, T)                                                                                               \
    VECTOR_CLONES static void NAME(const T *x, int64_t n, double *out) {                                              \
        double sums[LANES] = {0}, squares[LANES] = {0};                                                               \
        int64_t nonzero[LANES] = {0}, i = 0;                                                                          \
        T low[LANES], high[LANES];                                                                                    \
        for (int l = 0; l < LANES; l++) low[l] = high[l] = x[0];                                                      \
        for (; i + LANES <= n; i += LANES) {                                                                          \
            for (int l = 0; l < LANES; l++) {                                                                         \
                T v = x[i + l];                                                                                       \
                double d = v;                                                                                         \
                sums[l] += d;                                                                                         \
                squares[l] += d * d;                                                                                  \
                low[l] = v < low[l] ? v : low[l];                                                                     \
                high[l] = v > high[l] ? v : high[l];                                                                  \
                nonzero[l] += v != 0;                                                                                 \
            }                                                                                                         \
        }                                                                                                             \
        double sum = 0.0, square = 0.0;                                                                               \
        int64_t count = 0;                                                                                            \
        T lo = low[0], hi = high[0];                                                                                  \
        for (int l = 0; l < LANES; l++) {                                                                             \
            sum += sums[l];                                                                                           \
            square += squares[l];                                                                                     \
            count += nonzero[l];                                                                                      \
            lo = low[l] < lo ? low[l] : lo;                                                                           \
            hi = high[l] > hi ? high[l] : hi;                                                                         \
        }                                                                                                             \
        for (; i < n; i++) {                                                                                          \
            T v = x[i];                                                                                               \
            double d = v;                                                                                             \
            sum += d;                                                                                                 \
            square += d * d;                                                                                          \
            lo = v < lo ? v : lo;                                                                                     \
            hi = v > hi ? v : hi;                                                                                     \
            count += v != 0;                                                                                          \
        }                                                                                                             \
        out[0] = sum;                                                                                                 \
        out[1] = square;                                                                                              \
        out[2] = lo;                                                                                                  \
        out[3] = hi;                                                                                                  \
        out[4] = (double)count;                                                                                       \
    }

REDUCE(reduce_float, float)
REDUCE(reduce_double, double)

/* The same five of the first whole blocks of BLOCK_LANES x BLOCK values (a large tensor's bulk; returns how many
   values that is, 0 when n is less than one block). Each lane adds BLOCK values in the tensor's own type, then the
   block's partial sums go into double accumulators: float32 adds vectorise twice as wide as double ones, and a
   partial sum of 16 values is within a few float32 ulps of exact, so the totals stay within ~1e-7 of their
   magnitude (numpy's float64 sums). A function of its own: the lanes of a block in reduce_float's frame made every
   small tensor's row 9 ns slower. */
#define REDUCE_BLOCKS(NAME, T)                                                                                        \
    VECTOR_CLONES static int64_t NAME(const T *x, int64_t n, double *out) {                                           \
        double sums[LANES] = {0}, squares[LANES] = {0};                                                               \
        int64_t nonzero[LANES] = {0}, i = 0;                                                                          \
        T low[LANES], high[LANES];                                                                                    \
        for (int l = 0; l < LANES; l++) low[l] = high[l] = x[0];                                                      \
        for (; i + BLOCK_LANES * BLOCK <= n; i += BLOCK_LANES * BLOCK) {                                              \
            T block_sums[BLOCK_LANES] = {0}, block_squares[BLOCK_LANES] = {0};                                        \
            T block_low[BLOCK_LANES], block_high[BLOCK_LANES];                                                        \
            int32_t block_nonzero[BLOCK_LANES] = {0};                                                                 \
            for (int l = 0; l < BLOCK_LANES; l++) block_low[l] = block_high[l] = x[i];                                \
            for (int b = 0; b < BLOCK; b++) {                                                                         \
                const T *values = x + i + b * BLOCK_LANES;                                                            \
                for (int l = 0; l < BLOCK_LANES; l++) {                                                               \
                    T v = values[l];                                                                                  \
                    block_sums[l] += v;                                                                               \
                    block_squares[l] += v * v;                                                                        \
                    block_low[l] = v < block_low[l] ? v : block_low[l];                                               \
                    block_high[l] = v > block_high[l] ? v : block_high[l];                                            \
                    block_nonzero[l] += v != 0;                                                                       \
                }                                                                                                     \
            }                                                                                                         \
            for (int l = 0; l < LANES; l++) { /* two block lanes a lane: explicit halves vectorise, l % LANES not */ \
                int m = l + LANES;                                                                                    \
                sums[l] += (double)block_sums[l] + (double)block_sums[m];                                             \
                squares[l] += (double)block_squares[l] + (double)block_squares[m];                                    \
                nonzero[l] += block_nonzero[l] + block_nonzero[m];                                                    \
                T lo = block_low[l] < block_low[m] ? block_low[l] : block_low[m];                                     \
                T hi = block_high[l] > block_high[m] ? block_high[l] : block_high[m];                                 \
                low[l] = lo < low[l] ? lo : low[l];                                                                   \
                high[l] = hi > high[l] ? hi : high[l];                                                                \
            }                                                                                                         \
        }                                                                                                             \
        out[0] = out[1] = out[4] = 0.0;                                                                               \
        out[2] = low[0];                                                                                              \
        out[3] = high[0];                                                                                             \
        for (int l = 0; l < LANES; l++) {                                                                             \
            out[0] += sums[l];                                                                                        \
            out[1] += squares[l];                                                                                     \
            out[4] += (double)nonzero[l];                                                                             \
            out[2] = low[l] < out[2] ? low[l] : out[2];                                                               \
            out[3] = high[l] > out[3] ? high[l] : out[3];                                                             \
        }                                                                                                             \
        return i;                                                                                                     \
    }

REDUCE_BLOCKS(reduce_float_blocks, float)
REDUCE_BLOCKS(reduce_double_blocks, double)

/* Below this magnitude float32 squares lose precision (FLT_MIN is 1.2e-38) or flush to zero, which double
   accumulation does not: a tensor of such values only (a vanishing gradient) takes the lane loop throughout. */
#define TINY_FLOAT32 1e-15

/* The n values from position `first` at address, float64 or float32: whole blocks first (a large tensor), the
   rest (all of a small tensor's row) lane by lane. */
static void reduce_values(const void *address, int64_t first, int64_t n, int is_double, double *out) {
    double blocks[5];
    int64_t done = 0;
    if (n >= BLOCK_LANES * BLOCK) {
        done = is_double ? reduce_double_blocks((const double *)address + first, n, blocks)
                         : reduce_float_blocks((const float *)address + first, n, blocks);
        if (!is_double && fabs(blocks[2]) < TINY_FLOAT32 && fabs(blocks[3]) < TINY_FLOAT32) done = 0;
        if (done == n) {
            memcpy(out, blocks, sizeof blocks);
            return;
        }
    }
    if (is_double)
        reduce_double((const double *)address + first + done, n - done, out);
    else
        reduce_float((const float *)address + first + done, n - done, out);
    if (done) {
        out[0] += blocks[0];
        out[1] += blocks[1];
        out[2] = blocks[2] < out[2] ? blocks[2] : out[2];
        out[3] = blocks[3] > out[3] ? blocks[3] : out[3];
        out[4] += blocks[4];
    }
}

/* PyLong_AsLongLong by PyLong_AsLongLongAndOverflow's digit loop: CPython 3.11-3.13 convert an int of more than one
   30-bit digit (a nanosecond time, a device address) through _PyLong_AsByteArray, several times the work. -1 with
   OverflowError past 64 bits, as PyLong_AsLongLong. */
static long long as_long_long(PyObject *value) {
    int overflow;
    long long result = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow) PyErr_SetString(PyExc_OverflowError, "Python int too large to convert to C long long");
    return result;
}

/* A call's argument count, or a TypeError naming its signature. */
static int takes(Py_ssize_t nargs, Py_ssize_t expected, const char *signature) {
    if (nargs == expected) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", signature, expected, nargs);
    return 0;
}

/* The second pass of one row: sum(x - mean) and sum((x - mean)^2) in double. The first is what the first pass's
   mean is off by (its float32 block sums round alike over values of one size): the caller corrects the mean and
   the centred sum with it (the corrected two-pass algorithm), so the std of values far from zero with a tiny
   spread is exact although the first pass's mean is not. */
#define CENTERED(NAME, T)                                                                                             \
    VECTOR_CLONES static double NAME(const T *x, int64_t n, double mean, double *offset) {                            \
        double totals[LANES] = {0}, deviations[LANES] = {0}, total = 0.0, deviation = 0.0;                            \
        int64_t i = 0;                                                                                                \
        for (; i + LANES <= n; i += LANES) {                                                                          \
            for (int l = 0; l < LANES; l++) {                                                                         \
                double d = (double)x[i + l] - mean;                                                                   \
                deviations[l] += d;                                                                                   \
                totals[l] += d * d;                                                                                   \
            }                                                                                                         \
        }                                                                                                             \
        for (int l = 0; l < LANES; l++) {                                                                             \
            deviation += deviations[l];                                                                               \
            total += totals[l];                                                                                       \
        }                                                                                                             \
        for (; i < n; i++) {                                                                                          \
            double d = (double)x[i] - mean;                                                                           \
            deviation += d;                                                                                           \
            total += d * d;                                                                                           \
        }                                                                                                             \
        *offset = deviation;                                                                                          \
        return total;                                                                                                 \
    }

CENTERED(centered_float, float)
CENTERED(centered_double, double)

/* The nine statistics (mean, std, min, max, abs_max, norm, nan_count, inf_count, zero_fraction) of n values at
   address from one pass, and, when `exact_std` is set, the std's exact second pass where the mean carries half of the
   sum of squares or more (as the numpy path does; without it the std is left 0). 0: the sum of squares is not finite
   (NaN, Inf, or past the dtype's range); 1: one pass; 2: two. */
static int nine_stats(const void *address, int64_t first, int64_t n, int is_double, int exact_std, double *values) {
    double sums[5];
    reduce_values(address, first, n, is_double, sums);
    double total = sums[0], squares = sums[1], low = sums[2], high = sums[3];
    if (!(squares <= (is_double ? DBL_MAX : FLT_MAX))) return 0;
    double mean = total / (double)n;
    double centered = squares - total * mean;
    int passes = 1;
    if (!exact_std) {
        centered = 0.0;
    } else if (!(centered >= 0.5 * squares)) {
        double offset;
        centered = is_double ? centered_double((const double *)address + first, n, mean, &offset)
                             : centered_float((const float *)address + first, n, mean, &offset);
        centered -= offset * offset / (double)n;
        mean += offset / (double)n;
        passes = 2;
    }
    values[0] = mean;
    values[1] = n > 1 ? sqrt((centered > 0.0 ? centered : 0.0) / (double)(n - 1)) : 0.0;
    values[2] = low;
    values[3] = high;
    values[4] = fabs(low) > fabs(high) ? fabs(low) : fabs(high);
    values[5] = sqrt(squares);
    values[6] = 0.0;
    values[7] = 0.0;
    values[8] = ((double)n - sums[4]) / (double)n;
    return passes;
}

/* stat_rows(address, rows, n, is_float64, columns, out, out_row) -> bool: the statistics of each of `rows`
   contiguous rows of n values at address (a forward's small tensors of one size, one row each) into rows out_row..
   of `out`, a writable C-contiguous table of doubles len(columns) wide (a numpy array: taken as a buffer, which
   costs a tenth of asking numpy for its address); `columns` (bytes) picks from mean, std, min, max, abs_max, norm,
   nan_count, inf_count, zero_fraction (0-8), in its order. The std takes the exact second pass where the mean
   carries half of the sum of squares or more, as the numpy path does. False (the table unfinished) when a row's
   sum of squares is not finite, or for float32 past float32's range: the caller's numpy passes then count NaN and
   Inf as torch does. */
static PyObject *stat_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 7, "stat_rows(address, rows, n, is_float64, columns, out, out_row)")) return NULL;
    void *address = PyLong_AsVoidPtr(args[0]);
    long long rows = PyLong_AsLongLong(args[1]);
    long long n = PyLong_AsLongLong(args[2]);
    int is_double = PyObject_IsTrue(args[3]);
    char *columns;
    Py_ssize_t width;
    if (PyBytes_AsStringAndSize(args[4], &columns, &width) < 0) return NULL;
    long long out_row = PyLong_AsLongLong(args[6]);
    if (PyErr_Occurred()) return NULL;
    if (address == NULL || rows < 0 || n < 1 || out_row < 0) {
        PyErr_SetString(PyExc_ValueError, "stat_rows needs a non-null address and at least one value a row");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < width; j++) {
        if (columns[j] < 0 || columns[j] > 8) {
            PyErr_SetString(PyExc_ValueError, "stat_rows: a column is a number from 0 to 8");
            return NULL;
        }
    }
    Py_buffer table;
    if (PyObject_GetBuffer(args[5], &table, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (table.itemsize != 8 || (out_row + rows) * width * 8 > table.len) {
        PyBuffer_Release(&table);
        PyErr_SetString(PyExc_ValueError, "stat_rows: `out` is a table of doubles with room for the rows");
        return NULL;
    }
    double *out = (double *)table.buf + out_row * width;
    int exact_std = memchr(columns, 1, (size_t)width) != NULL, finite = 1;
    for (long long row = 0; row < rows && finite; row++) {
        double values[9];
        finite = nine_stats(address, row * n, (int64_t)n, is_double, exact_std, values) != 0;
        for (Py_ssize_t j = 0; finite && j < width; j++) out[row * width + j] = values[(int)columns[j]];
    }
    PyBuffer_Release(&table);
    return PyBool_FromLong(finite);
}

/* float_stats(address, n, is_float64, columns, names, stats) -> passes: the statistics of a large contiguous CPU
   float tensor (n >= 1 values at its data_ptr()) straight into the dict `stats`: names[j] gets statistic columns[j]
   (0-8 as in stat_rows; the counts 6 and 7 as ints). 1 or 2: the passes it took over the values (the second only for
   a wanted std that needs it); 0 (`stats` untouched) where the sum of squares is not finite: the caller's numpy
   passes then count NaN and Inf as torch does. The GIL is kept: the pass is shorter than a hand-over of it can
   cost. */
static PyObject *float_stats(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 6, "float_stats(address, n, is_float64, columns, names, stats)")) return NULL;
    void *address = PyLong_AsVoidPtr(args[0]);
    long long n = PyLong_AsLongLong(args[1]);
    int is_double = PyObject_IsTrue(args[2]);
    char *columns;
    Py_ssize_t width;
    if (PyBytes_AsStringAndSize(args[3], &columns, &width) < 0) return NULL;
    PyObject *names = args[4], *stats = args[5];
    if (PyErr_Occurred()) return NULL;
    if (address == NULL || n < 1 || !PyTuple_Check(names) || PyTuple_GET_SIZE(names) != width || !PyDict_Check(stats)) {
        PyErr_SetString(PyExc_ValueError,
                        "float_stats needs a non-null address, a value, a name per column and a dict");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < width; j++) {
        if (columns[j] < 0 || columns[j] > 8) {
            PyErr_SetString(PyExc_ValueError, "float_stats: a column is a number from 0 to 8");
            return NULL;
        }
    }
    double values[9];
    int passes = nine_stats(address, 0, (int64_t)n, is_double, memchr(columns, 1, (size_t)width) != NULL, values);
    if (!passes) return PyLong_FromLong(0);
    for (Py_ssize_t j = 0; j < width; j++) {
        int column = columns[j];
        PyObject *value = column == 6 || column == 7 ? PyLong_FromLong(0) : PyFloat_FromDouble(values[column]);
        if (value == NULL) return NULL;
        int failed = PyDict_SetItem(stats, PyTuple_GET_ITEM(names, j), value);
        Py_DECREF(value);
        if (failed) return NULL;
    }
    return PyLong_FromLong(passes);
}

/* copy(destination, source, nbytes): memcpy between two addresses the caller owns (a staging row, a tensor's
   data_ptr()). */
static PyObject *copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 3, "copy(destination, source, nbytes)")) return NULL;
    void *destination = PyLong_AsVoidPtr(args[0]);
    void *source = PyLong_AsVoidPtr(args[1]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (nbytes > 0 && (destination == NULL || source == NULL)) {
        PyErr_SetString(PyExc_ValueError, "copy needs non-null addresses");
        return NULL;
    }
    if (nbytes > 0) memcpy(destination, source, (size_t)nbytes);
    Py_RETURN_NONE;
}

/* untracked(t) -> t: an exact tuple no longer tracked by the garbage collector when none of its items can be part
   of a reference cycle (each of a type the collector ignores, or a tuple it no longer tracks): what CPython does to
   such a tuple at the first young collection it survives (_PyTuple_MaybeUntrack), done when it is made. A record of
   a forward is a tuple of thousands of numbers: until that collection, every young collection visited all of them
   (each then many times longer: the cheap model of benchmarks/overhead.py with statistics has one every few dozen
   forwards). Anything else is returned as it is. */
static PyObject *untracked(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 1, "untracked(t)")) return NULL;
    PyObject *t = args[0];
    if (PyTuple_CheckExact(t) && PyObject_GC_IsTracked(t)) {
        Py_ssize_t n = PyTuple_GET_SIZE(t), i;
        for (i = 0; i < n; i++) {
            PyObject *item = PyTuple_GET_ITEM(t, i);
            /* the type's flag, not PyObject_IS_GC: a call per item, and a type object counts as one that could be */
            if (PyType_IS_GC(Py_TYPE(item)) && (!PyTuple_CheckExact(item) || PyObject_GC_IsTracked(item))) break;
        }
        if (i == n) PyObject_GC_UnTrack(t);
    }
    Py_INCREF(t);
    return t;
}

/* The names the compiled code looks up or reads, interned once at import (PyInit__native) */
#define INTERNED(X)                                                                                                   \
    X(state) X(stack) X(skip_depth) X(timer) X(forward) X(columns) X(stats) X(_is_compiling_flag) X(_lock) X(_used)  \
    X(_blocks) X(grow) X(locked) X(values_address) X(counts_address) X(data_ptr) X(_pending) X(marking) X(handle)    \
    X(pop) X(append) X(mark) X(device) X(_on_device) X(_staged) X(_recent) X(in_transform) X(_rows_for) X(in_step)   \
    X(_rows) X(wanted) X(_all_finite) X(_device_rows) X(is_inference) X(_version) X(dtype) X(shape) X(get_device)    \
    X(is_contiguous) X(stride) X(is_cpu) X(layout) X(is_neg) X(values) X(count) X(filled) X(address) X(row_bytes)   \
    X(_row) X(batch) X(queue) X(launch) X(entries) X(limits) X(bytes) X(checked) X(nan_count) X(inf_count)            \
    X(plan) X(inference_mode) X(set_extra)
#define DECLARE_STRING(name) static PyObject *str_##name;
INTERNED(DECLARE_STRING)

/* output_call_values(module_of, output_stats, extras, outputs_slot, paths, types, table, counts): the flat attribute
   values of a forward whose calls hold nothing but their outputs' statistics, in call order: per call its module's
   path and type, then for each of its summaries (its bare tensor output's stats dict from ``output_stats``, then
   the named ones of ``extras[position][outputs_slot]``: a tuple's, a dict's) the stats dict's values; where the
   dict is a row of the forward's StatTable (its last item "_row": the row's index) its values but that one, then
   the row of ``table`` (float64 values, rows x columns) in its place, as floats, or as ints in the columns that
   ``counts`` (a byte per column) marks. A call with neither (it returned no tensor) has its path and type only.
   The caller has checked that no call has other attributes (inputs, module attributes). Returns (values, runs):
   ``runs`` the calls' layouts as (count, layout) for each stretch of consecutive calls of the same layout, a layout
   being ((name or None for the bare output, stats keys), ...), from which the caller makes the attribute keys once
   per layout. None where a forward does not have that form (a summary that is no dict, still on a device, a name
   that is not a str): the caller then takes its Python path. It replaces per-call Python, dearer still at a
   forward's end, where the model's own work has left the caches cold (benchmarks/overhead.py). */
typedef struct {
    PyObject *name;  /* NULL: the bare output */
    PyObject *stats; /* held */
    Py_ssize_t row;  /* -1: a dict of values, no row */
    Py_ssize_t size; /* the dict's, as counted (a finalizer run meanwhile could change the dict) */
    Py_ssize_t keys; /* where its keys begin in the keys met while its values were copied (the row's key left out) */
} OutputSummary;

typedef struct {
    OutputSummary *items;
    Py_ssize_t count, capacity;
} OutputSummaries;

static int is_row_key(PyObject *key) {
    return key == str__row || (PyUnicode_CheckExact(key) && PyUnicode_GET_LENGTH(key) == 4 &&
                               PyUnicode_CompareWithASCIIString(key, "_row") == 0);
}

/* Appends a summary: a table row (a non-empty dict holding "_row": an int index into the table; the copy of its
   values checks that it is the last key) or a dict of values (a large tensor's, summarised in the hook; not one still
   on a device: "_pending"): 1; 0 if it is neither; -1 on an error. Looked up by key: a walk through the dict to its
   last key cost several times as much. */
static int add_summary(OutputSummaries *summaries, PyObject *name, PyObject *stats, Py_ssize_t rows_in_table) {
    if (!PyDict_Check(stats) || PyDict_GET_SIZE(stats) == 0) return 0;
    Py_ssize_t row = -1;
    PyObject *found = PyDict_GetItemWithError(stats, str__row); /* borrowed */
    if (found != NULL) {
        row = PyLong_CheckExact(found) ? PyLong_AsSsize_t(found) : -1;
        if (row < 0 || row >= rows_in_table) {
            PyErr_Clear();
            return 0;
        }
    } else if (PyErr_Occurred() || PyDict_GetItemWithError(stats, str__pending) != NULL || PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (summaries->count == summaries->capacity) {
        Py_ssize_t capacity = summaries->capacity * 2 + 16;
        OutputSummary *items = PyMem_Realloc(summaries->items, sizeof(OutputSummary) * (size_t)capacity);
        if (items == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        summaries->items = items;
        summaries->capacity = capacity;
    }
    /* held: a collection while the values are made may run finalizers */
    summaries->items[summaries->count++] = (OutputSummary){Py_XNewRef(name), Py_NewRef(stats), row,
                                                        PyDict_GET_SIZE(stats), 0};
    return 1;
}

/* Whether two calls' summaries (``count`` each) have the same names and the same stats keys (``keys``: those met
   while their values were copied, in order; a row's "_row" is the last key of its dict): 1, 0, or -1. */
static int same_layout(const OutputSummary *a, const OutputSummary *b, Py_ssize_t count, PyObject *const *keys) {
    for (Py_ssize_t k = 0; k < count; k++) {
        if ((a[k].name == NULL) != (b[k].name == NULL) || (a[k].row < 0) != (b[k].row < 0) || a[k].size != b[k].size)
            return 0;
        for (Py_ssize_t i = 0, copied = a[k].size - (a[k].row >= 0); i < copied; i++)
            if (keys[a[k].keys + i] != keys[b[k].keys + i]) return 0;
        if (a[k].name != NULL && a[k].name != b[k].name) {
            int equal = PyObject_RichCompareBool(a[k].name, b[k].name, Py_EQ);
            if (equal <= 0) return equal;
        }
    }
    return 1;
}

static int add_run(PyObject *runs, Py_ssize_t count, const OutputSummary *summaries, Py_ssize_t n_summaries) {
    PyObject *layout = PyTuple_New(n_summaries);
    if (layout == NULL) return -1;
    for (Py_ssize_t k = 0; k < n_summaries; k++) {
        PyObject *keys = PyDict_Keys(summaries[k].stats);
        PyObject *key_tuple = keys != NULL ? PyList_AsTuple(keys) : NULL;
        Py_XDECREF(keys);
        /* "O": the name borrowed (None for the bare output), "N": the keys tuple taken */
        PyObject *entry = key_tuple != NULL ? Py_BuildValue("(ON)", summaries[k].name != NULL ? summaries[k].name
                                                                                               : Py_None, key_tuple)
                                            : NULL;
        if (entry == NULL) {
            Py_DECREF(layout);
            return -1;
        }
        PyTuple_SET_ITEM(layout, k, entry);
    }
    PyObject *run = Py_BuildValue("(nN)", count, layout);
    if (run == NULL) return -1;
    int failed = PyList_Append(runs, run);
    Py_DECREF(run);
    return failed;
}

static PyObject *output_call_values(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 8, "output_call_values(module_of, output_stats, extras, outputs_slot, paths, types, table, counts)"))
        return NULL;
    PyObject *module_of = args[0], *all_stats = args[1], *all_extras = args[2], *paths = args[4], *types = args[5];
    Py_ssize_t outputs_slot = PyLong_Check(args[3]) ? PyLong_AsSsize_t(args[3]) : -1;
    if (outputs_slot < 0 || !PyList_Check(module_of) || !PyDict_Check(all_stats) || !PyDict_Check(all_extras) ||
        !PyList_Check(paths) || !PyList_Check(types) || !PyBytes_Check(args[7])) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    Py_buffer table;
    if (PyObject_GetBuffer(args[6], &table, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) { /* not a plain array */
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (table.ndim != 2 || table.itemsize != 8 || table.format == NULL || strcmp(table.format, "d") != 0 ||
        PyBytes_GET_SIZE(args[7]) != table.shape[1]) {
        PyBuffer_Release(&table);
        Py_RETURN_NONE;
    }
    const double *cells = table.buf;
    const char *counts = PyBytes_AS_STRING(args[7]);
    Py_ssize_t width = table.shape[1], rows_in_table = table.shape[0];
    Py_ssize_t n = PyList_GET_SIZE(module_of), n_modules = PyList_GET_SIZE(paths), total = 0;
    OutputSummaries summaries = {NULL, 0, 0};
    Py_ssize_t *first_of = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)(n + 1)); /* call -> its first summary */
    PyObject *values = NULL, *runs = NULL, *result = NULL, **keys = NULL;
    if (first_of == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyList_GET_SIZE(types) != n_modules) goto not_rows;
    for (Py_ssize_t position = 0; position < n; position++) { /* the sizes, and the form checked */
        PyObject *index = PyList_GET_ITEM(module_of, position);
        Py_ssize_t module_index = PyLong_Check(index) ? PyLong_AsSsize_t(index) : -1;
        if (module_index < 0 || module_index >= n_modules) goto not_rows;
        first_of[position] = summaries.count;
        PyObject *key = PyLong_FromSsize_t(position);
        if (key == NULL) goto done;
        PyObject *stats = PyDict_GetItemWithError(all_stats, key); /* borrowed */
        PyObject *extras = stats != NULL || !PyErr_Occurred() ? PyDict_GetItemWithError(all_extras, key) : NULL;
        Py_DECREF(key);
        if (PyErr_Occurred()) goto done;
        if (stats != NULL) {
            int added = add_summary(&summaries, NULL, stats, rows_in_table);
            if (added < 0) goto done;
            if (!added) goto not_rows;
        }
        PyObject *outputs = NULL;
        if (extras != NULL) {
            if (!PyList_Check(extras) || PyList_GET_SIZE(extras) <= outputs_slot) goto not_rows;
            outputs = PyList_GET_ITEM(extras, outputs_slot);
        }
        if (outputs != NULL && outputs != Py_None) {
            if (!PyDict_Check(outputs)) goto not_rows;
            Py_ssize_t i = 0;
            PyObject *name, *named_stats;
            while (PyDict_Next(outputs, &i, &name, &named_stats)) {
                if (!PyUnicode_CheckExact(name)) goto not_rows; /* a marker (truncated, a feature's error) */
                int added = add_summary(&summaries, name, named_stats, rows_in_table);
                if (added < 0) goto done;
                if (!added) goto not_rows;
            }
        }
        total += 2;
        for (Py_ssize_t k = first_of[position]; k < summaries.count; k++)
            total += summaries.items[k].row >= 0 ? summaries.items[k].size - 1 + width : summaries.items[k].size;
    }
    first_of[n] = summaries.count;
    values = PyTuple_New(total);
    runs = PyList_New(0);
    keys = PyMem_Malloc(sizeof(PyObject *) * (size_t)(total ? total : 1)); /* borrowed: their dicts are held */
    if (values == NULL || runs == NULL) goto done;
    if (keys == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t keys_met = 0;
    Py_ssize_t at = 0, run = 0;
    for (Py_ssize_t position = 0; position < n; position++) {
        Py_ssize_t module_index = PyLong_AsSsize_t(PyList_GET_ITEM(module_of, position));
        PyTuple_SET_ITEM(values, at++, Py_NewRef(PyList_GET_ITEM(paths, module_index)));
        PyTuple_SET_ITEM(values, at++, Py_NewRef(PyList_GET_ITEM(types, module_index)));
        Py_ssize_t first = first_of[position], count = first_of[position + 1] - first;
        for (Py_ssize_t k = first; k < first + count; k++) {
            PyObject *stats = summaries.items[k].stats, *key, *value;
            Py_ssize_t i = 0, row = summaries.items[k].row, left = summaries.items[k].size - (row >= 0);
            summaries.items[k].keys = keys_met;
            while (left > 0 && PyDict_Next(stats, &i, &key, &value)) {
                if (row >= 0 && is_row_key(key)) goto not_rows; /* "_row" anywhere but last is no form of ours */
                keys[keys_met++] = key;
                PyTuple_SET_ITEM(values, at++, Py_NewRef(value));
                left--;
            }
            if (left || PyDict_GET_SIZE(stats) != summaries.items[k].size) goto not_rows; /* changed meanwhile */
            for (Py_ssize_t j = 0, cell_at = row * width; row >= 0 && j < width; j++) {
                double cell_value = cells[cell_at + j];
                PyObject *cell = counts[j] ? PyLong_FromDouble(cell_value) : PyFloat_FromDouble(cell_value);
                if (cell == NULL) goto done;
                PyTuple_SET_ITEM(values, at++, cell);
            }
        }
        if (position) {
            Py_ssize_t previous = first_of[position - 1], previous_count = first - previous;
            int same = previous_count == count
                           ? same_layout(summaries.items + previous, summaries.items + first, count, keys)
                           : 0;
            if (same < 0) goto done;
            if (!same) {
                if (add_run(runs, run, summaries.items + previous, previous_count) < 0) goto done;
                run = 0;
            }
        }
        run++;
    }
    if (n && add_run(runs, run, summaries.items + first_of[n - 1], first_of[n] - first_of[n - 1]) < 0) goto done;
    result = Py_BuildValue("(NN)", values, PyList_AsTuple(runs));
    values = NULL;
    goto done;
not_rows:
    PyErr_Clear();
    result = Py_NewRef(Py_None);
done:
    Py_XDECREF(values);
    Py_XDECREF(runs);
    for (Py_ssize_t k = 0; k < summaries.count; k++) {
        Py_XDECREF(summaries.items[k].name);
        Py_DECREF(summaries.items[k].stats);
    }
    PyMem_Free(summaries.items);
    PyMem_Free(first_of);
    PyMem_Free(keys);
    PyBuffer_Release(&table);
    return result;
}

/* put_values(buf, base, offsets, values, positions, shapes): the OTLP encoder's slot writes for a forward encoded
   as one block. values[positions[k]] goes to buf[base + offsets[k]]: a float as a little-endian double (fixed64),
   or, with ``shapes``, a shape (a tuple of ints) as one 5-byte varint per dimension at consecutive offsets. Each
   value's type is checked as it is written: False where one does not fit (a float slot given something else, a
   dimension out of 0..2**35, a shape that is not a non-empty tuple of ints, more or fewer dimensions than slots,
   a slot past the buffer); the caller then encodes the batch span by span and drops ``buf``. Replaces, per
   forward, an itemgetter tuple, a type check over it, numpy's fromiter and a fancy-indexed write. */
static int put_doubles(unsigned char *out, Py_ssize_t size, const int64_t *at, Py_ssize_t slots, PyObject *values,
                       const int64_t *position, Py_ssize_t n) {
    if (slots != n) return 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        if (position[k] < 0 || position[k] >= PyTuple_GET_SIZE(values) || at[k] < 0 || at[k] + 8 > size) return 0;
        PyObject *value = PyTuple_GET_ITEM(values, position[k]);
        if (!PyFloat_CheckExact(value)) return 0;
        double d = PyFloat_AS_DOUBLE(value);
        unsigned char bytes[8];
        memcpy(bytes, &d, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        for (int b = 0; b < 4; b++) {
            unsigned char t = bytes[b];
            bytes[b] = bytes[7 - b];
            bytes[7 - b] = t;
        }
#endif
        memcpy(out + at[k], bytes, 8);
    }
    return 1;
}

static int put_dims(unsigned char *out, Py_ssize_t size, const int64_t *at, Py_ssize_t slots, PyObject *values,
                    const int64_t *position, Py_ssize_t n) {
    Py_ssize_t slot = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *shape = position[k] >= 0 && position[k] < PyTuple_GET_SIZE(values)
                              ? PyTuple_GET_ITEM(values, position[k])
                              : NULL;
        if (shape == NULL || !PyTuple_CheckExact(shape) || PyTuple_GET_SIZE(shape) == 0 ||
            slot + PyTuple_GET_SIZE(shape) > slots)
            return 0;
        for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape); d++, slot++) {
            PyObject *dim = PyTuple_GET_ITEM(shape, d);
            int overflow = 0;
            long long v = PyLong_CheckExact(dim) ? PyLong_AsLongLongAndOverflow(dim, &overflow) : -1;
            if (overflow || v < 0 || v >= (1LL << 35) || at[slot] < 0 || at[slot] + 5 > size) return 0;
            unsigned char *p = out + at[slot];
            for (int b = 0; b < 4; b++) p[b] = (unsigned char)(((v >> (7 * b)) & 0x7F) | 0x80);
            p[4] = (unsigned char)((v >> 28) & 0x7F);
        }
    }
    return slot == slots;
}

/* The buffers of a slot writer: sources[0] (the encoded bytes) writable, the others read as typed arrays. -1 (an
   exception set, none held) where one is not a buffer. */
static int get_views(PyObject *const *sources, int count, Py_buffer *views) {
    for (int i = 0; i < count; i++) {
        if (PyObject_GetBuffer(sources[i], &views[i], i ? PyBUF_FORMAT : PyBUF_WRITABLE) < 0) {
            while (i--) PyBuffer_Release(&views[i]);
            return -1;
        }
    }
    return 0;
}

static void release_views(Py_buffer *views, int count) {
    for (int i = 0; i < count; i++) PyBuffer_Release(&views[i]);
}

static PyObject *put_values(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 6, "put_values(buf, base, offsets, values, positions, shapes)")) return NULL;
    Py_ssize_t base = PyLong_AsSsize_t(args[1]);
    int shapes = PyObject_IsTrue(args[5]);
    if ((base == -1 && PyErr_Occurred()) || shapes < 0) return NULL;
    if (!PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "put_values: values is a tuple");
        return NULL;
    }
    Py_buffer views[3];
    PyObject *sources[3] = {args[0], args[2], args[4]}, *result = NULL;
    if (get_views(sources, 3, views) < 0) return NULL;
    if (views[1].itemsize != 8 || views[2].itemsize != 8)
        PyErr_SetString(PyExc_TypeError, "put_values: offsets and positions are int64 arrays");
    else {
        unsigned char *out = (unsigned char *)views[0].buf + (base > 0 ? base : 0);
        Py_ssize_t size = base >= 0 ? views[0].len - base : -1;
        int fits = size >= 0 && (shapes ? put_dims : put_doubles)(out, size, views[1].buf, views[1].len / 8, args[3],
                                                                   views[2].buf, views[2].len / 8);
        result = Py_NewRef(fits ? Py_True : Py_False);
    }
    release_views(views, 3);
    return result;
}

/* put_span_fields(buf, base, trace_id, tid_at, sid_at, pid_at, has_pid, start_at, span_ids, parents, root_parent,
   starts, ends): a whole forward encoded as one block gets its fixed-width span fields, call by call: the trace id
   (16 bytes, the same for every call), its span id and its parent's (8 bytes big-endian; the parent's only where
   the call's template has the field: ``pid_at`` lists those slots in call order, ``has_pid`` says which calls),
   start and end times (8 bytes little-endian each, the end 9 bytes after the start). ``span_ids`` (unsigned),
   ``starts`` and ``ends`` (signed) are the forward's 64-bit columns (``array.array`` of "Q" / "q"), ``parents`` a
   list of positions (-1 for the root, whose parent is ``root_parent``). False where a column does not fit
   (lengths, item sizes, a slot past the buffer): the caller then writes them with numpy. Replaces ~4 numpy
   conversions and 5 fancy-indexed writes per batch. */
static void put_raw64(unsigned char *out, Py_ssize_t at, uint64_t v, int big_endian) {
    for (int b = 0; b < 8; b++) out[at + (big_endian ? 7 - b : b)] = (unsigned char)(v >> (8 * b));
}

static PyObject *put_span_fields(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 13, "put_span_fields(buf, base, trace_id, tid_at, sid_at, pid_at, has_pid, start_at, "
                          "span_ids, parents, root_parent, starts, ends)"))
        return NULL;
    Py_ssize_t base = PyLong_AsSsize_t(args[1]);
    if (base == -1 && PyErr_Occurred()) return NULL;
    PyObject *parents = args[9];
    unsigned long long root_parent = PyLong_AsUnsignedLongLong(args[10]);
    if (root_parent == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (!PyBytes_Check(args[2]) || PyBytes_GET_SIZE(args[2]) != 16 || !PyList_Check(parents)) {
        PyErr_SetString(PyExc_TypeError, "put_span_fields: a 16-byte trace id and a list of parents");
        return NULL;
    }
    Py_buffer views[9];
    PyObject *sources[9] = {args[0], args[3], args[4], args[5], args[6], args[7], args[8], args[11], args[12]};
    if (get_views(sources, 9, views) < 0) {
        PyErr_Clear();  /* a column that is not a buffer (a list): the numpy writer */
        Py_RETURN_FALSE;
    }
    const int64_t *tid_at = views[1].buf, *sid_at = views[2].buf, *pid_at = views[3].buf, *start_at = views[5].buf;
    const uint64_t *ids = views[6].buf, *starts = views[7].buf, *ends = views[8].buf;
    const unsigned char *has_pid = views[4].buf, *trace_id = (const unsigned char *)PyBytes_AS_STRING(args[2]);
    unsigned char *out = (unsigned char *)views[0].buf + base;
    Py_ssize_t size = views[0].len - base, n = PyList_GET_SIZE(parents), pids = views[3].len / 8, pid = 0;
    int fits = base >= 0 && views[4].itemsize == 1 && views[4].len == n;
    for (int v = 1; v < 9 && fits; v++)
        if (v != 4) fits = views[v].itemsize == 8 && (v == 3 || views[v].len / 8 == n);
    for (Py_ssize_t i = 0; i < n && fits; i++) {
        if (tid_at[i] < 0 || tid_at[i] + 16 > size || sid_at[i] < 0 || sid_at[i] + 8 > size || start_at[i] < 0 ||
            start_at[i] + 17 > size) {
            fits = 0;
            break;
        }
        memcpy(out + tid_at[i], trace_id, 16);
        put_raw64(out, sid_at[i], ids[i], 1);
        put_raw64(out, start_at[i], starts[i], 0);
        put_raw64(out, start_at[i] + 9, ends[i], 0);
        if (has_pid[i]) {
            PyObject *parent = PyList_GET_ITEM(parents, i);
            Py_ssize_t position = PyLong_Check(parent) ? PyLong_AsSsize_t(parent) : -2;
            fits = pid < pids && position >= -1 && position < n && pid_at[pid] >= 0 && pid_at[pid] + 8 <= size;
            if (fits) put_raw64(out, pid_at[pid++], position == -1 ? root_parent : ids[position], 1);
        }
    }
    if (PyErr_Occurred()) PyErr_Clear();
    release_views(views, 9);
    return Py_NewRef(fits && pid == pids ? Py_True : Py_False);
}

/* same_values(values, positions, expected, lengths): whether a forward's flat attribute values match an encoded
   block's (``_StatsBlock.match``): values[positions[k]] equal to expected[k] and of the same type (True, 1 and 1.0
   are equal in Python, not on the wire), or, with ``lengths``, a tuple or list of length expected[k] (a shape of the
   block's rank). The same object passes at once: forward after forward a model's paths, dtypes and shapes are the
   same objects. Replaces an itemgetter tuple, a type tuple and two comparisons per forward. */
static PyObject *same_values(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 4, "same_values(values, positions, expected, lengths)")) return NULL;
    PyObject *values = args[0], *expected = args[2];
    int lengths = PyObject_IsTrue(args[3]);
    if (lengths < 0) return NULL;
    Py_buffer positions;
    if (!PyTuple_Check(values) || !PyTuple_Check(expected)) {
        PyErr_SetString(PyExc_TypeError, "same_values: values and expected are tuples");
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &positions, PyBUF_FORMAT) < 0) return NULL;
    const int64_t *at = positions.buf;
    Py_ssize_t n = positions.len / 8, n_values = PyTuple_GET_SIZE(values);
    int same = positions.itemsize == 8 && n == PyTuple_GET_SIZE(expected);
    for (Py_ssize_t k = 0; k < n && same > 0; k++) {
        PyObject *value = at[k] >= 0 && at[k] < n_values ? PyTuple_GET_ITEM(values, at[k]) : NULL;
        PyObject *wanted = PyTuple_GET_ITEM(expected, k);
        if (value == NULL) {
            same = 0;
        } else if (lengths) {
            Py_ssize_t length = PyTuple_Check(value) || PyList_Check(value) ? Py_SIZE(value) : -1;
            same = length >= 0 && length == PyLong_AsSsize_t(wanted);
        } else if (value != wanted) {
            same = Py_TYPE(value) == Py_TYPE(wanted) ? PyObject_RichCompareBool(value, wanted, Py_EQ) : 0;
        }
    }
    PyBuffer_Release(&positions);
    if (same < 0 || PyErr_Occurred()) return NULL;
    return Py_NewRef(same ? Py_True : Py_False);
}

/* call_columns(starts, ends, parents, offset): a forward's epoch start and end times (perf_counter ns + offset; a
   call still open ends at its start) as native int64 bytes (``array("q", ...)`` makes them the batch's columns: no
   Python int per call), each call's depth (its parent's + 1) as a list, and each call's duration (end - start) as
   native int64 bytes, what the per-layer summary adds up. Replaces three Python loops of ``resolve_forward`` (a
   large part of its cost: benchmarks/overhead.py). None where a column is not a list of ints of the forward's
   length, or a parent does not come before its child: the caller's Python then makes them. */
static PyObject *call_columns(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 4, "call_columns(starts, ends, parents, offset)")) return NULL;
    PyObject *starts = args[0], *ends = args[1], *parents = args[2];
    long long offset = PyLong_AsLongLong(args[3]);
    if (offset == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_Check(starts) || !PyList_Check(ends) || !PyList_Check(parents)) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(starts);
    if (PyList_GET_SIZE(ends) != n || PyList_GET_SIZE(parents) != n) Py_RETURN_NONE;
    Py_ssize_t nbytes = n * (Py_ssize_t)sizeof(int64_t);
    PyObject *start_ns = PyBytes_FromStringAndSize(NULL, nbytes), *end_ns = PyBytes_FromStringAndSize(NULL, nbytes);
    PyObject *durations = PyBytes_FromStringAndSize(NULL, nbytes), *depth = PyList_New(n), *result = NULL;
    long *depths = PyMem_Malloc(sizeof(long) * (size_t)(n ? n : 1));
    if (start_ns == NULL || end_ns == NULL || depth == NULL || durations == NULL || depths == NULL) goto done;
    int64_t *duration = (int64_t *)PyBytes_AS_STRING(durations);
    int64_t *start_at = (int64_t *)PyBytes_AS_STRING(start_ns), *end_at = (int64_t *)PyBytes_AS_STRING(end_ns);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *start = PyList_GET_ITEM(starts, i), *end = PyList_GET_ITEM(ends, i);
        PyObject *parent = PyList_GET_ITEM(parents, i);
        int overflow = 0;
        long long s = PyLong_Check(start) ? PyLong_AsLongLongAndOverflow(start, &overflow) : 0;
        long long e = end == Py_None ? s : PyLong_Check(end) ? PyLong_AsLongLongAndOverflow(end, &overflow) : 0;
        long p = PyLong_Check(parent) ? PyLong_AsLong(parent) : -2;
        long long low = s < e ? s : e, high = s < e ? e : s;
        if (!PyLong_Check(start) || (end != Py_None && !PyLong_Check(end)) || overflow || p < -1 || p >= i ||
            PyErr_Occurred() || (offset > 0 && high > LLONG_MAX - offset) || (offset < 0 && low < LLONG_MIN - offset)) {
            PyErr_Clear();
            result = Py_NewRef(Py_None);
            goto done;
        }
        depths[i] = p < 0 ? 0 : depths[p] + 1;
        duration[i] = (int64_t)(e - s);
        start_at[i] = (int64_t)(s + offset);
        end_at[i] = (int64_t)(e + offset);
        PyObject *d = PyLong_FromLong(depths[i]);
        if (d == NULL) goto done;
        PyList_SET_ITEM(depth, i, d);
    }
    result = PyTuple_Pack(4, start_ns, end_ns, depth, durations);
done:
    Py_XDECREF(durations);
    Py_XDECREF(start_ns);
    Py_XDECREF(end_ns);
    Py_XDECREF(depth);
    PyMem_Free(depths);
    return result;
}

/* driver_call(function, a, b) -> int / elapsed_ms(function, start, end) -> (int, float): a CUDA driver entry point
   (its address: cuEventRecord(event, stream), cuEventElapsedTime(&ms, start, end)) called with the GIL held, as
   ctypes.PyDLL does, without ctypes' argument conversion (~1-2 us a call on an H100 host; two marks a traced call
   on the model's thread, two elapsed times a call on the worker). Returns the driver's result code. */
typedef int (*two_pointers)(void *, void *);
typedef int (*elapsed_function)(float *, void *, void *);

/* (function, pointer, pointer) as addresses (None: NULL); -1 (an exception set) for a bad argument or no function */
static int entry_point_arguments(PyObject *const *args, Py_ssize_t nargs, const char *signature, void *out[3]) {
    if (!takes(nargs, 3, signature)) return -1;
    for (int i = 0; i < 3; i++) out[i] = args[i] == Py_None ? NULL : PyLong_AsVoidPtr(args[i]);
    if (PyErr_Occurred()) return -1;
    if (out[0] == NULL) {
        PyErr_Format(PyExc_ValueError, "%s: no function", signature);
        return -1;
    }
    return 0;
}

static PyObject *driver_call(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    void *at[3];
    if (entry_point_arguments(args, nargs, "driver_call(function, a, b)", at) < 0) return NULL;
    return PyLong_FromLong(((two_pointers)at[0])(at[1], at[2]));
}

static PyObject *elapsed_ms(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    void *at[3];
    if (entry_point_arguments(args, nargs, "elapsed_ms(function, start, end)", at) < 0) return NULL;
    float milliseconds = 0.0f;
    int result = ((elapsed_function)at[0])(&milliseconds, at[1], at[2]);
    return Py_BuildValue("(id)", result, (double)milliseconds);
}

/* launch_kernel(launch, function, programs, threads, shared, stream, sizes, *params) -> int: cuLaunchKernel (its
   address) of a one-dimensional grid, the GIL held. Triton's launcher takes a Python wrapper, a data_ptr() call and
   a pointer check per tensor argument, and lets the GIL go around the launch: with the dispatch worker busy, every
   launch then hands the GIL to it and waits to get it back. ``sizes`` gives each parameter's width in bytes (4 or
   8; the kernel's own, read once from the driver); parameters past those given are zero (NULL scratch pointers).
   Returns the driver's result code. */
#define MAX_KERNEL_PARAMS 48
typedef int (*launch_function)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                               void **, void **);

/* cuLaunchKernel (``launch``) of ``function`` on a grid of ``gx`` x ``gy`` programs of ``threads``, with ``count``
   (at most MAX_KERNEL_PARAMS) parameters of the widths ``sizes`` (4: int32, else 8: 64 bits; the callers check)
   holding ``values`` (``n_values`` of them; those past them zero: NULL scratch pointers). Returns the driver's
   result code. */
static int launch_values(void *launch, void *function, unsigned long gx, unsigned long gy, unsigned long threads,
                         unsigned long shared, void *stream, const unsigned char *sizes, Py_ssize_t count,
                         const int64_t *values, Py_ssize_t n_values) {
    int64_t wide[MAX_KERNEL_PARAMS];
    int32_t narrow[MAX_KERNEL_PARAMS];
    void *params[MAX_KERNEL_PARAMS];
    for (Py_ssize_t i = 0; i < count; i++) {
        int64_t value = i < n_values ? values[i] : 0;
        if (sizes[i] == 4) {
            narrow[i] = (int32_t)value;
            params[i] = &narrow[i];
        } else {
            wide[i] = value;
            params[i] = &wide[i];
        }
    }
    return ((launch_function)launch)(function, (unsigned)gx, (unsigned)gy, 1, (unsigned)threads, 1, 1,
                                     (unsigned)shared, stream, params, NULL);
}

static PyObject *launch_kernel(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    const char *signature = "launch_kernel(launch, function, programs, threads, shared, stream, sizes, *params)";
    if (nargs < 7) {
        PyErr_Format(PyExc_TypeError, "%s: takes at least 7 arguments", signature);
        return NULL;
    }
    if (!PyBytes_Check(args[6])) {
        PyErr_Format(PyExc_TypeError, "%s: sizes must be bytes", signature);
        return NULL;
    }
    Py_ssize_t count = PyBytes_GET_SIZE(args[6]), given = nargs - 7;
    const unsigned char *sizes = (const unsigned char *)PyBytes_AS_STRING(args[6]);
    if (count > MAX_KERNEL_PARAMS || given > count) {
        PyErr_Format(PyExc_ValueError, "%s: %zd parameters for %zd sizes (at most %d)", signature, given, count,
                     MAX_KERNEL_PARAMS);
        return NULL;
    }
    void *launch = PyLong_AsVoidPtr(args[0]);
    void *function = PyLong_AsVoidPtr(args[1]);
    unsigned long programs = PyLong_AsUnsignedLong(args[2]);
    unsigned long threads = PyLong_AsUnsignedLong(args[3]);
    unsigned long shared = PyLong_AsUnsignedLong(args[4]);
    void *stream = args[5] == Py_None ? NULL : PyLong_AsVoidPtr(args[5]);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (sizes[i] != 4 && sizes[i] != 8) {
            PyErr_Format(PyExc_ValueError, "%s: a parameter of %d bytes", signature, (int)sizes[i]);
            return NULL;
        }
    }
    int64_t values[MAX_KERNEL_PARAMS];
    for (Py_ssize_t i = 0; i < given; i++) values[i] = as_long_long(args[i + 7]);
    if (PyErr_Occurred()) return NULL;
    if (launch == NULL || function == NULL || programs == 0 || threads == 0) {
        PyErr_Format(PyExc_ValueError, "%s: no function, or an empty grid", signature);
        return NULL;
    }
    return PyLong_FromLong(
        launch_values(launch, function, programs, 1, threads, shared, stream, sizes, count, values, given));
}

/* Launches ``native`` (a DirectLaunch: launch, function, threads, shared, sizes) on a grid of ``gx`` x ``gy``
   programs with ``values`` as its first parameters, whose widths must be ``expected`` (4: int32, 8: 64 bits), then
   NULL scratch pointers (8 bytes, at most two). Returns the driver's result code, or -1 with an exception set for a
   DirectLaunch it cannot read (``caller`` names the caller). */
static int launch_direct(PyObject *native, const char *caller, unsigned long gx, unsigned long gy, void *stream,
                         const int64_t *values, const unsigned char *expected, Py_ssize_t n_expected) {
    if (!PyTuple_Check(native) || PyTuple_GET_SIZE(native) != 5 || !PyBytes_Check(PyTuple_GET_ITEM(native, 4))) {
        PyErr_Format(PyExc_TypeError, "%s: a DirectLaunch is (launch, function, threads, shared, sizes)", caller);
        return -1;
    }
    void *launch = PyLong_AsVoidPtr(PyTuple_GET_ITEM(native, 0));
    void *function = PyLong_AsVoidPtr(PyTuple_GET_ITEM(native, 1));
    unsigned long threads = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(native, 2));
    unsigned long shared = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(native, 3));
    PyObject *widths = PyTuple_GET_ITEM(native, 4);
    Py_ssize_t count = PyBytes_GET_SIZE(widths);
    const unsigned char *sizes = (const unsigned char *)PyBytes_AS_STRING(widths);
    if (PyErr_Occurred()) return -1;
    int matches = launch != NULL && function != NULL && count >= n_expected && count <= n_expected + 2 &&
                  count <= MAX_KERNEL_PARAMS && memcmp(sizes, expected, (size_t)n_expected) == 0;
    for (Py_ssize_t i = n_expected; i < count && matches; i++) matches = sizes[i] == 8; /* scratch pointers */
    if (!matches) {
        PyErr_Format(PyExc_ValueError, "%s: no function, or not the kernel's parameters or their widths", caller);
        return -1;
    }
    return launch_values(launch, function, gx, gy, threads, shared, stream, sizes, count, values, n_expected);
}

/* The statistics kernel's parameters: x, values, counts (pointers); n, stride (int32) */
static const unsigned char row_widths[] = {8, 8, 8, 4, 4};

/* A launch of the statistics kernel (``native``: its DirectLaunch) into one row, as launch_kernel's. */
static int launch_row(PyObject *native, unsigned long programs, void *stream, void *x, void *values, void *counts,
                      int32_t n, int32_t stride) {
    int64_t row[5] = {(int64_t)(intptr_t)x, (int64_t)(intptr_t)values, (int64_t)(intptr_t)counts, n, stride};
    return launch_direct(native, "launch_taken", programs, 1, stream, row, row_widths, 5);
}

/* The batch kernel's parameters, BATCH_ENTRIES times: x, values, counts (int64 addresses); n, programs (int32) */
#define BATCH_ENTRIES 8
#define ENTRY_PARAMS 5
#define ENTRY_WIDTHS 8, 8, 8, 4, 4
static const unsigned char batch_widths[ENTRY_PARAMS * BATCH_ENTRIES] = {
    ENTRY_WIDTHS, ENTRY_WIDTHS, ENTRY_WIDTHS, ENTRY_WIDTHS, ENTRY_WIDTHS, ENTRY_WIDTHS, ENTRY_WIDTHS, ENTRY_WIDTHS};

/* launch_batch(native, programs, count, stream, arguments) -> the driver's result code: the batch kernel
   (triton_stats._batch_kernel; ``native``: its DirectLaunch) on a grid of programs x count, with ``arguments``
   (a list of BATCH_ENTRIES x (x, values, counts, n, programs) ints) as its parameters. */
static PyObject *launch_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    const char *signature = "launch_batch(native, programs, count, stream, arguments)";
    if (!takes(nargs, 5, signature)) return NULL;
    if (!PyList_CheckExact(args[4]) || PyList_GET_SIZE(args[4]) != ENTRY_PARAMS * BATCH_ENTRIES) {
        PyErr_Format(PyExc_TypeError, "%s: arguments is a list of %d ints", signature, ENTRY_PARAMS * BATCH_ENTRIES);
        return NULL;
    }
    int64_t values[ENTRY_PARAMS * BATCH_ENTRIES];
    for (Py_ssize_t i = 0; i < ENTRY_PARAMS * BATCH_ENTRIES; i++)
        values[i] = as_long_long(PyList_GET_ITEM(args[4], i));
    unsigned long programs = PyLong_AsUnsignedLong(args[1]), count = PyLong_AsUnsignedLong(args[2]);
    void *stream = args[3] == Py_None ? NULL : PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (programs == 0 || count == 0 || count > BATCH_ENTRIES) {
        PyErr_Format(PyExc_ValueError, "%s: an empty grid, or more than %d tensors", signature, BATCH_ENTRIES);
        return NULL;
    }
    int result = launch_direct(args[0], "launch_batch", programs, count, stream, values, batch_widths,
                               ENTRY_PARAMS * BATCH_ENTRIES);
    return result < 0 ? NULL : PyLong_FromLong(result);
}

/* run_uncompiled(set_eval_frame, function, *args, **kwargs): function(*args, **kwargs) with torch.compile's frame
   callback off (``torch._C._dynamo.eval_frame.set_eval_frame``), restored after. The model's own hooks are called
   through it: dynamo cannot trace a compiled function, so it breaks the graph around the call and runs it eagerly,
   and no frame of the hook is compiled then (what torch.compiler.disable does, without importing torch._dynamo,
   ~1-2.6 s, into a process that never compiles). */
static PyObject *run_uncompiled(PyObject *module, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    (void)module;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 2) {
        PyErr_SetString(PyExc_TypeError, "run_uncompiled(set_eval_frame, function, *args, **kwargs)");
        return NULL;
    }
    PyObject *none = Py_None;
    PyObject *prior = PyObject_Vectorcall(args[0], &none, 1, NULL);
    if (prior == NULL) return NULL;
    PyObject *result = PyObject_Vectorcall(args[1], args + 2, (size_t)(nargs - 2), kwnames);
    if (prior == Py_None) { /* no callback was set: nothing to restore (every call outside torch.compile) */
        Py_DECREF(prior);
        return result;
    }
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback); /* the function's error, if any, survives the restore */
    PyObject *restored = PyObject_Vectorcall(args[0], &prior, 1, NULL);
    Py_DECREF(prior);
    if (restored == NULL) {
        Py_XDECREF(result);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(traceback);
        return NULL;
    }
    Py_DECREF(restored);
    PyErr_Restore(type, value, traceback);
    return result;
}

/* traced_call(context, module_ref, function, *args, **kwargs): a traced module's forward inside a traced forward
   (``HookRecorder.traced_forward``'s Python body, for the common call), in C: no Python frame and no bytecode per
   call (the Python body was most of a call's cost without statistics: benchmarks/overhead.py, OTLP spans).
   It records the call (module index, parent, start, end appended to the forward's columns, the call pushed on and
   popped off the thread's stack), calls the module's own forward, and summarises a tensor output with the thread's
   StatComputer. Anything else goes to Python: the whole call to the body (context[SLOW]) where the forward is not
   traced here (no thread state, no open forward, a skipped forward, torch.export compiling, the module freed, its
   class's forward no longer `function`), and the other parts
   (a CUDA forward's timing events, a call that raised, a stack left unbalanced, an output that is no tensor, a
   statistic that failed) to the helpers the body uses itself. `context`: a tuple read by index, its slots named by
   CONTEXT_SLOTS; Python builds it as ``traced_forward.TracedCallContext``, whose fields must be these names in this
   order (exported as TRACED_CALL_CONTEXT: the Python side compares them before it uses this function, and
   tests/test_traced_call.py fails when they differ). */
#define CONTEXT_SLOTS(X)                                                                                              \
    X(INDEX, index) X(LOCAL, local) X(SLOW, slow) X(TENSOR, tensor) X(OUTPUT_STATS, output_stats)                    \
    X(OUTPUT_WORK, output_work) X(RUN_WORK, run_work) X(CALL_FAILED, call_failed) X(POP_TO, pop_to)                   \
    X(NOTE_ERROR, note_error) X(COMPILER, compiler) X(CLOCK, clock) X(OUTPUTS_SLOT, outputs_slot)                     \
    X(MARK_START, mark_start) X(FIRST_PARAMETER, first_parameter) X(MAX_TENSORS, max_tensors)
#define CONTEXT_INDEX_OF(upper, lower) CONTEXT_##upper,
enum { CONTEXT_SLOTS(CONTEXT_INDEX_OF) CONTEXT_SIZE };
#define CONTEXT_NAME_OF(upper, lower) #lower,
static const char *context_names[] = {CONTEXT_SLOTS(CONTEXT_NAME_OF)};

/* RawForward.columns: the forward's columns the body appends to and stores into, read by index in this order (one
   attribute read a call instead of one a column). Exported as FORWARD_COLUMNS: traced_forward.FORWARD_COLUMNS must
   be the same names, compared as the context's are. The first four are lists, the others dicts. */
#define FORWARD_COLUMNS(X)                                                                                            \
    X(MODULE, module) X(PARENT, parent) X(START, start) X(END, end) X(OUTPUT_STATS, output_stats)                     \
    X(START_EVENTS, start_events) X(END_EVENTS, end_events)
#define COLUMN_INDEX_OF(upper, lower) COLUMN_##upper,
enum { FORWARD_COLUMNS(COLUMN_INDEX_OF) COLUMNS_SIZE };
static const char *column_names[] = {FORWARD_COLUMNS(CONTEXT_NAME_OF)};

/* The attributes traced_call, launch_taken, stats_taken and mark_event read, each as (where, name): "local" the
   recorder's thread-local, "state" its ThreadState, "forward" the RawForward, "compiler" torch.compiler, "class" the
   module's class (its forward), "rows" a forward's StatRows, "block" one of its blocks of rows, "timer" a
   DriverEventTimer, "event" a DriverEvent, "computer" a StatComputer, "staging" a _Staging. Exported as
   ATTRIBUTES_READ for the test that each exists where it is read (a rename on
   the Python side would otherwise send calls down the Python body, or raise, without a word). */
#define ATTRIBUTES_READ(X)                                                                                            \
    X(state, local) X(stack, state) X(skip_depth, state) X(timer, state) X(forward, state) X(stats, state)          \
    X(columns, forward) X(_is_compiling_flag, compiler) X(forward, class) X(_lock, rows) X(_used, rows)              \
    X(_blocks, rows) X(grow, rows) X(values_address, block) X(counts_address, block) X(marking, timer)               \
    X(handle, event) X(device, timer) X(_on_device, computer) X(_staged, computer) X(_recent, computer)             \
    X(in_transform, computer) X(_rows_for, computer) X(in_step, computer) X(_rows, computer) X(wanted, computer)     \
    X(_all_finite, computer) X(_device_rows, computer) X(values, staging) X(count, staging) X(filled, staging)      \
    X(address, staging) X(row_bytes, staging) X(batch, computer) X(queue, batch) X(launch, batch) X(entries, batch)  \
    X(limits, batch) X(bytes, batch) X(checked, batch) X(plan, batch) X(inference_mode, computer)                   \
    X(set_extra, forward)
static PyObject *zero, *one;
/* each read names its interned string: a read without one does not compile */
#define ATTRIBUTE_READ_OF(name, where) {#where, #name, &str_##name},
static const struct {
    const char *where, *name;
    PyObject **interned;
} attributes_read[] = {ATTRIBUTES_READ(ATTRIBUTE_READ_OF)};

/* The slots (``__slots__``) of torchtrace's own objects that the hot path reads and writes (the thread's state, the
   statistics computer and its staging, the batch queue, the rows and their blocks, the CUDA timer and its events),
   each by its offset in the instance: ~30 instructions a read through this table, ~165 for an attribute look-up, and
   a traced call with statistics reads about twenty. bind_slots fills the table once per class from the class's
   member descriptors; an instance of another class (a subclass, a test's stand-in) is read by name. */
#define BOUND_SLOT_BITS 7
#define BOUND_SLOTS (1 << BOUND_SLOT_BITS) /* an open-addressed table, kept at most half full */
static struct {
    PyTypeObject *type;
    PyObject *name; /* interned: compared by identity */
    Py_ssize_t offset;
} bound_slots[BOUND_SLOTS];
static int bound_count;

/* Where probing an open-addressed table of 2^bits entries for ``key`` (pointers, mixed) begins: the high bits of
   Fibonacci hashing (the slot table here, pending_rows' set of dicts seen) */
static size_t first_slot(uintptr_t key, int bits) { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> (64 - bits)); }

/* Where (type, name) is in the table, or the empty entry where it would go */
static size_t slot_index(PyTypeObject *type, PyObject *name) {
    size_t at = first_slot((uintptr_t)name ^ ((uintptr_t)type >> 3), BOUND_SLOT_BITS);
    while (bound_slots[at].name != NULL && (bound_slots[at].name != name || bound_slots[at].type != type))
        at = (at + 1) & (BOUND_SLOTS - 1);
    return at;
}

/* The slot's address in ``owner``, or NULL where it is not one of the bound slots */
static PyObject **slot_of(PyObject *owner, PyObject *name) {
    size_t at = slot_index(Py_TYPE(owner), name);
    return bound_slots[at].name != NULL ? (PyObject **)((char *)owner + bound_slots[at].offset) : NULL;
}

/* owner.name, a new reference (NULL with an exception set) */
static PyObject *read_slot(PyObject *owner, PyObject *name) {
    PyObject **slot = slot_of(owner, name);
    if (slot != NULL && *slot != NULL) return Py_NewRef(*slot);
    return PyObject_GetAttr(owner, name); /* not bound, or unset: AttributeError as Python says it */
}

/* owner.name = value; 0, or -1 with an exception set */
static int write_slot(PyObject *owner, PyObject *name, PyObject *value) {
    PyObject **slot = slot_of(owner, name);
    if (slot == NULL) return PyObject_SetAttr(owner, name, value);
    PyObject *old = *slot;
    *slot = Py_NewRef(value);
    Py_XDECREF(old); /* last: a decref may run Python */
    return 0;
}

/* bound_slots() -> [(class, name), ...]: the slots read by offset */
static PyObject *bound_slots_of(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    PyObject *found = PyList_New(0);
    for (int i = 0; found != NULL && i < BOUND_SLOTS; i++) {
        if (bound_slots[i].name == NULL) continue;
        PyObject *pair = PyTuple_Pack(2, (PyObject *)bound_slots[i].type, bound_slots[i].name);
        if (pair == NULL || PyList_Append(found, pair) < 0) Py_CLEAR(found);
        Py_XDECREF(pair);
    }
    return found;
}

/* bind_slots(cls, owner) -> count: the slots of ``cls`` that the hot path reads of ``owner`` (ATTRIBUTES_READ's name
   for it) read by offset from now on in instances of that very class (plain object slots, its own or its bases';
   a name bound again keeps its first offset; none past a full table) */
static PyObject *bind_slots(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 2, "bind_slots(cls, owner)")) return NULL;
    const char *owner = PyUnicode_Check(args[1]) ? PyUnicode_AsUTF8(args[1]) : NULL;
    if (!PyType_Check(args[0]) || owner == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "bind_slots(cls, owner): a class and a name");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)args[0];
    long bound = 0;
    Py_ssize_t n_read = (Py_ssize_t)(sizeof(attributes_read) / sizeof(attributes_read[0]));
    for (Py_ssize_t i = 0; i < n_read; i++) {
        PyObject *name = *attributes_read[i].interned;
        if (strcmp(attributes_read[i].where, owner) != 0) continue;
        PyObject *descriptor = _PyType_Lookup(type, name); /* borrowed: what type(owner).name finds first */
        if (descriptor == NULL || !Py_IS_TYPE(descriptor, &PyMemberDescr_Type)) continue;
        PyMemberDef *member = ((PyMemberDescrObject *)descriptor)->d_member;
        size_t at = slot_index(type, name);
        if (member->type != T_OBJECT_EX || (member->flags & READONLY) || bound_slots[at].name != NULL) continue;
        if (2 * (bound_count + 1) > BOUND_SLOTS) break; /* full (modules reloaded many times): the rest by name */
        bound_slots[at].type = (PyTypeObject *)Py_NewRef(type); /* kept: its offsets are its */
        bound_slots[at].name = name;
        bound_slots[at].offset = member->offset;
        bound_count++;
        bound++;
    }
    return PyLong_FromLong(bound);
}

/* getattr(owner, name) as a new reference that must be a list (NULL without an exception: not one) */
static PyObject *read_slot(PyObject *owner, PyObject *name);

static PyObject *list_attribute(PyObject *owner, PyObject *name) {
    PyObject *value = read_slot(owner, name);
    if (value != NULL && !PyList_CheckExact(value)) Py_CLEAR(value);
    return value;
}

/* forward.columns as a new reference, checked: a tuple of COLUMNS_SIZE exact lists then dicts (NULL: not one, an
   exception set only where reading it raised) */
static PyObject *forward_columns(PyObject *forward) {
    PyObject *columns = PyObject_GetAttr(forward, str_columns);
    if (columns == NULL || !PyTuple_CheckExact(columns) || PyTuple_GET_SIZE(columns) != COLUMNS_SIZE) goto wrong;
    for (Py_ssize_t i = 0; i < COLUMNS_SIZE; i++) {
        PyObject *column = PyTuple_GET_ITEM(columns, i);
        if (i < COLUMN_OUTPUT_STATS ? !PyList_CheckExact(column) : !PyDict_CheckExact(column)) goto wrong;
    }
    return columns;
wrong:
    Py_XDECREF(columns);
    return NULL;
}

/* The exception being raised, taken (normalized, its traceback attached): the caller restores it with
   restore_raised. */
typedef struct {
    PyObject *type, *value, *traceback; /* before 3.12 the three; since, the exception in value alone */
} Raised;

static void take_raised(Raised *raised) {
#if PY_VERSION_HEX >= 0x030C0000
    raised->type = raised->traceback = NULL;
    raised->value = PyErr_GetRaisedException();
#else
    PyErr_Fetch(&raised->type, &raised->value, &raised->traceback);
    PyErr_NormalizeException(&raised->type, &raised->value, &raised->traceback);
    if (raised->traceback != NULL && raised->value != NULL) PyException_SetTraceback(raised->value, raised->traceback);
#endif
}

static void restore_raised(Raised *raised) {
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(raised->value);
#else
    PyErr_Restore(raised->type, raised->value, raised->traceback);
#endif
}

/* A taken exception let go of (another one replaces it). */
static void drop_raised(Raised *raised) {
    Py_XDECREF(raised->type);
    Py_XDECREF(raised->value);
    Py_XDECREF(raised->traceback);
}

/* A feature failed on the call's output: Exception -> note_error(forward, position, OUTPUTS, error), 0; anything
   else (KeyboardInterrupt) stays raised, -1. */
static int note_output_error(PyObject *context, PyObject *forward, PyObject *position) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    Raised raised;
    take_raised(&raised);
    PyObject *noted = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(context, CONTEXT_NOTE_ERROR), forward, position,
                                                   PyTuple_GET_ITEM(context, CONTEXT_OUTPUTS_SLOT), raised.value, NULL);
    drop_raised(&raised);
    if (noted == NULL) return -1;
    Py_DECREF(noted);
    return 0;
}

/* The names a flat tuple's tensors get in a call's output summaries ("0", "1", ...: as stats.find_tensors names
   them), made once */
#define TUPLE_NAMES 16
static PyObject *tuple_names[TUPLE_NAMES];

static PyObject *stats_of_taken(PyObject *computer, PyObject *tensor);

/* An output that is a plain tuple of tensors and Nones (an attention's (output, None), a block's (hidden, present)):
   its tensors' statistics, each as a bare tensor output's, set as the call's output summaries ({"0": stats, ...}:
   what the Python body's find_tensors and StatComputer make), without a Python frame. 1: done; 0: not such an
   output (none of its tensors, a subclass such as a named tuple, another item, more than the context's max_tensors
   or TUPLE_NAMES): the Python body's; -1 with an exception set. */
static int tuple_output_stats(PyObject *context, PyObject *state, PyObject *forward, PyObject *position,
                              PyObject *output) {
    if (!PyTuple_CheckExact(output)) return 0;
    PyObject *tensor = PyTuple_GET_ITEM(context, CONTEXT_TENSOR);
    Py_ssize_t n = PyTuple_GET_SIZE(output), tensors = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(output, i);
        if (Py_TYPE(item) == (PyTypeObject *)tensor) tensors++;
        else if (item != Py_None) return 0;
    }
    long limit = PyLong_AsLong(PyTuple_GET_ITEM(context, CONTEXT_MAX_TENSORS));
    if (limit == -1 && PyErr_Occurred()) return -1;
    if (tensors == 0 || tensors > limit || n > TUPLE_NAMES) return 0;
    PyObject *computer = read_slot(state, str_stats), *summaries = computer != NULL ? PyDict_New() : NULL;
    int outcome = summaries != NULL ? 1 : -1;
    for (Py_ssize_t i = 0; i < n && outcome == 1; i++) {
        PyObject *item = PyTuple_GET_ITEM(output, i);
        if (item == Py_None) continue;
        PyObject *stats = stats_of_taken(computer, item); /* a kind taken before: in C */
        if (stats == Py_None) Py_CLEAR(stats);
        else if (stats == NULL) {
            outcome = -1;
            break;
        }
        if (stats == NULL && (stats = PyObject_CallOneArg(computer, item)) == NULL) outcome = -1;
        else if (PyDict_SetItem(summaries, tuple_names[i], stats) < 0) outcome = -1;
        Py_XDECREF(stats);
    }
    if (outcome == 1) {
        PyObject *set = PyObject_CallMethodObjArgs(forward, str_set_extra, position,
                                                   PyTuple_GET_ITEM(context, CONTEXT_OUTPUTS_SLOT), summaries, NULL);
        if (set == NULL) outcome = -1;
        Py_XDECREF(set);
    }
    Py_XDECREF(summaries);
    Py_XDECREF(computer);
    return outcome;
}

/* the call's own positional arguments (after context, module_ref and function), as a tuple */
static PyObject *user_arguments(PyObject *const *args, Py_ssize_t nargs) {
    PyObject *tuple = PyTuple_New(nargs - 3);
    for (Py_ssize_t i = 3; tuple != NULL && i < nargs; i++) PyTuple_SET_ITEM(tuple, i - 3, Py_NewRef(args[i]));
    return tuple;
}

/* 1: record this call here (*state and *timer: new references); 0: hand it to the Python body; -1: an exception */
static int traced_here(PyObject *context, PyObject **state, PyObject **timer) {
    /* Dynamo never runs this function while it compiles (it inlines the Python body, which TracedForward.func
       shows it): no is_dynamo_compiling() here. torch.export's non-strict tracing runs Python as it is, with this
       flag set. */
    PyObject *flag = PyObject_GetAttr(PyTuple_GET_ITEM(context, CONTEXT_COMPILER), str__is_compiling_flag);
    if (flag == NULL) return -1;
    int exporting = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    if (exporting) return exporting < 0 ? -1 : 0;
    *state = PyObject_GetAttr(PyTuple_GET_ITEM(context, CONTEXT_LOCAL), str_state);
    if (*state == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();  /* no state on this thread yet: the body makes it */
        return 0;
    }
    PyObject *skip_depth = read_slot(*state, str_skip_depth);
    *timer = skip_depth != NULL ? read_slot(*state, str_timer) : NULL;
    int here = *timer != NULL && PyLong_CheckExact(skip_depth) && PyLong_AsLong(skip_depth) == 0;
    Py_XDECREF(skip_depth);
    if (PyErr_Occurred()) here = -1;
    if (here != 1) {
        Py_CLEAR(*state);
        Py_CLEAR(*timer);
    }
    return here;
}

/* time.perf_counter_ns, as imported at load (PyInit__native): a traced call's clock (``context.clock``) */
static PyObject *perf_counter_ns;

/* ``clock()``, a new reference: where it is time.perf_counter_ns on Linux, its value read here (CLOCK_MONOTONIC, as
   CPython reads it there, in the same nanoseconds): a Python call and its frame cost several times the read */
static PyObject *clock_now(PyObject *clock) {
#if defined(__linux__)
    struct timespec now;
    if (clock == perf_counter_ns && clock_gettime(CLOCK_MONOTONIC, &now) == 0)
        return PyLong_FromLongLong((long long)now.tv_sec * 1000000000LL + now.tv_nsec);
#endif
    return PyObject_CallNoArgs(clock);
}

/* The object a weak reference (``module_ref``) refers to, a new reference, None where it is gone: read directly from
   a plain weakref.ref, else called */
static PyObject *referent(PyObject *ref) {
    if (!PyWeakref_CheckRefExact(ref)) return PyObject_CallNoArgs(ref);
#if PY_VERSION_HEX >= 0x030D0000
    PyObject *object;
    int alive = PyWeakref_GetRef(ref, &object);
    return alive < 0 ? NULL : alive ? object : Py_NewRef(Py_None);
#else
    return Py_NewRef(PyWeakref_GetObject(ref));
#endif
}

/* the whole call to the Python body, which takes every case this file does not */
static PyObject *hand_over(PyObject *context, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    return PyObject_Vectorcall(PyTuple_GET_ITEM(context, CONTEXT_SLOW), args, (size_t)nargs, kwnames);
}

static int mark_end_of(PyObject *timer, PyObject *columns, PyObject *position);
static int mark_start_of(PyObject *context, PyObject *timer, PyObject *columns, PyObject *position,
                         PyObject *const *args, Py_ssize_t nargs);

static PyObject *traced_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    (void)self;
    if (nargs < 3 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != CONTEXT_SIZE) {
        PyErr_SetString(PyExc_TypeError, "traced_call(context, module_ref, function, *args, **kwargs)");
        return NULL;
    }
    PyObject *context = args[0], *function = args[2], *state = NULL, *timer = NULL;
    int here = traced_here(context, &state, &timer);
    if (here <= 0) return here < 0 ? NULL : hand_over(context, args, nargs, kwnames);
    PyObject *stack = list_attribute(state, str_stack), *forward = NULL, *columns = NULL, *module = NULL,
             *position = NULL, *output = NULL, *user_args = NULL;
    Py_ssize_t at = -1;
    if (stack == NULL || PyList_GET_SIZE(stack) == 0 || (forward = read_slot(state, str_forward)) == NULL ||
        (columns = forward_columns(forward)) == NULL) {
        if (!PyErr_Occurred()) output = hand_over(context, args, nargs, kwnames);
        goto done;
    }
    PyObject *modules = PyTuple_GET_ITEM(columns, COLUMN_MODULE), *parents = PyTuple_GET_ITEM(columns, COLUMN_PARENT),
             *starts = PyTuple_GET_ITEM(columns, COLUMN_START), *ends = PyTuple_GET_ITEM(columns, COLUMN_END);
    if ((module = referent(args[1])) == NULL) goto done;
    /* the module was freed (its forward kept): the body says so; its class's forward replaced since it was traced
       (a library patching the class, mock.patch.object): the body calls that one */
    if (module == Py_None || _PyType_Lookup(Py_TYPE(module), str_forward) != function) {
        output = hand_over(context, args, nargs, kwnames);
        goto done;
    }
    at = PyList_GET_SIZE(starts);
    if ((position = PyLong_FromSsize_t(at)) == NULL) goto done;
    if (PyList_Append(modules, PyTuple_GET_ITEM(context, CONTEXT_INDEX)) < 0 ||
        PyList_Append(parents, PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1)) < 0 ||
        PyList_Append(starts, zero) < 0 || PyList_Append(ends, Py_None) < 0 || PyList_Append(stack, position) < 0)
        goto done;
    if (timer != Py_None) { /* a CUDA forward: the call's start event, where it runs on the timer's device */
        int marked = mark_start_of(context, timer, columns, position, args, nargs);
        if (marked == 0) { /* its first parameter not looked up yet: the Python helper does, and marks */
            if ((user_args = user_arguments(args, nargs)) == NULL) goto done;
            PyObject *done_marking = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(context, CONTEXT_MARK_START),
                                                                  PyTuple_GET_ITEM(context, CONTEXT_INDEX), module,
                                                                  user_args, timer, forward, position, NULL);
            if (done_marking == NULL) goto done;
            Py_DECREF(done_marking);
        } else if (marked < 0) {
            goto done;
        }
    }
    PyObject *clock = PyTuple_GET_ITEM(context, CONTEXT_CLOCK), *start = clock_now(clock);
    if (start == NULL || PyList_SetItem(starts, at, start) < 0) goto done; /* last: the span times the module */

    /* the module's forward: (module, *args, **kwargs) */
    Py_ssize_t n_keywords = kwnames != NULL ? PyTuple_GET_SIZE(kwnames) : 0, total = nargs - 2 + n_keywords;
    PyObject *small[16], **call_args = total <= 16 ? small : PyMem_Malloc(sizeof(PyObject *) * (size_t)total);
    if (call_args == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    call_args[0] = module;
    for (Py_ssize_t i = 1; i < total; i++) call_args[i] = args[i + 2];
    output = PyObject_Vectorcall(function, call_args, (size_t)(nargs - 3 + 1), kwnames);
    if (call_args != small) PyMem_Free(call_args);

    if (output == NULL) { /* the call raised: ended now, then the body's own handling (call_failed), re-raised */
        Raised raised;
        take_raised(&raised);
        PyObject *end = clock_now(clock);
        int ready = end != NULL && (user_args != NULL || (user_args = user_arguments(args, nargs)) != NULL);
        PyObject *handled = ready ? PyObject_CallFunctionObjArgs(
            PyTuple_GET_ITEM(context, CONTEXT_CALL_FAILED), state, forward, position, end, raised.value, module,
            user_args, PyTuple_GET_ITEM(context, CONTEXT_OUTPUT_WORK), NULL) : NULL;
        Py_XDECREF(end);
        if (handled == NULL) PyErr_WriteUnraisable(function); /* the call's own exception is the one to raise */
        Py_XDECREF(handled);
        restore_raised(&raised);
        goto done;
    }
    PyObject *end = clock_now(clock);
    if (end == NULL) goto failed;
    Py_ssize_t depth = PyList_GET_SIZE(stack);
    PyObject *current = depth ? read_slot(state, str_forward) : NULL;
    Py_XDECREF(current); /* only its identity is compared */
    if (depth && current == forward && PyList_GET_ITEM(stack, depth - 1) == position) {
        /* popped as list.pop() does, without its call (a slice deletion cost ~350 instructions); the position
           stays held by this call */
        Py_SET_SIZE(stack, depth - 1);
        Py_DECREF(position);
    } else {
        if (PyErr_Occurred()) goto failed_end;
        PyObject *popped = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(context, CONTEXT_POP_TO), state, forward,
                                                        position, end, NULL);
        if (popped == NULL) goto failed_end;
        Py_DECREF(popped);
    }
    if (PyList_SetItem(ends, at, end) < 0) goto failed; /* stolen */
    /* its end event: before the statistics' kernels, which are not the module's work */
    if (timer != Py_None && mark_end_of(timer, columns, position) < 0) goto failed;

    PyObject *output_stats = PyTuple_GET_ITEM(context, CONTEXT_OUTPUT_STATS);
    PyObject *output_work = PyTuple_GET_ITEM(context, CONTEXT_OUTPUT_WORK), *result = NULL;
    if (output_stats != Py_None) {
        PyObject *tensor = PyTuple_GET_ITEM(context, CONTEXT_TENSOR);
        int is_tensor = Py_TYPE(output) == (PyTypeObject *)tensor ? 1 : PyObject_IsInstance(output, tensor);
        if (is_tensor < 0) goto failed;
        if (is_tensor) {
            PyObject *computer = read_slot(state, str_stats), *stats = NULL;
            if (computer != NULL && Py_TYPE(output) == (PyTypeObject *)tensor) { /* a kind taken before: in C */
                stats = stats_of_taken(computer, output);
                if (stats == Py_None) Py_CLEAR(stats);
                else if (stats == NULL) Py_CLEAR(computer); /* raised past Exception (KeyboardInterrupt) */
            }
            if (stats == NULL && computer != NULL) stats = PyObject_CallOneArg(computer, output);
            Py_XDECREF(computer);
            int stored = stats != NULL ? PyDict_SetItem(PyTuple_GET_ITEM(columns, COLUMN_OUTPUT_STATS), position, stats)
                                       : -1;
            Py_XDECREF(stats);
            if (stored < 0 && note_output_error(context, forward, position) < 0) goto failed;
            goto done;
        }
    } else if (PyTuple_CheckExact(output_work) && PyTuple_GET_SIZE(output_work) == 0) {
        goto done;
    }
    if (output_stats != Py_None) { /* a tuple of tensors and Nones: in C */
        int summarised = tuple_output_stats(context, state, forward, position, output);
        if (summarised < 0 && note_output_error(context, forward, position) < 0) goto failed;
        if (summarised != 0) goto done;
    }
    if (user_args == NULL && (user_args = user_arguments(args, nargs)) == NULL) goto failed;
    if (output_stats != Py_None) { /* the output is no tensor: its tensors found and summarised in Python */
        result = PyObject_CallFunctionObjArgs(output_stats, forward, position, module, user_args, output, NULL);
        if (result == NULL && note_output_error(context, forward, position) < 0) goto failed;
    } else {
        result = PyObject_CallFunctionObjArgs(PyTuple_GET_ITEM(context, CONTEXT_RUN_WORK), output_work,
                                              PyTuple_GET_ITEM(context, CONTEXT_OUTPUTS_SLOT), forward, position,
                                              module, user_args, output, NULL);
        if (result == NULL) goto failed;
    }
    Py_XDECREF(result);
    goto done;
failed_end:
    Py_DECREF(end);
failed:
    Py_CLEAR(output);
done:
    Py_XDECREF(user_args);
    Py_XDECREF(position);
    Py_XDECREF(module);
    Py_XDECREF(columns);
    Py_XDECREF(forward);
    Py_XDECREF(stack);
    Py_XDECREF(timer);
    Py_XDECREF(state);
    return output;
}

/* A timing event recorded now with the driver, as DriverEventTimer.mark does: ``marking`` is its (pool, the
   address of cuEventRecord, the device's index, torch's current device, torch's current raw stream). A new
   reference: the event; None where this path does not apply (the pool empty, another device current, the record
   refused: the event goes back to the pool, and the timer's general path makes, records or reports it); NULL with
   an exception set. */
static PyObject *mark_with(PyObject *marking) {
    if (!PyTuple_CheckExact(marking) || PyTuple_GET_SIZE(marking) != 5) {
        PyErr_SetString(PyExc_TypeError, "mark_event: (pool, record, index, current device, current stream)");
        return NULL;
    }
    PyObject *pool = PyTuple_GET_ITEM(marking, 0), *index = PyTuple_GET_ITEM(marking, 2);
    PyObject *event = PyObject_CallMethodNoArgs(pool, str_pop);
    if (event == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_IndexError)) return NULL;
        PyErr_Clear(); /* an empty pool: the general path makes one */
        Py_RETURN_NONE;
    }
    PyObject *current = PyObject_CallNoArgs(PyTuple_GET_ITEM(marking, 3)), *stream = NULL, *handle = NULL;
    int marked = current != NULL ? PyObject_RichCompareBool(current, index, Py_EQ) : -1;
    Py_XDECREF(current);
    if (marked > 0) {
        stream = PyObject_CallOneArg(PyTuple_GET_ITEM(marking, 4), index);
        handle = stream != NULL ? read_slot(event, str_handle) : NULL;
        void *record = PyLong_AsVoidPtr(PyTuple_GET_ITEM(marking, 1));
        void *raw_handle = handle != NULL ? PyLong_AsVoidPtr(handle) : NULL;
        void *raw_stream = stream != NULL && stream != Py_None ? PyLong_AsVoidPtr(stream) : NULL;
        if (handle == NULL || PyErr_Occurred() || record == NULL) marked = -1;
        else marked = ((two_pointers)record)(raw_handle, raw_stream) == 0;
    }
    Py_XDECREF(stream);
    Py_XDECREF(handle);
    if (marked > 0) return event;
    /* not marked here: the event back to its pool, an error kept for the caller (unless putting it back failed) */
    Raised raised;
    take_raised(&raised);
    PyObject *back = PyObject_CallMethodOneArg(pool, str_append, event);
    Py_DECREF(event);
    if (back == NULL) {
        drop_raised(&raised);
        return NULL;
    }
    Py_DECREF(back);
    restore_raised(&raised);
    if (marked < 0) return NULL;
    Py_RETURN_NONE;
}

/* mark_event(marking) -> event or None: see mark_with (DriverEventTimer.mark calls it) */
static PyObject *mark_event(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 1, "mark_event(marking)")) return NULL;
    return mark_with(args[0]);
}

/* The timer marks now (a DriverEventTimer in C, any other through its mark()), into events[position] (``events``:
   the forward's start_events or end_events dict) where it could mark. 0, or -1 with an exception set. */
static int mark_into(PyObject *timer, PyObject *events, PyObject *position) {
    PyObject *marking = read_slot(timer, str_marking), *event;
    if (marking == NULL) { /* another kind of timer (torch's events) */
        if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return -1;
        PyErr_Clear();
        event = PyObject_CallMethodNoArgs(timer, str_mark);
    } else {
        event = mark_with(marking);
        Py_DECREF(marking);
        if (event == Py_None) {
            Py_DECREF(event);
            event = PyObject_CallMethodNoArgs(timer, str_mark); /* the general path */
        }
    }
    if (event == NULL) return -1;
    int stored = event != Py_None ? PyDict_SetItem(events, position, event) : 0;
    Py_DECREF(event);
    return stored;
}

/* A timed call's end event, as recorder.mark_end: where its start was marked. 0, or -1 with an exception set. */
static int mark_end_of(PyObject *timer, PyObject *columns, PyObject *position) {
    int started = PyDict_Contains(PyTuple_GET_ITEM(columns, COLUMN_START_EVENTS), position);
    if (started <= 0) return started;
    return mark_into(timer, PyTuple_GET_ITEM(columns, COLUMN_END_EVENTS), position);
}

/* A timed call's start event, as HookRecorder._mark_start: where the call runs on the timer's device, which its
   first own parameter says (the recorder's first_parameter, by module index), else its first tensor argument; a
   call with neither runs there. 1: done (marked, or elsewhere); 0: its first parameter not looked up yet (the
   Python helper does that, and marks); -1 with an exception set. */
static int mark_start_of(PyObject *context, PyObject *timer, PyObject *columns, PyObject *position,
                         PyObject *const *args, Py_ssize_t nargs) {
    PyObject *known = PyTuple_GET_ITEM(context, CONTEXT_FIRST_PARAMETER);
    PyObject *tensor = PyDict_Check(known) ? PyDict_GetItemWithError(known, PyTuple_GET_ITEM(context, CONTEXT_INDEX))
                                           : NULL; /* borrowed */
    if (tensor == NULL) return PyErr_Occurred() ? -1 : 0;
    for (Py_ssize_t i = 3; tensor == Py_None && i < nargs; i++) { /* no parameter: the first tensor argument */
        int is_tensor = PyObject_IsInstance(args[i], PyTuple_GET_ITEM(context, CONTEXT_TENSOR));
        if (is_tensor < 0) return -1;
        if (is_tensor) tensor = args[i];
    }
    if (tensor != Py_None) {
        Py_INCREF(tensor); /* the dict's entry may be replaced by another thread's look-up meanwhile */
        PyObject *device = PyObject_GetAttr(tensor, str_device), *timer_device = read_slot(timer, str_device);
        int here = device != NULL && timer_device != NULL ? PyObject_RichCompareBool(device, timer_device, Py_EQ) : -1;
        Py_XDECREF(device);
        Py_XDECREF(timer_device);
        Py_DECREF(tensor);
        if (here <= 0) return here < 0 ? -1 : 1;
    }
    return mark_into(timer, PyTuple_GET_ITEM(columns, COLUMN_START_EVENTS), position) < 0 ? -1 : 1;
}

/* launch_taken(plan, rows, tensor, head, wanted) -> stats or None: the statistics of a device tensor of a kind the
   kernel took before (``device.launch_plan``), in C: the next row of ``rows`` (a StatRows) reserved under its lock,
   the kernel launched into it from C (cuLaunchKernel, the GIL held), and the tensor's stats returned: a copy of
   ``head`` with the row pending (the rows' next block made first where needed: StatRows.grow). None, with nothing
   launched, where this path does not apply (no kernel compiled for its alignment, another device current, the
   rows' lock held by another thread or every row used, a launch the driver refused): the Python path then
   reduces the tensor and says why where something failed. ``plan``: (n, stride, programs, device index, key
   aligned, key unaligned, the compiled kernels by key, current device, current raw stream, (rows a block, rows at
   most, bytes a float row, bytes a count row), the batch kernel's key, the tensor's bytes, the batch kernel's
   compiled launches by key, (its BLOCK, programs in a full grid)). */
enum { PLAN_N, PLAN_STRIDE, PLAN_PROGRAMS, PLAN_INDEX, PLAN_ALIGNED, PLAN_UNALIGNED, PLAN_DIRECT, PLAN_DEVICE,
       PLAN_STREAM, PLAN_GEOMETRY, PLAN_BATCH_KEY, PLAN_BYTES, PLAN_BATCH_DIRECT, PLAN_BATCH_GRID, PLAN_SIZE };

/* The next row of a StatRows: 1 with its index and addresses, 0 where Python must reserve it (its lock held by
   another thread, or no rows left), 2 where the row's block is not made yet, -1 with an exception set.
   StatRows.reserve() takes the row under the rows' lock; here the lock is only asked whether it is free (a call of
   acquire and release costs several times as much). That is enough while the GIL is held and no Python code runs
   from the question to the write of _used (attribute reads and writes of plain values, ints made and dropped):
   no thread is inside reserve()'s locked section then, and none can enter it meanwhile. */
static int reserve_row(PyObject *rows, PyObject *geometry, long long *index, void **values, void **counts) {
    long long block_rows = PyLong_AsLongLong(PyTuple_GET_ITEM(geometry, 0));
    long long max_rows = PyLong_AsLongLong(PyTuple_GET_ITEM(geometry, 1));
    long long value_bytes = PyLong_AsLongLong(PyTuple_GET_ITEM(geometry, 2));
    long long count_bytes = PyLong_AsLongLong(PyTuple_GET_ITEM(geometry, 3));
    if (PyErr_Occurred()) return -1;
    PyObject *lock = read_slot(rows, str__lock);
    PyObject *held = lock != NULL ? PyObject_CallMethodNoArgs(lock, str_locked) : NULL;
    Py_XDECREF(lock);
    if (held != Py_False) {
        Py_XDECREF(held);
        return PyErr_Occurred() ? -1 : 0;
    }
    Py_DECREF(held);
    int outcome = -1;
    PyObject *used = read_slot(rows, str__used), *blocks = NULL, *next = NULL, *base = NULL;
    long long at = used != NULL ? PyLong_AsLongLong(used) : -1;
    if (at < 0 || PyErr_Occurred() || (blocks = list_attribute(rows, str__blocks)) == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "launch_taken: StatRows._used, _blocks unreadable");
        goto done;
    }
    outcome = 0;
    if (at >= max_rows || block_rows <= 0) goto done;
    outcome = 2;
    if (at / block_rows >= PyList_GET_SIZE(blocks)) goto done;
    PyObject *block = PyList_GET_ITEM(blocks, at / block_rows);
    long long row = at % block_rows;
    outcome = -1;
    if ((base = read_slot(block, str_values_address)) == NULL) goto done;
    *values = (void *)(intptr_t)(as_long_long(base) + row * value_bytes);
    Py_CLEAR(base);
    if ((base = read_slot(block, str_counts_address)) == NULL) goto done;
    *counts = (void *)(intptr_t)(as_long_long(base) + row * count_bytes);
    if (PyErr_Occurred() || (next = PyLong_FromLongLong(at + 1)) == NULL ||
        write_slot(rows, str__used, next) < 0)
        goto done;
    *index = at;
    outcome = 1;
done:
    Py_XDECREF(base);
    Py_XDECREF(next);
    Py_XDECREF(blocks);
    Py_XDECREF(used);
    return outcome;
}

/* A batched.StatBatch entry, by index: (tensor, version, its kind's batching state, stats or None (checked only),
   batch key, raw stream, address, values row, counts row, elements) */
enum { ENTRY_TENSOR, ENTRY_VERSION, ENTRY_STATE, ENTRY_STATS, ENTRY_KEY, ENTRY_STREAM, ENTRY_ADDRESS, ENTRY_VALUES,
       ENTRY_COUNTS, ENTRY_N, ENTRY_SIZE };

/* Whether two entries are of one batch kernel key and stream (1), not (0), or -1 with an exception set */
static int same_batch(PyObject *entry, PyObject *first) {
    PyObject *key = PyTuple_GET_ITEM(entry, ENTRY_KEY), *first_key = PyTuple_GET_ITEM(first, ENTRY_KEY);
    int same = key == first_key ? 1 : PyObject_RichCompareBool(key, first_key, Py_EQ);
    return same > 0 ? PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, ENTRY_STREAM),
                                               PyTuple_GET_ITEM(first, ENTRY_STREAM), Py_EQ)
                    : same;
}

/* A full queue launched in C, as StatBatch.launch does where every queued tensor is unchanged: one launch a batch
   kernel key and stream among its entries. 1 (launched, the queue emptied, the checked kinds noted), 0 where
   batch.launch() is to (a tensor changed since it was queued, one of another device, a batch kernel not compiled
   yet, a launch the driver refused: Python's says why; nothing was launched but where the driver refused), -1 with
   an exception set. */
static int launch_queue(PyObject *batch, PyObject *entries, PyObject *plan) {
    Py_ssize_t count = PyList_GET_SIZE(entries);
    if (count == 0 || count > BATCH_ENTRIES) return 0;
    PyObject *natives[BATCH_ENTRIES]; /* borrowed: each entry's batch kernel */
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *entry = PyList_GET_ITEM(entries, i);
        if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != ENTRY_SIZE) return 0;
        PyObject *now = PyObject_GetAttr(PyTuple_GET_ITEM(entry, ENTRY_TENSOR), str__version);
        int unchanged = now != NULL ? PyObject_RichCompareBool(now, PyTuple_GET_ITEM(entry, ENTRY_VERSION), Py_EQ) : -1;
        Py_XDECREF(now);
        if (unchanged <= 0) return unchanged;
        natives[i] = NULL;
        if (PyTuple_GET_ITEM(entry, ENTRY_STATS) == Py_None) continue; /* checked only: nothing launched */
        /* launched here only on the current device (the plan's: its tensor was just launched or queued on it) */
        PyObject *key = PyTuple_GET_ITEM(entry, ENTRY_KEY);
        int here = PyTuple_CheckExact(key) && PyTuple_GET_SIZE(key) == 3
                       ? PyObject_RichCompareBool(PyTuple_GET_ITEM(key, 0), PyTuple_GET_ITEM(plan, PLAN_INDEX), Py_EQ)
                       : 0;
        if (here <= 0) return here;
        natives[i] = PyDict_GetItemWithError(PyTuple_GET_ITEM(plan, PLAN_BATCH_DIRECT), key);
        if (natives[i] == NULL || natives[i] == Py_None) return PyErr_Occurred() ? -1 : 0;
    }
    PyObject *grid = PyTuple_GET_ITEM(plan, PLAN_BATCH_GRID), *checked = list_attribute(batch, str_checked);
    long long block = PyTuple_Check(grid) && PyTuple_GET_SIZE(grid) == 2 ? PyLong_AsLongLong(PyTuple_GET_ITEM(grid, 0))
                                                                         : 0;
    long long full = block > 0 ? PyLong_AsLongLong(PyTuple_GET_ITEM(grid, 1)) : 0;
    if (checked == NULL || block <= 0 || full <= 0 || PyErr_Occurred()) {
        Py_XDECREF(checked);
        return PyErr_Occurred() ? -1 : 0;
    }
    char grouped[BATCH_ENTRIES] = {0}, launched[BATCH_ENTRIES] = {0};
    int outcome = 1;
    for (Py_ssize_t first = 0; first < count && outcome == 1; first++) { /* a launch of first's key and stream */
        PyObject *head = PyList_GET_ITEM(entries, first);
        if (grouped[first] || PyTuple_GET_ITEM(head, ENTRY_STATS) == Py_None) continue; /* checked only */
        int64_t values[ENTRY_PARAMS * BATCH_ENTRIES];
        Py_ssize_t members = 0;
        long long total = 0;
        for (Py_ssize_t i = first; i < count && outcome == 1; i++) {
            PyObject *entry = PyList_GET_ITEM(entries, i);
            if (grouped[i] || PyTuple_GET_ITEM(entry, ENTRY_STATS) == Py_None) continue;
            int same = i == first ? 1 : same_batch(entry, head);
            if (same <= 0) {
                outcome = same < 0 ? -1 : 1;
                continue;
            }
            grouped[i] = (char)(first + 1); /* the group it is launched in */
            for (int j = 0; j < 4; j++)
                values[ENTRY_PARAMS * members + j] = as_long_long(PyTuple_GET_ITEM(entry, ENTRY_ADDRESS + j));
            total += values[ENTRY_PARAMS * members + 3];
            members++;
        }
        PyObject *stream = PyTuple_GET_ITEM(head, ENTRY_STREAM);
        void *raw_stream = stream == Py_None ? NULL : PyLong_AsVoidPtr(stream);
        if (outcome < 0 || PyErr_Occurred()) {
            outcome = -1;
            break;
        }
        /* each member's share of the grid, as triton_stats.batch_shares */
        long long most = 1;
        for (Py_ssize_t m = 0; m < members; m++) {
            long long n = values[ENTRY_PARAMS * m + 3], blocks = (n + block - 1) / block;
            long long share = total > 0 ? full * n / total : 1;
            share = share < blocks ? share : blocks;
            values[ENTRY_PARAMS * m + 4] = share > 1 ? share : 1;
            if (values[ENTRY_PARAMS * m + 4] > most) most = values[ENTRY_PARAMS * m + 4];
        }
        for (Py_ssize_t i = ENTRY_PARAMS * members; i < ENTRY_PARAMS * BATCH_ENTRIES; i++)
            values[i] = values[i % ENTRY_PARAMS]; /* the grid has no programs for these */
        int result = launch_direct(natives[first], "launch_batch", (unsigned long)most, (unsigned long)members,
                                   raw_stream, values, batch_widths, ENTRY_PARAMS * BATCH_ENTRIES);
        if (result != 0) outcome = result < 0 ? -1 : 0;
        for (Py_ssize_t i = first; i < count && result == 0; i++) launched[i] |= grouped[i] == first + 1;
    }
    /* stopped after some launches (the driver refused one, an error): those leave the queue, never launched twice */
    for (Py_ssize_t i = count - 1; i >= 0 && outcome != 1; i--)
        if (launched[i] && PyList_SetSlice(entries, i, i + 1, NULL) < 0) outcome = -1;
    for (Py_ssize_t i = 0; i < count && outcome == 1; i++) {
        PyObject *entry = PyList_GET_ITEM(entries, i);
        if (PyTuple_GET_ITEM(entry, ENTRY_STATS) == Py_None &&
            PyList_Append(checked, PyTuple_GET_ITEM(entry, ENTRY_STATE)) < 0)
            outcome = -1;
    }
    Py_DECREF(checked);
    if (outcome == 1 && (PyList_SetSlice(entries, 0, count, NULL) < 0 || write_slot(batch, str_bytes, zero) < 0))
        outcome = -1;
    return outcome;
}

/* Queues (tensor, version, batching, stats or None, ...: see ENTRY_SIZE) in ``batch`` as StatBatch.queue does, and
   launches the queue where it is full: in C where it can (launch_queue), else through batch.launch(). 0, or -1 with
   an exception set. */
static int queue_entry(PyObject *batch, PyObject *tensor, PyObject *version, PyObject *batching, PyObject *stats,
                       PyObject *plan, PyObject *stream, void *address, void *values, void *counts, PyObject *n) {
    PyObject *entry = PyTuple_New(ENTRY_SIZE), *entries = NULL, *limits = NULL, *held = NULL, *now = NULL;
    if (entry == NULL) return -1;
    PyObject *items[ENTRY_SIZE] = {Py_NewRef(tensor), Py_NewRef(version), Py_NewRef(batching), Py_NewRef(stats),
                                   Py_NewRef(PyTuple_GET_ITEM(plan, PLAN_BATCH_KEY)), Py_NewRef(stream),
                                   PyLong_FromVoidPtr(address), PyLong_FromVoidPtr(values), PyLong_FromVoidPtr(counts),
                                   Py_NewRef(n)};
    for (Py_ssize_t i = 0; i < ENTRY_SIZE; i++) PyTuple_SET_ITEM(entry, i, items[i]);
    PyObject *nbytes = PyTuple_GET_ITEM(plan, PLAN_BYTES);
    int outcome = -1;
    if (PyErr_Occurred() || (entries = list_attribute(batch, str_entries)) == NULL ||
        (limits = read_slot(batch, str_limits)) == NULL || (held = read_slot(batch, str_bytes)) == NULL)
        goto done;
    if (!PyTuple_CheckExact(limits) || PyTuple_GET_SIZE(limits) != 2) {
        PyErr_SetString(PyExc_TypeError, "stats_taken: StatBatch.limits is (size, bound)");
        goto done;
    }
    /* the plan of a queue's first tensor launches what is left of it at the forward's end (launch_queued) */
    if (PyList_GET_SIZE(entries) == 0 && write_slot(batch, str_plan, plan) < 0) goto done;
    if (PyList_Append(entries, entry) < 0 || (now = PyNumber_Add(held, nbytes)) == NULL ||
        write_slot(batch, str_bytes, now) < 0)
        goto done;
    int full = PyList_GET_SIZE(entries) >= PyLong_AsSsize_t(PyTuple_GET_ITEM(limits, 0));
    if (!full) full = PyObject_RichCompareBool(now, PyTuple_GET_ITEM(limits, 1), Py_GE);
    if (full < 0 || PyErr_Occurred()) goto done;
    outcome = 0;
    if (full) {
        int launched = launch_queue(batch, entries, plan);
        if (launched == 0) { /* Python's launch: changed tensors, another device's, a first compilation, errors */
            PyObject *done_launching = PyObject_CallMethodNoArgs(batch, str_launch);
            launched = done_launching != NULL ? 1 : -1;
            Py_XDECREF(done_launching);
        }
        outcome = launched < 0 ? -1 : 0;
    }
done:
    Py_XDECREF(now);
    Py_XDECREF(held);
    Py_XDECREF(limits);
    Py_XDECREF(entries);
    Py_DECREF(entry);
    return outcome;
}

/* launch_queued(batch) -> bool: what is left in a StatBatch's queue at the forward's end, launched in C as a full
   queue is (launch_queue) with the plan of its first tensor, where that tensor's device is still the current one.
   False (the queue as it was, but for launches the driver took before refusing one) where batch.launch() is to. */
static PyObject *launch_queued(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 1, "launch_queued(batch)")) return NULL;
    PyObject *entries = list_attribute(args[0], str_entries), *plan = NULL, *current = NULL;
    if (entries != NULL) plan = read_slot(args[0], str_plan);
    int launched = PyErr_Occurred() ? -1 : 0; /* entries not an exact list: Python's launch */
    if (plan != NULL && PyTuple_CheckExact(plan) && PyTuple_GET_SIZE(plan) == PLAN_SIZE) {
        current = PyObject_CallNoArgs(PyTuple_GET_ITEM(plan, PLAN_DEVICE));
        int here = current != NULL ? PyObject_RichCompareBool(current, PyTuple_GET_ITEM(plan, PLAN_INDEX), Py_EQ) : -1;
        launched = here > 0 ? launch_queue(args[0], entries, plan) : here;
    }
    Py_XDECREF(current);
    Py_XDECREF(plan);
    Py_XDECREF(entries);
    return launched < 0 ? NULL : PyBool_FromLong(launched);
}

/* launch_taken's work: stats (a new reference), None (a new reference) where this path does not apply, NULL with an
   exception set. With a ``batch`` (a batched.StatBatch, else NULL), the tensor's ``version`` and its kind's
   ``batching`` state (batched.py): a kind queued from now on (0) is queued there instead of launched (where it is
   16-byte aligned), one still checked (> 0) is launched and queued to be checked. */
static PyObject *launch_for(PyObject *plan, PyObject *rows, PyObject *tensor, PyObject *head, PyObject *wanted,
                            PyObject *batch, PyObject *batching, PyObject *version) {
    if (!PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != PLAN_SIZE || !PyDict_CheckExact(head) ||
        !PyDict_Check(PyTuple_GET_ITEM(plan, PLAN_DIRECT)) || !PyTuple_Check(PyTuple_GET_ITEM(plan, PLAN_GEOMETRY)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(plan, PLAN_GEOMETRY)) != 4) {
        PyErr_SetString(PyExc_TypeError, "launch_taken: a plan of device.launch_plan and a stats dict");
        return NULL;
    }
    PyObject *pointer = PyObject_CallMethodNoArgs(tensor, str_data_ptr);
    if (pointer == NULL) return NULL;
    void *address = PyLong_AsVoidPtr(pointer);
    Py_DECREF(pointer);
    if (PyErr_Occurred()) return NULL;
    long state = -1; /* the kind's batching state; -1: launched at once */
    if (batch != NULL && PyList_CheckExact(batching) && PyList_GET_SIZE(batching) == 1) {
        state = PyLong_AsLong(PyList_GET_ITEM(batching, 0));
        if (state == -1 && PyErr_Occurred()) return NULL;
    }
    int queued = state == 0 && (uintptr_t)address % 16 == 0;
    PyObject *key = PyTuple_GET_ITEM(plan, (uintptr_t)address % 16 ? PLAN_UNALIGNED : PLAN_ALIGNED);
    PyObject *native = PyDict_GetItemWithError(PyTuple_GET_ITEM(plan, PLAN_DIRECT), key); /* borrowed */
    if (native == NULL || native == Py_None) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    Py_INCREF(native); /* held across calls that may run Python */
    PyObject *index = PyTuple_GET_ITEM(plan, PLAN_INDEX), *stats = NULL, *stream = NULL, *pending = NULL;
    PyObject *current = PyObject_CallNoArgs(PyTuple_GET_ITEM(plan, PLAN_DEVICE));
    int here = current != NULL ? PyObject_RichCompareBool(current, index, Py_EQ) : -1;
    Py_XDECREF(current);
    long long row = 0;
    void *values = NULL, *counts = NULL;
    PyObject *geometry = PyTuple_GET_ITEM(plan, PLAN_GEOMETRY);
    int reserved = here > 0 ? reserve_row(rows, geometry, &row, &values, &counts) : here;
    if (reserved == 2) { /* the next block made (from the pool: once a forward and every BLOCK_ROWS rows) */
        PyObject *grown = PyObject_CallMethodNoArgs(rows, str_grow);
        reserved = grown != NULL ? reserve_row(rows, geometry, &row, &values, &counts) : -1;
        Py_XDECREF(grown);
    }
    if (reserved != 1) goto done;
    if ((stream = PyObject_CallOneArg(PyTuple_GET_ITEM(plan, PLAN_STREAM), index)) == NULL) goto done;
    void *raw_stream = stream == Py_None ? NULL : PyLong_AsVoidPtr(stream);
    PyObject *n = PyTuple_GET_ITEM(plan, PLAN_N);
    long n_value = PyLong_AsLong(n), stride = PyLong_AsLong(PyTuple_GET_ITEM(plan, PLAN_STRIDE));
    unsigned long programs = PyLong_AsUnsignedLong(PyTuple_GET_ITEM(plan, PLAN_PROGRAMS));
    if (PyErr_Occurred()) goto done;
    int result = queued ? 0 : launch_row(native, programs, raw_stream, address, values, counts, (int32_t)n_value,
                                         (int32_t)stride);
    if (result != 0) goto done; /* -1: an exception set; a driver error: the Python path tries and says why */
    /* the row pending, as device.device_stats records it: (rows, row, n, wanted, fused, passes) */
    PyObject *row_index = PyLong_FromLongLong(row);
    if (row_index == NULL || (pending = PyTuple_New(6)) == NULL) {
        Py_XDECREF(row_index);
        goto done;
    }
    PyTuple_SET_ITEM(pending, 0, Py_NewRef(rows));
    PyTuple_SET_ITEM(pending, 1, row_index);
    PyTuple_SET_ITEM(pending, 2, Py_NewRef(n));
    PyTuple_SET_ITEM(pending, 3, Py_NewRef(wanted));
    PyTuple_SET_ITEM(pending, 4, Py_NewRef(Py_True));
    PyTuple_SET_ITEM(pending, 5, Py_NewRef(one));
    if ((stats = PyDict_Copy(head)) != NULL && PyDict_SetItem(stats, str__pending, pending) < 0) Py_CLEAR(stats);
    if (stats != NULL && (queued || state > 0) &&
        queue_entry(batch, tensor, version, batching, queued ? stats : Py_None, plan, stream, address, values, counts,
                    n) < 0)
        Py_CLEAR(stats); /* not queued: the Python path summarises it (its row stays unread) */
done:
    Py_XDECREF(pending);
    Py_XDECREF(stream);
    Py_DECREF(native);
    if (stats == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return stats;
}

static PyObject *launch_taken(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 5, "launch_taken(plan, rows, tensor, head, wanted)")) return NULL;
    return launch_for(args[0], args[1], args[2], args[3], args[4], NULL, NULL, NULL);
}

/* A computer's attribute, a new reference (NULL with an exception set) */
#define GET(owner, name) PyObject_GetAttr(owner, str_##name)
/* A bound slot of the computer's, by offset (read_slot) */
#define SLOT(owner, name) read_slot(owner, str_##name)
/* StatComputer._recent: the last tensor summarised, its version, its stats, then the same of the one before */
enum { RECENT_LAST = 0, RECENT_PREVIOUS = 3, RECENT_SIZE = 6 };

/* A plain CPU tensor of a kind staged before, into its staging's next row as _Staging.add does (one memcpy; the
   row reduced with the forward's others when it ends): a copy of ``head`` naming that row (a new reference), None
   where Python decides (its staging None: a large tensor, reduced at once; not contiguous or a lazy negation; the
   staging full, which Python grows; no data pointer), NULL with an exception set. */
static PyObject *staged_row(PyObject *head, PyObject *staging, PyObject *tensor) {
    if (staging == Py_None || !PyDict_CheckExact(head)) Py_RETURN_NONE;
    PyObject *contiguous = PyObject_CallMethodNoArgs(tensor, str_is_contiguous);
    PyObject *negative = contiguous == Py_True ? PyObject_CallMethodNoArgs(tensor, str_is_neg) : NULL;
    int plain = negative == Py_False;
    Py_XDECREF(contiguous);
    Py_XDECREF(negative);
    if (!plain) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *values = read_slot(staging, str_values), *count = NULL, *filled = NULL, *stats = NULL,
             *pointer = NULL, *found = NULL;
    Py_ssize_t rows = values != NULL ? PyObject_Length(values) : -1;
    long long at = rows >= 0 && (count = read_slot(staging, str_count)) != NULL ? PyLong_AsLongLong(count) : -1;
    if (at < 0 || at >= rows || (filled = list_attribute(staging, str_filled)) == NULL) goto done; /* full: grown */
    PyObject *address = read_slot(staging, str_address), *row_bytes = read_slot(staging, str_row_bytes);
    char *base = address != NULL ? (char *)PyLong_AsVoidPtr(address) : NULL;
    Py_ssize_t width = row_bytes != NULL ? PyLong_AsSsize_t(row_bytes) : -1;
    Py_XDECREF(address);
    Py_XDECREF(row_bytes);
    if (base == NULL || width <= 0 || (pointer = PyObject_CallMethodNoArgs(tensor, str_data_ptr)) == NULL) goto done;
    const void *source = PyLong_AsVoidPtr(pointer);
    if (source == NULL || (stats = PyDict_Copy(head)) == NULL) goto done; /* NULL: functorch's wrappers */
    memcpy(base + at * width, source, (size_t)width);
    PyObject *row = PyLong_FromLongLong(at), *next = PyLong_FromLongLong(at + 1);
    int stored = row != NULL && next != NULL && PyDict_SetItem(stats, str__row, row) == 0 &&
                 PyList_Append(filled, stats) == 0 && write_slot(staging, str_count, next) == 0;
    Py_XDECREF(row);
    Py_XDECREF(next);
    if (stored) found = Py_NewRef(stats);
done:
    Py_XDECREF(stats);
    Py_XDECREF(pointer);
    Py_XDECREF(filled);
    Py_XDECREF(count);
    Py_XDECREF(values);
    if (found == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return found;
}

/* A CPU tensor's stats by its kind in ``staged`` (StatComputer._staged: (dtype, shape, layout) -> (head, staging)):
   staged_row's, or None (a new reference) where it is no CPU tensor or its kind is not there; NULL with an
   exception set. */
static PyObject *staged_stats(PyObject *staged, PyObject *tensor, PyObject *dtype, PyObject *shape) {
    PyObject *is_cpu = PyObject_GetAttr(tensor, str_is_cpu), *layout = NULL, *key = NULL, *kind = NULL,
             *stats = NULL;
    if (is_cpu == Py_True && (layout = PyObject_GetAttr(tensor, str_layout)) != NULL &&
        (key = PyTuple_Pack(3, dtype, shape, layout)) != NULL &&
        (kind = PyDict_GetItemWithError(staged, key)) != NULL) {
        Py_INCREF(kind); /* (head, staging) */
        stats = PyTuple_CheckExact(kind) && PyTuple_GET_SIZE(kind) == 2
                    ? staged_row(PyTuple_GET_ITEM(kind, 0), PyTuple_GET_ITEM(kind, 1), tensor)
                    : Py_NewRef(Py_None);
        Py_DECREF(kind);
    }
    Py_XDECREF(key);
    Py_XDECREF(layout);
    Py_XDECREF(is_cpu);
    if (stats == NULL && !PyErr_Occurred()) Py_RETURN_NONE;
    return stats;
}

/* StatComputer.__call__'s path for a tensor of a kind taken before, in C: what the Python does for it (the last
   two tensors recognised while unchanged; a small CPU tensor's kind looked up by (dtype, shape, layout) and its
   values copied into its staging row; a device tensor's kind by (dtype, shape, device index, and strides where it
   is not contiguous), a row of the forward or the step reserved and the kernel launched from C; the recent tensors
   shifted), without its frames. ``tensor``: an exact torch.Tensor. A new reference: its stats, or None where the
   Python path decides (no such kind, inside a functorch transform, anything staged_row or launch_taken declines,
   and any Exception, which the Python path meets again and reports). */
static PyObject *stats_of_taken(PyObject *computer, PyObject *tensor) {
    PyObject *kinds = SLOT(computer, _on_device), *staged = NULL, *found = NULL, *version = NULL, *recent = NULL,
             *key = NULL, *entry = NULL, *rows = NULL, *wanted = NULL, *stats = NULL, *batch = NULL;
    int inference = -1;
    if (kinds == NULL || !PyDict_CheckExact(kinds) || (staged = SLOT(computer, _staged)) == NULL ||
        !PyDict_CheckExact(staged) || (PyDict_GET_SIZE(kinds) == 0 && PyDict_GET_SIZE(staged) == 0))
        goto done;
    PyObject *mode = SLOT(computer, inference_mode); /* the forward began under inference_mode: not asked */
    PyObject *flag = mode == Py_True ? Py_NewRef(Py_True)
                     : mode != NULL  ? PyObject_CallMethodNoArgs(tensor, str_is_inference)
                                     : NULL;
    inference = flag != NULL ? PyObject_IsTrue(flag) : -1;
    Py_XDECREF(flag);
    Py_XDECREF(mode);
    if (inference < 0) goto done;
    if (!inference) { /* an inference tensor has no version counter: the same object is never trusted twice */
        if ((version = GET(tensor, _version)) == NULL || (recent = SLOT(computer, _recent)) == NULL) goto done;
        if (!PyList_CheckExact(recent) || PyList_GET_SIZE(recent) != RECENT_SIZE) goto done;
        Py_ssize_t seen = tensor == PyList_GET_ITEM(recent, RECENT_LAST)       ? RECENT_LAST
                          : tensor == PyList_GET_ITEM(recent, RECENT_PREVIOUS) ? RECENT_PREVIOUS
                                                                                : -1;
        if (seen >= 0) { /* unchanged since (the same version): its stats again, nothing launched */
            int same = PyObject_RichCompareBool(version, PyList_GET_ITEM(recent, seen + 1), Py_EQ);
            if (same < 0) goto done;
            if (same) {
                found = Py_NewRef(PyList_GET_ITEM(recent, seen + 2));
                goto done;
            }
        }
    }
    PyObject *dtype = GET(tensor, dtype), *shape = GET(tensor, shape);
    if (dtype != NULL && shape != NULL && PyDict_GET_SIZE(staged)) { /* a CPU tensor of a kind staged before */
        stats = staged_stats(staged, tensor, dtype, shape);
        if (stats != Py_None) {
            Py_DECREF(dtype);
            Py_DECREF(shape);
            if (stats == NULL) goto done;
            goto summarised;
        }
        Py_CLEAR(stats);
    }
    PyObject *index = dtype != NULL && shape != NULL && PyDict_GET_SIZE(kinds) && !PyErr_Occurred()
                          ? PyObject_CallMethodNoArgs(tensor, str_get_device)
                          : NULL;
    PyObject *contiguous = index != NULL ? PyObject_CallMethodNoArgs(tensor, str_is_contiguous) : NULL;
    if (contiguous == Py_True) {
        key = PyTuple_Pack(3, dtype, shape, index);
    } else if (contiguous == Py_False) { /* a permuted one (attention's transposed output): its strides too */
        PyObject *strides = PyObject_CallMethodNoArgs(tensor, str_stride);
        key = strides != NULL ? PyTuple_Pack(4, dtype, shape, index, strides) : NULL;
        Py_XDECREF(strides);
    }
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    Py_XDECREF(index);
    Py_XDECREF(contiguous);
    if (key == NULL || (entry = PyDict_GetItemWithError(kinds, key)) == NULL) goto done;
    Py_INCREF(entry); /* (head, stride, device, plan, batching) */
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 5 || PyTuple_GET_ITEM(entry, 3) == Py_None) goto done;
    PyObject *in_transform = SLOT(computer, in_transform);
    PyObject *transformed = in_transform != NULL ? PyObject_CallOneArg(in_transform, tensor) : NULL;
    Py_XDECREF(in_transform);
    int plain = transformed != NULL ? transformed == Py_False : -1;
    Py_XDECREF(transformed);
    if (plain <= 0) goto done;
    PyObject *device = PyTuple_GET_ITEM(entry, 2), *rows_for = SLOT(computer, _rows_for), *in_step = NULL;
    int stepping = rows_for == NULL ? -1 : rows_for == Py_None ? 0 : (in_step = SLOT(computer, in_step)) != NULL ?
        PyObject_IsTrue(in_step) : -1; /* as `rows_for is not None and in_step` */
    Py_XDECREF(in_step);
    if (stepping > 0) {
        rows = PyObject_CallOneArg(rows_for, device);
    } else if (stepping == 0) {
        PyObject *forward_rows = SLOT(computer, _rows);
        rows = forward_rows != NULL && PyDict_CheckExact(forward_rows) ? PyDict_GetItemWithError(forward_rows, device)
                                                                         : NULL;
        Py_XINCREF(rows);
        Py_XDECREF(forward_rows);
        if (rows == NULL && !PyErr_Occurred()) /* the forward's first tensor on this device: its rows made */
            rows = PyObject_CallMethodOneArg(computer, str__device_rows, device);
    }
    Py_XDECREF(rows_for);
    if (rows == NULL || (wanted = SLOT(computer, wanted)) == NULL) goto done;
    PyObject *batching = PyTuple_GET_ITEM(entry, 4);
    if (batching != Py_None && !inference && ((batch = SLOT(computer, batch)) == NULL || batch == Py_None)) {
        if (batch == NULL) goto done;
        Py_CLEAR(batch);
    }
    stats = launch_for(PyTuple_GET_ITEM(entry, 3), rows, tensor, PyTuple_GET_ITEM(entry, 0), wanted, batch, batching,
                       version);
    if (stats == NULL || stats == Py_None) goto done;
    /* launched: the forward's rows are read on the host */
    if (write_slot(computer, str__all_finite, Py_False) < 0) goto done;
summarised: /* the tensor is the latest one summarised */
    if (!inference && PyList_GET_SIZE(recent) == RECENT_SIZE) { /* (tensor, version, stats), then the last three */
        PyObject *dropped[3];
        for (Py_ssize_t i = 0; i < 3; i++) {
            dropped[i] = PyList_GET_ITEM(recent, RECENT_PREVIOUS + i);
            PyList_SET_ITEM(recent, RECENT_PREVIOUS + i, PyList_GET_ITEM(recent, RECENT_LAST + i));
        }
        PyList_SET_ITEM(recent, RECENT_LAST, Py_NewRef(tensor));
        PyList_SET_ITEM(recent, RECENT_LAST + 1, Py_NewRef(version));
        PyList_SET_ITEM(recent, RECENT_LAST + 2, Py_NewRef(stats));
        for (Py_ssize_t i = 0; i < 3; i++) Py_DECREF(dropped[i]); /* last: a decref may run Python (a tensor freed) */
    }
    found = Py_NewRef(stats);
done:
    Py_XDECREF(batch);
    Py_XDECREF(stats);
    Py_XDECREF(wanted);
    Py_XDECREF(rows);
    Py_XDECREF(entry);
    Py_XDECREF(key);
    Py_XDECREF(recent);
    Py_XDECREF(version);
    Py_XDECREF(staged);
    Py_XDECREF(kinds);
    if (found == NULL) {
        if (PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL; /* KeyboardInterrupt: raised on */
            PyErr_Clear();
        }
        Py_RETURN_NONE;
    }
    return found;
}
#undef GET

/* stats_taken(computer, tensor) -> stats or None: see stats_of_taken (StatComputer.__call__ calls it) */
static PyObject *stats_taken(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 2, "stats_taken(computer, tensor)")) return NULL;
    return stats_of_taken(args[0], args[1]);
}

/* The raw handles of a list of events (raw handles or DriverEvents) into ``handles`` (room for the list's length);
   -1 with an exception set on a bad event. */
static int event_handles(PyObject *events, void **handles) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
        PyObject *event = PyList_GET_ITEM(events, i);
        PyObject *handle = PyLong_Check(event) ? Py_NewRef(event) : read_slot(event, str_handle);
        handles[i] = handle != NULL ? PyLong_AsVoidPtr(handle) : NULL;
        Py_XDECREF(handle);
        if (PyErr_Occurred()) return -1;
    }
    return 0;
}

/* cuEventElapsedTime from ``origin`` to each of ``n`` events into ``milliseconds``, the GIL not needed: the first
   error's code, or 0 */
static int read_elapsed(elapsed_function function, void *origin, void **handles, float *milliseconds, Py_ssize_t n) {
    int code = 0;
    for (Py_ssize_t read = 0; read < n && code == 0; read++) {
        milliseconds[read] = 0.0f;
        code = function(&milliseconds[read], origin, handles[read]);
    }
    return code;
}

/* ``n`` milliseconds as a new list of int nanoseconds (as int(ms * 1_000_000)) */
static PyObject *nanoseconds(const float *milliseconds, Py_ssize_t n) {
    PyObject *result = PyList_New(n);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        PyObject *ns = PyLong_FromLongLong((long long)((double)milliseconds[i] * 1e6));
        if (ns == NULL) Py_CLEAR(result);
        else PyList_SET_ITEM(result, i, ns);
    }
    return result;
}

/* elapsed_since(function, origin, events) -> [ns, ...]: cuEventElapsedTime (its address) from one event to each of a
   list (raw handles or DriverEvents, all complete), as int nanoseconds: a traced CUDA forward's calls placed on the
   device's timeline in one call, not two Python calls each. The reads (~3 us each on an H200 host, two per traced
   call) run with the GIL released. Raises RuntimeError on a driver error. */
static PyObject *elapsed_since(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 3, "elapsed_since(function, origin, events)")) return NULL;
    elapsed_function function = (elapsed_function)PyLong_AsVoidPtr(args[0]);
    void *origin = PyLong_AsVoidPtr(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (function == NULL || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "elapsed_since(function, origin, events): a function and a list of events");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[2]);
    void **handles = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(void *));
    float *milliseconds = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(float));
    PyObject *result = NULL;
    if (handles == NULL || milliseconds == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (event_handles(args[2], handles) < 0) goto done;
    int code;
    Py_BEGIN_ALLOW_THREADS
    code = read_elapsed(function, origin, handles, milliseconds, n);
    Py_END_ALLOW_THREADS
    if (code) PyErr_Format(PyExc_RuntimeError, "torchtrace: cuEventElapsedTime failed with CUDA error %d", code);
    else result = nanoseconds(milliseconds, n);
done:
    PyMem_Free(handles);
    PyMem_Free(milliseconds);
    return result;
}

/* -- a forward's events read off the model's thread (torchtrace/_pipeline/device_times.py) ----------------------------

   read_later(query, elapsed, exchange, origin, last, starts, ends) -> EventRead: a forward's timing events handed to
   one native thread of the process (started on demand, ended after READER_IDLE_S without work) that never takes the
   GIL: it waits for ``last`` (cuEventQuery, ``query``'s address, every READ_POLL_US: cuEventSynchronize would spin a
   core for it) and reads cuEventElapsedTime (``elapsed``) from ``origin`` to each of ``starts`` and ``ends`` (lists
   of DriverEvents or raw handles, read into a job here, with the GIL). Its first act is to put itself in
   thread-local stream-capture mode (``exchange``: cuThreadExchangeStreamCaptureMode), so that its queries cannot
   invalidate a graph another thread captures. ``EventRead.take()`` -> (start offsets, end offsets), int ns, once read;
   None where the caller is to read them itself: not read yet (the thread then leaves them: the caller may give the
   events back for reuse), or the driver refused (the caller's own read says why). A read in progress is waited for,
   the GIL released. No thread holding ``reads_lock`` ever waits for the GIL: the native thread never takes it, and
   Python's callers release the lock before taking the GIL back. POSIX threads only (elsewhere: no read_later, and
   forwards are read where they are resolved). */
#if defined(EVENT_READS)
#define READ_POLL_US 200
#define READER_IDLE_S 10
#define NOT_READY 600 /* CUDA_ERROR_NOT_READY */
typedef int (*one_pointer)(void *);

static void pause_us(long long us) {
    struct timespec pause = {(time_t)(us / 1000000), (long)(us % 1000000) * 1000};
    nanosleep(&pause, NULL);
}

enum { JOB_QUEUED, JOB_READING, JOB_DONE, JOB_FAILED, JOB_LEFT };

typedef struct read_job {
    struct read_job *next;
    one_pointer query;
    elapsed_function elapsed;
    void *origin, *last;
    Py_ssize_t starts, n; /* handles[0:starts] the calls' start events, handles[starts:n] their end events */
    void **handles;
    float *milliseconds;
    int state, in_queue, abandoned; /* abandoned: its EventRead is gone, whoever holds it last frees it */
} read_job;

static pthread_mutex_t reads_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t reads_queued = PTHREAD_COND_INITIALIZER, reads_done = PTHREAD_COND_INITIALIZER;
static read_job *queue_head, *queue_tail, *reading;
static int reader_running;
static one_pointer reader_exchange; /* cuThreadExchangeStreamCaptureMode, for the thread's first act */

static void free_job(read_job *job) {
    free(job->handles);
    free(job->milliseconds);
    free(job);
}

static void *reader_main(void *unused) {
    (void)unused;
    pthread_mutex_lock(&reads_lock);
    if (reader_exchange != NULL) {
        int mode = 1; /* CU_STREAM_CAPTURE_MODE_THREAD_LOCAL */
        reader_exchange(&mode);
    }
    for (;;) {
        while (queue_head == NULL) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_sec += READER_IDLE_S;
            if (pthread_cond_timedwait(&reads_queued, &reads_lock, &until) != 0 && queue_head == NULL) {
                reader_running = 0;
                pthread_mutex_unlock(&reads_lock);
                return NULL;
            }
        }
        read_job *job = queue_head;
        queue_head = job->next;
        if (queue_head == NULL) queue_tail = NULL;
        job->in_queue = 0;
        if (job->state != JOB_QUEUED) { /* left to its caller */
            if (job->abandoned) free_job(job);
            continue;
        }
        job->state = JOB_READING;
        reading = job;
        pthread_mutex_unlock(&reads_lock);
        int code;
        while ((code = job->query(job->last)) == NOT_READY) pause_us(READ_POLL_US);
        if (code == 0) code = read_elapsed(job->elapsed, job->origin, job->handles, job->milliseconds, job->n);
        pthread_mutex_lock(&reads_lock);
        reading = NULL;
        job->state = code ? JOB_FAILED : JOB_DONE;
        pthread_cond_broadcast(&reads_done);
        if (job->abandoned) free_job(job);
    }
}

/* a forked child has no reader thread: what the parent queued or read is the caller's to read (its events are the
   parent's anyway) */
static void reads_after_fork(void) {
    pthread_mutex_init(&reads_lock, NULL);
    pthread_cond_init(&reads_queued, NULL);
    pthread_cond_init(&reads_done, NULL);
    for (read_job *job = queue_head; job != NULL; job = job->next) job->state = JOB_FAILED, job->in_queue = 0;
    if (reading != NULL) reading->state = JOB_FAILED;
    queue_head = queue_tail = reading = NULL;
    reader_running = 0;
}

typedef struct {
    PyObject_HEAD read_job *job;
} EventRead;

static void EventRead_dealloc(EventRead *self) {
    read_job *job = self->job;
    pthread_mutex_lock(&reads_lock);
    if (job->state == JOB_QUEUED) job->state = JOB_LEFT; /* nobody wants it read any more */
    if (job->in_queue || job->state == JOB_READING) { /* the thread frees it when done with it */
        job->abandoned = 1;
        job = NULL;
    }
    pthread_mutex_unlock(&reads_lock);
    if (job != NULL) free_job(job);
    PyTypeObject *type = Py_TYPE(self);
    type->tp_free((PyObject *)self);
}

static PyObject *EventRead_take(EventRead *self, PyObject *unused) {
    (void)unused;
    read_job *job = self->job;
    pthread_mutex_lock(&reads_lock);
    if (job->state == JOB_QUEUED) job->state = JOB_LEFT;
    int state = job->state;
    pthread_mutex_unlock(&reads_lock);
    if (state == JOB_READING) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&reads_lock);
        while (job->state == JOB_READING) pthread_cond_wait(&reads_done, &reads_lock);
        state = job->state;
        pthread_mutex_unlock(&reads_lock);
        Py_END_ALLOW_THREADS
    }
    if (state != JOB_DONE) Py_RETURN_NONE;
    PyObject *starts = nanoseconds(job->milliseconds, job->starts), *ends = NULL, *result = NULL;
    if (starts != NULL && (ends = nanoseconds(job->milliseconds + job->starts, job->n - job->starts)) != NULL)
        result = PyTuple_Pack(2, starts, ends);
    Py_XDECREF(starts);
    Py_XDECREF(ends);
    return result;
}

static PyMethodDef EventRead_methods[] = {
    {"take", (PyCFunction)EventRead_take, METH_NOARGS,
     "take() -> (start offsets, end offsets) once read, else None (from now on the caller's to read)"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject EventReadType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "torchtrace._native.EventRead",
    .tp_basicsize = sizeof(EventRead),
    .tp_dealloc = (destructor)EventRead_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A forward's timing events, read by the native reader thread (read_later)",
    .tp_methods = EventRead_methods,
};

static PyObject *read_later(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    const char *signature = "read_later(query, elapsed, exchange, origin, last, starts, ends)";
    if (!takes(nargs, 7, signature)) return NULL;
    void *at[5];
    for (int i = 0; i < 5; i++) at[i] = args[i] == Py_None ? NULL : PyLong_AsVoidPtr(args[i]);
    if (PyErr_Occurred()) return NULL;
    if (at[0] == NULL || at[1] == NULL || !PyList_Check(args[5]) || !PyList_Check(args[6])) {
        PyErr_Format(PyExc_TypeError, "%s: two functions, two events and two lists of events", signature);
        return NULL;
    }
    Py_ssize_t starts = PyList_GET_SIZE(args[5]), n = starts + PyList_GET_SIZE(args[6]);
    read_job *job = calloc(1, sizeof(read_job));
    if (job == NULL || (job->handles = malloc((size_t)(n ? n : 1) * sizeof(void *))) == NULL ||
        (job->milliseconds = malloc((size_t)(n ? n : 1) * sizeof(float))) == NULL) {
        if (job != NULL) free_job(job);
        return PyErr_NoMemory();
    }
    job->query = (one_pointer)at[0];
    job->elapsed = (elapsed_function)at[1];
    job->origin = at[3];
    job->last = at[4];
    job->starts = starts;
    job->n = n;
    if (event_handles(args[5], job->handles) < 0 || event_handles(args[6], job->handles + starts) < 0) {
        free_job(job);
        return NULL;
    }
    EventRead *read = PyObject_New(EventRead, &EventReadType);
    if (read == NULL) {
        free_job(job);
        return NULL;
    }
    read->job = job;
    int started = 0;
    pthread_mutex_lock(&reads_lock);
    reader_exchange = (one_pointer)at[2];
    if (!reader_running) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        reader_running = started = pthread_create(&thread, &attributes, reader_main, NULL) == 0;
        pthread_attr_destroy(&attributes);
    }
    if (reader_running) {
        job->in_queue = 1;
        if (queue_tail != NULL) queue_tail->next = job;
        else queue_head = job;
        queue_tail = job;
        if (!started) pthread_cond_signal(&reads_queued);
    } else {
        job->state = JOB_LEFT; /* no thread could be started: the caller reads them */
    }
    pthread_mutex_unlock(&reads_lock);
    return (PyObject *)read;
}
#endif

/* place_times(starts, ends, origin_ns, start_events, start_offsets, end_events, end_offsets) -> (starts, ends):
   dispatcher._times's placement of a CUDA forward's calls on the device's timeline, one C loop rather than Python a
   call. ``start_events`` / ``end_events``: position -> event (the keys read, in order), ``*_offsets``: elapsed_since
   each, from the forward's first event; a call timed by a start event starts at ``origin_ns`` plus its offset and
   keeps its host duration unless an end event gives its end. New lists; the host columns are left as they are. */
static PyObject *place_times(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 7, "place_times(starts, ends, origin_ns, start_events, start_offsets, end_events, end_offsets)"))
        return NULL;
    long long origin = as_long_long(args[2]);
    if (origin == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_Check(args[0]) || !PyList_Check(args[1]) || PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1]) ||
        !PyDict_Check(args[3]) || !PyList_Check(args[4]) || PyDict_GET_SIZE(args[3]) != PyList_GET_SIZE(args[4]) ||
        !PyDict_Check(args[5]) || !PyList_Check(args[6]) || PyDict_GET_SIZE(args[5]) != PyList_GET_SIZE(args[6])) {
        PyErr_SetString(PyExc_TypeError, "place_times: columns of one length, and an offset an event");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    PyObject *starts = PyList_GetSlice(args[0], 0, n), *ends = PyList_GetSlice(args[1], 0, n), *placed = NULL;
    if (starts == NULL || ends == NULL) goto done;
    for (int kind = 0; kind < 2; kind++) { /* the start events, then the end events */
        PyObject *events = args[3 + 2 * kind], *offsets = args[4 + 2 * kind], *key, *value;
        Py_ssize_t at = 0, i = 0;
        while (PyDict_Next(events, &at, &key, &value)) {
            Py_ssize_t position = PyNumber_AsSsize_t(key, PyExc_IndexError);
            long long offset = as_long_long(PyList_GET_ITEM(offsets, i++));
            if (PyErr_Occurred()) goto done;
            if (position < 0 || position >= n) {
                PyErr_SetString(PyExc_IndexError, "place_times: an event's position past the forward's calls");
                goto done;
            }
            long long host_duration = 0;
            if (kind == 0 && PyList_GET_ITEM(ends, position) != Py_None) {
                host_duration = as_long_long(PyList_GET_ITEM(ends, position)) -
                                as_long_long(PyList_GET_ITEM(starts, position));
                if (PyErr_Occurred()) goto done;
            }
            PyObject *start = kind == 0 ? PyLong_FromLongLong(origin + offset) : NULL;
            PyObject *end = PyLong_FromLongLong(origin + offset + host_duration);
            if ((kind == 0 && start == NULL) || end == NULL) {
                Py_XDECREF(start);
                Py_XDECREF(end);
                goto done;
            }
            if (kind == 0) PyList_SetItem(starts, position, start); /* steals; the index is checked */
            PyList_SetItem(ends, position, end);
        }
    }
    placed = PyTuple_Pack(2, starts, ends);
done:
    Py_XDECREF(starts);
    Py_XDECREF(ends);
    return placed;
}

/* Whether ``pointer`` was in ``set`` (an open-addressed table of 2^bits slots, NULL empty); added if not */
static int seen_before(const void **set, int bits, const void *pointer) {
    size_t mask = ((size_t)1 << bits) - 1, slot = first_slot((uintptr_t)pointer, bits);
    for (; set[slot] != NULL; slot = (slot + 1) & mask)
        if (set[slot] == pointer) return 1;
    set[slot] = pointer;
    return 0;
}

/* numpy's maximum(x, 0.0): NaN kept */
static double at_least_zero(double x) { return x >= 0.0 || x != x ? x : 0.0; }

/* rows_table(values, counts, index, n, raw, columns, counted, out) -> bool: stats.device_table's finish of a
   forward's device rows, one C loop rather than numpy a column: row index[i] of ``values`` (float32, RAW_COLUMNS
   first) and ``counts`` (int64, COUNT_COLUMNS first), copied from the device, of n[i] elements (raw sums where
   raw[i], else a torch-op row of mean, std, min, max, norm) into row i of ``out`` (float64, C-contiguous, a column
   each of ``columns``: codes 0-8 as in stat_rows), the same values as device.finish_raw_rows and numpy give; the
   zero fraction 0 unless ``counted``. Returns whether no row counts NaN or Inf. */
static PyObject *rows_table(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 8, "rows_table(values, counts, index, n, raw, columns, counted, out)")) return NULL;
    char *columns;
    Py_ssize_t width;
    int counted = PyObject_IsTrue(args[6]);
    if (counted < 0 || PyBytes_AsStringAndSize(args[5], &columns, &width) < 0) return NULL;
    for (Py_ssize_t j = 0; j < width; j++) {
        if (columns[j] < 0 || columns[j] > 8) {
            PyErr_SetString(PyExc_ValueError, "rows_table: a column is a number from 0 to 8");
            return NULL;
        }
    }
    Py_buffer views[6] = {{0}};
    int taken = 0, flags[6] = {PyBUF_ND | PyBUF_FORMAT, PyBUF_ND | PyBUF_FORMAT, PyBUF_SIMPLE, PyBUF_SIMPLE,
                               PyBUF_SIMPLE, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS};
    PyObject *result = NULL;
    for (; taken < 6; taken++)
        if (PyObject_GetBuffer(args[taken == 5 ? 7 : taken], &views[taken], flags[taken]) < 0) goto done;
    Py_buffer *values = &views[0], *counts = &views[1], *out = &views[5];
    Py_ssize_t count = views[2].len / (Py_ssize_t)sizeof(Py_ssize_t);
    if (values->ndim != 2 || values->itemsize != 4 || strcmp(values->format, "f") != 0 || values->shape[1] < 6 ||
        counts->ndim != 2 || counts->itemsize != 8 || counts->shape[1] < 3 || counts->shape[0] != values->shape[0] ||
        views[3].len != count * (Py_ssize_t)sizeof(double) || views[4].len != count || out->itemsize != 8 ||
        out->len != count * width * 8) {
        PyErr_SetString(PyExc_ValueError, "rows_table: float32 value rows and int64 count rows, an index, n and raw "
                                          "of one length, and a float64 table of that many rows");
        goto done;
    }
    const Py_ssize_t *index = views[2].buf;
    const double *n = views[3].buf;
    const char *raw = views[4].buf;
    double *table = out->buf;
    int finite = 1;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t row = index[i];
        if (row < 0 || row >= values->shape[0]) {
            PyErr_SetString(PyExc_IndexError, "rows_table: a row index past the rows copied");
            goto done;
        }
        const float *v = (const float *)values->buf + row * values->shape[1];
        const int64_t *c = (const int64_t *)counts->buf + row * counts->shape[1];
        double stat[9], elements = n[i];
        if (raw[i]) { /* sum_d, squares_d, min, max, squares, shift */
            double sum_d = v[0], squares_d = v[1];
            stat[0] = (double)v[5] + sum_d / elements;
            stat[1] = sqrt(at_least_zero(elements > 1 ? (squares_d - sum_d * sum_d / elements) / (elements - 1) : 0.0));
            stat[2] = v[2];
            stat[3] = v[3];
            stat[5] = sqrt((double)v[4]);
            if (c[0]) { /* NaN: every statistic NaN, as torch gives */
                stat[0] = stat[1] = stat[2] = stat[3] = stat[5] = NAN;
            } else if (c[1]) {
                stat[1] = NAN;
                stat[5] = INFINITY;
            }
        } else { /* torch ops' row: mean, std, min, max, norm */
            stat[0] = v[0];
            stat[1] = v[1];
            stat[2] = v[2];
            stat[3] = v[3];
            stat[5] = v[4];
        }
        double low = fabs(stat[2]), high = fabs(stat[3]);
        stat[4] = low != low || high != high ? NAN : low > high ? low : high;
        stat[6] = (double)c[0];
        stat[7] = (double)c[1];
        stat[8] = counted ? (elements - (double)c[2]) / elements : 0.0;
        finite = finite && c[0] == 0 && c[1] == 0;
        for (Py_ssize_t j = 0; j < width; j++) table[i * width + j] = stat[(int)columns[j]];
    }
    result = PyBool_FromLong(finite);
done:
    for (int k = 0; k < taken; k++) PyBuffer_Release(&views[k]);
    return result;
}

/* Whether a stats dict counts NaN or Inf (1), not (0), or -1 with an exception set */
static int counts_nonfinite(PyObject *stats) {
    PyObject *names[2] = {str_nan_count, str_inf_count};
    for (int k = 0; k < 2; k++) {
        PyObject *counted = PyDict_GetItemWithError(stats, names[k]); /* borrowed */
        int nonzero = counted != NULL ? PyObject_IsTrue(counted) : PyErr_Occurred() ? -1 : 0;
        if (nonzero != 0) return nonzero;
    }
    return 0;
}

/* pending_rows(summaries) -> (stats, rows, wanted, index, n, raw, others_finite) or None: stats.device_table's pass
   over a forward's stats dicts on the worker, one C loop rather than Python a dict. ``stats``: the dicts whose
   statistics are still in a device row (``_pending``: rows, row, n, wanted, raw, repeats 1), each once (a container's
   dict may be its child's), in order; ``index``, ``n`` and ``raw``: their rows, element counts and raw flags as
   native intp, float64 and bool bytes; ``others_finite``: whether no other dict is pending an expanded view's
   scaling or counts NaN or Inf. None where nothing is pending, or the rows or the wanted statistics differ. */
static PyObject *pending_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 1, "pending_rows(summaries)")) return NULL;
    PyObject *all = PySequence_Fast(args[0], "pending_rows(summaries): an iterable of stats dicts");
    if (all == NULL) return NULL;
    Py_ssize_t total = PySequence_Fast_GET_SIZE(all), count = 0;
    int bits = 4; /* a set of the dicts seen, at most half full */
    while (((size_t)1 << bits) < (size_t)total * 2) bits++;
    const void **set = PyMem_Calloc((size_t)1 << bits, sizeof(void *));
    PyObject **entries = PyMem_Malloc(sizeof(PyObject *) * (size_t)(total ? total : 1)), *found = NULL;
    PyObject *filled = PyList_New(0), *index = NULL, *n = NULL, *raw = NULL;
    int others_finite = 1;
    if (set == NULL || entries == NULL || filled == NULL) {
        if (filled != NULL) PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < total; i++) {
        PyObject *stats = PySequence_Fast_GET_ITEM(all, i);
        if (!PyDict_Check(stats)) {
            PyErr_SetString(PyExc_TypeError, "pending_rows(summaries): an iterable of stats dicts");
            goto done;
        }
        PyObject *entry = PyDict_GetItemWithError(stats, str__pending); /* borrowed */
        if (entry == NULL && PyErr_Occurred()) goto done;
        if (entry != NULL && (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 6)) {
            PyErr_SetString(PyExc_TypeError, "pending_rows: a _pending entry is (rows, row, n, wanted, raw, repeats)");
            goto done;
        }
        int single = entry != NULL ? PyObject_RichCompareBool(PyTuple_GET_ITEM(entry, 5), one, Py_EQ) : 0;
        if (single < 0) goto done;
        if (!single) { /* read already, or an expanded view's (scaled when read: resolve) */
            int nonfinite = entry != NULL ? 1 : others_finite ? counts_nonfinite(stats) : 0;
            if (nonfinite < 0) goto done;
            others_finite = others_finite && !nonfinite;
        } else if (!seen_before(set, bits, stats)) {
            if (PyList_Append(filled, stats) < 0) goto done;
            entries[count++] = entry;
        }
    }
    if (count == 0) goto none;
    PyObject *rows = PyTuple_GET_ITEM(entries[0], 0), *wanted = PyTuple_GET_ITEM(entries[0], 3);
    index = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(Py_ssize_t));
    n = PyBytes_FromStringAndSize(NULL, count * (Py_ssize_t)sizeof(double));
    raw = PyBytes_FromStringAndSize(NULL, count);
    if (index == NULL || n == NULL || raw == NULL) goto done;
    Py_ssize_t *rows_at = (Py_ssize_t *)PyBytes_AS_STRING(index);
    double *elements = (double *)PyBytes_AS_STRING(n);
    char *raw_sums = PyBytes_AS_STRING(raw);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *entry = entries[i], *its_wanted = PyTuple_GET_ITEM(entry, 3);
        if (PyTuple_GET_ITEM(entry, 0) != rows) goto none;
        int same = its_wanted == wanted ? 1 : PyObject_RichCompareBool(its_wanted, wanted, Py_EQ);
        if (same <= 0) {
            if (same < 0) goto done;
            goto none;
        }
        rows_at[i] = PyNumber_AsSsize_t(PyTuple_GET_ITEM(entry, 1), PyExc_OverflowError);
        elements[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(entry, 2));
        int is_raw = PyObject_IsTrue(PyTuple_GET_ITEM(entry, 4));
        if (is_raw < 0 || PyErr_Occurred()) goto done;
        raw_sums[i] = (char)is_raw;
    }
    found = Py_BuildValue("(OOOOOOO)", filled, rows, wanted, index, n, raw, others_finite ? Py_True : Py_False);
    goto done;
none:
    found = Py_NewRef(Py_None);
done:
    Py_DECREF(all);
    PyMem_Free(set);
    PyMem_Free(entries);
    Py_XDECREF(filled);
    Py_XDECREF(index);
    Py_XDECREF(n);
    Py_XDECREF(raw);
    return found;
}

/* name_rows(stats) -> None: each dict's pending row replaced by its row of the forward's table, its position (the
   last key, as a CPU forward's small tensors') */
static PyObject *name_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 1, "name_rows(stats)")) return NULL;
    if (!PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "name_rows(stats): a list of stats dicts");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[0]); i++) {
        PyObject *stats = PyList_GET_ITEM(args[0], i), *row = NULL;
        if (!PyDict_Check(stats) || PyDict_DelItem(stats, str__pending) < 0 || (row = PyLong_FromSsize_t(i)) == NULL ||
            PyDict_SetItem(stats, str__row, row) < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "name_rows(stats): a list of stats dicts");
            Py_XDECREF(row);
            return NULL;
        }
        Py_DECREF(row);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"float_stats", (PyCFunction)(void (*)(void))float_stats, METH_FASTCALL,
     "float_stats(address, n, is_float64, columns, names, stats) -> passes (0: not finite)"},
    {"stat_rows", (PyCFunction)(void (*)(void))stat_rows, METH_FASTCALL,
     "stat_rows(address, rows, n, is_float64, columns, out, out_row) -> bool: each row's statistics as a table"},
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL, "copy(destination, source, nbytes) -> None"},
    {"output_call_values", (PyCFunction)(void (*)(void))output_call_values, METH_FASTCALL,
     "output_call_values(module_of, output_stats, extras, outputs_slot, paths, types, table, counts) -> (values, runs) "
     "or None"},
    {"put_values", (PyCFunction)(void (*)(void))put_values, METH_FASTCALL,
     "put_values(buf, base, offsets, values, positions, shapes) -> bool: floats as little-endian doubles (shapes: "
     "5-byte varints) at the offsets"},
    {"put_span_fields", (PyCFunction)(void (*)(void))put_span_fields, METH_FASTCALL,
     "put_span_fields(buf, base, trace_id, tid_at, sid_at, pid_at, has_pid, start_at, span_ids, parents, "
     "root_parent, starts, ends) -> bool: a block-encoded forward's ids and times"},
    {"driver_call", (PyCFunction)(void (*)(void))driver_call, METH_FASTCALL,
     "driver_call(function, a, b) -> int: a CUDA driver entry point of two pointers, the GIL held"},
    {"elapsed_ms", (PyCFunction)(void (*)(void))elapsed_ms, METH_FASTCALL,
     "elapsed_ms(function, start, end) -> (result, milliseconds): cuEventElapsedTime, the GIL held"},
    {"elapsed_since", (PyCFunction)(void (*)(void))elapsed_since, METH_FASTCALL,
     "elapsed_since(function, origin, events) -> [ns, ...]: cuEventElapsedTime from one event to each, the GIL "
     "released"},
#if defined(EVENT_READS)
    {"read_later", (PyCFunction)(void (*)(void))read_later, METH_FASTCALL,
     "read_later(query, elapsed, exchange, origin, last, starts, ends) -> EventRead: a forward's events read by a "
     "native thread once the last is complete"},
#endif
    {"launch_kernel", (PyCFunction)(void (*)(void))launch_kernel, METH_FASTCALL,
     "launch_kernel(launch, function, programs, threads, shared, stream, sizes, *params) -> int: cuLaunchKernel, "
     "the GIL held"},
    {"launch_batch", (PyCFunction)(void (*)(void))launch_batch, METH_FASTCALL,
     "launch_batch(native, programs, count, stream, arguments) -> int: the batch statistics kernel, the GIL held"},
    {"pending_rows", (PyCFunction)(void (*)(void))pending_rows, METH_FASTCALL,
     "pending_rows(summaries) -> (stats, rows, wanted, index, n, raw, others_finite) or None: a forward's stats "
     "dicts still in one set of device rows"},
    {"rows_table", (PyCFunction)(void (*)(void))rows_table, METH_FASTCALL,
     "rows_table(values, counts, index, n, raw, columns, counted, out) -> bool: a forward's device rows finished "
     "into its table"},
    {"name_rows", (PyCFunction)(void (*)(void))name_rows, METH_FASTCALL,
     "name_rows(stats) -> None: each dict's pending row replaced by its position"},
    {"place_times", (PyCFunction)(void (*)(void))place_times, METH_FASTCALL,
     "place_times(starts, ends, origin_ns, start_events, start_offsets, end_events, end_offsets) -> (starts, ends): "
     "a CUDA forward's calls on the device's timeline"},
    {"bind_slots", (PyCFunction)(void (*)(void))bind_slots, METH_FASTCALL,
     "bind_slots(cls, owner) -> count: the slots the hot path reads of owner, read by offset in cls"},
    {"bound_slots", bound_slots_of, METH_NOARGS, "bound_slots() -> [(class, name), ...]: the slots read by offset"},
    {"call_columns", (PyCFunction)(void (*)(void))call_columns, METH_FASTCALL,
     "call_columns(starts, ends, parents, offset) -> (start_ns, end_ns, depth, durations) or None"},
    {"same_values", (PyCFunction)(void (*)(void))same_values, METH_FASTCALL,
     "same_values(values, positions, expected, lengths) -> bool: the values at the positions equal and of the "
     "same types (lengths: tuples or lists of those lengths)"},
    {"untracked", (PyCFunction)(void (*)(void))untracked, METH_FASTCALL,
     "untracked(t) -> t: a tuple of atomic items no longer tracked by the garbage collector"},
    {"run_uncompiled", (PyCFunction)(void (*)(void))run_uncompiled, METH_FASTCALL | METH_KEYWORDS,
     "run_uncompiled(set_eval_frame, function, *args, **kwargs): the call with torch.compile's frame callback off"},
    {"mark_event", (PyCFunction)(void (*)(void))mark_event, METH_FASTCALL,
     "mark_event(marking) -> event or None: a driver timing event from the pool, recorded now"},
    {"launch_queued", (PyCFunction)(void (*)(void))launch_queued, METH_FASTCALL,
     "launch_queued(batch) -> bool: a StatBatch's queue launched from C at the forward's end"},
    {"launch_taken", (PyCFunction)(void (*)(void))launch_taken, METH_FASTCALL,
     "launch_taken(plan, rows, tensor, head, wanted) -> stats or None: a device tensor's statistics launched from C"},
    {"stats_taken", (PyCFunction)(void (*)(void))stats_taken, METH_FASTCALL,
     "stats_taken(computer, tensor) -> stats or None: StatComputer's path for a device tensor of a kind taken before"},
    {"traced_call", (PyCFunction)(void (*)(void))traced_call, METH_FASTCALL | METH_KEYWORDS,
     "traced_call(context, module_ref, function, *args, **kwargs): a traced module's forward, recorded"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

/* A tuple of ``count`` names, a new reference (NULL with an exception set) */
static PyObject *names_tuple(const char *const *names, Py_ssize_t count) {
    PyObject *tuple = PyTuple_New(count);
    for (Py_ssize_t i = 0; tuple != NULL && i < count; i++) {
        PyObject *name = PyUnicode_FromString(names[i]);
        if (name == NULL) Py_CLEAR(tuple);
        else PyTuple_SET_ITEM(tuple, i, name);
    }
    return tuple;
}

/* module.name = value, the reference stolen either way; -1 on failure */
static int add_object(PyObject *module, const char *name, PyObject *value) {
    if (value == NULL) return -1;
    if (PyModule_AddObject(module, name, value) < 0) {
        Py_DECREF(value);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__native(void) {
#define INTERN(name)                                                                                                  \
    if ((str_##name = PyUnicode_InternFromString(#name)) == NULL) return NULL;
    INTERNED(INTERN)
    if ((zero = PyLong_FromLong(0)) == NULL || (one = PyLong_FromLong(1)) == NULL) return NULL;
    for (int i = 0; i < TUPLE_NAMES; i++)
        if ((tuple_names[i] = PyUnicode_FromFormat("%d", i)) == NULL) return NULL;
    PyObject *time_module = PyImport_ImportModule("time");
    perf_counter_ns = time_module != NULL ? PyObject_GetAttrString(time_module, "perf_counter_ns") : NULL;
    Py_XDECREF(time_module);
    if (perf_counter_ns == NULL) return NULL;
#if defined(EVENT_READS)
    if (PyType_Ready(&EventReadType) < 0) return NULL;
    static int fork_handler;
    if (!fork_handler && pthread_atfork(NULL, NULL, reads_after_fork) == 0) fork_handler = 1;
#endif
    PyObject *created = PyModule_Create(&module);
    if (created == NULL) return NULL;
    Py_ssize_t n_read = (Py_ssize_t)(sizeof(attributes_read) / sizeof(attributes_read[0]));
    PyObject *reads = PyTuple_New(n_read);
    for (Py_ssize_t i = 0; reads != NULL && i < n_read; i++) {
        PyObject *pair = Py_BuildValue("(sO)", attributes_read[i].where, *attributes_read[i].interned);
        if (pair == NULL) Py_CLEAR(reads);
        else PyTuple_SET_ITEM(reads, i, pair);
    }
    if (add_object(created, "ATTRIBUTES_READ", reads) < 0 ||
        add_object(created, "TRACED_CALL_CONTEXT", names_tuple(context_names, CONTEXT_SIZE)) < 0 ||
        add_object(created, "FORWARD_COLUMNS", names_tuple(column_names, COLUMNS_SIZE)) < 0) {
        Py_DECREF(created);
        return NULL;
    }
    return created;
}
