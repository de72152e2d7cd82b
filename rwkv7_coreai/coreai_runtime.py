"""The one place that talks to the Core AI runtime (coreai-core) on this host.

* :func:`lower_universal` writes the Linux ahead-of-time form (``.aimodelx`` with the
  ``main-universal.odix``) through coreai-core's private ``AIModelAsset._write_odix`` — the
  Linux counterpart of ``xcrun coreai-build compile``; wrapped here so a coreai-core upgrade
  touches one function.
* :class:`DecodeSession` loads a lowered bundle and runs ``main`` token by token with the
  two states kept between calls (they mutate in place).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from .errors import PipelineError
from .export_graph import STATE_NAMES


def lower_universal(aimodel: Path, out_dir: Path) -> None:
    """Lower an ``.aimodel`` into ``out_dir`` (an existing, empty ``*.aimodelx`` directory)."""
    from coreai.authoring.asset import AIModelAsset

    if not AIModelAsset.is_valid(aimodel):
        raise PipelineError(aimodel, "is not a valid .aimodel asset", "re-run the export stage")
    from . import reproducible

    with reproducible.lowering_scope():  # canonical register order: byte-identical .odix
        AIModelAsset.load(aimodel)._write_odix(out_dir)  # noqa: SLF001 - see module docstring


class DecodeSession:
    """Synchronous wrapper around an async Core AI model with persistent states."""

    def __init__(self, aimodelx: Path, state_shapes: dict[str, tuple[int, ...]], state_dtype: np.dtype):
        import coreai.runtime as rt

        self._rt = rt
        self._loop = asyncio.new_event_loop()
        try:
            self._model = self._loop.run_until_complete(rt.AIModel.load(str(aimodelx)))
            self._fn = self._model.load_function("main")
        except Exception as exc:  # noqa: BLE001 - runtime errors have many types
            self._loop.close()
            raise PipelineError(aimodelx, f"Core AI runtime cannot load it ({type(exc).__name__}: {exc})",
                                "re-run the aot stage; check the toolchain versions") from None
        self.state_shapes, self.state_dtype = state_shapes, np.dtype(state_dtype)
        self.reset()

    def reset(self) -> None:
        self.states = {n: self._rt.NDArray(np.zeros(self.state_shapes[n], self.state_dtype)) for n in STATE_NAMES}

    def step(self, token: int) -> np.ndarray:
        ids = self._rt.NDArray(np.array([[token]], dtype=np.int32))
        pos = self._rt.NDArray(np.zeros((1, 1), dtype=np.int32))
        res = self._loop.run_until_complete(
            self._fn(inputs={"input_ids": ids, "position_ids": pos}, state=self.states))
        return np.asarray(res["logits"].numpy()).reshape(-1).astype(np.float64)

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {n: np.asarray(a.numpy()).copy() for n, a in self.states.items()}

    def close(self) -> None:
        self._fn = self._model = None
        self._loop.close()

    def __enter__(self) -> "DecodeSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
