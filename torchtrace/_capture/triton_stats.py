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
    from torchtrace._native import launch_kernel as _launch_kernel
except ImportError:  # not built: Triton's launcher
    _launch_kernel = None

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
    program = tl.program_id(0)
    programs = tl.num_programs(0)
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
    programs = min(-(-n // BLOCK), _programs.get(index) or _max_programs(index))
    return (n, stride, programs, index, aligned, unaligned, _direct, _current_device, _current_raw_stream, geometry)


def forget_compiled() -> None:
    """The kernel failed: nothing is launched from C any longer (launch plans read these), Triton's JIT compiles
    again if it is ever asked."""
    _direct.clear()
    _launchers.clear()
    _compiled.clear()


def direct_launch(kernel: Any) -> DirectLaunch | None:
    """How to launch a compiled kernel from C, or None where anything about it is not what this module passes: a
    Triton that adds parameters, needs scratch memory, clusters or cooperative launches; no driver; no C module."""
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
        if sizes is None or sizes[: len(_ARGUMENT_SIZES)] != _ARGUMENT_SIZES:
            return None
        scratch = sizes[len(_ARGUMENT_SIZES) :]
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
