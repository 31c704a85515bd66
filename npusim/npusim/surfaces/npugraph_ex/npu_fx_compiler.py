"""npugraph_ex's backend and compiler (``npugraph_ex.npu_fx_compiler``).

``get_npu_backend(compiler_config=...)`` is a dynamo backend: AOT autograd over the FX
graph, with :class:`_NpuFxCompiler` compiling the forward graph.  The compiler optimises
the graph in place (:func:`_optimize_fx`: every pattern registered with
``register_replacement`` replaced, the core-limit scope markers removed) and returns a
:class:`_CompiledFxGraph`.  With ``force_eager=True`` (vllm-ascend's setting) it runs the
graph eagerly; by default it captures one NPU graph per input signature (at most
``capture_limit``; past that, eagerly) on its first call and replays it after, the inputs
copied into the graph's own (``clone_input``), its outputs returned as they are (or cloned,
``clone_output``), as torchair's ``AclGraph`` does.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from npusim.surfaces.graphs import NPUGraph, graph
from npusim.surfaces.npugraph_ex.configs.compiler_config import CompilerConfig, _process_kwargs_options
from npusim.surfaces.npugraph_ex.patterns.pattern_pass_manager import _pattern_manager
from npusim.surfaces.npugraph_ex.scope import remove_scope_markers

__all__ = ["compile_fx", "get_compiler", "get_npu_backend", "register_dynamo_backend"]


def _optimize_fx(graph_module: torch.fx.GraphModule, config: Any = None, observer: Any = None) -> torch.fx.GraphModule:
    """Optimise ``graph_module`` in place and return it: the registered patterns replaced."""
    config = config if config is not None else CompilerConfig()
    if config.post_grad_custom_pre_pass is not None:
        config.post_grad_custom_pre_pass(graph_module.graph)
    if config.pattern_fusion_pass:
        _pattern_manager().apply(graph_module.graph)
    remove_scope_markers(graph_module.graph)  # core limits: the simulated device has no cores to limit
    if config.post_grad_custom_post_pass is not None:
        config.post_grad_custom_post_pass(graph_module.graph)
    graph_module.graph.lint()
    graph_module.recompile()
    return graph_module


@dataclasses.dataclass
class _CompiledFxArtifacts:
    version: str = "0.1"
    py_code: str | None = None


class _Captured:
    """One input signature's graph: its static inputs and the outputs its replays write."""

    def __init__(self, runner: Any, args: tuple[Any, ...], config: CompilerConfig) -> None:
        self.clone_input, self.clone_output = bool(config.clone_input), bool(config.clone_output)
        self.inputs = tuple(a.clone() if self.clone_input and isinstance(a, torch.Tensor) else a for a in args)
        self.graph = NPUGraph()
        with graph(self.graph, capture_error_mode=config.capture_error_mode):
            self.outputs = runner(*self.inputs)

    def run(self, args: tuple[Any, ...]) -> Any:
        for mine, given in zip(self.inputs, args):
            if isinstance(mine, torch.Tensor) and mine is not given and mine.data_ptr() != given.data_ptr():
                if not self.clone_input:
                    raise RuntimeError(
                        "npugraph_ex: with clone_input=False the graph reads the tensors it was captured "
                        "with; pass the same tensors, or compile with clone_input=True"
                    )
                mine.copy_(given)
        self.graph.replay()
        if self.clone_output:
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in self.outputs]
        return self.outputs


class _CompiledFxGraph:
    """A compiled forward: its runner (the optimised graph), run eagerly or captured."""

    def __init__(self, runner: Any, config: Any = None) -> None:
        self.runner = runner
        self.config = config
        self._graphs: dict[tuple[Any, ...], _Captured] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        config = self.config
        if config is None or config.force_eager or kwargs:
            return self.runner(*args, **kwargs)
        key = tuple((tuple(a.shape), a.stride(), a.dtype, a.device) if isinstance(a, torch.Tensor) else a for a in args)
        captured = self._graphs.get(key)
        if captured is None:
            if len(self._graphs) >= config.capture_limit:
                return self.runner(*args)
            self.runner(*args)  # a warm-up run before the capture, as torchair's
            captured = self._graphs[key] = _Captured(self.runner, args, config)
        return captured.run(args)

    def get_code(self, extend_config: Any = None) -> str | None:
        """The compiled graph's Python source, for a cache: the simulator has none to give."""
        return None

    @classmethod
    def load_artifacts(cls, artifacts: _CompiledFxArtifacts) -> _CompiledFxGraph:
        raise RuntimeError(
            "npugraph_ex on npugraph's simulator caches no compiled code (get_code() gave none); recompile instead"
        )


class _NpuFxCompiler:
    """The forward compiler AOT autograd calls with each (aten-level) graph."""

    def __init__(self, compiler_config: CompilerConfig) -> None:
        self.config = compiler_config

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return self._get_compiled_gm(gm, example_inputs)

    def _get_compiled_gm(self, gm: torch.fx.GraphModule, example_inputs: Any) -> _CompiledFxGraph:
        return _CompiledFxGraph(self._gen_compiled_gm(gm, example_inputs), self.config)

    def _gen_compiled_gm(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        return _optimize_fx(gm, self.config)


def _npu_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Any,
    compiler_config: CompilerConfig | None = None,
    decompositions: dict[Any, Any] | None = None,
    **kwargs: Any,
) -> Any:
    config = compiler_config if compiler_config is not None else CompilerConfig()
    _process_kwargs_options(config, kwargs)
    compiler = _NpuFxCompiler(config)
    # torch's AOT-autograd cache holds inductor's compiled code only; a graph compiled here is
    # not that, so it is not cached (vLLM turns the bundled cache on around its compiles,
    # and torch 2.14 then asserts "expected OutputCode")
    # imported here, not at load: the simulator loads inside `import torch`, and AOT autograd
    # imports dynamo, which imports Triton (whose own import may have started torch's)
    from torch._functorch.aot_autograd import aot_module_simplified

    with torch._functorch.config.patch(bundled_autograd_cache=False, force_autograd_cache=False):
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=compiler,
            inference_compiler=compiler,
            decompositions=decompositions or {},
            keep_inference_input_mutations=True,
        )


def get_npu_backend(*, compiler_config: CompilerConfig | None = None, custom_decompositions: Any = None) -> Any:
    """A dynamo backend compiling with ``compiler_config`` (default: a fresh ``CompilerConfig``)."""
    config = compiler_config if compiler_config is not None else CompilerConfig()
    return functools.partial(_npu_backend, compiler_config=config, decompositions=dict(custom_decompositions or {}))


def get_compiler(compiler_config: CompilerConfig | None = None) -> _NpuFxCompiler:
    return _NpuFxCompiler(compiler_config if compiler_config is not None else CompilerConfig())


def compile_fx(gm: torch.fx.GraphModule, example_inputs: Any = None, options: dict[str, Any] | None = None) -> Any:
    """Compile an aten-level graph (no AOT autograd) with ``options``."""
    config = CompilerConfig()
    _process_kwargs_options(config, {"options": options or {}})
    return get_compiler(config)(gm, example_inputs)


def dynamo_backend(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """The ``npugraph_ex`` dynamo backend torch_npu registers (``torch.compile(backend="npugraph_ex")``)."""
    config = CompilerConfig()
    config.mode = "npugraph_ex"
    return get_npu_backend(compiler_config=config)(gm, example_inputs, **kwargs)


def register_dynamo_backend() -> None:
    """Make ``torch.compile(backend="npugraph_ex")`` this backend, as importing torch_npu does
    (an earlier registration of the name is replaced, as torch_npu replaces it)."""
    from torch._dynamo.backends import registry

    registry._BACKENDS.pop("npugraph_ex", None)
    registry._COMPILER_FNS.pop("npugraph_ex", None)
    registry.register_backend(dynamo_backend, "npugraph_ex")
