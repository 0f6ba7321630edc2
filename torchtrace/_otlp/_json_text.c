/* The OTLP/JSON trace file's span text, written in C (torchtrace._otlp._json_text; optional: without it the
   templates are filled by Python's ``%`` operator, the same text, slower).

   percent_format(text, values): ``text % values`` for the conversions json_lines' templates hold (``%%``, ``%032x``
   and ``%016x`` of ids, ``%d`` of times, ``%r`` of finite floats, ``%s`` of ASCII text: a shape's JSON), or None
   where anything else is met (the caller then takes ``%``). A float's text is the one ``repr`` gives: the shortest
   digits that read back to the same double (Ryu, third_party/ryu, where CPython's dtoa takes several times as
   long), laid out as CPython's float_repr lays them out. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ryu/d2s.c" /* d2d, d2d_small_int, decimalLength17: the digits of a double */

#define MAX_CONVERSION 40 /* the longest text a number's conversion writes: a float's is at most 24 characters */

static const char hex_digits[] = "0123456789abcdef";

/* repr(f) for a finite double, written to out (at most 24 characters); returns the count. Positional between 1e-4
   and 1e16 (with ".0" on a whole number), else d.ddde-XX, as CPython's format_float_short does in 'r' mode. */
static int write_float(double f, char *out) {
    const uint64_t bits = double_to_bits(f);
    const uint64_t ieee_mantissa = bits & ((1ull << DOUBLE_MANTISSA_BITS) - 1);
    const uint32_t ieee_exponent = (uint32_t)((bits >> DOUBLE_MANTISSA_BITS) & ((1u << DOUBLE_EXPONENT_BITS) - 1));
    char *p = out;
    if (bits >> 63) *p++ = '-';
    if (ieee_exponent == 0 && ieee_mantissa == 0) {
        memcpy(p, "0.0", 3);
        return (int)(p + 3 - out);
    }
    floating_decimal_64 v;
    if (d2d_small_int(ieee_mantissa, ieee_exponent, &v)) {
        while (v.mantissa % 10 == 0) { /* a whole number below 2^53 comes with its trailing zeros */
            v.mantissa /= 10;
            v.exponent++;
        }
    } else {
        v = d2d(ieee_mantissa, ieee_exponent);
    }
    char digits[17];
    const int n = (int)decimalLength17(v.mantissa);
    uint64_t rest = v.mantissa;
    for (int i = n - 1; i >= 0; i--) {
        digits[i] = (char)('0' + rest % 10);
        rest /= 10;
    }
    const int point = n + v.exponent; /* the value is 0.<digits> x 10^point */
    if (point <= -4 || point > 16) {
        int exponent = point - 1;
        *p++ = digits[0];
        if (n > 1) {
            *p++ = '.';
            memcpy(p, digits + 1, (size_t)(n - 1));
            p += n - 1;
        }
        *p++ = 'e';
        *p++ = exponent < 0 ? '-' : '+';
        if (exponent < 0) exponent = -exponent;
        if (exponent >= 100) *p++ = (char)('0' + exponent / 100);
        *p++ = (char)('0' + exponent / 10 % 10);
        *p++ = (char)('0' + exponent % 10);
    } else if (point <= 0) {
        *p++ = '0';
        *p++ = '.';
        memset(p, '0', (size_t)-point);
        p += -point;
        memcpy(p, digits, (size_t)n);
        p += n;
    } else if (point >= n) {
        memcpy(p, digits, (size_t)n);
        p += n;
        memset(p, '0', (size_t)(point - n));
        p += point - n;
        *p++ = '.';
        *p++ = '0';
    } else {
        memcpy(p, digits, (size_t)point);
        p += point;
        *p++ = '.';
        memcpy(p, digits + point, (size_t)(n - point));
        p += n - point;
    }
    return (int)(p - out);
}

static char *write_hex(uint64_t value, int width, char *out) {
    for (int i = width - 1; i >= 0; i--) {
        out[i] = hex_digits[value & 15];
        value >>= 4;
    }
    return out + width;
}

static char *write_decimal(long long value, char *out) {
    char reversed[20];
    int n = 0;
    unsigned long long magnitude = value < 0 ? 0ull - (unsigned long long)value : (unsigned long long)value;
    do {
        reversed[n++] = (char)('0' + magnitude % 10);
        magnitude /= 10;
    } while (magnitude);
    if (value < 0) *out++ = '-';
    while (n) *out++ = reversed[--n];
    return out;
}

static PyObject *shift_64; /* the int 64 */

/* The 32 hex digits of an int in [0, 2^128), or 0 with no exception where it is not one */
static int write_hex128(PyObject *value, char *out) {
    PyObject *high = PyNumber_Rshift(value, shift_64);
    if (high == NULL) return 0;
    unsigned long long high_bits = PyLong_AsUnsignedLongLong(high); /* negative or past 2^128: OverflowError */
    Py_DECREF(high);
    if (high_bits == (unsigned long long)-1 && PyErr_Occurred()) return 0;
    write_hex(high_bits, 16, out);
    write_hex(PyLong_AsUnsignedLongLongMask(value), 16, out + 16);
    return 1;
}

/* One conversion of ``value`` at out; the end of what it wrote, or NULL (no exception) where it is not one of the
   templates' own: the caller gives up and Python's ``%`` writes the whole text. */
static char *convert(const char *spec, Py_ssize_t spec_length, PyObject *value, PyObject **last_id, char *last_hex,
                     char *out) {
    if (spec_length == 1 && spec[0] == 's') { /* ASCII text as it is (its length is in the buffer's bound) */
        if (!PyUnicode_CheckExact(value) || !PyUnicode_IS_ASCII(value)) return NULL;
        Py_ssize_t length = PyUnicode_GET_LENGTH(value);
        memcpy(out, PyUnicode_DATA(value), (size_t)length);
        return out + length;
    }
    if (spec_length == 1 && spec[0] == 'r') {
        if (!PyFloat_CheckExact(value)) return NULL;
        double f = PyFloat_AS_DOUBLE(value);
        if (!isfinite(f)) return NULL;
        return out + write_float(f, out);
    }
    if (!PyLong_CheckExact(value)) return NULL;
    if (spec_length == 1 && spec[0] == 'd') {
        int overflow;
        long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (overflow || (number == -1 && PyErr_Occurred())) return NULL;
        return write_decimal(number, out);
    }
    if (spec_length == 4 && memcmp(spec, "016x", 4) == 0) {
        unsigned long long number = PyLong_AsUnsignedLongLong(value);
        if (number == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
        return write_hex(number, 16, out);
    }
    if (spec_length == 4 && memcmp(spec, "032x", 4) == 0) {
        if (value != *last_id) { /* a forward's spans share one trace id object: its digits are made once */
            if (!write_hex128(value, last_hex)) return NULL;
            *last_id = value;
        }
        memcpy(out, last_hex, 32);
        return out + 32;
    }
    return NULL;
}

/* The length of the conversion spec after a '%' at text[at] (up to and including its letter), 0 if none */
static Py_ssize_t spec_length_at(const char *text, Py_ssize_t at, Py_ssize_t length) {
    for (Py_ssize_t end = at; end < length && end - at < 8; end++) {
        char c = text[end];
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '%') return end - at + 1;
    }
    return 0;
}

static PyObject *percent_format(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyUnicode_Check(args[0]) || !PyTuple_Check(args[1])) Py_RETURN_NONE;
#if PY_VERSION_HEX < 0x030C0000
    if (PyUnicode_READY(args[0]) < 0) return NULL;
#endif
    if (!PyUnicode_IS_ASCII(args[0])) Py_RETURN_NONE; /* the templates are ASCII (json.dumps escapes the rest) */
    const char *text = (const char *)PyUnicode_DATA(args[0]);
    const Py_ssize_t length = PyUnicode_GET_LENGTH(args[0]);
    PyObject *values = args[1];
    const Py_ssize_t count = PyTuple_GET_SIZE(values);
    /* written in place into a str of the longest length the values can take, cut to the length written */
    Py_ssize_t bound = length + count * MAX_CONVERSION;
    for (Py_ssize_t i = 0; i < count; i++) { /* a text value may be longer than a number's conversion */
        PyObject *value = PyTuple_GET_ITEM(values, i);
        if (PyUnicode_CheckExact(value)) {
#if PY_VERSION_HEX < 0x030C0000
            if (PyUnicode_READY(value) < 0) return NULL;
#endif
            bound += PyUnicode_GET_LENGTH(value);
        }
    }
    PyObject *result = PyUnicode_New(bound, 127);
    if (result == NULL) return NULL;
    char *buffer = (char *)PyUnicode_DATA(result);
    char *out = buffer;
    Py_ssize_t at = 0, used = 0;
    PyObject *last_id = NULL;
    char last_hex[32];
    while (at < length) {
        const char *percent = memchr(text + at, '%', (size_t)(length - at));
        Py_ssize_t literal = percent == NULL ? length - at : percent - (text + at);
        memcpy(out, text + at, (size_t)literal);
        out += literal;
        at += literal;
        if (percent == NULL) break;
        Py_ssize_t spec = spec_length_at(text, at + 1, length);
        if (spec == 1 && text[at + 1] == '%') {
            *out++ = '%';
        } else {
            out = spec == 0 || used == count ? NULL
                                             : convert(text + at + 1, spec, PyTuple_GET_ITEM(values, used++), &last_id,
                                                       last_hex, out);
            if (out == NULL) break;
        }
        at += 1 + spec;
    }
    if (out == NULL || used != count) { /* not one of the templates' texts, or not their values: Python's % */
        PyErr_Clear();
        Py_DECREF(result);
        Py_RETURN_NONE;
    }
    if (PyUnicode_Resize(&result, out - buffer) < 0) { /* no memory: the str is left as it was, or NULL */
        Py_XDECREF(result);
        return NULL;
    }
    return result;
}

static PyMethodDef methods[] = {
    {"percent_format", (PyCFunction)(void (*)(void))percent_format, METH_FASTCALL,
     "percent_format(text, values) -> str or None: text % values for the JSON templates' conversions, else None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_json_text", NULL, -1, methods};

PyMODINIT_FUNC PyInit__json_text(void) {
    if ((shift_64 = PyLong_FromLong(64)) == NULL) return NULL;
    return PyModule_Create(&module);
}
