"""One Triton kernel reducing a tensor into its statistics row: one launch and one read of the data per tensor.

The torch path (``device.reduce_into``) costs about ten kernel launches and as many passes over the tensor; here
every program reduces a strided share of the tensor in registers and adds its partial sums into the row with
atomics, so the row holds raw sums that the host finishes (``device.finish_raw``). Float sums accumulate in
float32 per lane, then across lanes and programs. Imported only when a CUDA tensor is
summarised and Triton is installed (CUDA builds of torch ship it).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from torchtrace._capture.cuda_driver import driver, kernel_param_sizes

try:
    from torchtrace._native import launch_batch as _launch_batch
    from torchtrace._native import launch_kernel as _launch_kernel
except ImportError:  # not built: Triton's launcher
    _launch_kernel = _launch_batch = None

_logger = logging.getLogger(__name__)
_current_device = getattr(torch._C, "_cuda_getDevice", None)  # CUDA builds of torch only
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

BLOCK = 1024
PROGRAMS_PER_SM = 4
OPTIONS = {"enable_fp_fusion": True}  # stated, so Triton does not warn in the user's process that it is unset


@triton.jit
def _load(x_ptr, offsets, stride, mask, CONTIGUOUS: tl.constexpr):
    # A runtime stride of 1 is still a multiplication to the compiler: its loads then cannot be vectorised (a large
    # tensor's pass then takes much longer); contiguous data is loaded without it.
    if CONTIGUOUS:
        values = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    else:
        values = tl.load(x_ptr + offsets * stride, mask=mask, other=0.0)
    return values.to(tl.float32)


# n and stride are not specialised (on n % 16, n == 1, ...): a traced model meets many tensor sizes, and each
# specialisation would be another compilation, inside a hook, during the first forwards.
@triton.jit(do_not_specialize=["n", "stride"])
def _row_kernel(
    x_ptr, values_ptr, counts_ptr, n, stride, COUNT_ZEROS: tl.constexpr, CONTIGUOUS: tl.constexpr, BLOCK: tl.constexpr
):
    _reduce(x_ptr, values_ptr, counts_ptr, n, stride, tl.program_id(0), tl.num_programs(0), COUNT_ZEROS, CONTIGUOUS,
            BLOCK)  # fmt: skip


@triton.jit
def _reduce(x_ptr, values_ptr, counts_ptr, n, stride, program, programs, COUNT_ZEROS: tl.constexpr,
            CONTIGUOUS: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    """Adds this program's share of the raw sums of ``x`` into its row (the kernels' common body)."""
    # Sums of x - shift, shift being the mean of the finite values among the first BLOCK: the variance then does
    # not cancel when |mean| >> std. Every program computes the same shift from the same (cached) block.
    head = tl.arange(0, BLOCK)
    first = _load(x_ptr, head, stride, head < n, CONTIGUOUS)
    finite = (head < n) & (first == first) & (tl.abs(first) < float("inf"))
    shift = tl.sum(tl.where(finite, first, 0.0), axis=0) / tl.maximum(tl.sum(finite.to(tl.float32), axis=0), 1.0)
    sum_d = tl.zeros([BLOCK], dtype=tl.float32)
    squares_d = tl.zeros([BLOCK], dtype=tl.float32)
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    low = tl.full([BLOCK], float("inf"), dtype=tl.float32)
    high = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    nans = tl.zeros([BLOCK], dtype=tl.int32)
    infs = tl.zeros([BLOCK], dtype=tl.int32)
    nonzero = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(program * BLOCK, n, programs * BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        inside = offsets < n
        x = _load(x_ptr, offsets, stride, inside, CONTIGUOUS)
        d = tl.where(inside, x - shift, 0.0)
        sum_d += d
        squares_d += d * d
        squares += x * x
        low = tl.minimum(low, tl.where(inside, x, float("inf")))
        high = tl.maximum(high, tl.where(inside, x, float("-inf")))
        nans += (inside & (x != x)).to(tl.int32)
        infs += (inside & (tl.abs(x) == float("inf"))).to(tl.int32)
        if COUNT_ZEROS:
            nonzero += (inside & (x != 0.0)).to(tl.int32)
    tl.atomic_add(values_ptr + 0, tl.sum(sum_d, axis=0))
    tl.atomic_add(values_ptr + 1, tl.sum(squares_d, axis=0))
    tl.atomic_min(values_ptr + 2, tl.min(low, axis=0))
    tl.atomic_max(values_ptr + 3, tl.max(high, axis=0))
    tl.atomic_add(values_ptr + 4, tl.sum(squares, axis=0))
    if program == 0:
        tl.store(values_ptr + 5, shift)
    tl.atomic_add(counts_ptr + 0, tl.sum(nans, axis=0).to(tl.int64))
    tl.atomic_add(counts_ptr + 1, tl.sum(infs, axis=0).to(tl.int64))
    if COUNT_ZEROS:
        tl.atomic_add(counts_ptr + 2, tl.sum(nonzero, axis=0).to(tl.int64))


BATCH = 8  # tensors one launch of the batch kernel reduces, at most
_BATCH_PARAMETERS = [f"{name}{entry}" for entry in range(BATCH) for name in ("x", "values", "counts", "n", "programs")]


@triton.jit
def _pick(entry, a0, a1, a2, a3, a4, a5, a6, a7):
    """The argument of batch entry ``entry`` (a kernel cannot index its parameters)."""
    picked = tl.where(entry == 6, a6, a7)
    picked = tl.where(entry == 5, a5, picked)
    picked = tl.where(entry == 4, a4, picked)
    picked = tl.where(entry == 3, a3, picked)
    picked = tl.where(entry == 2, a2, picked)
    picked = tl.where(entry == 1, a1, picked)
    return tl.where(entry == 0, a0, picked)


# Up to BATCH contiguous tensors of one dtype, each into its own row: grid (programs of the largest share, tensors);
# each tensor's share of the device's programs is in proportion to its size (a batch of one large tensor and small
# ones reads the large one about as fast as its own launch would), and the programs past a tensor's share return at
# once. Addresses are int64 parameters, made pointers here: the host queues them without making a tensor a row.
# Every one is 16-byte aligned (the caller's check), as the single kernel's specialisation tells its compiler.
@triton.jit(do_not_specialize=_BATCH_PARAMETERS)
def _batch_kernel(
    x0, values0, counts0, n0, programs0, x1, values1, counts1, n1, programs1, x2, values2, counts2, n2, programs2,
    x3, values3, counts3, n3, programs3, x4, values4, counts4, n4, programs4, x5, values5, counts5, n5, programs5,
    x6, values6, counts6, n6, programs6, x7, values7, counts7, n7, programs7,
    DTYPE: tl.constexpr, COUNT_ZEROS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    entry = tl.program_id(1)
    programs = _pick(entry, programs0, programs1, programs2, programs3, programs4, programs5, programs6, programs7)
    if tl.program_id(0) < programs:
        x = _pick(entry, x0, x1, x2, x3, x4, x5, x6, x7)
        values = _pick(entry, values0, values1, values2, values3, values4, values5, values6, values7)
        counts = _pick(entry, counts0, counts1, counts2, counts3, counts4, counts5, counts6, counts7)
        n = _pick(entry, n0, n1, n2, n3, n4, n5, n6, n7)
        x_ptr = tl.multiple_of(x, 16).to(tl.pointer_type(DTYPE))
        values_ptr = tl.multiple_of(values, 16).to(tl.pointer_type(tl.float32))
        counts_ptr = tl.multiple_of(counts, 16).to(tl.pointer_type(tl.int64))
        _reduce(x_ptr, values_ptr, counts_ptr, n, 1, tl.program_id(0), programs, COUNT_ZEROS, True, BLOCK)


_programs: dict[int, int] = {}  # device index -> programs in a full grid


def _max_programs(index: int) -> int:
    programs = _programs.get(index)
    if programs is None:
        cores = torch.cuda.get_device_properties(index).multi_processor_count if index >= 0 else 1
        programs = _programs[index] = PROGRAMS_PER_SM * cores
    return programs


def applies(x: torch.Tensor) -> bool:
    """Whether the kernel can read this tensor (of a dtype it loads: ``device.READ_AS_IS``, the caller's check) as
    it is: its elements filling one block of memory in any order (contiguous, or a permutation of contiguous such as
    attention's transposed output: every statistic is order-free), with int32 offsets.

    The grid-stride loop's int32 counter runs up to n + programs * BLOCK and must not wrap (it would then load below
    the tensor): 2**30 elements leaves room for any GPU's grid; larger tensors take the torch-op reduction."""
    return (x.is_contiguous() or _one_block(x)) and x.numel() < 2**30


def _one_block(x: torch.Tensor) -> bool:
    """Whether the elements fill one block of memory without gaps or overlaps (torch has no public check): the
    strides, smallest first, are the running products of their sizes (dimensions of size one can be skipped)."""
    expected = 1
    for size, stride in sorted(zip(x.shape, x.stride()), key=lambda dimension: dimension[1]):
        if size != 1:
            if stride != expected:
                return False
            expected *= size
    return True


def reduce_row(x: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, counted: bool, stride: int = 1) -> None:
    """Adds the raw sums of every ``stride``-th element of ``x`` (in memory order) into a row holding
    ``device.RAW_START`` (columns: _device.RAW_COLUMNS)."""
    n = -(-x.numel() // stride)
    index = x.get_device()  # an int, no device object made; -1 on the CPU (Triton's interpreter)
    programs = min(-(-n // BLOCK), _programs.get(index) or _max_programs(index))
    if index >= 0 and index != _current_device():
        with torch.cuda.device(index):  # Triton launches on the current device, torch ops on the tensor's
            _launch(x, values, counts, n, stride, counted, programs, index)
    elif not _launch_row(x, values, counts, n, stride, counted, programs, index):
        _launch(x, values, counts, n, stride, counted, programs, index)


def _launch_row(x: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, n: int, stride: int, counted: bool,
                programs: int, index: int) -> bool:  # fmt: skip
    """The launch from C of the kernel compiled before for ``x``'s kind, on the current device ``index``: every
    launch after a kind's first that ``_native.launch_taken`` did not make (see _direct: CUDA tensors only). False,
    nothing launched, where there is no such kernel or the thread has no context on the device yet (Triton's
    launcher, which sets one up, is for those)."""
    address = x.data_ptr()
    native = _direct.get((index, x.dtype, address % 16 == 0, counted, stride == 1)) if launch_directly else None
    if native is None:
        return False
    result = _launch_kernel(
        native.launch, native.function, programs, native.threads, native.shared, _current_raw_stream(index),
        native.sizes, address, values.data_ptr(), counts.data_ptr(), n, stride,
    )  # fmt: skip
    if result and result != _NO_CONTEXT:
        raise RuntimeError(f"torchtrace: launching the statistics kernel failed with CUDA error {result}")
    return not result


# Launching through the JIT function binds and specialises every argument again, each launch: about twice a torch
# op's launch on an H100 host. After its first use, the kernel compiled for a specialisation is launched from C
# (``_native.launch_kernel``: cuLaunchKernel with the GIL held, raw addresses, no pointer checks) where the driver
# confirms the kernel's parameters are the ones passed here; else through Triton's own launcher for it. Keyed by
# what the JIT specialises on here (n and stride are not specialised, and always int32: ``applies``; the rows are
# 32-byte aligned).
_compiled: dict[tuple, Any] = {}  # (device index, dtype, 16-byte aligned, counted, contiguous) -> its kernel
_launchers: dict[tuple, Any] = {}  # (that key, programs) -> Triton's launcher for it
_direct: dict[tuple, DirectLaunch | None] = {}  # that key -> how to launch it from C (None: through Triton)
launch_directly = True  # False once this Triton's compiled kernels take other arguments (then the JIT launches)
_NO_CONTEXT = 201  # CUDA_ERROR_INVALID_CONTEXT: a thread that has not used the device yet (Triton's launcher then)
_ARGUMENT_SIZES = (8, 8, 8, 4, 4)  # x, values, counts (pointers); n, stride (int32)
BATCH_ARGUMENT_SIZES = (8, 8, 8, 4, 4) * BATCH  # x, values, counts (int64 addresses); n, programs (int32), each
_batch_direct: dict[tuple, DirectLaunch | None] = {}  # (device index, dtype, counted) -> the batch kernel's launch


class DirectLaunch(NamedTuple):
    """What ``_native.launch_kernel`` needs of a compiled kernel: its function, block size, shared memory and the
    widths of its parameters (ours, then Triton's scratch pointers, passed as NULL). A tuple: C reads it by index."""

    launch: int
    function: int
    threads: int
    shared: int
    sizes: bytes


def launch_plan(x: torch.Tensor, n: int, stride: int, counted: bool, geometry: tuple) -> tuple | None:
    """``_native.launch_taken``'s plan for the tensors of ``x``'s kind (its dtype and device, ``n`` elements read
    every ``stride``-th; ``geometry``: the rows' layout, ``device.ROW_GEOMETRY``); None where no kernel for the kind
    is launched from C (not compiled yet, or not launchable so)."""
    index = x.get_device()
    aligned, unaligned = ((index, x.dtype, alignment, counted, stride == 1) for alignment in (True, False))
    if _launch_kernel is None or not launch_directly or not (_direct.get(aligned) or _direct.get(unaligned)):
        return None
    full = _programs.get(index) or _max_programs(index)
    # then, for batched.StatBatch: the key a tensor is queued under, the bytes it holds, the batch kernel's compiled
    # launches and its grid's limits (BLOCK, programs in a full grid)
    return (n, stride, min(-(-n // BLOCK), full), index, aligned, unaligned, _direct, _current_device,
            _current_raw_stream, geometry, (index, x.dtype, counted), n * x.element_size(), _batch_direct,
            (BLOCK, full))  # fmt: skip


def forget_compiled() -> None:
    """The kernel failed: nothing is launched from C any longer (launch plans read these), Triton's JIT compiles
    again if it is ever asked."""
    _direct.clear()
    _batch_direct.clear()
    _launchers.clear()
    _compiled.clear()


def direct_launch(kernel: Any, arguments: tuple[int, ...] = _ARGUMENT_SIZES) -> DirectLaunch | None:
    """How to launch a compiled kernel from C, or None where anything about it is not what this module passes
    (``arguments``: the widths of its parameters): a Triton that adds parameters, needs scratch memory, clusters or
    cooperative launches; no driver; no C module."""
    cuda = driver()
    if _launch_kernel is None or cuda is None:
        return None
    try:
        kernel._init_handles()
        metadata = kernel.metadata
        function = int(kernel.function)
        if (
            getattr(metadata, "num_ctas", 1) != 1
            or getattr(metadata, "global_scratch_size", 0)
            or getattr(metadata, "profile_scratch_size", 0)
            or getattr(metadata, "launch_cooperative_grid", False)
            or getattr(metadata, "launch_pdl", False)
            or not function
        ):
            return None
        sizes = kernel_param_sizes(function)
        if sizes is None or sizes[: len(arguments)] != arguments:
            return None
        scratch = sizes[len(arguments) :]
        if len(scratch) > 2 or any(size != 8 for size in scratch):
            return None
        return DirectLaunch(cuda.launch_address, function, 32 * metadata.num_warps, metadata.shared, bytes(sizes))
    except Exception as error:  # another Triton's CompiledKernel: its own launcher goes on working
        _logger.debug("torchtrace: the statistics kernel cannot be launched from C: %s", error)
        return None


def _launch(x: torch.Tensor, values: torch.Tensor, counts: torch.Tensor, n: int, stride: int, counted: bool,
            programs: int, index: int) -> None:  # fmt: skip
    """A launch through Triton: its launcher for a kernel compiled before, else the JIT (which compiles it; whether
    it can be launched from C next time is found out then)."""
    global launch_directly
    direct = launch_directly and x.is_cuda  # not under Triton's interpreter (CPU tensors)
    contiguous = stride == 1
    key = (index, x.dtype, x.data_ptr() % 16 == 0, counted, contiguous)
    if direct:
        launcher = _launchers.get((key, programs))
        if launcher is None and key in _compiled:
            launcher = _launchers[key, programs] = _compiled[key][(programs, 1, 1)]
        if launcher is not None:
            try:  # constexprs included, as Triton 3.6's JIT passes them; a mismatch fails before any launch
                launcher(x, values, counts, n, stride, counted, contiguous, BLOCK, stream=_current_raw_stream(index))
                return
            except TypeError as error:  # the compiled kernel's launcher takes another argument list
                launch_directly = direct = False
                _logger.debug("torchtrace: launching the compiled statistics kernel directly failed: %s", error)
    kernel = _row_kernel[(programs,)](
        x, values, counts, n, stride, COUNT_ZEROS=counted, CONTIGUOUS=contiguous, BLOCK=BLOCK, **OPTIONS
    )
    if direct:
        _compiled[key] = kernel
        _direct[key] = direct_launch(kernel)


def launch_batch(key: tuple, stream: Any, members: list[tuple[int, int, int, int]]) -> None:
    """One launch of the batch kernel over ``members`` (at most BATCH of (address, values row address, counts row
    address, elements): 16-byte aligned tensors whose elements fill one block of memory, of the kind ``key``:
    (device index, dtype, counted)) on ``stream`` (a raw stream) of the members' device: from C once the kernel is
    compiled, else through Triton's JIT (which compiles it)."""
    index = key[0]
    shares = batch_shares([member[3] for member in members], BLOCK, _programs.get(index) or _max_programs(index))
    padded = [(*member, share) for member, share in zip(members, shares)]
    padded += padded[:1] * (BATCH - len(members))  # never read: the grid has no programs for them
    arguments = [value for member in padded for value in member]
    if index >= 0 and index != _current_device():  # the launch from C is on the current device
        with torch.cuda.device(index):
            _launch_batch_here(key, max(shares), len(members), stream, arguments)
    else:
        _launch_batch_here(key, max(shares), len(members), stream, arguments)


def batch_shares(sizes: list[int], block: int, full: int) -> list[int]:
    """Programs each of a batch's tensors (of ``sizes`` elements) is read by: in proportion to its size, of a grid of
    about ``full`` programs; at least one, at most one a ``block`` of its elements (as ``_native``'s launch_queue)."""
    total = max(1, sum(sizes))
    return [max(1, min(-(-n // block), full * n // total)) for n in sizes]


def _launch_batch_here(key: tuple, programs: int, count: int, stream: Any, arguments: list[int]) -> None:
    native = _batch_direct.get(key) if launch_directly else None
    if native is not None:
        result = _launch_batch(native, programs, count, stream, arguments)
        if result == 0:
            return
        if result != _NO_CONTEXT:
            raise RuntimeError(f"torchtrace: launching the batched statistics kernel failed with CUDA error {result}")
    index = key[0]
    if index >= 0:  # Triton's JIT launches on torch's current stream: the queued tensors' own
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=index)):
            _jit_batch(key, programs, count, arguments)
    else:  # Triton's interpreter (tests/test_device.py): the host's memory
        _jit_batch(key, programs, count, arguments)


def raw_stream(index: int) -> int:
    """The raw current stream of device ``index`` (0: the CPU, under the interpreter)."""
    return _current_raw_stream(index) if index >= 0 else 0


def _jit_batch(key: tuple, programs: int, count: int, arguments: list[int]) -> None:
    index, dtype, counted = key
    kernel = _batch_kernel[(programs, count)](
        *arguments, DTYPE=_TRITON_DTYPES[dtype], COUNT_ZEROS=counted, BLOCK=BLOCK, **OPTIONS
    )
    if index >= 0 and launch_directly and key not in _batch_direct:
        _batch_direct[key] = direct_launch(kernel, BATCH_ARGUMENT_SIZES)


_TRITON_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
