"""The simulated driver's module and kernel calls: load, look up, unload, launch.

A launch is stream work that runs the kernel's Python stand-in (`kernels`), if one
is registered, when the stream drains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from capsafe.backend import Dim3, KernelArg, check_kernel_args
from capsafe.errors import CudaError, cuda_error
from capsafe.handles import Function, Module, Stream
from capsafe.sim.contexts import SimDriverBase
from capsafe.sim.kernels import SimMemory, check_launch, parse_image, standin
from capsafe.sim.streams import StreamState


class KernelCalls(SimDriverBase):
    """Modules and kernel launches."""

    # -- modules and kernels -------------------------------------------------------
    def module_load_data(self, image: bytes) -> Module:
        with self._lock:
            ctx = self._enter("module_load_data", "cuModuleLoadData")
            state = parse_image(bytes(image))
            handle = Module(next(self._ids))
            ctx.modules[handle.value] = state
            return handle

    def module_get_function(self, module: Module, name: str) -> Function:
        with self._lock:
            ctx = self._enter("module_get_function", "cuModuleGetFunction")
            state = self._lookup(ctx.modules, module, Module, "cuModuleGetFunction")
            if not state.has_kernel(name):
                raise cuda_error(
                    "CUDA_ERROR_NOT_FOUND",
                    "cuModuleGetFunction",
                    f"no kernel named {name!r} in the module",
                )
            handle = Function(next(self._ids), name=name, module=module)
            ctx.functions[handle.value] = (module.value, name)
            return handle

    def module_unload(self, module: Module) -> None:
        with self._lock:
            ctx = self._enter("module_unload", "cuModuleUnload")
            self._lookup(ctx.modules, module, Module, "cuModuleUnload")
            del ctx.modules[module.value]

    def launch_kernel(
        self,
        function: Function,
        grid: Dim3,
        block: Dim3,
        args: Sequence[KernelArg],
        stream: Stream,
        shared_mem: int = 0,
    ) -> None:
        symbol = "cuLaunchKernel"
        with self._lock:
            ctx = self._enter("launch_kernel", symbol, stream)
            module_id, name = self._lookup(ctx.functions, function, Function, symbol)
            if module_id not in ctx.modules:
                raise cuda_error(
                    "CUDA_ERROR_INVALID_HANDLE", symbol, f"the module of {name!r} was unloaded"
                )
            ss = self._stream(ctx, stream, symbol)
            grid3, block3 = check_launch(grid, block, shared_mem, symbol)
            checked = check_kernel_args(args)
            memory = ctx.memory

            def node(s: StreamState, seq: int) -> Callable[[], None]:
                def run() -> None:
                    fn = standin(name)
                    if fn is None:
                        return
                    try:
                        fn(SimMemory(memory, name), grid3, block3, checked)
                    except CudaError:
                        raise
                    except Exception as exc:
                        raise cuda_error(
                            "CUDA_ERROR_LAUNCH_FAILED",
                            f"{symbol}({name})",
                            f"the stand-in raised {exc!r}",
                        ) from exc

                return run

            ctx.streams.submit(ss, node, symbol)
