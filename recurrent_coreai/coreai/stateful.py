"""The frame of every family's export modules: a decode module whose states are buffers it
mutates, a prefill module over the decode module's own parts and states, and the build that puts
the normal-form weights into a decode module made on the meta device.

Nothing here knows an architecture: a family subclasses :class:`Decode` and :class:`Prefill`
(its ``forward`` is the math) and builds its decode module with :func:`build_on_meta`.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Iterable, Mapping

import torch
from torch import nn

# Tokens per prefill call when none is named: the one default (config.yaml's prefill.chunk is the
# setting every stage passes; each family's build_prefill and stages/export.py default to this).
PREFILL_CHUNK = 64

Weights = Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
Parts = Callable[[str, torch.Tensor], list[tuple[str, torch.Tensor]]]


class Decode(nn.Module):
    """A decode module: ``g`` (the geometry), ``parts`` (its top-level submodules, registered in
    that order: they name the parameters) and ``states`` (zero buffers, registered after the
    parts, in the order given: the family's state specs -- anything with ``.name`` and ``.shape``,
    such as ``families.base.StateSpec`` -- or a mapping name -> shape), everything in ``dtype``.
    A subclass writes ``forward``; each state gets ONE write per call."""

    def __init__(self, g: Any, dtype: torch.dtype, parts: Mapping[str, nn.Module],
                 states: Mapping[str, tuple[int, ...]] | Iterable[Any]):
        super().__init__()
        self.g = g
        for name, part in parts.items():
            self.add_module(name, part)
        pairs = states.items() if isinstance(states, Mapping) else ((s.name, s.shape) for s in states)
        for name, shape in pairs:
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))
        self.to(dtype)

    def reset(self) -> None:
        """Every state back to zeros."""
        for state in self.buffers(recurse=False):
            state.zero_()


class Prefill(nn.Module):
    """A prefill module: ``chunk`` tokens per call (static), over ``decode``'s own parts and state
    buffers (not copies): the parameter names are the decode module's, so a bundle holding both
    stores each weight once, a quantised decode module gives a quantised prefill, and in eager
    torch both read and write the same states. A subclass sets :attr:`max_chunk` (what its chunked
    form allows) and writes ``forward``."""

    max_chunk: ClassVar[int]

    def __init__(self, decode: Decode, chunk: int):
        super().__init__()
        if not 1 <= chunk <= self.max_chunk:
            raise ValueError(f"prefill chunk must be in 1..{self.max_chunk}, got {chunk}")
        self.g, self.chunk = decode.g, chunk
        for name, part in decode.named_children():
            self.add_module(name, part)
        for name, state in decode.named_buffers(recurse=False):
            self.register_buffer(name, state)


def build_on_meta(make: Callable[[], nn.Module], weights: Weights, each_linear: Callable[[str, nn.Linear], nn.Module] | None = None,
                  parts: Parts | None = None) -> nn.Module:
    """``make()`` built on the meta device, with its own buffers (the states) made zeros and the
    normal-form ``weights`` (a mapping, or (name, tensor) pairs as a checkpoint streams them)
    assigned one at a time, strictly: no random init, no second copy of the model.

    * ``parts(name, tensor)``: the module parameter(s) one normal-form tensor becomes, as
      [(parameter name, tensor)] (e.g. a matrix transposed into an ``nn.Linear``); by default the
      tensor itself under its own name;
    * each tensor is cast to its parameter's dtype (no copy when it has it already) and made
      contiguous;
    * ``each_linear(name, linear)``, if given, is called as soon as all of an ``nn.Linear``'s
      parameters are in and returns the module to put in its place (e.g. the linear quantised),
      before more is read.

    A weight that is no parameter of the module, is given twice or has another shape, and the
    parameters no weight filled, raise KeyError naming them. Meta tensors give a complete module
    of meta weights (names and shapes: what a quantisation plan is made from)."""
    with torch.device("meta"):
        module = make()
    for name, state in list(module.named_buffers(recurse=False)):
        module.register_buffer(name, torch.zeros(state.shape, dtype=state.dtype))
    params = dict(module.named_parameters())
    linears = {name: {f"{name}.{p}" for p, _ in mod.named_parameters()}
               for name, mod in module.named_modules() if isinstance(mod, nn.Linear)}
    loaded: set[str] = set()
    for normal, tensor in (weights.items() if isinstance(weights, Mapping) else weights):
        for name, t in (parts(normal, tensor) if parts is not None else [(normal, tensor)]):
            target = params.get(name)
            if target is None or name in loaded:
                raise KeyError(f"unexpected weight {normal}" + (" (given twice)" if name in loaded else ""))
            if tuple(t.shape) != tuple(target.shape):
                raise KeyError(f"weight {normal} has shape {list(tensor.shape)} (module {name} wants {list(target.shape)})")
            owner, _, leaf = name.rpartition(".")
            module.get_submodule(owner).load_state_dict({leaf: t.to(target.dtype).contiguous()}, strict=False, assign=True)
            loaded.add(name)
            if each_linear is not None and owner in linears and linears[owner] <= loaded:
                holder, _, attr = owner.rpartition(".")
                setattr(module.get_submodule(holder), attr, each_linear(owner, module.get_submodule(owner)))
    missing = [n for n in params if n not in loaded]
    if missing:
        raise KeyError(f"missing weights {missing[:3]} ({len(missing)} in all)")
    return module.eval()
