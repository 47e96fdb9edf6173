"""CUDA graphs: a static-shape compiled model captured once and replayed, all graphs of one load
sharing one memory pool and one capture stream."""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AotbuildError


class GraphPool:
    """The memory pool and the one stream capturing into it, shared by the CUDA graphs of one load:
    they run one after another, the outputs they keep alive are never handed out again, and the
    allocator reuses a pool's free blocks only on the stream that freed them."""

    def __init__(self, device: torch.device) -> None:
        with torch.cuda.device(device):
            self.handle = torch.cuda.graph_pool_handle()
            self.stream = torch.cuda.Stream(device)


class CudaGraph:
    """One static-shape compiled model captured as a CUDA graph on its first call, then replayed.

    AOTInductor launches every kernel from the host on each call; a replay launches the recorded
    sequence at once. Inputs are copied into static buffers (the copy also converts dtype, device
    and layout to what the model was compiled for); outputs are cloned out of the graph's memory,
    which the next replay overwrites.

    `run` must be a single-threaded runner: the threaded one records and queries a CUDA event
    around each run, and querying is not allowed while a stream is being captured.
    """

    def __init__(self, name: str, run: Any, inputs: list[dict[str, Any]], device: torch.device,
                 pool: GraphPool) -> None:
        self._name, self._run, self._device, self._pool = name, run, device, pool
        self._static = [torch.empty_strided(e["shape"], e["stride"], dtype=getattr(torch, e["dtype"]), device=device)
                        for e in inputs if "shape" in e]
        self._graph: torch.cuda.CUDAGraph | None = None
        self._outputs: list[torch.Tensor] = []

    def reset(self) -> None:
        """Forget the capture (it holds the pointers of the constants bound then)."""
        self._graph, self._outputs = None, []

    def __call__(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.cuda.device(self._device):  # replay launches on the current device's stream
            for static, tensor in zip(self._static, tensors, strict=True):
                static.copy_(tensor)
            if self._graph is None:
                self._graph = self._capture()
            self._graph.replay()
            return [output.clone() for output in self._outputs]

    def _capture(self) -> torch.cuda.CUDAGraph:
        # One ordinary run first, on a side stream: it loads the kernels (module loading cannot be
        # captured) and settles the allocator. The model takes the current stream, so under
        # `torch.cuda.graph` its launches are recorded. The runner empties the list it is given.
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            self._run(list(self._static))
        torch.cuda.current_stream(self._device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool.handle, stream=self._pool.stream):
                self._outputs = self._run(list(self._static))
        except RuntimeError as exc:
            raise AotbuildError(f"CUDA graph capture of compiled model {self._name} failed: {exc}",
                                hint="load with cuda_graphs=False (aotbuild run --no-cuda-graphs); "
                                     "to build without graphs, set cuda_graphs = false in the target") from exc
        return graph
