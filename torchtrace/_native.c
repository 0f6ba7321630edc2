/* The compiled helpers of the statistics' hot path (torchtrace._native; optional: without them torchtrace takes
   numpy's passes and ctypes.memmove, the same values, slower).

   reduce: one pass over a large CPU tensor's values for its statistics: sum, sum of squares, min, max, non-zero
   count. numpy and torch take one pass each (five in all: 248 us for 1M float32 on one core, where this takes 81 us,
   2026-11-25). Each of LANES accumulators adds every LANES-th value, so the compiler vectorises the loop without
   reordering any sum (no -ffast-math needed). Sums and squares are added in double: a float32 accumulator drifts by
   parts per million over values far from zero, which the std's second pass (x - mean) then multiplies. On x86-64
   Linux the loop is compiled for AVX-512, AVX2 and the baseline, picked at load time (target_clones). NaN and Inf
   are not handled here: they make the sum of squares non-finite, and the caller then takes its exact numpy / torch
   passes, which count them and propagate them as torch does.

   stat_rows: the statistics of each row of a forward's small tensors of one size, staged as rows of one array, as
   a table (128 rows of 32 floats: 11 us, the call included, where numpy's vectorised passes and its column
   arithmetic take 64, 2026-11-25).

   copy: a small tensor's bytes into its staging row (39 ns a call where ctypes.memmove takes 279, 2026-11-25). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <float.h>
#include <math.h>
#include <string.h>

#define LANES 16

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

/* The n values from position `first` at address, float64 or float32. */
static void reduce_values(const void *address, int64_t first, int64_t n, int is_double, double *out) {
    if (is_double)
        reduce_double((const double *)address + first, n, out);
    else
        reduce_float((const float *)address + first, n, out);
}

/* A call's argument count, or a TypeError naming its signature. */
static int takes(Py_ssize_t nargs, Py_ssize_t expected, const char *signature) {
    if (nargs == expected) return 1;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", signature, expected, nargs);
    return 0;
}

/* reduce(address, n, is_float64) -> (sum, sum of squares, min, max, non-zero count): n >= 1 contiguous values at
   address (a tensor's data_ptr()). The GIL is kept: the pass is shorter than a hand-over of it can cost. */
static PyObject *reduce(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 3, "reduce(address, n, is_float64)")) return NULL;
    void *address = PyLong_AsVoidPtr(args[0]);
    long long n = PyLong_AsLongLong(args[1]);
    int is_double = PyObject_IsTrue(args[2]);
    if (PyErr_Occurred()) return NULL;
    if (address == NULL || n < 1) {
        PyErr_SetString(PyExc_ValueError, "reduce needs a non-null address and at least one value");
        return NULL;
    }
    double out[5];
    reduce_values(address, 0, (int64_t)n, is_double, out);
    return Py_BuildValue("(ddddL)", out[0], out[1], out[2], out[3], (long long)out[4]);
}

/* The second pass of one row: sum((x - mean)^2) in double. */
#define CENTERED(NAME, T)                                                                                             \
    static double NAME(const T *x, int64_t n, double mean) {                                                          \
        double total = 0.0;                                                                                           \
        for (int64_t i = 0; i < n; i++) {                                                                             \
            double d = (double)x[i] - mean;                                                                           \
            total += d * d;                                                                                           \
        }                                                                                                             \
        return total;                                                                                                 \
    }

CENTERED(centered_float, float)
CENTERED(centered_double, double)

/* stat_rows(address, rows, n, is_float64, columns, out_address) -> bool: the statistics of each of `rows`
   contiguous rows of n values at address (a forward's small tensors of one size, one row each) into a rows x
   len(columns) table of doubles at out_address; `columns` (bytes) picks from mean, std, min, max, abs_max, norm,
   nan_count, inf_count, zero_fraction (0-8), in its order. The std takes the exact second pass where the mean
   carries half of the sum of squares or more, as the numpy path does. False (the table unfinished) when a row's
   sum of squares is not finite, or for float32 past float32's range: the caller's numpy passes then count NaN and
   Inf as torch does. */
static PyObject *stat_rows(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (!takes(nargs, 6, "stat_rows(address, rows, n, is_float64, columns, out_address)")) return NULL;
    void *address = PyLong_AsVoidPtr(args[0]);
    long long rows = PyLong_AsLongLong(args[1]);
    long long n = PyLong_AsLongLong(args[2]);
    int is_double = PyObject_IsTrue(args[3]);
    char *columns;
    Py_ssize_t width;
    if (PyBytes_AsStringAndSize(args[4], &columns, &width) < 0) return NULL;
    double *out = (double *)PyLong_AsVoidPtr(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (address == NULL || out == NULL || rows < 0 || n < 1) {
        PyErr_SetString(PyExc_ValueError, "stat_rows needs non-null addresses and at least one value a row");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < width; j++) {
        if (columns[j] < 0 || columns[j] > 8) {
            PyErr_SetString(PyExc_ValueError, "stat_rows: a column is a number from 0 to 8");
            return NULL;
        }
    }
    const double most = is_double ? DBL_MAX : FLT_MAX;
    for (long long row = 0; row < rows; row++) {
        double sums[5], values[9];
        reduce_values(address, row * n, (int64_t)n, is_double, sums);
        double total = sums[0], squares = sums[1], low = sums[2], high = sums[3];
        if (!(squares <= most)) Py_RETURN_FALSE; /* NaN, Inf, or past the dtype's range */
        double mean = total / (double)n;
        double centered = squares - total * mean;
        if (!(centered >= 0.5 * squares))
            centered = is_double ? centered_double((const double *)address + row * n, (int64_t)n, mean)
                                 : centered_float((const float *)address + row * n, (int64_t)n, mean);
        values[0] = mean;
        values[1] = sqrt((centered > 0.0 ? centered : 0.0) / (double)(n > 1 ? n - 1 : 1));
        values[2] = low;
        values[3] = high;
        values[4] = fabs(low) > fabs(high) ? fabs(low) : fabs(high);
        values[5] = sqrt(squares);
        values[6] = 0.0;
        values[7] = 0.0;
        values[8] = 1.0 - sums[4] / (double)n;
        for (Py_ssize_t j = 0; j < width; j++) out[row * width + j] = values[(int)columns[j]];
    }
    Py_RETURN_TRUE;
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

static PyMethodDef methods[] = {
    {"reduce", (PyCFunction)(void (*)(void))reduce, METH_FASTCALL,
     "reduce(address, n, is_float64) -> (sum, sum of squares, min, max, non-zero count)"},
    {"stat_rows", (PyCFunction)(void (*)(void))stat_rows, METH_FASTCALL,
     "stat_rows(address, rows, n, is_float64, columns, out_address) -> bool: each row's statistics as a table"},
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL, "copy(destination, source, nbytes) -> None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", NULL, -1, methods};

PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&module); }
