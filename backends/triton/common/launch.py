"""Launching a compiled Triton kernel without Triton's per-call binding, and the compile options of every kernel.

``fn[grid](*args, **constexprs, **options)`` re-derives on every call what cannot have changed
since the last one: it binds the arguments to the signature, specialises each one (dtype,
16-byte alignment, integers equal to 1 or divisible by 16), hashes that into a cache key, looks the
compiled kernel up, checks the globals it read and builds launch metadata. On the H200's host that
is most of an eager call (27 us of "kernel alone" for a GEMV whose GPU time is 6 us).

``KernelLaunch`` makes the first call of a signature through ``fn[grid]`` (which compiles), keeps
the compiled kernel that call returned, and launches later calls straight through its launcher
(``CompiledKernel.run``, the C function Triton itself ends in) when a cheap guard shows that Triton
would have chosen the same compiled kernel:

* every tensor argument 16-byte aligned (Triton's alignment specialisation), as on the first call;
* the same number of arguments, every tensor of the first call's dtype;
* every scalar argument equal to the first call's and of its type (covers the integers' ``== 1`` / ``% 16`` /
  32-bit specialisations and bool / int / float, which compare equal in Python but specialise differently; a
  caller whose strides change falls back rather than guessing);
* every ``None`` argument still ``None``;
* with ``free_ints`` (launchers whose strides and lengths change from call to call: attention over growing
  sequences), an integer argument only in Triton's own specialisation of it instead of its value: ``== 1``,
  divisible by 16, and 32-bit or not -- the same compiled kernel Triton's cache would pick;
* the same current device, and no launch hooks installed (profilers such as Proton set them and
  expect Triton's own path, which this then takes).

Anything else goes through ``fn[grid]``, which is always correct, and that call's kernel becomes
the fast one. The caller's part of the contract: an argument that is none of a tensor, a number or
``None`` (a TMA descriptor) is not guarded, so it must keep its block shape and dtype at its position
(true for the backend's launchers, whose ops fix them). Under the interpreter every call goes
through ``fn[grid]``. Whether a launcher takes the fast path is its own state (``fast_enabled``), set
from ``switches.fast_launch_enabled()`` when it is made unless given, and changed with ``set_fast``.
"""

from __future__ import annotations

import numbers
from typing import Any

from .switches import fast_launch_enabled

#: Compile options every kernel of this backend is launched and lowered with. ``enable_fp_fusion``:
#: the kernels are written for fused multiply-adds (the GEMV's one FFMA per code, the attention's
#: ``acc += p @ v`` rescaling), which Triton 3.6-3.9 emit by default and Triton 3.10 will not
#: (``TRITON_DEFAULT_FP_FUSION``); stating it keeps the compiled code the same across versions.
KERNEL_OPTIONS = {"enable_fp_fusion": True}


def _hooked(hook) -> bool:
    """Whether a launch hook is installed: Triton 3.6+ keeps a ``HookChain`` (installed when it has calls),
    earlier ones ``None`` or a callable."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return True if calls is None else bool(calls)


def int_class(x: int) -> tuple[bool, bool, bool]:
    """What Triton specialises a (non-constexpr) integer argument on: equal to 1, divisible by 16, fits 32 bits."""
    return x == 1, x % 16 == 0, -0x80000000 <= x <= 0x7FFFFFFF


class _Fast:
    """The compiled kernel of one guarded call and what its guard compares."""

    __slots__ = ("compiled", "device", "n_args", "tensor_pos", "dtypes", "scalar_pos", "none_pos", "scalars",
                 "scalar_types", "tail", "int_pos", "int_classes")

    def __init__(self, compiled, device, args: tuple, tail: tuple, free_ints: bool = False):
        self.compiled, self.device, self.tail, self.n_args = compiled, device, tail, len(args)
        self.tensor_pos = tuple(i for i, a in enumerate(args) if hasattr(a, "data_ptr"))
        self.dtypes = tuple(args[i].dtype for i in self.tensor_pos)
        # scalars (bools, ints, floats, numpy scalars) compared by value: stricter than Triton, which specialises
        # integers only and floats not at all, so a changed scalar falls back rather than guessing
        free = {i for i, a in enumerate(args) if type(a) is int} if free_ints else set()
        self.int_pos = tuple(sorted(free))
        self.int_classes = tuple(int_class(args[i]) for i in self.int_pos)
        self.scalar_pos = tuple(i for i, a in enumerate(args) if isinstance(a, numbers.Number) and i not in free)
        self.none_pos = tuple(i for i, a in enumerate(args) if a is None)
        self.scalars = tuple(args[i] for i in self.scalar_pos)
        self.scalar_types = tuple(type(s) for s in self.scalars)


class KernelLaunch:
    """``launch(*args)``: ``fn`` on ``grid`` with fixed ``constexprs`` and compile ``options``.

    ``args`` are the kernel's runtime arguments, in signature order, all positional; ``constexprs``
    name the parameters after them (any the kernel declares with a default may be left out).
    ``interpret`` (Triton's interpreter) disables the fast path; ``fast`` False sends every launch through
    ``fn[grid]`` (default: ``switches.fast_launch_enabled()``, read once, here). ``free_ints``: integer arguments
    are guarded by their specialisation, not their value (see the module docstring); ``on(grid, *args)`` launches
    on a grid of that call's own.
    """

    def __init__(self, fn, grid: tuple[int, ...], constexprs: dict[str, Any], options: dict[str, Any],
                 interpret: bool = False, fast: bool | None = None, free_ints: bool = False):
        self.fn, self.constexprs, self.options, self.free_ints = fn, constexprs, options, free_ints
        self.fast_enabled = fast_launch_enabled() if fast is None else bool(fast)
        self.grid = tuple(grid)
        self.grid3 = (tuple(grid) + (1, 1))[:3]
        self.fast_ok = not interpret   # False also for a Triton whose compiled kernels launch differently
        self._fast: _Fast | None = None
        self._driver = self._runtime = None   # triton's active driver and runtime knobs, bound on first use
        self._tails: dict[int, tuple] = {}
        self.fast_calls = self.slow_calls = 0   # introspection (tests, benchmarks)

    def __call__(self, *args) -> None:
        fast = self._fast
        if fast is not None and self.fast_enabled and self._guard(fast, args):
            c = fast.compiled
            self.fast_calls += 1
            c.run(*self.grid3, self._driver.get_current_stream(fast.device), c.function, c.packed_metadata,
                  None, None, None, *args, *fast.tail)
            return
        self._slow(args)

    def on(self, grid: tuple[int, ...], *args) -> None:
        """Launch on ``grid`` (this call's own: a launcher whose grid follows the call's lengths)."""
        fast = self._fast
        if fast is not None and self.fast_enabled and self._guard(fast, args):
            c = fast.compiled
            self.fast_calls += 1
            g = (*grid, 1, 1)
            c.run(g[0], g[1], g[2], self._driver.get_current_stream(fast.device), c.function, c.packed_metadata,
                  None, None, None, *args, *fast.tail)
            return
        self._slow(args, tuple(grid))

    def set_fast(self, enabled: bool) -> bool:
        """Turn this launcher's fast path on or off (at once: a recorded fast kernel is not used while off);
        returns the previous setting."""
        previous, self.fast_enabled = self.fast_enabled, bool(enabled)
        return previous

    def _guard(self, fast: _Fast, args: tuple) -> bool:
        """Whether ``fn[grid]`` would pick ``fast.compiled`` for ``args`` (see the module docstring)."""
        rt = self._runtime
        if len(args) != fast.n_args or _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook):
            return False
        try:
            bits = 0
            for i, dt in zip(fast.tensor_pos, fast.dtypes):
                a = args[i]
                if a.dtype is not dt:
                    return False
                bits |= a.data_ptr()
        except AttributeError:   # a tensor position got something else
            return False
        if bits & 15:
            return False
        for i in fast.none_pos:
            if args[i] is not None:
                return False
        for i, v, t in zip(fast.scalar_pos, fast.scalars, fast.scalar_types):
            a = args[i]
            if type(a) is not t or a != v:   # the type first: a tensor's ``!=`` is a tensor, whose truth raises
                return False
        for i, cls in zip(fast.int_pos, fast.int_classes):
            a = args[i]
            if type(a) is not int or int_class(a) != cls:
                return False
        return self._driver.get_current_device() == fast.device

    def _slow(self, args: tuple, grid: tuple | None = None) -> None:
        """Triton's own path (binds, compiles if needed, launches); its kernel becomes the fast one."""
        self.slow_calls += 1
        compiled = self.fn[self.grid if grid is None else grid](*args, **self.constexprs, **self.options)
        if not self.fast_ok or not self.fast_enabled:
            self._fast = None
            return
        if hasattr(compiled, "result"):   # an asynchronous compile's future
            compiled = compiled.result()
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata")):
            self.fast_ok = False
            return
        aligned = all(a.data_ptr() % 16 == 0 for a in args if hasattr(a, "data_ptr"))
        if not aligned:   # compiled without the alignment assumption: correct for any call, but keep it simple
            self._fast = None
            return
        if self._driver is None:
            from triton import knobs
            from triton.runtime import driver

            self._driver, self._runtime = driver.active, knobs.runtime
        self._fast = _Fast(compiled, self._driver.get_current_device(), args, self._tail(len(args)), self.free_ints)

    def _tail(self, n_args: int) -> tuple:
        """The parameters after the ``n_args`` runtime ones, as Triton binds them: constexprs and defaults
        (worked out once: ``inspect.signature`` alone costs tens of microseconds)."""
        tail = self._tails.get(n_args)
        if tail is None:
            tail = self._tails[n_args] = self._bind_tail(n_args)
        return tail

    def _bind_tail(self, n_args: int) -> tuple:
        import inspect

        params = list(inspect.signature(self.fn.fn).parameters.values())[n_args:]
        tail = []
        for p in params:
            if p.name in self.constexprs:
                tail.append(self.constexprs[p.name])
            elif p.default is not inspect.Parameter.empty:
                tail.append(p.default)
            else:
                raise TypeError(f"KernelLaunch of {getattr(self.fn, '__name__', self.fn)}: parameter {p.name!r} was given neither "
                                "positionally nor as a constexpr; pass runtime arguments positionally")
        return tuple(tail)
