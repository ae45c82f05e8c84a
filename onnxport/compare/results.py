"""What a run gives: every output of one model on one sample, which can be saved and compared later."""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgumentError

_FORMAT = "onnxport.run-results/1"


@dataclass
class RunResults:
    """Every output of one run, in the runner's output order.

    Attributes:
        runner: who computed them (``'torch'``, ``'onnxruntime (default level)'``, …).
        outputs: output name → values, the batches of the sample joined along the first axis.
        n_samples: how many inputs the sample held.
        meta: anything the runner wants kept beside the values (the file, the level).
    """

    runner: str
    outputs: dict[str, np.ndarray]
    n_samples: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return list(self.outputs)

    @property
    def arrays(self) -> list[np.ndarray]:
        return list(self.outputs.values())

    def renamed(self, names: list[str]) -> RunResults:
        """The same values under other output names (a PyTorch run's outputs have positions, not names)."""
        if len(names) != len(self.outputs):
            raise InvalidArgumentError(
                f"{self.runner} gave {len(self.outputs)} outputs, but {len(names)} names were given for them; "
                "compare runs of the same model."
            )
        return RunResults(self.runner, dict(zip(names, self.arrays)), self.n_samples, dict(self.meta))

    def save(self, path: str | os.PathLike) -> Path:
        """Write the results to one ``.npz`` file (atomically), to be read back by :meth:`load`."""
        from .._core.io import write_bytes_atomic

        target = Path(path)
        if target.suffix != ".npz":
            raise InvalidArgumentError(f"RunResults.save writes an .npz file; give a path ending in .npz, not '{target}'.")
        header = {"format": _FORMAT, "runner": self.runner, "names": self.names, "n_samples": self.n_samples,
                  "meta": self.meta}
        buffer = io.BytesIO()
        # arrays by position: output names may hold characters a zip member name cannot
        np.savez(buffer, header=np.array(json.dumps(header)), **{f"output_{i}": a for i, a in enumerate(self.arrays)})
        return write_bytes_atomic(target, buffer.getvalue())

    @classmethod
    def load(cls, path: str | os.PathLike) -> RunResults:
        """Results saved by :meth:`save`."""
        source = Path(path)
        if not source.is_file():
            raise InvalidArgumentError(f"'{source}' does not exist: give an .npz file written by RunResults.save.")
        try:
            with np.load(source, allow_pickle=False) as data:
                header = json.loads(str(data["header"]))
                if header.get("format") != _FORMAT:
                    raise ValueError(f"format {header.get('format')!r}")
                arrays = [data[f"output_{i}"] for i in range(len(header["names"]))]
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
            raise InvalidArgumentError(
                f"'{source}' is not a file written by RunResults.save ({error}); run the model again and save it."
            ) from None
        return cls(header["runner"], dict(zip(header["names"], arrays)), int(header["n_samples"]), header["meta"])
